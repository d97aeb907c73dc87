"""benchmarks/gpu.sh, dry-run on this machine's CPU with JAX at the
smallest sizes: it checks the device, then writes the benchmark's CSV,
Markdown table and plots in the formats the full GPU run writes."""

import csv
import os
import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu.sh"
COLUMNS_START = ("model", "mode", "num_models", "batch_size")


@pytest.mark.backends("jax", reason="gpu.sh sets KERAS_BACKEND=jax itself: "
                      "a run under the TensorFlow suite would repeat it")
@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_dry_run_writes_csv_markdown_and_plots(tmp_path):
    # Both modes of the full run (its default), at the dry run's sizes.
    environment = {**os.environ, "OUT_DIR": str(tmp_path),
                   "MODES": "serial,fused"}
    done = subprocess.run(["bash", str(SCRIPT), "--dry-run"], cwd=ROOT,
                          env=environment, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "JAX" in done.stdout and "devices:" in done.stdout
    assert "Keras on jax" in done.stdout
    with open(tmp_path / "results.csv") as file:
        rows = list(csv.DictReader(file))
    assert tuple(rows[0])[:4] == COLUMNS_START
    assert [(r["model"], r["mode"], r["num_models"]) for r in rows] == [
        ("mlp", mode, size) for size in "124" for mode in ("serial", "fused")]
    assert all(float(r["samples_per_s"]) > 0 for r in rows)
    # Two stock models timed, scaled to B = 4; float32 by default.
    assert [r["serial_models_timed"] for r in rows
            if r["mode"] == "serial"] == ["1", "2", "2"]
    assert {r["dtype_policy"] for r in rows} == {"float32"}
    assert all(float(r["speedup"]) > 0 for r in rows if r["mode"] == "fused")
    markdown = (tmp_path / "results.md").read_text().splitlines()
    assert markdown[0].startswith(
        "| model | B | serial samples/s | fused samples/s | fused speedup")
    assert [line.split(" | ")[:2] for line in markdown[2:5]] == [
        ["| mlp", "1"], ["| mlp", "2"], ["| mlp", "4"]]
    assert "serial: 2 stock model(s) timed" in markdown[6]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert (tmp_path / "speedup.png").stat().st_size > 0


def test_dry_run_flag_is_documented():
    text = SCRIPT.read_text()
    assert "--dry-run" in text and "KERAS_BACKEND=jax" in text
    assert "mlp,resnet18,pointnet,mobilenet_v3_small,bert_tiny," in text
    assert "SIZES=${SIZES:-1,8,32}" in text and "--time_budget" in text
