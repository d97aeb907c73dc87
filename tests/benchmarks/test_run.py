"""The training benchmark harness: its FLOP counter, its argument parsing,
and one smoke run of every mode with the tiniest settings (not a timing
test: it checks that the harness runs and writes a well-formed CSV)."""

import argparse
import csv
import dataclasses
import json
import os
import pathlib
import subprocess
import sys

import keras
import numpy as np
import pytest

# The harness lives next to the package, not inside it.
ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks import (  # noqa: E402
    backends,
    measure,
    run,
    run_results,
    run_workers,
    worker,
)
from benchmarks.workloads import (  # noqa: E402
    CycledBatches,
    Workload,
    parse_overrides,
    parse_value,
)
from hftatf.models.batches import ArrayBatches  # noqa: E402

BACKEND = keras.backend.backend()
# Until the JAX trainer lands, an array's fit runs on TensorFlow only.
def trained(model, x, y):
    model.fit(x, y, batch_size=len(x), epochs=1, verbose=0)
    return model


def dense_step():
    """A trained 3-layer Dense model, its batch and the FLOPs of the dots
    of its training step."""
    batch, sizes = 8, (6, 5, 4, 3)
    x = keras.Input((sizes[0],))
    h = x
    for units in sizes[1:]:
        h = keras.layers.Dense(units)(h)
    model = keras.Model(x, h)
    model.compile("sgd", "mse")
    data = (np.ones((batch, sizes[0]), "float32"),
            np.ones((batch, sizes[-1]), "float32"))
    trained(model, *data)
    products = [2 * batch * a * b for a, b in zip(sizes, sizes[1:])]
    # Forward, kernel gradients, and input gradients of every layer but the
    # first (the data need none).
    return model, data, 2 * sum(products) + sum(products[1:])


@pytest.mark.backends("jax", reason="XLA's cost analysis of a JAX step")
def test_jax_step_flops_are_the_dots_and_a_few_element_wise_ops():
    model, data, dots = dense_step()
    flops = measure.train_step_flops(model, data)
    assert dots <= flops <= 1.5 * dots


@pytest.mark.backends("tensorflow", reason="the HLO of a tf.function step; "
                      "JAX's step is counted by XLA's cost analysis")
def test_hlo_flops_of_a_dense_step_are_the_textbook_count():
    tf = pytest.importorskip("tensorflow")
    model, data, expected = dense_step()
    flops = measure.train_step_flops(
        model, tuple(tf.constant(d) for d in data))
    assert flops == expected


@pytest.mark.backends("tensorflow", reason="the HLO of a tf.function step; "
                      "JAX's step is counted by XLA's cost analysis")
def test_hlo_flops_count_convolutions_and_their_gradients():
    batch = 2
    x = keras.Input((6, 6, 3))
    h = keras.layers.Conv2D(4, 3, padding="same")(x)
    h = keras.layers.DepthwiseConv2D(3)(h)
    model = keras.Model(x, h)
    model.compile("sgd", "mse")
    data = (np.ones((batch, 6, 6, 3), "float32"),
            np.ones((batch, 4, 4, 4), "float32"))
    trained(model, *data)
    tf = pytest.importorskip("tensorflow")
    conv = 2 * batch * 6 * 6 * 4 * 3 * 3 * 3
    depthwise = 2 * batch * 4 * 4 * 4 * 3 * 3
    # The depthwise input gradient sums 3 x 3 windows over the padded
    # 6 x 6 map, as XLA computes it.
    depthwise_input = 2 * batch * 6 * 6 * 4 * 3 * 3
    # conv: forward and kernel gradient (the data need no gradient).
    expected = 2 * conv + 2 * depthwise + depthwise_input
    flops = measure.train_step_flops(
        model, tuple(tf.constant(d) for d in data))
    assert flops == expected


def test_hlo_flops_read_operand_shapes_from_their_definitions():
    text = """
      %a = f32[4,3]{1,0} parameter(0)
      %b = f32[3,5]{1,0} parameter(1)
      %dot.1 = f32[4,5]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
      %dot.2 = f32[4,5]{1,0} dot(f32[4,3]{1,0} %a, f32[3,5]{1,0} %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
      %dead = f32[4,5]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
      ROOT %add = f32[4,5]{1,0} add(%dot.1, %dot.2)
    """  # noqa: E501
    assert measure.hlo_flops(text) == 2 * (2 * 4 * 5 * 3)
    assert measure.hlo_flops("HloModule m") == 0


