"""The launcher end to end on the CPU: the main job, zoo models, per-model
hyper-parameters, schedules, mixed precision, files and resumption."""

import csv
import dataclasses
import json
import math
import pathlib

import keras
import numpy as np
import pytest
from absl.testing import flagsaver
from testing import Interrupt, assert_close

from hftatf import report
from hftatf.models import data as zoo_data
from hftatf.tpu import config as config_module
from hftatf.tpu import page, plots, results, resume, train
from hftatf.tpu.config import Config, ConfigError

FLAGS = train.FLAGS

TEXT = ["the cat sat on the mat and the dog sat on the log " * 6,
        "a bird flew over the tree and a fish swam in the sea " * 6,
        "one two three four five six seven eight nine ten " * 6]
TINY_TEXT_MODEL = dict(vocabulary_size=64, sequence_length=8, max_length=8,
                       num_layers=1, hidden_dim=16, num_heads=2,
                       intermediate_dim=32)
TINY_TEXT_DATA = dict(vocabulary_size=64, sequence_length=8, source=TEXT)
# Per zoo model: builder and data arguments that make one step quick.
TINY = {
    "mlp": dict(model_args={"hidden_units": [16]}),
    "transformer_lm": dict(model_args=TINY_TEXT_MODEL,
                           data_args=TINY_TEXT_DATA),
    "bert_tiny": dict(model_args=TINY_TEXT_MODEL, data_args=TINY_TEXT_DATA),
    "resnet18": dict(model_args={"input_shape": [8, 8, 3], "width": 0.0625},
                     data_args={"image_size": 8, "augment": False}),
    "dcgan": dict(model_args={"latent_dim": 8, "image_size": 8,
                              "filters": 8},
                  data_args={"image_size": 8}),
}


@pytest.fixture(scope="module", autouse=True)
def _launcher_flags():
    """The launcher's flags on absl's global FLAGS for this module's tests,
    removed afterwards (other launchers define flags of the same names)."""
    before = set(FLAGS)
    train.define_flags()
    FLAGS.mark_as_parsed()
    yield
    for name in set(FLAGS) - before:
        delattr(FLAGS, name)


def one_step(name, tmp_path, **values):
    """Config for one training step and one validation step of `name`."""
    defaults = dict(num_models=2, epochs=1, train_steps=1, eval_steps=1,
                    batch_size=4, verbose=0, model_dir=str(tmp_path / name),
                    export_dir="")
    return Config(model=name, **{**defaults, **TINY[name], **values})


def read_csv(path):
    with open(path, newline="") as file:
        return list(csv.DictReader(file))


def test_main_job_trains_reports_and_exports_four_models(tmp_path, capsys):
    model_dir = tmp_path / "run"
    with flagsaver.flagsaver(epochs=1, train_steps=3, verbose=0,
                             model_dir=str(model_dir)):
        train.main([])
    printed = capsys.readouterr().out
    lines = printed.splitlines()
    # verbose=0: no header, the table first.
    header = lines[0].split()
    assert header == ["model", "learning_rate", "loss", "accuracy",
                      "val_loss", "val_accuracy", "status"]
    rates = [0.3, 0.1, 0.03, 0.01]
    for line, rate in zip(lines[1:5], rates):
        assert line.split()[1] == str(rate)
    assert "Best: model" in printed and "Exported 4 models" in printed

    rows = read_csv(model_dir / results.RESULTS_FILE)
    assert [float(r["learning_rate"]) for r in rows] == rates
    assert all(math.isfinite(float(r["val_accuracy"])) for r in rows)
    history = read_csv(model_dir / results.HISTORY_FILE)
    assert [(r["epoch"], r["model"]) for r in history] == [
        ("0", str(b)) for b in range(4)]
    config_files = sorted(p.name for p in model_dir.glob("config.*"))
    assert config_files in (["config.yaml"], ["config.json"])
    # One TensorBoard run per model, named after its rate, with training
    # and validation as stock Keras writes them.
    runs = sorted((model_dir / "logs").iterdir())
    assert [run.name for run in runs] == sorted(f"lr={r}" for r in rates)
    for run in runs:
        for split in ("train", "validation"):
            assert list((run / split).glob("events.*")), (run, split)
    plot = model_dir / plots.LOSS_CURVES_FILE
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert not plot.exists()
    else:
        assert plot.stat().st_size > 1000
        assert (model_dir / plots.HYPERPARAMETERS_FILE).exists()
    assert (model_dir / page.REPORT_FILE).exists()
    # The backup of a finished run is gone: rerunning starts over.
    assert not list((model_dir / "backup").glob("*"))

    (_, _), (x_val, _) = zoo_data.digits()
    for b, rate in enumerate(rates):
        path = model_dir / "export" / f"model_{b}"
        model = keras.models.load_model(path / "model.keras")
        assert model.predict(x_val[:4, ..., None], verbose=0).shape == (4, 10)
        metadata = json.loads((path / "metadata.json").read_text())
        assert np.isclose(metadata["hyperparameters"]["learning_rate"], rate)
        assert set(metadata["metrics"]) == {"loss", "accuracy", "val_loss",
                                            "val_accuracy"}


