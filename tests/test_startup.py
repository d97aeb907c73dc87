"""The launchers start quietly: TensorFlow's start-up notes are left out
in a launcher's process, unless its user asks for them."""

import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest

from hftatf.core import startup

ROOT = pathlib.Path(__file__).resolve().parents[1]
STARTUP = ROOT / "hftatf" / "core" / "startup.py"

# Loads the module from its file, so that nothing but it runs before
# TensorFlow is imported, then starts TensorFlow.
PROBE = f"""
import importlib.util, sys
spec = importlib.util.spec_from_file_location("startup", {str(STARTUP)!r})
startup = importlib.util.module_from_spec(spec)
spec.loader.exec_module(startup)
print(startup.quiet_launcher_start(argv=sys.argv[1:]))
import tensorflow as tf
print(int(tf.constant(1) + 1))
"""


def tensorflow_environ():
    """This process' environment for a launcher on the TensorFlow backend
    (whose notes these tests are about), with no log level set."""
    env = {key: value for key, value in os.environ.items()
           if key != "TF_CPP_MIN_LOG_LEVEL"}
    return {**env, "KERAS_BACKEND": "tensorflow"}


def run_probe(*argv, **environ):
    env = tensorflow_environ()
    env.update(environ)
    return subprocess.run([sys.executable, "-c", PROBE, *argv], env=env,
                          capture_output=True, text=True, timeout=300)


def notes(stderr):
    return [line for line in stderr.splitlines()
            if line.startswith(("I0000", "I1", "W0000"))]


@pytest.mark.slow
def test_a_launcher_starts_without_tensorflows_notes():
    quiet = run_probe("hftatf-train", "--epochs=1")
    assert quiet.returncode == 0, quiet.stderr[-2000:]
    assert quiet.stdout.split() == ["True", "2"]
    assert notes(quiet.stderr) == [], quiet.stderr
    assert "absl::InitializeLog" not in quiet.stderr
    # Asked for, the notes show (this TensorFlow writes some on import).
    loud = run_probe("hftatf-train", "--verbose=3")
    assert loud.stdout.split() == ["False", "2"]
    assert notes(loud.stderr), loud.stderr


def test_only_launchers_and_only_unless_asked():
    environ = {}
    assert not startup.quiet_launcher_start(environ, ["python"], [])
    assert not startup.quiet_launcher_start(
        {"TF_CPP_MIN_LOG_LEVEL": "0"}, ["/usr/bin/hftatf-train"], [])
    assert not startup.quiet_launcher_start(
        environ, ["hftatf-tune", "--verbose", "3"], [])
    assert environ == {}
    assert startup.launcher_argv(
        ["-m"], ["python", "-m", "hftatf.tpu.train", "--epochs=1"]) == [
        "hftatf.tpu.train", "--epochs=1"]
    assert startup.launcher_argv(["pytest"], ["python", "-m", "pytest"]) \
        is None
    assert not startup.asks_for_tensorflow_logs(["--verbose=2"])


def test_the_backend_is_read_as_keras_reads_it(tmp_path):
    (tmp_path / "keras.json").write_text('{"backend": "jax"}')
    assert startup.keras_backend_setting({"KERAS_HOME": str(tmp_path)}) == (
        "jax")
    assert startup.keras_backend_setting({
        "KERAS_HOME": str(tmp_path), "KERAS_BACKEND": "torch"}) == "torch"
    assert startup.keras_backend_setting(
        {"KERAS_HOME": str(tmp_path / "none")}) == "tensorflow"


def test_warnings_and_errors_are_kept():
    text = ("WARNING: All log messages before absl::InitializeLog() is "
            "called are written to STDERR\n"
            "I0000 00:00:1796403487.103247   23454 port.cc:153] oneDNN\n"
            "E0000 00:00:1796403498.794572   23454 cuda_platform.cc:52] x\n"
            "W1204 16:37:21.496927 139900087065472 results.py:205] y\n"
            "UserWarning: z\n")
    assert startup.without_notes(text) == "".join(
        text.splitlines(keepends=True)[2:])


