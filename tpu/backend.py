"""The Keras backend of a launcher run: `--backend`, else `KERAS_BACKEND`
(else Keras's default, TensorFlow).

Keras reads `KERAS_BACKEND` once, when it is first imported, and the
launcher's own package imports it before any flag is parsed. So the console
program applies `--backend` by starting itself again with `KERAS_BACKEND`
set (`relaunch_for_backend`), before it reads any data or builds anything;
a run started from Python (`main`) refuses a `--backend` that disagrees
with the Keras already imported (`check_backend`).
"""

import importlib.util
import os
import sys

import keras

from hftatf.tpu.config import ConfigError

BACKENDS = ("tensorflow", "jax")
FLAG = "--backend"


def requested_backend(argv):
    """The value of `--backend` in the command line `argv` (the last one
    given), or None."""
    value = None
    for index, item in enumerate(argv):
        if item == FLAG and index + 1 < len(argv):
            value = argv[index + 1]
        elif item.startswith(FLAG + "="):
            value = item[len(FLAG) + 1:]
    return value


def check_backend(backend):
    """Raises a ConfigError unless `backend` (None: any) is the backend
    Keras runs on in this process."""
    if backend is None or backend == keras.backend.backend():
        return
    if backend not in BACKENDS:
        raise ConfigError(
            f"--backend={backend} is not a backend the launcher runs on; "
            f"pass one of {', '.join(BACKENDS)}.")
    raise ConfigError(
        f"--backend={backend}, but Keras is already imported in this process "
        f"on {keras.backend.backend()}, and a backend cannot change after "
        f"Keras's import. Set KERAS_BACKEND={backend} before Python starts "
        "(or run hftatf-train, which does).")


def relaunch_for_backend(argv, module="hftatf.tpu.train"):
    """Starts `python -m module argv[1:]` in place of this process, with
    `KERAS_BACKEND` set, where `argv` asks for a known backend other than
    the one Keras was imported on; else returns."""
    backend = requested_backend(argv)
    if backend not in BACKENDS or backend == keras.backend.backend():
        return
    if importlib.util.find_spec(backend) is None:
        # Before the new process, whose Keras would fail on its import.
        extra = "" if backend == "tensorflow" else "[jax]"
        print(f"{os.path.basename(argv[0])}: error: --backend={backend} "
              f"needs {backend}, which is not installed here. Install it "
              f"(`pip install \"hftatf{extra}\"`) or pass another "
              "--backend.", file=sys.stderr)
        sys.exit(2)
    environment = {**os.environ, "KERAS_BACKEND": backend}
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", module, *argv[1:]],
              environment)