def test_best_learning_rate_learns_digits(tmp_path):
    run = train.train(Config(epochs=4, verbose=0, model_dir=str(tmp_path),
                             export_dir=""))
    assert max(r["val_accuracy"] for r in run.results) > 0.9
    assert run.best["val_accuracy"] == max(r["val_accuracy"]
                                           for r in run.results)


@pytest.mark.parametrize("name", [
    "mlp", "transformer_lm",
    pytest.param("bert_tiny", marks=pytest.mark.slow),
    pytest.param("resnet18", marks=pytest.mark.slow),
    pytest.param("dcgan", marks=pytest.mark.slow),
])
def test_zoo_models_train_one_step(tmp_path, name):
    run = train.train(one_step(name, tmp_path))
    assert run.num_replicas == 1 and run.initial_epoch == 0
    assert [r["model"] for r in run.results] == [0, 1]
    losses = ("d_loss", "g_loss") if name == "dcgan" else ("loss",)
    for row in run.results:
        for loss in losses:
            assert math.isfinite(row[loss]) and math.isfinite(
                row[f"val_{loss}"])
        assert row["status"] == "ok"
    assert run.array.num_models == 2
    assert run.array.optimizer.iterations.numpy() == 1


def test_grid_schedule_and_per_model_optimizer_args(tmp_path):
    config = one_step(
        "mlp", tmp_path, num_models=None, optimizer="adamw", epochs=2,
        train_steps=2, grid="learning_rate=0.01,0.001;weight_decay=0,0.1",
        optimizer_args="beta_1=0.8", schedule="cosine",
        schedule_args="alpha=0.1,warmup_epochs=1")
    run = train.train(config)
    optimizer = run.array.optimizer
    assert type(optimizer).__name__ == "AdamW"
    np.testing.assert_allclose(optimizer.get_hyperparameter("beta_1"),
                               [0.8] * 4)
    np.testing.assert_allclose(optimizer.get_hyperparameter("weight_decay"),
                               [0, 0.1, 0, 0.1])
    # After the 4 steps of the run the cosine schedule has decayed every
    # model's rate to alpha times its own.
    np.testing.assert_allclose(
        optimizer.get_hyperparameter("learning_rate"),
        0.1 * np.array([0.01, 0.01, 0.001, 0.001]), rtol=1e-5)
    assert [(r["learning_rate"], r["weight_decay"]) for r in run.results] == [
        (0.01, 0), (0.01, 0.1), (0.001, 0), (0.001, 0.1)]


def test_mixed_precision_policy_is_applied_and_restored(tmp_path):
    run = train.train(one_step("mlp", tmp_path,
                               mixed_precision="mixed_bfloat16"))
    policies = {layer.dtype_policy.name for layer in run.array.layers
                if layer.weights}
    assert policies == {"mixed_bfloat16"}
    assert keras.mixed_precision.global_policy().name == "float32"
    assert all(math.isfinite(r["loss"]) for r in run.results)