def test_parse_overrides():
    assert parse_overrides("width=0.5,hidden_units=(8;4),dropout=none,"
                           "name=tiny,augment=true") == {
        "width": 0.5, "hidden_units": (8, 4), "dropout": None,
        "name": "tiny", "augment": True}
    assert parse_value("3") == 3
    with pytest.raises(ValueError, match="name=value"):
        parse_overrides("width")


def test_parse_args_rejects_unknown_modes():
    with pytest.raises(SystemExit):
        run.parse_args(["--modes", "serial,parallel"])


@pytest.mark.parametrize("value", ["0", "2,-1", "two", "1.5"])
def test_parse_args_rejects_array_sizes_it_cannot_train(value, capsys):
    with pytest.raises(SystemExit):
        run.parse_args(["--num_models", value])
    assert "--num_models must be" in capsys.readouterr().err
    assert run.parse_args(["--num_models", "1,8"]).num_models == [1, 8]


def test_parse_args_reads_models_per_pass():
    assert run.parse_args([]).models_per_pass == "auto"
    assert run.parse_args(["--models_per_pass", "2"]).models_per_pass == 2
    with pytest.raises(SystemExit):
        run.parse_args(["--models_per_pass", "some"])


@pytest.mark.parametrize("argv,message", [
    (["--modes="], "--modes must name at least one"),
    (["--modes=,"], "--modes must name at least one"),
    (["--modes", "fused,fused,serial"], "--modes lists fused more than once"),
    (["--num_models="], "--num_models must name at least one"),
    (["--num_models", "2,2"], "--num_models lists 2 more than once"),
    (["--model", ""], "--model must name at least one"),
    (["--model", "mlp,mlp"], "--model lists mlp more than once"),
    (["--model", "all,mlp"], "--model all stands alone"),
    (["--model", "mlp,no_such_model"],
     "unknown --model no_such_model; known: bert_mini"),
    (["--repeats", "0"], "--repeats must be at least 1"),
    (["--repeats", "-2"], "--repeats must be at least 1"),
    (["--steps_per_execution", "0"], "--steps_per_execution must be at"),
    (["--stock_steps_per_execution", "-1"],
     "--stock_steps_per_execution must be at"),
    (["--steps", "0"], "--steps must be 'auto' or at least 1"),
    (["--steps", "-5"], "--steps must be 'auto' or at least 1"),
    (["--warmup_steps", "0"], "--warmup_steps must be at least 1"),
    (["--epochs", "0"], "--epochs must be at least 1"),
    (["--batch_size", "0"], "--batch_size must be at least 1"),
    (["--data_batches", "0"], "--data_batches must be at least 1"),
    (["--peak_size", "0"], "--peak_size must be at least 1"),
    (["--timeout", "0"], "--timeout must be a positive number"),
    (["--epoch_seconds", "-1"], "--epoch_seconds must be a positive"),
    (["--models_per_pass", "0"], "--models_per_pass must be 'auto', 'all'"),
    (["--serial_models", "0"], "--serial_models must be 'all' or at least"),
    (["--serial_models", "some"], "--serial_models must be 'all' or an"),
    (["--time_budget", "0"], "--time_budget must be a positive number"),
    (["--dtype_policy", "float16"], "--dtype_policy: invalid choice"),
    (["--num_models", "auto,auto"], "--num_models lists auto more than"),
    (["--num_models", "auto,0"], "--num_models must be positive"),
    (["--max_num_models", "0"], "--max_num_models must be at least 1"),
])
def test_parse_args_rejects_values_it_cannot_measure(argv, message, capsys):
    with pytest.raises(SystemExit) as error:
        run.parse_args(argv)
    assert error.value.code == 2
    assert message in capsys.readouterr().err


def test_quick_sets_defaults_that_explicit_flags_override():
    args = run.parse_args(["--quick"])
    assert (args.num_models, args.epochs, args.warmup_steps,
            args.epoch_seconds) == ([1, 2, 4], 2, 2, 0.5)
    args = run.parse_args(["--quick", "--epochs", "5", "--warmup_steps", "4",
                           "--epoch_seconds", "3", "--num_models", "8"])
    assert (args.num_models, args.epochs, args.warmup_steps,
            args.epoch_seconds) == ([8], 5, 4, 3.0)
    assert run.parse_args([]).epochs == 3


