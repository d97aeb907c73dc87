"""Hyper-parameter tuning with arrays (`pip install hftatf[tune]`).

keras-tuner tuners that train many trials at once as fused arrays:

    tuner = hftatf.tuning.FusedRandomSearch(
        build, objective="val_accuracy", max_trials=32, num_models=8)
    tuner.search(x, y, epochs=10, validation_data=(x_val, y_val))
    best = tuner.get_best_models()[0]          # a plain Keras model

- `FusedTuner` (and `FusedRandomSearch`, `FusedHyperband`,
  `FusedBayesianOptimization`): the trial loop, grouping trials whose models
  can share an array, successive halving by compaction;
- `auto_num_models`: the array size that fits the device and pays;
- `hftatf.tuning.distributed`: keras-tuner's chief/worker mode, with local
  processes for one machine.
"""

try:
    import keras_tuner  # noqa: F401
except ImportError as error:  # pragma: no cover
    raise ImportError(
        "hftatf.tuning needs keras-tuner: pip install 'hftatf[tune]'"
    ) from error

from hftatf.tuning import arrays, distributed, sizing
from hftatf.tuning.sizing import auto_num_models
from hftatf.tuning.tuner import (
    FusedBayesianOptimization,
    FusedHyperband,
    FusedRandomSearch,
    FusedTuner,
)

__all__ = [
    "FusedBayesianOptimization",
    "FusedHyperband",
    "FusedRandomSearch",
    "FusedTuner",
    "arrays",
    "auto_num_models",
    "distributed",
    "sizing",
]