@pytest.mark.parametrize("eval_steps", [None, 1])
def test_tfrecord_dataset(tmp_path, eval_steps):
    # Two epochs: the second validates too (Keras keeps the validation
    # iterator from epoch to epoch; it ran out: StopIteration).
    (x, y), (x_val, y_val) = zoo_data.digits()
    zoo_data.write_image_tfrecords(tmp_path / "train.tfrecord", x[:64],
                                   y[:64])
    zoo_data.write_image_tfrecords(tmp_path / "val.tfrecord", x_val[:32],
                                   y_val[:32])
    config = one_step("mlp", tmp_path, train_steps=None,
                      eval_steps=eval_steps, batch_size=16, epochs=2,
                      dataset=str(tmp_path / "train*.tfrecord"),
                      validation_dataset=str(tmp_path / "val.tfrecord"))
    run = train.train(config)
    assert run.array.optimizer.iterations.numpy() == 8
    for b in range(2):
        losses = run.history[f"val_loss_{b}"]
        assert len(losses) == 2 and all(map(math.isfinite, losses))
    # Each epoch validates on the same examples: the array evaluated on
    # them gives the last epoch's values.
    images = x_val[:32 if eval_steps is None else 16].reshape(-1, 8, 8, 1)
    images = (np.round(images * 255.0) / 255.0).astype("float32")  # PNG
    evaluated = run.array.evaluate(images, y_val[:len(images)], verbose=0,
                                   return_dict=True)
    for b in range(2):
        assert_close(evaluated[f"loss_{b}"], run.history[f"val_loss_{b}"][-1])


def test_rerun_after_an_interruption_resumes(tmp_path):
    config = one_step("mlp", tmp_path, epochs=3, train_steps=3)
    with pytest.raises(KeyboardInterrupt):
        train.train(config, callbacks=[Interrupt(epoch=1)])
    backup = json.loads((tmp_path / "mlp" / "backup" / "backup.json")
                        .read_text())
    assert backup["epoch"] == 1
    run = train.train(config)
    assert run.initial_epoch == 1
    assert run.array.optimizer.iterations.numpy() == 9
    history = read_csv(tmp_path / "mlp" / results.HISTORY_FILE)
    assert [(r["epoch"], r["model"]) for r in history] == [
        (str(e), str(b)) for e in range(3) for b in range(2)]
    assert len(run.history["loss_0"]) == 3


def test_a_run_killed_while_it_writes_its_results_writes_them_again(
        tmp_path, monkeypatch):
    config = one_step("mlp", tmp_path, epochs=2, train_steps=2)
    write_results = train._report
    trained = []

    def killed(plan, array, header):
        trained.append(array.get_weights())
        raise KeyboardInterrupt

    monkeypatch.setattr(train, "_report", killed)
    with pytest.raises(KeyboardInterrupt):
        train.train(config)
    # The trained run is kept, not trained again.
    backup = tmp_path / "mlp" / "backup"
    assert json.loads((backup / "backup.json").read_text())["epoch"] == 2
    monkeypatch.setattr(train, "_report", write_results)
    run = train.train(config)
    assert run.initial_epoch == 2
    for got, want in zip(run.array.get_weights(), trained[0]):
        np.testing.assert_array_equal(got, want)
    assert [r["model"] for r in run.results] == [0, 1]
    assert len(read_csv(tmp_path / "mlp" / results.HISTORY_FILE)) == 4
    assert not (backup / "backup.json").exists()


def test_resuming_another_number_of_models_fails_before_writing(tmp_path):
    config = one_step("mlp", tmp_path, epochs=2, train_steps=2)
    with pytest.raises(KeyboardInterrupt):
        train.train(config, callbacks=[Interrupt(epoch=1)])
    model_dir = tmp_path / "mlp"

    def files():
        """The config, history and backup (TensorBoard flushes its own)."""
        paths = [*model_dir.glob("*"), *(model_dir / "backup").glob("*")]
        return {p.name: p.read_bytes() for p in paths if p.is_file()}

    written = files()
    assert {"history.csv", "backup.json"} <= set(written)
    with pytest.raises(ConfigError, match="holds an array of 2 models; this "
                       "run has 3.*another --model_dir"):
        train.train(one_step("mlp", tmp_path, epochs=2, train_steps=2,
                             num_models=3))
    assert files() == written