# -- runs with stand-in workers (nothing trains) ---------------------------


def fake_workers(monkeypatch, timeouts=(), fail=None):
    """Replaces the worker processes: every epoch of one model takes 1 s
    stock and 0.5 s fused (2 s and 1 s of processor time); the sizing picks
    B = 16. The tasks in
    `timeouts` ("probe", "serial", "single", "fused") run past --timeout;
    `fail(spec)` may raise. Returns the specs the workers were given."""
    specs = []

    def run_worker(spec, timeout):
        specs.append(spec)
        if fail is not None:
            fail(spec)
        if spec["task"] in timeouts:
            raise subprocess.TimeoutExpired(spec["task"], timeout)
        if spec["task"] == "probe":
            return {"jit": {"false": [0.01]}, "step_flops": 1e3,
                    "matmul_peak_flops": 1e9}
        if spec["task"] == "size":
            return {"num_models": 16}
        if spec["task"] == "serial":
            return {"model_epoch_seconds": [[1.0]] * spec["num_models"],
                    "model_epoch_cpu_seconds": [[2.0]] * spec["num_models"],
                    "peak_rss_mb": 10.0}
        return {"epoch_seconds": [0.5], "epoch_cpu_seconds": [1.0],
                "peak_rss_mb": 20.0, "jit_compile": False,
                "models_per_pass": spec["models_per_pass"]}

    def run_concurrent(spec, num_models, timeout):
        specs.append({**spec, "task": "single", "num_models": num_models})
        if "single" in timeouts:
            raise subprocess.TimeoutExpired("single", timeout)
        return [{"epoch_seconds": [1.0], "epoch_cpu_seconds": [2.0],
                 "peak_rss_mb": 10.0}] * num_models

    monkeypatch.setattr(run, "run_worker", run_worker)
    monkeypatch.setattr(run, "run_concurrent", run_concurrent)
    return specs


def fake_run(tmp_path, *flags):
    return ["--steps", "2", "--epochs", "1", "--warmup_steps", "1",
            "--stock_jit", "false", "--output_dir", str(tmp_path), *flags]


def read_table(tmp_path):
    with open(tmp_path / "results.csv") as file:
        return list(csv.DictReader(file))


@pytest.mark.parametrize("task", ["serial", "single", "fused"])
def test_a_timed_out_mode_is_recorded_and_the_run_goes_on(task, tmp_path,
                                                          monkeypatch):
    fake_workers(monkeypatch, timeouts=(task,))
    run.main(fake_run(tmp_path, "--model", "mlp,pointnet", "--num_models",
                      "1,2", "--fused_jit", "best"))
    table = read_table(tmp_path)
    mode = {"single": "concurrent"}.get(task, task)
    assert [(r["model"], r["num_models"]) for r in table[::3]] == [
        ("mlp", "1"), ("mlp", "2"), ("pointnet", "1"), ("pointnet", "2")]
    for row in table:
        timed_out = row["mode"] == mode
        assert row["timeouts"] == ("1" if timed_out else "0")
        assert row["repeats"] == ("0" if timed_out else "1")
        assert (row["samples_per_s"] == "") == timed_out
        # No serial measurement, no speedup; none for a missing mode.
        assert (row["speedup"] == "") == (timed_out or task == "serial")
    markdown = (tmp_path / "results.md").read_text()
    assert markdown.count("timed out") == 4


def test_a_timed_out_probe_skips_its_model(tmp_path, monkeypatch):
    def fail(spec):
        if spec["task"] == "probe" and spec["model"] == "mlp":
            raise subprocess.TimeoutExpired("probe", 1)

    fake_workers(monkeypatch, fail=fail)
    run.main(fake_run(tmp_path, "--model", "mlp,pointnet", "--num_models",
                      "2"))
    assert {r["model"] for r in read_table(tmp_path)} == {"pointnet"}


def crash(task, model=None, num_models=None, jit=None):
    """A `fail` for `fake_workers`: the worker of `task` (and of `model`,
    `num_models`, fused `jit`, where given) crashes."""
    def fail(spec):
        if (spec["task"] == task
                and model in (None, spec["model"])
                and num_models in (None, spec.get("num_models"))
                and jit in (None, spec.get("fused_jit_compile"))):
            raise run.WorkerError(f"{task} worker: Segmentation fault")
    return fail


