"""Fused Nadam: Adam with Nesterov momentum, per model."""

import keras
from keras import ops

from hftatf.api import hftatf_export
from hftatf.core import compat
from hftatf.optimizers.base import FusedOptimizer

__all__ = ["Nadam"]


@hftatf_export
class Nadam(FusedOptimizer):
    """`keras.optimizers.Nadam` for an array: per-model hyper-parameters.

    Every variable is `[B, ...]`; model `b`'s slice is updated exactly as the
    stock optimizer with `learning_rate[b]`, `beta_1[b]`, `beta_2[b]` and
    `epsilon[b]` would update it. The slots `_momentums` and `_velocities`
    are `[B, ...]` like their variables. Stock Nadam's running product of
    momentum coefficients, `prod_t beta_1 * (1 - 0.5 * 0.96 ** t)`, depends
    on `beta_1`, so here it is a `[B]` optimizer variable, `_u_product`,
    advanced once per optimizer step (not once per variable) as in Keras.

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
        dtype = variables[0].dtype if variables else keras.backend.floatx()
        super().build(variables)
        self._momentums, self._velocities = self.add_optimizer_variables(
            variables, ["momentum", "velocity"])
        # Every replica computes the same product; only one must write it.
        self._u_product = self.add_variable(
            (self.num_models,), initializer="ones", dtype=dtype,
            aggregation="only_first_replica", name="u_product")

    @compat.optimizer_hook
    def _backend_update_step(self, grads, trainable_variables, learning_rate):
        # Advanced here, once per step before the variables are updated, as
        # stock Nadam does; skipped with them on gradient-accumulation steps.
        u_product = self._u_product
        beta_1 = self._hyper("beta_1", u_product)
        local_step = self._local_step(u_product)
        self.assign(
            u_product,
            u_product * beta_1 * (1.0 - 0.5 * ops.power(0.96, local_step)))
        super()._backend_update_step(grads, trainable_variables,
                                     learning_rate)

    def update_step(self, gradient, variable, learning_rate):
        dtype = variable.dtype
        lr = self._per_model(learning_rate, variable)
        gradient = ops.cast(gradient, dtype)
        # A sparse gradient's occurrences are squared one by one, as stock.
        squared = self._summed(ops.square(gradient), variable)
        gradient = self._summed(gradient, variable)
        beta_1 = self._hyper("beta_1", variable)
        beta_2 = self._hyper("beta_2", variable)
        epsilon = self._hyper("epsilon", variable)

        local_step = self._local_step(variable)
        next_step = local_step + 1
        decay = ops.cast(0.96, dtype)
        u_t = beta_1 * (1.0 - 0.5 * ops.power(decay, local_step))
        u_t_1 = beta_1 * (1.0 - 0.5 * ops.power(decay, next_step))
        u_product_t = self._per_model(self._u_product, variable)
        u_product_t_1 = u_product_t * u_t_1
        beta_2_power = ops.power(beta_2, local_step)

        index = compat.variable_index(self, variable)
        m = self._momentums[index]
        v = self._velocities[index]

        self.assign_add(m, ops.multiply(ops.subtract(gradient, m), 1 - beta_1))
        self.assign_add(
            v, ops.multiply(ops.subtract(squared, v), 1 - beta_2))
        m_hat = (ops.divide(ops.multiply(u_t_1, m), 1 - u_product_t_1)
                 + ops.divide(ops.multiply(1 - u_t, gradient),
                              1 - u_product_t))
        v_hat = ops.divide(v, 1 - beta_2_power)
        # `+` on tensors, not ops.add nor a Keras variable's `+`, which
        # calls it: on TensorFlow, ops.add turns into bias_add (along the
        # last axis) whenever the shapes allow it, mixing models.
        self.assign_sub(
            variable,
            ops.divide(ops.multiply(m_hat, lr), ops.sqrt(v_hat) + epsilon))
