"""The run's plots and report page, read back: PNGs of the right size that
are not blank, a page that shows the table and the plots."""

import math
import pathlib
import subprocess

import numpy as np
import pytest

from hftatf import report
from hftatf.tpu import page, plots

matplotlib_image = pytest.importorskip(
    "matplotlib.image", reason="the plots need matplotlib (hftatf[data])")

RATES = [0.3, 0.1, 0.03, 0.01]
CHROMIUM = pathlib.Path("/usr/bin/chromium")


def a_history():
    """Four models over 5 epochs; model 3 diverges at epoch 3."""
    history = {}
    for b, rate in enumerate(RATES):
        loss = [2.0 / (1 + rate * 10 * e) for e in range(5)]
        if b == 3:
            loss[3:] = [math.nan, math.nan]
        history[f"loss_{b}"] = loss
        history[f"val_loss_{b}"] = [v * 1.1 for v in loss]
        history[f"accuracy_{b}"] = [1 - v / 2 for v in loss]
    return history


def read_png(path):
    image = matplotlib_image.imread(path)
    assert image.ndim == 3 and image.shape[2] in (3, 4), image.shape
    return image


def assert_not_blank(image):
    # Curves, axes and text: many colours, not one background.
    pixels = image[..., :3].reshape(-1, 3)
    assert pixels.std() > 0.05
    assert len(np.unique(np.round(pixels, 2), axis=0)) > 20


def test_loss_curves_and_hyperparameter_plots(tmp_path):
    history = a_history()
    columns = {"learning_rate": RATES}
    rows = report.model_results(history, columns,
                                diverged=[False, False, False, True])
    curves = plots.plot_loss_curves(
        history, [f"model {b}" for b in range(4)],
        tmp_path / plots.LOSS_CURVES_FILE, best=0,
        diverged=[False, False, False, True])
    image = read_png(curves)
    # Two panels (training and validation loss) side by side, 100 dpi.
    assert image.shape[:2] == (400, 1200)
    assert_not_blank(image)
    swept = plots.plot_hyperparameters(
        rows, columns, tmp_path / plots.HYPERPARAMETERS_FILE, best=0)
    image = read_png(swept)
    # A panel per final value: loss, accuracy, val_loss; two a row.
    assert image.shape[:2] == (700, 900)
    assert_not_blank(image)
    # Nothing varies: no hyper-parameter plot.
    assert plots.plot_hyperparameters(
        rows, {"learning_rate": [0.1] * 4}, tmp_path / "none.png") is None


def test_loss_curves_of_outliers_and_models_never_finite(tmp_path,
                                                        monkeypatch):
    import matplotlib.figure

    history = a_history()
    # Model 1 reaches a loss 1e5 times the others'; model 2 diverges in
    # its first epoch, and has no value to draw.
    history["loss_1"] = [2.0, 5e4, 3e5, 3e5, 3e5]
    history["loss_2"] = [math.nan] * 5
    drawn = []
    savefig = matplotlib.figure.Figure.savefig

    def keep(figure, *args, **kwargs):
        drawn.append(figure)
        return savefig(figure, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", keep)
    plots.plot_loss_curves(history, [f"model {b}" for b in range(4)],
                           tmp_path / plots.LOSS_CURVES_FILE, best=0,
                           diverged=[False, False, True, True])
    training, validation = drawn[0].axes
    assert training.get_yscale() == "log"
    assert validation.get_yscale() == "linear"
    labels = [text.get_text() for text in training.get_legend().get_texts()]
    assert "1 diverged before a finite value (not drawn)" in labels, labels
    assert labels.count("diverged") == 1, labels


def test_log_axis_for_rates_and_wide_positive_ranges():
    assert plots.log_axis("learning_rate", [0.1, 0.05])
    assert plots.log_axis("weight_decay", [1e-5, 1e-3])
    assert not plots.log_axis("weight_decay", [0.0, 1e-3])
    assert not plots.log_axis("momentum", [0.8, 0.9])
    assert plots.varied({"learning_rate": [0.1, 0.2], "beta_1": [0.9] * 2}) \
        == ["learning_rate"]


def write_page(tmp_path):
    history = a_history()
    columns = {"learning_rate": [float(np.float32(r)) for r in RATES]}
    rows = report.model_results(history, columns,
                                diverged=[False, False, False, True])
    images = [plots.plot_loss_curves(
        history, [f"model {b}" for b in range(4)],
        tmp_path / plots.LOSS_CURVES_FILE, best=0),
        plots.plot_hyperparameters(
            rows, columns, tmp_path / plots.HYPERPARAMETERS_FILE, best=0)]
    return page.write_report(tmp_path / page.REPORT_FILE, "hftatf-train: mlp",
                             ["hftatf-train: 4 mlp models"], rows, columns,
                             best=0, images=images)


def test_the_report_page_shows_the_table_and_the_plots(tmp_path):
    text = write_page(tmp_path).read_text()
    assert f'<img src="{plots.LOSS_CURVES_FILE}"' in text
    assert f'<img src="{plots.HYPERPARAMETERS_FILE}"' in text
    for name in (plots.LOSS_CURVES_FILE, plots.HYPERPARAMETERS_FILE):
        assert (tmp_path / name).exists()
    assert "<th>learning_rate</th>" in text
    # Hyper-parameters as given; the best row and the diverged one marked.
    assert "<td>0.03</td>" in text and "0.0299" not in text
    assert '<tr class="best"><td>0</td>' in text
    assert '<tr class="diverged"><td>3</td>' in text


@pytest.mark.skipif(not CHROMIUM.exists(),
                    reason="no headless browser: /usr/bin/chromium is missing")
def test_the_report_page_renders_in_chromium(tmp_path):
    path = write_page(tmp_path)
    screenshot = tmp_path / "screenshot.png"
    result = subprocess.run(
        [str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu",
         "--window-size=1280,2400", f"--screenshot={screenshot}",
         path.as_uri()], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    image = read_png(screenshot)
    assert image.shape[:2] == (2400, 1280)
    assert_not_blank(image)
    dom = subprocess.run(
        [str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu",
         "--dump-dom", path.as_uri()], capture_output=True, text=True,
        timeout=120).stdout
    assert plots.LOSS_CURVES_FILE in dom and "<table>" in dom


def test_the_main_jobs_install_brings_matplotlib():
    # README: `pip install -e ".[data]" && hftatf-train` writes the plots.
    setup = (pathlib.Path(__file__).resolve().parents[2] / "setup.py")
    text = setup.read_text()
    data = text[text.index('"data": ['):]
    assert "matplotlib" in data[:data.index("]")]