@pytest.mark.parametrize("task", ["serial", "fused"])
def test_a_crashed_worker_is_recorded_and_the_run_goes_on(
        task, tmp_path, monkeypatch, capsys):
    fake_workers(monkeypatch, fail=crash(task, num_models=1))
    with pytest.raises(SystemExit, match=rf"1 measurement\(s\) failed.*"
                       rf"mlp B=1 {task}"):
        run.main(fake_run(tmp_path, "--num_models", "1,2", "--modes",
                          "serial,fused", "--fused_jit", "false"))
    assert "Segmentation fault" in capsys.readouterr().out
    table = read_table(tmp_path)
    assert [(r["mode"], r["num_models"]) for r in table] == [
        ("serial", "1"), ("fused", "1"), ("serial", "2"), ("fused", "2")]
    for row in table:
        failed = row["mode"] == task and row["num_models"] == "1"
        assert row["failures"] == ("1" if failed else "0")
        assert row["timeouts"] == "0"
        assert (row["samples_per_s"] == "") == failed
    assert table[3]["speedup"] == "4.0"
    assert table[1]["speedup"] == ""
    assert "| failed |" in (tmp_path / "results.md").read_text()


@pytest.mark.backends("tensorflow", reason="on JAX `best` measures XLA "
                      "alone: there is no other setting to fall back on")
def test_a_crash_under_one_xla_setting_leaves_the_other(tmp_path,
                                                        monkeypatch):
    fake_workers(monkeypatch, fail=crash("fused", jit=True))
    run.main(fake_run(tmp_path, "--num_models", "2", "--modes",
                      "serial,fused", "--fused_jit", "best"))
    fused = read_table(tmp_path)[1]
    assert (fused["failures"], fused["speedup"]) == ("0", "4.0")


def test_best_jit_is_xla_alone_on_jax():
    assert run._best_settings(argparse.Namespace(backend="jax")) == [True]
    assert run._best_settings(argparse.Namespace(
        backend="tensorflow")) == [False, True]


def test_a_failed_probe_skips_its_model(tmp_path, monkeypatch):
    fake_workers(monkeypatch, fail=crash("probe", model="mlp"))
    with pytest.raises(SystemExit, match="mlp probe"):
        run.main(fake_run(tmp_path, "--model", "mlp,pointnet",
                          "--num_models", "2"))
    assert {r["model"] for r in read_table(tmp_path)} == {"pointnet"}


def test_a_crashed_concurrent_worker_is_a_worker_error(monkeypatch):
    spec = {"model": "mlp", "seed": 0}
    monkeypatch.setattr(run_workers, "_command", lambda spec: [
        sys.executable, "-c", "import sys; sys.exit('no READY line')"])
    with pytest.raises(run_workers.WorkerError, match="no READY line"):
        run_workers.run_concurrent(spec, 2, timeout=60)


def test_concurrent_throughput_sums_each_process_median_epoch(monkeypatch):
    args = run.parse_args(["--timeout", "10"])
    # The first epoch of each process is slow (say, a late start); the
    # medians are 1 s and 2 s.
    results = [{"epoch_seconds": [9.0, 1.0, 1.0],
                "epoch_cpu_seconds": [9.0, 3.0, 3.0], "peak_rss_mb": 5.0},
               {"epoch_seconds": [9.0, 2.0, 2.0],
                "epoch_cpu_seconds": [9.0, 4.0, 4.0], "peak_rss_mb": 7.0}]
    monkeypatch.setattr(run, "run_concurrent",
                        lambda spec, num_models, timeout: results)
    seconds, cpu_seconds, rss, device, jit, per_pass = run.measure_mode(
        args, "concurrent", 2, {"jit_compile": True})
    # 1 + 1/2 rounds of one model per second: two models' round in 4/3 s.
    assert seconds == pytest.approx(4 / 3)
    assert cpu_seconds == pytest.approx(7.0)
    assert (rss, device, jit, per_pass) == (12.0, None, True, None)


def test_models_per_pass_is_clamped_to_each_array_size(tmp_path,
                                                       monkeypatch):
    specs = fake_workers(monkeypatch)
    run.main(fake_run(tmp_path, "--num_models", "1,4", "--modes", "fused",
                      "--fused_jit", "false", "--models_per_pass", "2"))
    assert [s["models_per_pass"] for s in specs
            if s["task"] == "fused"] == [1, 2]
    assert [r["models_per_pass"] for r in read_table(tmp_path)] == ["1", "2"]


