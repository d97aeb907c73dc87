"""Fused Lion."""

from keras import ops

from hftatf.api import hftatf_export
from hftatf.core import compat
from hftatf.core.validation import Range
from hftatf.optimizers.base import FusedOptimizer

__all__ = ["Lion"]


@hftatf_export
class Lion(FusedOptimizer):
    """`keras.optimizers.Lion` for an array: per-model hyper-parameters.

    Every variable is `[B, ...]`; model `b`'s slice is updated exactly as the
    stock optimizer with `learning_rate[b]`, `beta_1[b]` and `beta_2[b]`
    would update it:

        w = w - learning_rate * sign(beta_1 * m + (1 - beta_1) * g)
        m = beta_2 * m + (1 - beta_2) * g

    The momentum slots `_momentums` are `[B, ...]` like their variables.

    Args:
        learning_rate: a float, a length-B sequence, a
            `LearningRateSchedule`, or a length-B sequence of schedules.
            Defaults to 0.001.
        beta_1: a float in (0, 1] or a length-B sequence of them (at 0 Lion
            degenerates to SignSGD, so Keras rejects it). Defaults to 0.9.
        beta_2: a float in [0, 1] or a length-B sequence of them.
            Defaults to 0.99.
        **kwargs: the other arguments of `hftatf.optimizers.FusedOptimizer`
            (`weight_decay`, `clipnorm`, `clipvalue`, `global_clipnorm`,
            `use_ema`, ..., `name`, `num_models`).
    """

    # Keras refuses a beta_1 of 0; at 1 Lion steps on the sign of its
    # momentum alone, and no bias correction divides by 1 - beta.
    hyperparameter_ranges = {
        "beta_1": Range(0.0, 1.0, low_open=True,
                        why=" (at 0 Lion degenerates to SignSGD, so Keras "
                        "refuses it)"),
        "beta_2": Range(0.0, 1.0)}

    def __init__(self, learning_rate=0.001, beta_1=0.9, beta_2=0.99,
                 **kwargs):
        super().__init__(
            learning_rate=learning_rate,
            hyperparameters={"beta_1": beta_1, "beta_2": beta_2},
            **kwargs,
        )

    def build(self, variables):
        if self.built:
            return
        super().build(variables)
        self._momentums = self.add_optimizer_variables(variables, "momentum")

    def update_step(self, gradient, variable, learning_rate):
        lr = self._per_model(learning_rate, variable)
        gradient = ops.cast(gradient, variable.dtype)
        beta_1 = self._hyper("beta_1", variable)
        beta_2 = self._hyper("beta_2", variable)
        m = self._momentums[compat.variable_index(self, variable)]

        self.assign_sub(
            variable,
            ops.multiply(lr, ops.sign(ops.multiply(m, beta_1)
                                      + ops.multiply(gradient, 1.0 - beta_1))))
        self.assign(m, ops.multiply(m, beta_2)
                    + ops.multiply(gradient, 1.0 - beta_2))
