"""Fused Adagrad, and the initializer of per-model slot values."""

import keras
import numpy as np
from keras import ops

from hftatf.api import hftatf_export
from hftatf.core import compat
from hftatf.optimizers.base import FusedOptimizer

__all__ = ["Adagrad"]


class PerModelConstant(keras.initializers.Initializer):
    """Fills slice `b` of a `[B, ...]` variable with `values[b]`.

    An initializer rather than an assignment, so that it also works when
    Keras builds the optimizer symbolically (inside a traced train step).
    """

    def __init__(self, values):
        self.values = np.asarray(values, dtype="float64").reshape(-1)

    def __call__(self, shape, dtype=None):
        values = self.values.reshape((-1,) + (1,) * (len(shape) - 1))
        return keras.initializers.Constant(values)(shape, dtype=dtype)

    def get_config(self):
        return {"values": self.values.tolist()}


def per_model_initial_value(optimizer, name):
    """An initializer giving model `b`'s slot slices hyper-parameter
    `name`'s value for model `b`, as it is when the optimizer is built."""
    values = np.broadcast_to(
        np.asarray(optimizer._hyper_values[name], dtype="float64"),
        (optimizer.num_models,))
    return PerModelConstant(values)


@hftatf_export
class Adagrad(FusedOptimizer):
    """`keras.optimizers.Adagrad` for an array: per-model hyper-parameters.

    Every variable is `[B, ...]`; model `b`'s slice is updated exactly as the
    stock optimizer with `learning_rate[b]`, `initial_accumulator_value[b]`
    and `epsilon[b]` would update it:

        accumulator = accumulator + g ** 2
        w = w - learning_rate * g / sqrt(accumulator + epsilon)

    The slots `_accumulators` are `[B, ...]` like their variables; model
    `b`'s slice starts at `initial_accumulator_value[b]`. As in Keras,
    `initial_accumulator_value` is read when the optimizer is built:
    changing it later changes no accumulator.

    Args:
        learning_rate: a float, a length-B sequence, a
            `LearningRateSchedule`, or a length-B sequence of schedules.
            Defaults to 0.001.
        initial_accumulator_value: a float or a length-B sequence. Defaults
            to 0.1.
        epsilon: a float or a length-B sequence. Defaults to 1e-7.
        **kwargs: the other arguments of `hftatf.optimizers.FusedOptimizer`
            (`weight_decay`, `clipnorm`, `clipvalue`, `global_clipnorm`,
            `use_ema`, ..., `name`, `num_models`).
    """

    applies_sparse_gradients = True

    def __init__(self, learning_rate=0.001, initial_accumulator_value=0.1,
                 epsilon=1e-7, **kwargs):
        super().__init__(
            learning_rate=learning_rate,
            hyperparameters={
                "initial_accumulator_value": initial_accumulator_value,
                "epsilon": epsilon},
            **kwargs,
        )

    def build(self, variables):
        if self.built:
            return
        super().build(variables)
        self._accumulators = self.add_optimizer_variables(
            variables, "accumulator",
            initializer=per_model_initial_value(
                self, "initial_accumulator_value"))

    def update_step(self, gradient, variable, learning_rate):
        lr = self._per_model(learning_rate, variable)
        gradient = ops.cast(gradient, variable.dtype)
        # A sparse gradient's occurrences are squared one by one, as stock.
        squared = self._summed(ops.square(gradient), variable)
        gradient = self._summed(gradient, variable)
        epsilon = self._hyper("epsilon", variable)
        accumulator = self._accumulators[compat.variable_index(self, variable)]

        self.assign_add(accumulator, squared)
        # `+` on tensors (a slot's `.value`), not ops.add nor a Keras
        # variable's `+`, which calls it: on TensorFlow, ops.add turns into
        # bias_add (along the last axis) whenever the shapes allow it,
        # mixing models.
        self.assign_sub(
            variable,
            ops.divide(ops.multiply(lr, gradient),
                       ops.sqrt(accumulator.value + epsilon)))