def test_models_per_pass_all_is_what_a_gan_array_does():
    work = Workload("dcgan", batch_size=4,
                    model_args={"latent_dim": 8, "filters": 4,
                                "image_size": 8},
                    data_args={"image_size": 8})
    for setting in (None, 2):
        assert work.fused_model(2, jit_compile=False,
                                models_per_pass=setting).compiled
    with pytest.raises(ValueError, match="'auto' or 'all'"):
        work.fused_model(2, jit_compile=False, models_per_pass=1)


def test_serial_models_are_timed_once_and_scaled_to_each_array_size(
        tmp_path, monkeypatch):
    specs = fake_workers(monkeypatch)
    run.main(fake_run(tmp_path, "--num_models", "1,4,8", "--modes",
                      "serial,fused", "--fused_jit", "false",
                      "--serial_models", "2"))
    # B = 1 trains its one model; B = 4 two, whose time B = 8 takes again.
    assert [s["num_models"] for s in specs if s["task"] == "serial"] == [1, 2]
    table = read_table(tmp_path)
    serial = [r for r in table if r["mode"] == "serial"]
    assert [r["serial_models_timed"] for r in serial] == ["1", "2", "2"]
    # A stock model's epoch takes 1 s at every B, so serial's rate is one
    # model's; the array's epoch of B models takes 0.5 s.
    assert len({float(r["samples_per_s"]) for r in serial}) == 1
    assert [float(r["speedup"]) for r in table if r["mode"] == "fused"] == [
        2.0, 8.0, 16.0]
    assert "serial: 2 stock model(s) timed one after another" in (
        tmp_path / "results.md").read_text()


def test_auto_adds_the_array_size_the_sizing_code_picks(tmp_path,
                                                         monkeypatch):
    specs = fake_workers(monkeypatch)
    run.main(fake_run(tmp_path, "--num_models", "auto,8", "--modes",
                      "serial,fused", "--fused_jit", "false",
                      "--max_num_models", "512"))
    sizing = [s for s in specs if s["task"] == "size"]
    assert [s["max_num_models"] for s in sizing] == [512]
    table = read_table(tmp_path)
    assert [(r["num_models"], r["sized"]) for r in table] == [
        ("8", "False"), ("8", "False"), ("16", "True"), ("16", "True")]
    assert "auto_num_models` (the largest array that fits and still gains " \
        "throughput): mlp 16." in (tmp_path / "results.md").read_text()


def test_a_failed_sizing_leaves_the_other_sizes(tmp_path, monkeypatch):
    def fail(spec):
        if spec["task"] == "size":
            raise run.WorkerError("out of host memory")

    fake_workers(monkeypatch, fail=fail)
    with pytest.raises(SystemExit, match="mlp sizing"):
        run.main(fake_run(tmp_path, "--num_models", "2,auto", "--modes",
                          "serial,fused", "--fused_jit", "false"))
    assert [r["num_models"] for r in read_table(tmp_path)] == ["2", "2"]


def test_past_the_time_budget_measurements_are_left_out(tmp_path,
                                                        monkeypatch):
    # Every worker takes 10 s of a clock the run reads.
    clock = [0.0]
    fake_workers(monkeypatch, fail=lambda spec: clock.__setitem__(
        0, clock[0] + 10.0))
    monkeypatch.setattr(run.time, "monotonic", lambda: clock[0])
    rows = run.main(fake_run(tmp_path, "--model", "mlp,pointnet",
                             "--num_models", "1,2", "--modes",
                             "serial,fused", "--fused_jit", "false",
                             "--time_budget", "25"))
    # The probe (0-10 s), B = 1 serial (10-20 s) and fused (20-30 s) start
    # within 25 s; nothing after.
    assert [(r["model"], r["mode"], r["num_models"]) for r in rows] == [
        ("mlp", "serial", 1), ("mlp", "fused", 1)]
    assert len(read_table(tmp_path)) == 2
    assert (tmp_path / "results.md").exists()


