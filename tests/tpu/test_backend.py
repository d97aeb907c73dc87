"""The launcher's backend: `--backend` read from the command line, applied
by starting the program again before Keras's import, refused where Keras
already runs on another backend."""

import os
import pathlib
import subprocess
import sys

import keras
import pytest

from hftatf.tpu import backend
from hftatf.tpu.config import ConfigError

ROOT = pathlib.Path(__file__).resolve().parents[2]
BACKEND = keras.backend.backend()
OTHER = next(name for name in backend.BACKENDS if name != BACKEND)


def test_the_flag_is_read_from_the_command_line():
    assert backend.requested_backend(["hftatf-train", "--model=mlp"]) is None
    assert backend.requested_backend(["p", "--backend", "jax"]) == "jax"
    assert backend.requested_backend(
        ["p", "--backend=jax", "--backend=tensorflow"]) == "tensorflow"


def test_a_backend_other_than_the_imported_one_is_refused():
    backend.check_backend(None)
    backend.check_backend(BACKEND)
    with pytest.raises(ConfigError,
                       match=f"already imported .* on {BACKEND}.*"
                             f"KERAS_BACKEND={OTHER}"):
        backend.check_backend(OTHER)
    with pytest.raises(ConfigError, match="one of tensorflow, jax"):
        backend.check_backend("theano")


def test_the_program_starts_again_on_the_asked_backend(tmp_path):
    (tmp_path / "backend_probe.py").write_text(
        "import sys, keras\nprint(keras.backend.backend(), sys.argv[1:])\n")
    code = ("from hftatf.tpu.backend import relaunch_for_backend\n"
            f"relaunch_for_backend(['hftatf-train', '--backend', '{OTHER}', "
            "'--epochs=1'], module='backend_probe')\n"
            "print('not relaunched')\n")
    environment = {**os.environ, "KERAS_BACKEND": BACKEND,
                   "PYTHONPATH": os.pathsep.join(
                       [str(tmp_path), str(ROOT),
                        os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT,
                          env=environment, capture_output=True, text=True,
                          timeout=300)
    assert done.stdout.strip() == (
        f"{OTHER} ['--backend', '{OTHER}', '--epochs=1']"), done.stderr


def test_a_backend_that_is_not_installed_is_named_before_starting_again(
        monkeypatch, capsys):
    real_find_spec = backend.importlib.util.find_spec
    monkeypatch.setattr(backend.importlib.util, "find_spec",
                        lambda name: None if name == OTHER
                        else real_find_spec(name))
    monkeypatch.setattr(backend.os, "execve",
                        lambda *args: pytest.fail("started again"))
    with pytest.raises(SystemExit) as exit_info:
        backend.relaunch_for_backend(["hftatf-train", f"--backend={OTHER}"])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert f"--backend={OTHER} needs {OTHER}, which is not installed" in error
    assert "pip install" in error
