"""The Keras backend a benchmark runs on: `--backend`, else the
environment's `KERAS_BACKEND` (else Keras's default, TensorFlow).

Keras reads `KERAS_BACKEND` once, when it is first imported, so the flag is
applied before that: `python -m benchmarks.run` imports no Keras itself and
hands the backend to its worker processes through their environment.
"""

import os
import sys

BACKENDS = ("tensorflow", "jax")
HELP = (
    "the Keras backend to measure on: tensorflow or jax (default: "
    "$KERAS_BACKEND, else tensorflow). On jax no TensorFlow is imported: "
    "the zoo's data come as NumPy batches and XLA compiles every step.")


def add_flag(parser):
    """Adds `--backend` to an argparse parser."""
    parser.add_argument("--backend", choices=BACKENDS, default=None,
                        help=HELP)


def apply(backend):
    """Makes `backend` (None: the environment's) the backend of this
    process and of the processes it starts; returns its name.

    Raises:
        ValueError: Keras is already imported here on another backend,
            which cannot change any more.
    """
    keras = sys.modules.get("keras")
    current = keras.backend.backend() if keras is not None else None
    if backend is None:
        return current or os.environ.get("KERAS_BACKEND", "tensorflow")
    if current is not None and current != backend:
        raise ValueError(
            f"--backend={backend} asks for Keras on {backend}, but Keras is "
            f"already imported in this process on {current}, and a backend "
            "cannot change after Keras's import. Run the command in a fresh "
            f"process, or set KERAS_BACKEND={backend} before Python starts.")
    os.environ["KERAS_BACKEND"] = backend
    return backend