def test_device_memory_and_the_arrays_share_of_b_stock_models(
        tmp_path, monkeypatch):
    fake_workers(monkeypatch)
    worker = run.run_worker

    def on_a_gpu(spec, timeout):
        result = worker(spec, timeout)
        result["peak_device_mb"] = {"serial": 100.0, "fused": 300.0}.get(
            spec["task"])
        return result

    monkeypatch.setattr(run, "run_worker", on_a_gpu)
    run.main(fake_run(tmp_path, "--num_models", "4", "--modes",
                      "serial,fused", "--fused_jit", "false"))
    assert [r["peak_device_mb"] for r in read_table(tmp_path)] == [
        "100.0", "300.0"]
    header, _, row = (tmp_path / "results.md").read_text().splitlines()[:3]
    assert header.endswith("| serial device MiB (one model) | fused device "
                           "MiB | fused device memory / B stock models' |")
    # 300 MiB for the array against 4 x 100 MiB for 4 stock models.
    assert row.endswith("| 100 | 300 | 0.75 |")


def test_the_csv_is_written_after_every_array_size(tmp_path, monkeypatch):
    def fail(spec):
        if spec["task"] == "fused" and spec["num_models"] == 2:
            raise RuntimeError("the run died")

    fake_workers(monkeypatch, fail=fail)
    with pytest.raises(RuntimeError, match="the run died"):
        run.main(fake_run(tmp_path, "--num_models", "1,2", "--modes",
                          "serial,fused", "--fused_jit", "false"))
    assert [(r["mode"], r["num_models"]) for r in read_table(tmp_path)] == [
        ("serial", "1"), ("fused", "1")]


def test_an_unusable_output_dir_stops_the_run_before_measuring(
        tmp_path, monkeypatch):
    specs = fake_workers(monkeypatch)
    taken = tmp_path / "a_file"
    taken.write_text("")
    with pytest.raises(SystemExit, match="--output_dir"):
        run.main(fake_run(taken / "results"))
    assert specs == []


def test_report_creates_its_directory(tmp_path):
    rows = [{"model": "mlp", "mode": "serial", "num_models": 1,
             "samples_per_s": 10.0}]
    run.report(rows, tmp_path / "new" / "dir")
    assert (tmp_path / "new" / "dir" / "results.md").exists()


def guarded_data(samples):
    """Recipe data of `samples` samples (two features, a label) whose
    input pipeline fails on its 100th pass: a loop over it that would
    never end fails instead."""

    class Guarded(ArrayBatches):
        def on_epoch_end(self):
            super().on_epoch_end()
            if self.epoch >= 100:
                raise RuntimeError("looped forever")

    def data(batch_size, seed=0, **kwargs):
        arrays = (np.zeros((samples, 2), "float32"),
                  np.arange(samples, dtype="float32"))
        return Guarded(arrays, batch_size), None

    return data


@pytest.mark.parametrize("samples,count,match", [
    (10, 0, "at least one batch"),
    (3, 2, "no full batch"),
])
def test_workload_batches_reject_what_they_cannot_give(samples, count,
                                                       match):
    work = Workload("mlp", batch_size=4)
    work.recipe = dataclasses.replace(work.recipe,
                                      data=guarded_data(samples))
    with pytest.raises(ValueError, match=match):
        work.batches(count)


def test_workload_batches_are_full_and_repeat():
    work = Workload("mlp", batch_size=16)
    batches = work.batches(3)
    x, y = batches
    assert x.shape == (3, 16, 8, 8, 1) and y.shape == (3, 16)
    element = next(iter(work.dataset(3)))
    assert element[0].shape == (16, 8, 8, 1)
    # Data with fewer full batches than asked for are cycled through.
    small = Workload("mlp", batch_size=4)
    small.recipe = dataclasses.replace(small.recipe, data=guarded_data(10))
    assert small.batches(5)[1][:, 0].tolist() == [0, 4, 0, 4, 0]


def test_stock_gan_twin_trains_like_the_array():
    work = Workload("dcgan", batch_size=4,
                    model_args={"latent_dim": 8, "filters": 4,
                                "image_size": 8},
                    data_args={"image_size": 8})
    dataset = work.dataset(2)
    stock = work.stock_model(jit_compile=False)
    logs = stock.fit(dataset, steps_per_epoch=2, verbose=0).history
    assert set(logs) == {"d_loss", "g_loss"}
    array = work.fused_model(2, jit_compile=False)
    logs = array.fit(dataset, steps_per_epoch=2, verbose=0).history
    assert {"d_loss_0", "g_loss_1"} <= set(logs)


