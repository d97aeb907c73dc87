"""Fused optimizers: stock Keras optimizers with per-model hyper-parameters.

Every float hyper-parameter is a float (shared) or a length-B sequence (one
value per model of the array).
"""

import keras

from hftatf.optimizers.adam import Adam
from hftatf.optimizers.base import FusedOptimizer
from hftatf.optimizers.sgd import SGD

# One module per optimizer family.
from hftatf.optimizers.adadelta import *  # noqa: E402,F401,F403
from hftatf.optimizers.adafactor import *  # noqa: E402,F401,F403
from hftatf.optimizers.adagrad import *  # noqa: E402,F401,F403
from hftatf.optimizers.adamax import *  # noqa: E402,F401,F403
from hftatf.optimizers.adamw import *  # noqa: E402,F401,F403
from hftatf.optimizers.ftrl import *  # noqa: E402,F401,F403
from hftatf.optimizers.lamb import *  # noqa: E402,F401,F403
from hftatf.optimizers.lars import *  # noqa: E402,F401,F403
from hftatf.optimizers.lion import *  # noqa: E402,F401,F403
from hftatf.optimizers.loss_scale import *  # noqa: E402,F401,F403
from hftatf.optimizers.nadam import *  # noqa: E402,F401,F403
from hftatf.optimizers.rmsprop import *  # noqa: E402,F401,F403
from hftatf.optimizers import schedules  # noqa: E402,F401

__all__ = ["Adam", "FusedOptimizer", "SGD", "get"]


def get(identifier):
    """Returns a fused optimizer for `identifier`.

    Args:
        identifier: a fused optimizer (returned as it is); the name of one
            (`"adam"`, `"sgd"`, with default arguments); or an unbuilt stock
            `keras.optimizers` instance of a class that hftatf fuses, converted
            with the same hyper-parameters for every model. Stock clipping is
            converted to per-model clipping, which is what B separate stock
            optimizers would do.
    """
    if isinstance(identifier, FusedOptimizer):
        return identifier
    by_name = {cls.__name__.lower(): cls for cls in (Adam, SGD)}
    if isinstance(identifier, str):
        try:
            return by_name[identifier.lower()]()
        except KeyError:
            raise ValueError(
                f"Unknown fused optimizer '{identifier}'. Available: "
                f"{', '.join(sorted(by_name))}.") from None
    if isinstance(identifier, dict):
        return keras.saving.deserialize_keras_object(identifier)
    if isinstance(identifier, keras.optimizers.Optimizer):
        cls = by_name.get(type(identifier).__name__.lower())
        if cls is None or type(identifier) is not getattr(
                keras.optimizers, cls.__name__):
            raise TypeError(
                f"hftatf has no fused form of {type(identifier).__name__}; "
                f"use one of hftatf.optimizers: {', '.join(sorted(by_name))}."
            )
        if identifier.built:
            raise ValueError(
                f"The stock optimizer '{identifier.name}' is already built "
                "on other variables; pass a new one, or an hftatf optimizer.")
        config = identifier.get_config()
        rate = identifier._learning_rate
        if isinstance(rate, keras.optimizers.schedules.LearningRateSchedule):
            config["learning_rate"] = rate
        return cls.from_config(config)
    raise TypeError(
        "`optimizer` must be an hftatf optimizer (e.g. "
        "hftatf.optimizers.Adam(learning_rate=[...])), its name, or a stock "
        f"Keras optimizer to convert. Received: {identifier!r}.")
