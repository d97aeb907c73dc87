"""Fused FTRL-Proximal."""

from keras import ops

from hftatf.api import hftatf_export
from hftatf.core import compat
from hftatf.core.validation import Range
from hftatf.optimizers.adagrad import per_model_initial_value
from hftatf.optimizers.base import FusedOptimizer

__all__ = ["Ftrl"]


@hftatf_export
class Ftrl(FusedOptimizer):
    """`keras.optimizers.Ftrl` for an array: per-model hyper-parameters.

    Every variable is `[B, ...]`; model `b`'s slice is updated exactly as the
    stock optimizer with model `b`'s value of every hyper-parameter below
    would update it (FTRL-Proximal, McMahan et al. 2013, with Keras's
    shrinkage and `beta`). The slots `_accumulators` and `_linears` are
    `[B, ...]` like their variables; model `b`'s accumulators start at
    `initial_accumulator_value[b]`, read when the optimizer is built
    (changing it later changes no accumulator, as in Keras).

    Args:
        learning_rate: a float, a length-B sequence, a
            `LearningRateSchedule`, or a length-B sequence of schedules.
            Defaults to 0.001.
        learning_rate_power: a float <= 0 or a length-B sequence of them.
            Defaults to -0.5.
        initial_accumulator_value: a float >= 0 or a length-B sequence.
            Defaults to 0.1.
        l1_regularization_strength, l2_regularization_strength,
        l2_shrinkage_regularization_strength: floats >= 0 or length-B
            sequences. Default to 0.
        beta: a float or a length-B sequence. Defaults to 0.
        **kwargs: the other arguments of `hftatf.optimizers.FusedOptimizer`
            (`weight_decay`, `clipnorm`, `clipvalue`, `global_clipnorm`,
            `use_ema`, ..., `name`, `num_models`).
    """

    applies_sparse_gradients = True
    # The ranges the stock Ftrl checks (`initial_accumulator_value` is
    # checked by every fused optimizer).
    hyperparameter_ranges = {
        "learning_rate_power": Range(high=0.0),
        "l1_regularization_strength": Range(0.0),
        "l2_regularization_strength": Range(0.0),
        "l2_shrinkage_regularization_strength": Range(0.0),
    }

    def __init__(self, learning_rate=0.001, learning_rate_power=-0.5,
                 initial_accumulator_value=0.1,
                 l1_regularization_strength=0.0,
                 l2_regularization_strength=0.0,
                 l2_shrinkage_regularization_strength=0.0, beta=0.0,
                 **kwargs):
        super().__init__(
            learning_rate=learning_rate,
            hyperparameters={
                "learning_rate_power": learning_rate_power,
                "initial_accumulator_value": initial_accumulator_value,
                "l1_regularization_strength": l1_regularization_strength,
                "l2_regularization_strength": l2_regularization_strength,
                "l2_shrinkage_regularization_strength": (
                    l2_shrinkage_regularization_strength),
                "beta": beta,
            },
            **kwargs,
        )

    def build(self, variables):
        if self.built:
            return
        super().build(variables)
        self._accumulators, self._linears = self.add_optimizer_variables(
            variables, ["accumulator", "linear"],
            initializer=[
                per_model_initial_value(self, "initial_accumulator_value"),
                "zeros"])

    def update_step(self, gradient, variable, learning_rate):
        lr = self._per_model(learning_rate, variable)
        gradient = ops.cast(gradient, variable.dtype)
        # A sparse gradient's occurrences are squared one by one, as stock.
        squared = self._summed(ops.square(gradient), variable)
        gradient = self._summed(gradient, variable)
        index = compat.variable_index(self, variable)
        accum = self._accumulators[index]
        linear = self._linears[index]
        lr_power = self._hyper("learning_rate_power", variable)
        l1_reg = self._hyper("l1_regularization_strength", variable)
        l2_reg = self._hyper("l2_regularization_strength", variable)
        l2_shrinkage = self._hyper("l2_shrinkage_regularization_strength",
                                   variable)
        beta = self._hyper("beta", variable)

        # `+` on tensors, not ops.add nor a Keras variable's `+`, which
        # calls it: on TensorFlow, ops.add turns into bias_add (along the
        # last axis) whenever the shapes allow it, mixing models.
        l2_reg = l2_reg + beta / (2.0 * lr)
        grad_to_use = gradient + ops.multiply(2 * l2_shrinkage, variable)
        new_accum = accum + squared
        self.assign_add(
            linear,
            ops.subtract(
                grad_to_use,
                ops.multiply(
                    ops.divide(ops.subtract(ops.power(new_accum, -lr_power),
                                            ops.power(accum, -lr_power)),
                               lr),
                    variable)))
        quadratic = ops.divide(ops.power(new_accum, -lr_power), lr) + (
            2 * l2_reg)
        # minimum/maximum rather than ops.clip, whose bounds must be scalars
        # or of the clipped tensor's shape on some backends.
        linear_clipped = ops.minimum(ops.maximum(linear, -l1_reg), l1_reg)
        self.assign(variable,
                    ops.divide(ops.subtract(linear_clipped, linear),
                               quadratic))
        self.assign(accum, new_accum)
