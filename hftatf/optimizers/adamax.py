"""Fused Adamax."""

from keras import ops

from hftatf.api import hftatf_export
from hftatf.core import compat
from hftatf.core.validation import Range
from hftatf.optimizers.base import FusedOptimizer

__all__ = ["Adamax"]


@hftatf_export
class Adamax(FusedOptimizer):
    """`keras.optimizers.Adamax` for an array: per-model hyper-parameters.

    Every variable is `[B, ...]`; model `b`'s slice is updated exactly as the
    stock optimizer with `learning_rate[b]`, `beta_1[b]`, `beta_2[b]` and
    `epsilon[b]` would update it:

        m = beta_1 * m + (1 - beta_1) * g
        u = max(beta_2 * u, |g|)
        w = w - learning_rate * m / ((1 - beta_1 ** t) * (u + epsilon))

    The slots `_m` (first moment) and `_u` (infinity norm) are `[B, ...]`
    like their variables.

    Args:
        learning_rate: a float, a length-B sequence, a
            `LearningRateSchedule`, or a length-B sequence of schedules.
            Defaults to 0.001.
        beta_1, beta_2, epsilon: floats or length-B sequences; defaults 0.9,
            0.999 and 1e-7, as in Keras.
        **kwargs: the other arguments of `hftatf.optimizers.FusedOptimizer`
            (`weight_decay`, `clipnorm`, `clipvalue`, `global_clipnorm`,
            `use_ema`, ..., `name`, `num_models`).
    """

    applies_sparse_gradients = True
    complemented_hyperparameters = ("beta_1",)

    # At 1 the infinity norm `u` just never decays: no division by zero.
    hyperparameter_ranges = {"beta_2": Range(0.0, 1.0)}

    def __init__(self, learning_rate=0.001, beta_1=0.9, beta_2=0.999,
                 epsilon=1e-7, **kwargs):
        super().__init__(
            learning_rate=learning_rate,
            hyperparameters={"beta_1": beta_1, "beta_2": beta_2,
                             "epsilon": epsilon},
            **kwargs,
        )

    def build(self, variables):
        if self.built:
            return
        super().build(variables)
        self._m, self._u = self.add_optimizer_variables(
            variables, ["momentum", "norm"])

    def update_step(self, gradient, variable, learning_rate):
        lr = self._per_model(learning_rate, variable)
        gradient = ops.cast(gradient, variable.dtype)
        # A sparse gradient's occurrences are taken one by one, as stock.
        absolute = self._summed(ops.abs(gradient), variable)
        gradient = self._summed(gradient, variable)
        beta_1 = self._hyper("beta_1", variable)
        beta_2 = self._hyper("beta_2", variable)
        epsilon = self._hyper("epsilon", variable)
        beta_1_power = ops.power(beta_1, self._local_step(variable))

        index = compat.variable_index(self, variable)
        m = self._m[index]
        u = self._u[index]

        self.assign_add(m, ops.multiply(ops.subtract(gradient, m),
                                        self._complement("beta_1", variable)))
        u_t = ops.maximum(ops.multiply(beta_2, u), absolute)
        self.assign(u, u_t)
        # `+` on tensors, not ops.add nor a Keras variable's `+`, which
        # calls it: on TensorFlow, ops.add turns into bias_add (along the
        # last axis) whenever the shapes allow it, mixing models.
        self.assign_sub(
            variable,
            ops.divide(ops.multiply(lr, m),
                       ops.multiply(1 - beta_1_power, u_t + epsilon)))