def test_probe_measures_a_stock_twin_with_a_step_of_its_own():
    # The GAN twin holds its weights in two inner models and does not count
    # as built itself, which `count_params()` requires.
    spec = {"model": "dcgan", "batch_size": 4, "seed": 0,
            "model_args": {"latent_dim": 8, "filters": 4, "image_size": 8},
            "data_args": {"image_size": 8}, "data_batches": 2, "steps": 1,
            "epochs": 1, "warmup_steps": 1, "jit_settings": [False],
            "peak_size": 64, "peak_seconds": 0.05}
    result = worker.probe(spec)
    stock = Workload("dcgan", batch_size=4, model_args=spec["model_args"],
                     data_args=spec["data_args"]).stock_model(False)
    inner = (stock.generator.count_params()
             + stock.discriminator.count_params())
    assert inner <= result["parameters"] <= inner + 2  # + a seed state
    assert result["step_flops"] > 0 and len(result["jit"]["false"]) == 1


def test_worker_builds_under_the_dtype_policy_and_reports_device_memory(
        monkeypatch, capsys):
    seen = {}

    def task(spec):
        model = Workload("mlp", batch_size=4).stock_model(False)
        seen["policies"] = {layer.dtype_policy.name for layer in model.layers
                            if layer.weights}
        seen["peak"] = measure.matmul_peak(8, 0.0, keras.config.dtype_policy(
            ).compute_dtype)[1]
        return {}

    monkeypatch.setitem(worker.TASKS, "policy", task)
    try:
        worker.main([json.dumps({"task": "policy",
                                 "dtype_policy": "mixed_bfloat16"})])
    finally:
        keras.config.set_dtype_policy("float32")
    assert seen["policies"] == {"mixed_bfloat16"}
    assert "8x8 bfloat16 matmul" in seen["peak"]
    result = json.loads(capsys.readouterr().out.split(
        worker.RESULT_PREFIX)[-1])
    # This machine's CPU reports no device memory of its own.
    assert result["peak_device_mb"] is None and result["peak_rss_mb"] > 0


def test_sizing_task_asks_the_sizing_code_and_refuses_a_custom_step():
    spec = {"task": "size", "model": "mlp", "batch_size": 8, "seed": 0,
            "max_num_models": 2}
    # Timing decides between 1 and 2; never past the largest allowed.
    assert worker.size(spec)["num_models"] in (1, 2)
    with pytest.raises(ValueError, match="FusedGAN's step of its own"):
        worker.size({**spec, "model": "dcgan"})


def test_epoch_timer_records_wall_and_processor_time():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile("sgd", "mse", jit_compile=False)
    x = np.zeros((8, 4), "float32")
    dataset = CycledBatches((x[np.newaxis], x[np.newaxis, :, :2]))
    timer = measure.timed_fit(model, dataset, steps=3, epochs=2,
                              warmup_steps=1)
    assert len(timer.durations) == len(timer.cpu_durations) == 2
    assert all(seconds > 0 for seconds in timer.durations)
    assert all(seconds > 0 for seconds in timer.cpu_durations)


def test_csv_round_trip(tmp_path):
    rows = [{"model": "pointnet", "mode": "fused", "num_models": 8,
             "batch_size": 64, "jit_compile": True, "samples_per_s": 1234.5,
             "speedup": None, "models_per_pass": 2},
            # A GAN array reports how its passes are sized, not a count.
            {"model": "dcgan", "mode": "fused", "num_models": 2,
             "batch_size": 64, "jit_compile": False, "samples_per_s": 10.5,
             "speedup": 0.9, "models_per_pass": "auto"}]
    path = tmp_path / "results.csv"
    run.write_csv(rows, path)
    read = run.read_csv(path)
    assert len(read) == 2
    for row, row_read in zip(rows, read):
        assert {k: row_read[k] for k in row} == row
    assert read[0]["peak_rss_mb"] is None


