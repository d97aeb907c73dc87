"""hftatf: horizontally fused training arrays for Keras 3 (TensorFlow, JAX).

Train B same-architecture Keras models as one fused model:

    array = hftatf.fuse(model, num_models=4)
    array.compile(hftatf.optimizers.Adam([1e-3, 3e-4, 1e-4, 3e-5]),
                  loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    array.fit(x, y, epochs=5)
    array.export_models("exported/")
"""

# ruff: noqa: E402
# First: a launcher's process silences TensorFlow's start-up notes, which
# must happen before TensorFlow is imported (hftatf.core.startup).
from hftatf.core import startup
from hftatf.core.version import __version__  # noqa: F401

startup.quiet_launcher_start()

import importlib

from hftatf import (
    backup,
    callbacks,
    distribute,
    export,
    layers,
    optimizers,
    passes,
    progress,
    report,
    seeds,
    sparse,
)
from hftatf.export import (
    export_models,
    export_serving,
    from_exported,
    load_models,
)
from hftatf.fuse import fuse, fuse_models
from hftatf.model import FusedModel

__all__ = [
    "FusedModel",
    "backup",
    "callbacks",
    "distribute",
    "export",
    "export_models",
    "export_serving",
    "from_exported",
    "fuse",
    "fuse_models",
    "layers",
    "load_models",
    "optimizers",
    "passes",
    "progress",
    "report",
    "seeds",
    "sparse",
]

# Imported on first use: `tuning` needs keras-tuner (the `tune` extra), the
# model zoo and the launcher need only what they use.
_LAZY_SUBMODULES = ("models", "tpu", "tuning")


def __getattr__(name):
    if name in _LAZY_SUBMODULES:
        return importlib.import_module(f"hftatf.{name}")
    raise AttributeError(f"module 'hftatf' has no attribute {name!r}")