def test_resuming_with_other_learning_rates_fails_before_writing(tmp_path):
    # The backup would go on with its own rates; results.csv would name the
    # new ones.
    config = one_step("mlp", tmp_path, epochs=2, train_steps=2)
    with pytest.raises(KeyboardInterrupt):
        train.train(config, callbacks=[Interrupt(epoch=1)])
    model_dir = tmp_path / "mlp"
    written = {p.name: p.read_bytes() for p in model_dir.glob("*")
               if p.is_file()}
    changed = dataclasses.replace(config, learning_rate=[0.01, 0.02])
    with pytest.raises(ConfigError, match="other settings: learning_rate "
                       r"\[.*\], now \[0.01, 0.02\].*config.yaml"):
        train.train(changed)
    assert {p.name: p.read_bytes() for p in model_dir.glob("*")
            if p.is_file()} == written
    # More epochs (and other outputs) may change: it resumes.
    run = train.train(dataclasses.replace(config, epochs=3, verbose=0))
    assert run.initial_epoch == 1


def test_a_long_list_that_changed_is_told_by_its_first_difference():
    # One line, however many models.
    rates = [0.01 * (b + 1) for b in range(100)]
    assert resume._setting_change(
        "learning_rate", rates, rates[:7] + [0.5] + rates[8:]) == (
        "learning_rate 0.08 for model 7, now 0.5 (of 100 values)")
    assert resume._setting_change("learning_rate", rates, rates[:50]) == (
        "learning_rate 100 values, now 50")
    assert resume._setting_change("seed", 0, 1) == "seed 0, now 1"


def test_a_rerun_of_the_written_config_exports_under_its_own_model_dir(
        tmp_path):
    config = one_step("mlp", tmp_path, epochs=1, train_steps=1,
                      export_dir=None)
    train.train(config)
    assert (tmp_path / "mlp" / "export").is_dir()
    written = config_module.read_file(tmp_path / "mlp" / "config.yaml")
    assert written["export_dir"] is None
    rerun = config_module.Config.from_dict(written).updated(
        {"model_dir": str(tmp_path / "rerun")}, "the flags").resolved()
    assert rerun.export_dir == str(tmp_path / "rerun" / "export")


@pytest.mark.parametrize("name", ["model_dir", "export_dir"])
def test_a_directory_that_is_a_file_is_refused_before_training(tmp_path,
                                                               name):
    (tmp_path / "afile").write_text("")
    config = one_step("mlp", tmp_path, **{name: str(tmp_path / "afile"
                                                    / "sub")})
    with pytest.raises(ConfigError, match=f"--{name}=.*afile is a file"):
        config.validate()


@pytest.mark.skipif(not pathlib.Path("/proc/self").is_dir(),
                    reason="a directory no process can make: Linux's /proc")
def test_a_directory_that_cannot_be_made_is_refused_before_training(
        tmp_path):
    config = one_step("mlp", tmp_path, model_dir="/proc/hftatf-run")
    with pytest.raises(ConfigError,
                       match="--model_dir=/proc/hftatf-run is not a "
                             "directory this run can write to"):
        config.validate()
    # A directory that can be made is checked, and nothing is left behind.
    one_step("mlp", tmp_path, model_dir=str(tmp_path / "a" / "b")).validate()
    assert not (tmp_path / "a").exists()


def test_an_unreadable_backup_fails_before_writing(tmp_path):
    backup_dir = tmp_path / "mlp" / "backup"
    backup_dir.mkdir(parents=True)
    (backup_dir / "backup.json").write_text('{"epoch": "one"}')
    with pytest.raises(ConfigError, match="backup.json is unreadable"):
        train.train(one_step("mlp", tmp_path))
    assert sorted(p.name for p in (tmp_path / "mlp").rglob("*")) == [
        "backup", "backup.json"]


def test_a_corrupt_backup_fails_before_writing(tmp_path):
    backup_dir = tmp_path / "mlp" / "backup"
    backup_dir.mkdir(parents=True)
    (backup_dir / "w.weights.h5").write_bytes(b"truncated")
    (backup_dir / "backup.json").write_text(json.dumps(
        {"epoch": 3, "weights": "w.weights.h5", "sha256": "0" * 64}))
    with pytest.raises(ConfigError, match="backup .* is corrupt"):
        train.train(one_step("mlp", tmp_path))
    assert sorted(p.name for p in (tmp_path / "mlp").rglob("*")) == [
        "backup", "backup.json", "w.weights.h5"]