def test_smoke_run_writes_a_well_formed_csv(tmp_path):
    # Steps compiled by XLA on JAX, where a step without it runs op by op
    # (each operation compiled on its own, for most of the test's time);
    # on TensorFlow without, which traces faster.
    jit = "true" if BACKEND == "jax" else "false"
    # A row of another model, kept by --append.
    kept = {"model": "pointnet", "mode": "fused", "num_models": 4,
            "samples_per_s": 10.0}
    run.write_csv([kept], tmp_path / "results.csv")
    rows = run.main([
        "--append",
        "--model", "mlp", "--num_models", "2",
        "--modes", "serial,concurrent,fused", "--batch_size", "8",
        "--steps", "2", "--epochs", "1", "--warmup_steps", "1",
        "--data_batches", "2", "--stock_jit", jit, "--fused_jit", jit,
        "--models_per_pass", "1", "--model_args", "hidden_units=(4)",
        "--peak_size", "64",
        "--peak_seconds", "0.05", "--output_dir", str(tmp_path)])
    with open(tmp_path / "results.csv") as file:
        table = list(csv.DictReader(file))
    assert tuple(table[0]) == run_results.COLUMNS
    assert table[0]["model"] == "pointnet"
    assert float(table[0]["samples_per_s"]) == 10.0
    table = table[1:]
    assert [r["mode"] for r in table] == ["serial", "concurrent", "fused"]
    assert len(rows) == 4
    for row in table:
        assert row["model"] == "mlp" and row["num_models"] == "2"
        assert float(row["samples_per_s"]) > 0
        assert float(row["cpu_samples_per_s"]) > 0
        assert float(row["peak_rss_mb"]) > 0
        assert float(row["step_gflop"]) > 0
        assert float(row["percent_of_peak"]) > 0
        assert row["jit_compile"] == str(jit == "true")
    assert [r["models_per_pass"] for r in table] == ["", "", "1"]
    assert float(table[0]["speedup"]) == 1.0
    assert float(table[0]["cpu_speedup"]) == 1.0
    assert float(table[2]["cpu_speedup"]) > 0
    # The concurrent mode holds two processes: about twice one's memory.
    assert float(table[1]["peak_rss_mb"]) > 1.5 * float(
        table[0]["peak_rss_mb"])
    markdown = (tmp_path / "results.md").read_text().splitlines()
    assert markdown[0].startswith("| model | B | serial samples/s")
    assert "| fused CPU-time speedup |" in markdown[0]
    assert markdown[0].endswith("| fused XLA | fused models/pass |")
    assert [line.split(" | ")[:2] for line in markdown[2:]] == [
        ["| pointnet", "4"], ["| mlp", "2"]]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert (tmp_path / "speedup_mlp.png").stat().st_size > 0
    assert (tmp_path / "speedup.png").stat().st_size > 0


def test_report_only_redraws_from_the_csv_without_measuring(tmp_path,
                                                            monkeypatch):
    args = ["--report_only", "--output_dir", str(tmp_path)]
    with pytest.raises(SystemExit, match="no results"):
        run.main(args)
    rows = [{"model": "mlp", "mode": mode, "num_models": 2,
             "samples_per_s": value, "speedup": value / 10.0}
            for mode, value in (("serial", 10.0), ("fused", 25.0))]
    run.write_csv(rows, tmp_path / "results.csv")

    def measure(*args, **kwargs):
        raise AssertionError("--report_only measured")

    monkeypatch.setattr(run, "benchmark_model", measure)
    assert [r["samples_per_s"] for r in run.main(args)] == [10.0, 25.0]
    markdown = (tmp_path / "results.md").read_text().splitlines()
    assert [line.split(" | ")[:2] for line in markdown[2:]] == [
        ["| mlp", "2"]]
    assert "2.50" in markdown[2]


# -- the backend ------------------------------------------------------------


def test_backend_flag_goes_to_the_workers_or_is_refused(monkeypatch):
    monkeypatch.delenv("KERAS_BACKEND", raising=False)
    assert backends.apply(None) == BACKEND
    assert backends.apply(BACKEND) == BACKEND
    assert run.parse_args(["--backend", BACKEND]).backend == BACKEND
    other = next(b for b in backends.BACKENDS if b != BACKEND)
    with pytest.raises(ValueError, match=f"already imported .* on {BACKEND}"):
        backends.apply(other)


def test_backend_flag_is_applied_before_keras_is_imported(tmp_path):
    # The parent process of a benchmark imports no Keras: the flag sets the
    # workers' backend.
    probe = (
        "import os, sys\n"
        "from benchmarks import run\n"
        "args = run.parse_args(['--backend', 'jax', '--model', 'mlp'])\n"
        "import keras\n"
        "print(args.backend, os.environ['KERAS_BACKEND'],"
        " keras.backend.backend())\n")
    environment = {k: v for k, v in os.environ.items()
                   if k != "KERAS_BACKEND"}
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT,
                          env=environment, capture_output=True, text=True,
                          timeout=300)
    assert done.stdout.split() == ["jax", "jax", "jax"], done.stderr
