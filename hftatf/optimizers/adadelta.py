"""Fused Adadelta."""

from keras import ops

from hftatf import sparse
from hftatf.api import hftatf_export
from hftatf.core import compat
from hftatf.optimizers.base import FusedOptimizer

__all__ = ["Adadelta"]


@hftatf_export
class Adadelta(FusedOptimizer):
    """`keras.optimizers.Adadelta` for an array: per-model hyper-parameters.

    Every variable is `[B, ...]`; model `b`'s slice is updated exactly as the
    stock optimizer with `learning_rate[b]`, `rho[b]` and `epsilon[b]` would
    update it:

        E[g^2] = rho * E[g^2] + (1 - rho) * g ** 2
        delta = -sqrt(E[dw^2] + epsilon) * g / sqrt(E[g^2] + epsilon)
        E[dw^2] = rho * E[dw^2] + (1 - rho) * delta ** 2
        w = w + learning_rate * delta

    The slots `_accumulated_grads` (`E[g^2]`) and `_accumulated_delta_vars`
    (`E[dw^2]`) are `[B, ...]` like their variables.

    Args:
        learning_rate: a float, a length-B sequence, a
            `LearningRateSchedule`, or a length-B sequence of schedules.
            Defaults to 0.001.
        rho: decay rate; a float or a length-B sequence. Defaults to 0.95.
        epsilon: a float or a length-B sequence. Defaults to 1e-7.
        **kwargs: the other arguments of `hftatf.optimizers.FusedOptimizer`
            (`weight_decay`, `clipnorm`, `clipvalue`, `global_clipnorm`,
            `use_ema`, ..., `name`, `num_models`).
    """

    applies_sparse_gradients = True
    complemented_hyperparameters = ("rho",)

    def __init__(self, learning_rate=0.001, rho=0.95, epsilon=1e-7,
                 **kwargs):
        super().__init__(
            learning_rate=learning_rate,
            hyperparameters={"rho": rho, "epsilon": epsilon},
            **kwargs,
        )

    def build(self, variables):
        if self.built:
            return
        super().build(variables)
        self._accumulated_grads, self._accumulated_delta_vars = (
            self.add_optimizer_variables(
                variables, ["accumulated_grad", "accumulated_delta_var"]))

    def update_step(self, gradient, variable, learning_rate):
        lr = self._per_model(learning_rate, variable)
        gradient = ops.cast(gradient, variable.dtype)
        # A sparse gradient's occurrences are squared one by one, and so
        # are their steps, as stock.
        squared = self._summed(ops.square(gradient), variable)
        rho = self._hyper("rho", variable)
        one_minus_rho = self._complement("rho", variable)
        epsilon = self._hyper("epsilon", variable)
        index = compat.variable_index(self, variable)
        accumulated_grad = self._accumulated_grads[index]
        accumulated_delta_var = self._accumulated_delta_vars[index]

        # `+` on tensors (a slot's `.value`), not ops.add nor a Keras
        # variable's `+`, which calls it: on TensorFlow, ops.add turns into
        # bias_add (along the last axis) whenever the shapes allow it,
        # mixing models.
        def rms(x):
            return ops.sqrt(x.value + epsilon)

        self.assign(accumulated_grad, ops.multiply(rho, accumulated_grad)
                    + ops.multiply(one_minus_rho, squared))
        if sparse.is_sparse(gradient):
            delta_var = sparse.with_values(gradient, ops.negative(ops.divide(
                ops.multiply(self._at_rows(rms(accumulated_delta_var),
                                           gradient), gradient.values),
                self._at_rows(rms(accumulated_grad), gradient))))
        else:
            delta_var = ops.negative(ops.divide(
                ops.multiply(rms(accumulated_delta_var), gradient),
                rms(accumulated_grad)))
        squared_delta = self._summed(ops.square(delta_var), variable)
        delta_var = self._summed(delta_var, variable)
        self.assign(accumulated_delta_var,
                    ops.multiply(rho, accumulated_delta_var)
                    + ops.multiply(one_minus_rho, squared_delta))
        self.assign_add(variable, ops.multiply(lr, delta_var))