@pytest.mark.parametrize("values, message", [
    # resnet18's builder takes **kwargs: a misspelt name reaches the build.
    (dict(model_args={"input_shape": [8, 8, 3], "widht": 0.0625}),
     "refused them.*widht"),
    (dict(model_args={"input_shape": [8, 8, 3], "width": "abc"}),
     "refused them"),
    # Images of 8 x 8 for a model built for 16 x 16.
    (dict(model_args={"input_shape": [16, 16, 3], "width": 0.0625}),
     r"takes images of shape \(16, 16, 3\), but the data's examples "
     r"have shape \(8, 8, 3\)"),
])
def test_a_model_that_cannot_train_fails_before_a_run_is_overwritten(
        tmp_path, values, message):
    model_dir = tmp_path / "resnet18"
    (model_dir / "logs").mkdir(parents=True)
    for name in ("config.yaml", "history.csv", "logs/events"):
        (model_dir / name).write_text(f"the previous run's {name}")
    with pytest.raises(ConfigError, match=message):
        train.train(one_step("resnet18", tmp_path, **values))
    for name in ("config.yaml", "history.csv", "logs/events"):
        assert (model_dir / name).read_text() == (
            f"the previous run's {name}")


def test_a_training_set_of_less_than_one_step_fails_before_writing(
        tmp_path):
    config = one_step("mlp", tmp_path, train_steps=None, batch_size=4096)
    with pytest.raises(ConfigError, match="not one step"):
        train.train(config)
    assert not (tmp_path / "mlp").exists()


# What lays a one-CPU run out, as the header names it: the strategy on
# TensorFlow, the keras.distribution (none) on JAX.
PLACEMENT = {"tensorflow": "OneDeviceStrategy", "jax": "one device"}


