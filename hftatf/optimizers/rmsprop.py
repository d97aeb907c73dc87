"""Fused RMSprop, plain or centered, with or without momentum."""

import numpy as np
from keras import ops

from hftatf.api import hftatf_export
from hftatf.core import compat
from hftatf.core.validation import Range, shared
from hftatf.optimizers.base import FusedOptimizer

__all__ = ["RMSprop"]


@hftatf_export
class RMSprop(FusedOptimizer):
    """`keras.optimizers.RMSprop` for an array: per-model hyper-parameters.

    Every variable is `[B, ...]`; model `b`'s slice is updated exactly as the
    stock optimizer with `learning_rate[b]`, `rho[b]`, `momentum[b]` and
    `epsilon[b]` would update it:

        v = rho * v + (1 - rho) * g ** 2
        a = rho * a + (1 - rho) * g                       # centered only
        increment = learning_rate * g / sqrt(v - a ** 2 + epsilon)
        w = w - increment                                 # momentum <= 0
        w = w - (m = momentum * m + increment)            # momentum > 0

    Slots, each `[B, ...]` like its variable: `_velocities`;
    `_average_gradients` when `centered`; `_momentums` when some model's
    momentum is positive when the optimizer is built (a model whose
    momentum is not positive then keeps its last increment there, and is
    updated without momentum, as in Keras).

    Args:
        learning_rate: a float, a length-B sequence, a
            `LearningRateSchedule`, or a length-B sequence of schedules.
            Defaults to 0.001.
        rho: discount factor of the gradient history; a float or a length-B
            sequence. Defaults to 0.9.
        momentum: a float <= 1 or a length-B sequence of them (<= 0: no
            momentum for that model). Defaults to 0.
        epsilon: a float or a length-B sequence. Defaults to 1e-7.
        centered: whether to normalise by the estimated variance of the
            gradient (one bool shared by all models). Defaults to False.
        **kwargs: the other arguments of `hftatf.optimizers.FusedOptimizer`
            (`weight_decay`, `clipnorm`, `clipvalue`, `global_clipnorm`,
            `use_ema`, ..., `name`, `num_models`).
    """

    applies_sparse_gradients = True
    complemented_hyperparameters = ("rho",)

    # As in Keras, a momentum <= 0 turns momentum off for that model; one
    # above 1 makes it grow without bound.
    hyperparameter_ranges = {"momentum": Range(high=1.0)}

    def __init__(self, learning_rate=0.001, rho=0.9, momentum=0.0,
                 epsilon=1e-7, centered=False, **kwargs):
        super().__init__(
            learning_rate=learning_rate,
            hyperparameters={"rho": rho, "momentum": momentum,
                             "epsilon": epsilon},
            **kwargs,
        )
        self.centered = bool(shared("centered", centered))

    def build(self, variables):
        if self.built:
            return
        super().build(variables)
        self._velocities = self.add_optimizer_variables(variables, "velocity")
        self._momentums = []
        if np.any(np.asarray(self._hyper_values["momentum"]) > 0):
            self._momentums = self.add_optimizer_variables(variables,
                                                           "momentum")
        self._average_gradients = []
        if self.centered:
            self._average_gradients = self.add_optimizer_variables(
                variables, "average_gradient")

    def set_hyperparameter(self, name, value):
        if (name == "momentum" and self.built and not self._momentums
                and np.any(np.asarray(value) > 0)):
            raise ValueError(
                "This RMSprop optimizer was built without momentum (no "
                "model's momentum was positive), so it has no momentum "
                "slots; momentum cannot be switched on now. Received: "
                f"momentum={value!r}. Create the optimizer with a positive "
                "momentum for some model.")
        super().set_hyperparameter(name, value)

    def update_step(self, gradient, variable, learning_rate):
        lr = self._per_model(learning_rate, variable)
        gradient = ops.cast(gradient, variable.dtype)
        # A sparse gradient's occurrences are squared one by one, as stock.
        squared = self._summed(ops.square(gradient), variable)
        gradient = self._summed(gradient, variable)
        rho = self._hyper("rho", variable)
        epsilon = self._hyper("epsilon", variable)
        index = compat.variable_index(self, variable)
        velocity = self._velocities[index]

        # `+` on tensors (a slot's `.value`), not ops.add nor a Keras
        # variable's `+`, which calls it: on TensorFlow, ops.add turns into
        # bias_add (along the last axis) whenever the shapes allow it,
        # mixing models.
        one_minus_rho = self._complement("rho", variable)
        self.assign(velocity, ops.multiply(rho, velocity)
                    + ops.multiply(one_minus_rho, squared))
        if self.centered:
            average_grad = self._average_gradients[index]
            self.assign(average_grad, ops.multiply(rho, average_grad)
                        + ops.multiply(one_minus_rho, gradient))
            denominator = velocity - ops.square(average_grad) + epsilon
        else:
            denominator = velocity.value + epsilon
        increment = ops.divide(ops.multiply(lr, gradient),
                               ops.sqrt(denominator))
        if not self._momentums:
            self.assign_sub(variable, increment)
            return
        momentum = self._hyper("momentum", variable)
        m = self._momentums[index]
        # A select, not momentum * m with momentum clamped at 0: stock
        # RMSprop ignores a non-positive momentum, whatever m holds.
        self.assign(m, ops.where(momentum > 0,
                                 ops.multiply(momentum, m) + increment,
                                 increment))
        self.assign_sub(variable, m)

    def get_config(self):
        config = super().get_config()
        config["centered"] = self.centered
        return config