@pytest.mark.slow
def test_the_launcher_command_runs_quietly(tmp_path):
    env = tensorflow_environ()
    result = subprocess.run(
        [sys.executable, "-m", "hftatf.tpu.train", "--epochs=1",
         "--train_steps=1", "--eval_steps=1", "--export_dir=",
         f"--model_dir={tmp_path}", "--verbose=2"], env=env,
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert notes(result.stderr) == [], result.stderr


# `import hftatf` on JAX, then what it imported, and what the TF-only
# features say without TensorFlow (blocked as if not installed: argv[1]).
JAX_PROBE = """
import sys
if sys.argv[1] == "blocked":
    sys.modules["tensorflow"] = None
import hftatf
import keras
print(sorted(m for m in sys.modules if m.split(".")[0] == "tensorflow"
             and sys.modules[m] is not None))
features = (lambda: hftatf.callbacks.TensorBoard("logs"),
            lambda: hftatf.export_models(
                hftatf.fuse(keras.Sequential([keras.Input((4,)),
                                              keras.layers.Dense(2)]), 2),
                "out", format="saved_model"))
for feature in features if sys.argv[1] == "blocked" else ():
    try:
        feature()
    except ImportError as error:
        print(type(error).__name__, error)
"""


def run_on_jax(directory, *argv):
    env = {**os.environ, "KERAS_BACKEND": "jax", "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-c", JAX_PROBE, *argv],
                            env=env, cwd=directory, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.splitlines()


def test_hftatf_on_jax_imports_no_tensorflow(tmp_path):
    imported, *_ = run_on_jax(tmp_path, "installed")
    assert imported == "[]"


def test_tensorflow_features_on_jax_without_it_say_what_to_install(
        tmp_path):
    imported, *errors = run_on_jax(tmp_path, "blocked")
    assert imported == "[]"
    assert len(errors) == 2, errors
    for error, feature in zip(errors, ("TensorBoard", "SavedModel")):
        assert error.startswith("ImportError") and feature in error, error
        assert "pip install tensorflow" in error, error


SWITCH = """
import keras
import hftatf
array = hftatf.fuse(keras.Sequential([keras.Input((3,)),
                                      keras.layers.Dense(2)]), 2)
keras.config.set_backend({other!r})
import keras
for name, step in [
        ("compile", lambda: array.compile("sgd", loss="mse")),
        ("fuse", lambda: hftatf.fuse(keras.Sequential([
            keras.Input((3,)), keras.layers.Dense(2)]), 2))]:
    try:
        step()
        print(name, "ran")
    except ValueError as error:
        print(name, "refused:", error)
"""


def test_a_backend_switched_after_import_is_refused():
    # `keras.config.set_backend` reloads Keras; arrays made for the backend
    # hftatf was imported on must not train on the other one.
    backend = os.environ.get("KERAS_BACKEND", "tensorflow")
    other = "jax" if backend == "tensorflow" else "tensorflow"
    if importlib.util.find_spec(other) is None:
        pytest.skip(f"{other} is not installed")
    result = subprocess.run(
        [sys.executable, "-c", SWITCH.format(other=other)],
        env={**os.environ, "KERAS_BACKEND": backend}, capture_output=True,
        text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.strip().splitlines()[-2:]
    for name, line in zip(["compile", "fuse"], lines):
        assert line.startswith(f"{name} refused:"), result.stdout
        assert f"imported on Keras's {backend!r} backend" in line
        assert "in a new process" in line


NUMPY_PROBE = """
import keras
import numpy as np
import hftatf
x = np.random.default_rng(0).normal(size=(8, 4)).astype("float32")
array = hftatf.fuse(keras.Sequential([keras.Input((4,)),
                                      keras.layers.Dense(3)]), 2)
outputs = np.asarray(array.predict(x, verbose=0))
models = array.unfuse(compile=False)
print(outputs.shape)
print(max(float(np.max(np.abs(
    outputs[:, b] - np.asarray(model.predict(x, verbose=0)))))
    for b, model in enumerate(models)))
array.compile(hftatf.optimizers.SGD(0.1), loss="mse")
try:
    array.fit(x, np.zeros((8, 3)), verbose=0)
except (NotImplementedError, ValueError) as error:
    print("fit refused:", error)
"""


@pytest.mark.backends("tensorflow", reason="the probe sets its own backend: "
                      "a run under the JAX suite would repeat it")
def test_a_backend_without_a_trainer_fuses_and_predicts():
    # Keras's NumPy backend runs models but trains none: an array built
    # there predicts as its stock models, and `fit` is refused.
    result = subprocess.run(
        [sys.executable, "-c", NUMPY_PROBE],
        env={**os.environ, "KERAS_BACKEND": "numpy"}, capture_output=True,
        text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    shape, difference, refused = result.stdout.strip().splitlines()[-3:]
    assert shape == "(8, 2, 3)", result.stdout
    assert float(difference) < 1e-6, result.stdout
    assert refused.startswith("fit refused:"), result.stdout
