"""Fused stochastic gradient descent, with momentum and Nesterov momentum."""

import numpy as np
from keras import ops

from hftatf.api import hftatf_export
from hftatf.core import compat
from hftatf.core.validation import shared
from hftatf.optimizers.base import FusedOptimizer


@hftatf_export
class SGD(FusedOptimizer):
    """`keras.optimizers.SGD` for an array: per-model hyper-parameters.

    Model `b`'s slice of every variable is updated exactly as the stock
    optimizer with `learning_rate[b]` and `momentum[b]` would update it:

        velocity = momentum * velocity - learning_rate * g
        w = w + velocity                                  # nesterov=False
        w = w + momentum * velocity - learning_rate * g   # nesterov=True

    and `w = w - learning_rate * g` while no model uses momentum.

    Args:
        learning_rate: a float, a length-B sequence, a
            `LearningRateSchedule`, or a length-B sequence of schedules.
            Defaults to 0.01.
        momentum: a float in [0, 1] or a length-B sequence of them. Momentum
            slots are created when any model's momentum is non-zero when the
            optimizer is built. Defaults to 0.
        nesterov: whether to apply Nesterov momentum (shared by all models).
        **kwargs: the other arguments of `hftatf.optimizers.FusedOptimizer`
            (`weight_decay`, `clipnorm`, `clipvalue`, `global_clipnorm`,
            `use_ema`, ..., `name`, `num_models`).
    """

    def __init__(self, learning_rate=0.01, momentum=0.0, nesterov=False,
                 **kwargs):
        super().__init__(learning_rate=learning_rate,
                         hyperparameters={"momentum": momentum}, **kwargs)
        self.nesterov = bool(shared("nesterov", nesterov))

    def build(self, variables):
        if self.built:
            return
        super().build(variables)
        self.momentums = []
        if np.any(np.asarray(self._hyper_values["momentum"]) != 0):
            self.momentums = self.add_optimizer_variables(variables,
                                                          "momentum")

    def set_hyperparameter(self, name, value):
        if (name == "momentum" and self.built and not self.momentums
                and np.any(np.asarray(value) != 0)):
            raise ValueError(
                "This SGD optimizer was built without momentum (every model's "
                "momentum was 0), so it has no momentum slots; momentum "
                f"cannot be switched on now. Received: momentum={value!r}. "
                "Create the optimizer with a non-zero momentum for some model."
            )
        super().set_hyperparameter(name, value)

    def update_step(self, gradient, variable, learning_rate):
        learning_rate = self._per_model(learning_rate, variable)
        gradient = ops.cast(gradient, variable.dtype)
        if not self.momentums:
            self.assign_sub(variable, ops.multiply(gradient, learning_rate))
            return
        m = self.momentums[compat.variable_index(self, variable)]
        momentum = self._hyper("momentum", variable)
        self.assign(m, ops.subtract(ops.multiply(m, momentum),
                                    ops.multiply(gradient, learning_rate)))
        if self.nesterov:
            self.assign_add(
                variable,
                ops.subtract(ops.multiply(m, momentum),
                             ops.multiply(gradient, learning_rate)))
        else:
            self.assign_add(variable, m)

    def get_config(self):
        config = super().get_config()
        config["nesterov"] = self.nesterov
        return config