def test_a_header_then_the_table_every_n_epochs(tmp_path, capsys,
                                                monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    model_dir = tmp_path / "run"
    with flagsaver.flagsaver(epochs=2, train_steps=2, eval_steps=1,
                             verbose=2, table_every=1,
                             learning_rate=["0.03", "0.01"],
                             model_dir=str(model_dir), export_dir=""):
        train.main([])
    lines = capsys.readouterr().out.splitlines()
    assert lines[:3] == [
        "hftatf-train: 2 mlp models; data: digit_images (recipe mlp); 2 "
        "epochs of 2 steps per epoch (+1 validation), batch 64",
        "  per model: learning_rate 0.03, 0.01",
        f"  device: 1 CPU ({PLACEMENT[keras.backend.backend()]}); backend "
        f"{keras.backend.backend()}; XLA on"]
    assert lines[3] == "Epoch 1/2"
    history = results.read_history(model_dir / results.HISTORY_FILE, 2)
    tables = [i for i, line in enumerate(lines) if line.startswith("Epoch")
              and line.endswith(":")]
    assert [lines[i] for i in tables] == ["Epoch 1:", "Epoch 2:"]
    for epoch, i in enumerate(tables):
        assert lines[i + 1].split() == [
            "model", "learning_rate", "loss", "accuracy", "val_loss",
            "val_accuracy", "status"]
        # By the recipe's monitor; ties to the first model.
        monitored = [history[f"val_accuracy_{b}"][epoch] for b in range(2)]
        best = int(np.argmax(monitored))
        for b, rate in enumerate(["0.03", "0.01"]):
            cells = lines[i + 2 + b].split()
            assert cells[:2] == [f"{b}*" if b == best else str(b), rate]
            assert cells[2] == f"{history[f'loss_{b}'][epoch]:.4g}"
            if epoch:
                change = (history[f"loss_{b}"][1] - history[f"loss_{b}"][0])
                assert cells[3] == f"({change:+.2g})"
    # The table is printed after the epoch's line.
    assert lines[tables[0] - 1].startswith("2/2 - ")


def test_without_validation_the_best_is_by_training_loss(tmp_path, capsys):
    model_dir = tmp_path / "run"
    with flagsaver.flagsaver(epochs=1, train_steps=1, eval_steps=0,
                             verbose=0, model_dir=str(model_dir),
                             export_dir=""):
        train.main([])
    printed = capsys.readouterr().out
    assert printed.splitlines()[0].split() == [
        "model", "learning_rate", "loss", "accuracy", "status"]
    assert "by the training loss (val_accuracy has no values)." in printed
    with open(model_dir / results.RESULTS_FILE, newline="") as file:
        assert next(csv.reader(file)) == [
            "model", "learning_rate", "loss", "accuracy", "status"]


@pytest.mark.parametrize("schedule, args, stock", [
    ("constant", {}, lambda rate: (lambda step: rate)),
    ("cosine", {"alpha": 0.2}, lambda rate: keras.optimizers.schedules
     .CosineDecay(rate, decay_steps=60, alpha=0.2)),
    ("exponential", {"decay_rate": 0.5, "decay_epochs": 2},
     lambda rate: keras.optimizers.schedules.ExponentialDecay(
         rate, decay_steps=20, decay_rate=0.5)),
    ("step", {}, lambda rate: keras.optimizers.schedules.ExponentialDecay(
        rate, decay_steps=20, decay_rate=0.1, staircase=True)),
])
def test_schedules_follow_the_stock_ones_per_model(schedule, args, stock):
    rates = [0.1, 0.01]
    config = Config(schedule=schedule, schedule_args=args, epochs=6)
    learning_rate = train.make_learning_rate(config, rates, 10)
    for step in (0, 7, 20, 33, 60, 75):
        values = (learning_rate(step) if callable(learning_rate)
                  else learning_rate)
        expected = [float(stock(rate)(step)) for rate in rates]
        np.testing.assert_allclose(np.asarray(values, "float32"), expected,
                                   rtol=1e-6)


def test_warmup_rises_linearly_to_the_schedule():
    config = Config(schedule="cosine", schedule_args={"warmup_epochs": 1},
                    epochs=4)
    learning_rate = train.make_learning_rate(config, [0.1, 0.01], 10)
    cosine = [keras.optimizers.schedules.CosineDecay(rate, decay_steps=40)
              for rate in (0.1, 0.01)]
    np.testing.assert_allclose(np.asarray(learning_rate(0)), [0, 0])
    np.testing.assert_allclose(
        np.asarray(learning_rate(5)),
        [0.5 * float(c(10)) for c in cosine], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(learning_rate(25)),
                               [float(c(25)) for c in cosine], rtol=1e-6)


def test_a_diverged_models_results_are_all_of_its_last_finite_epoch():
    nan = math.nan
    history = {"loss_0": [1.0, 0.5, 0.25], "val_loss_0": [1.1, 0.6, 0.3],
               "accuracy_0": [0.1, 0.2, 0.3],
               "loss_1": [2.0, 9e15, nan], "val_loss_1": [2.1, nan, nan],
               "accuracy_1": [0.4, 0.35, 0.7],
               "loss_2": [nan, nan, nan], "val_loss_2": [1.0, nan, nan],
               "accuracy_2": [0.5, 0.6, 0.7]}
    rows = report.model_results(history, {"learning_rate": [0.1, 1e6, 1e9]},
                                diverged=[False, True, True])
    assert (rows[0]["loss"], rows[0]["val_loss"], rows[0]["accuracy"]) == (
        0.25, 0.3, 0.3)
    # Epoch 1, where its loss was last finite: not epoch 0's val_loss, nor
    # epoch 2's accuracy.
    assert rows[1]["loss"] == 9e15 and rows[1]["accuracy"] == 0.35
    assert math.isnan(rows[1]["val_loss"])
    assert all(math.isnan(rows[2][name])
               for name in ("loss", "val_loss", "accuracy"))
    assert [row["status"] for row in rows] == ["ok", "diverged", "diverged"]


def test_mlp_widths_that_are_not_integers_are_named_in_the_error(tmp_path):
    # "abc" was read one letter per layer: "Received: units=a".
    config = one_step("mlp", tmp_path, model_args={"hidden_units": "abc"})
    with pytest.raises(ConfigError, match="`hidden_units` must be a "
                       "sequence of layer widths.*'abc'"):
        train.build_model(config.recipe(), config)
