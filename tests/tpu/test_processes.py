"""The launcher in fresh processes: MirroredStrategy over logical CPUs (set
up before TensorFlow starts; on JAX, DataParallel over XLA host devices), a
run killed with SIGKILL and rerun, and the command line itself."""

import json
import os
import pathlib
import signal
import subprocess
import sys

import keras
import numpy as np
import pytest
from testing import JAX_COLLECTIVE_TIMEOUT, with_xla_flags

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
TIMEOUT_S = 600

pytestmark = pytest.mark.slow

TINY_RUN = ["--model=mlp", "--model_args=hidden_units=[16]", "--export_dir=",
            "--verbose=0"]


def launch(replicas, summary, *flags):
    """Runs launcher_process.py on this checkout's hftatf and this test
    process's Keras backend."""
    env = {**os.environ, "KERAS_BACKEND": keras.backend.backend(),
           "PYTHONPATH": os.pathsep.join(
               [str(ROOT), os.environ.get("PYTHONPATH", "")])}
    if keras.backend.backend() == "jax":
        env = with_xla_flags(env, JAX_COLLECTIVE_TIMEOUT)
    return subprocess.run(
        [sys.executable, str(HERE / "launcher_process.py"), str(replicas),
         str(summary), *flags], env=env, cwd=ROOT,
        capture_output=True, text=True, timeout=TIMEOUT_S)


def test_mirrored_over_two_logical_cpus_trains_like_one_device(tmp_path):
    summary = tmp_path / "summary.json"
    result = launch(2, summary, *TINY_RUN, "--learning_rate=0.1,0.05",
                    "--batch_size=32", "--epochs=1", "--train_steps=3",
                    "--eval_steps=2", f"--model_dir={tmp_path / 'run'}",
                    "--strategies=mirrored,cpu")
    assert result.returncode == 0, result.stderr[-3000:]
    mirrored, single = json.loads(summary.read_text())
    assert (mirrored["num_replicas"], single["num_replicas"]) == (2, 1)
    # Each replica reads half of the same global batches.
    for a, b in zip(mirrored["weights"], single["weights"]):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)
    for key in ("loss_0", "loss_1", "val_loss_0", "val_accuracy_1"):
        np.testing.assert_allclose(mirrored["history"][key],
                                   single["history"][key], atol=1e-5)


@pytest.mark.parametrize("epoch", ["4_steps", "one_pass"])
def test_killed_run_resumes_to_the_uninterrupted_weights(tmp_path, epoch):
    # An epoch of one pass reshuffles the stream at every epoch: the
    # resumed stream must draw the uninterrupted one's passes, however many
    # iterators were opened on it before training (Keras opens one).
    steps = ["--train_steps=4", "--batch_size=32"] if epoch == "4_steps" else [
        "--batch_size=128"]
    flags = [*TINY_RUN, "--model_args=hidden_units=[16],dropout=0.2",
             "--learning_rate=0.1,0.03", "--epochs=3", *steps,
             "--eval_steps=2", "--deterministic", "--strategy=cpu"]
    whole = launch(1, tmp_path / "whole.json", *flags,
                   f"--model_dir={tmp_path / 'whole'}",
                   f"--weights_out={tmp_path / 'whole.npz'}")
    assert whole.returncode == 0, whole.stderr[-3000:]

    resumed_flags = [*flags, f"--model_dir={tmp_path / 'resumed'}",
                     f"--weights_out={tmp_path / 'resumed.npz'}"]
    killed = launch(1, tmp_path / "killed.json", *resumed_flags,
                    "--kill_at=1:2")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    backup = json.loads(
        (tmp_path / "resumed" / "backup" / "backup.json").read_text())
    assert backup["epoch"] == 1

    resumed = launch(1, tmp_path / "resumed.json", *resumed_flags)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    (run,) = json.loads((tmp_path / "resumed.json").read_text())
    assert run["initial_epoch"] == 1
    (uninterrupted,) = json.loads((tmp_path / "whole.json").read_text())
    assert run["history"] == uninterrupted["history"]
    expected = np.load(tmp_path / "whole.npz")
    actual = np.load(tmp_path / "resumed.npz")
    assert len(expected.files) == len(actual.files)
    for name in expected.files:
        np.testing.assert_array_equal(actual[name], expected[name])


def test_module_command_line_refuses_invalid_flags_before_any_work(
        tmp_path):
    refused = subprocess.run(
        [sys.executable, "-m", "hftatf.tpu.train", "--model=no_such_model",
         f"--model_dir={tmp_path / 'run'}"],
        capture_output=True, text=True, timeout=TIMEOUT_S)
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert "hftatf-train: error: --model: Unknown zoo model" in refused.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("module,command,directory", [
    ("hftatf.tpu.train", "hftatf-train", "model_dir"),
    ("hftatf.tpu.tune", "hftatf-tune", "directory")])
def test_a_stray_word_on_the_command_line_is_one_line(tmp_path, module,
                                                       command, directory):
    refused = subprocess.run(
        [sys.executable, "-m", module, "resnet18",
         f"--{directory}={tmp_path / 'run'}"],
        capture_output=True, text=True, timeout=TIMEOUT_S)
    assert refused.returncode == 2, refused.stderr[-3000:]
    lines = [line for line in refused.stderr.splitlines()
             if line.startswith(f"{command}: ")]
    assert lines == [f"{command}: error: Unexpected arguments: resnet18 "
                     "(every option is a --flag; see --helpfull)."]
    # No usage text: the flags' help is not printed.
    assert f"--{directory}" not in refused.stderr
    assert not (tmp_path / "run").exists()
