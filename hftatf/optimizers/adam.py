"""Fused Adam."""

from keras import ops

from hftatf.api import hftatf_export
from hftatf.core import compat
from hftatf.core.validation import shared
from hftatf.optimizers.base import FusedOptimizer


def adam_step(optimizer, gradient, variable, lr, m, v, betas, epsilon,
              v_hat=None):
    """One Adam step of `variable` by `optimizer` (a `FusedOptimizer`),
    with the `[B, 1, ..., 1]` learning rate `lr` and `epsilon`, the
    optimizer's (complemented) hyper-parameters named `betas`, its slots
    `m` and `v`, and with AMSGrad's `v_hat` where given."""
    beta_1, beta_2 = (optimizer._hyper(name, variable) for name in betas)
    one_minus_beta_1, one_minus_beta_2 = (
        optimizer._complement(name, variable) for name in betas)
    local_step = optimizer._local_step(variable)
    # A sparse gradient's occurrences are squared one by one, as stock.
    squared = optimizer._summed(ops.square(gradient), variable)
    gradient = optimizer._summed(gradient, variable)
    beta_1_power = ops.power(beta_1, local_step)
    beta_2_power = ops.power(beta_2, local_step)
    alpha = lr * ops.sqrt(1 - beta_2_power) / (1 - beta_1_power)

    optimizer.assign_add(
        m, ops.multiply(ops.subtract(gradient, m), one_minus_beta_1))
    optimizer.assign_add(
        v, ops.multiply(ops.subtract(squared, v), one_minus_beta_2))
    if v_hat is not None:
        optimizer.assign(v_hat, ops.maximum(v_hat, v))
        v = v_hat
    # `+`, not ops.add: on TensorFlow, ops.add turns into bias_add (along
    # the last axis) whenever the shapes allow it, mixing models.
    optimizer.assign_sub(
        variable, ops.divide(ops.multiply(m, alpha), ops.sqrt(v) + epsilon))


@hftatf_export
class Adam(FusedOptimizer):
    """`keras.optimizers.Adam` for an array: per-model hyper-parameters.

    Model `b`'s slice of every variable is updated exactly as the stock
    optimizer with `learning_rate[b]`, `beta_1[b]`, `beta_2[b]` and
    `epsilon[b]` would update it, AMSGrad included.

    Args:
        learning_rate: a float, a length-B sequence, a
            `LearningRateSchedule`, or a length-B sequence of schedules.
            Defaults to 0.001.
        beta_1, beta_2, epsilon: floats or length-B sequences; defaults 0.9,
            0.999 and 1e-7, as in Keras.
        amsgrad: whether to apply AMSGrad (shared by all models).
        **kwargs: the other arguments of `hftatf.optimizers.FusedOptimizer`
            (`weight_decay`, `clipnorm`, `clipvalue`, `global_clipnorm`,
            `use_ema`, ..., `name`, `num_models`).
    """

    complemented_hyperparameters = ("beta_1", "beta_2")
    applies_sparse_gradients = True

    def __init__(self, learning_rate=0.001, beta_1=0.9, beta_2=0.999,
                 epsilon=1e-7, amsgrad=False, **kwargs):
        super().__init__(
            learning_rate=learning_rate,
            hyperparameters={"beta_1": beta_1, "beta_2": beta_2,
                             "epsilon": epsilon},
            **kwargs,
        )
        self.amsgrad = bool(shared("amsgrad", amsgrad))

    def build(self, variables):
        if self.built:
            return
        super().build(variables)
        self._momentums, self._velocities = self.add_optimizer_variables(
            variables, ["momentum", "velocity"])
        if self.amsgrad:
            self._velocity_hats = self.add_optimizer_variables(
                variables, "velocity_hat")

    def update_step(self, gradient, variable, learning_rate):
        lr = self._per_model(learning_rate, variable)
        gradient = ops.cast(gradient, variable.dtype)
        epsilon = self._hyper("epsilon", variable)

        index = compat.variable_index(self, variable)
        adam_step(self, gradient, variable, lr, self._momentums[index],
                  self._velocities[index], ("beta_1", "beta_2"), epsilon,
                  self._velocity_hats[index] if self.amsgrad else None)

    def get_config(self):
        config = super().get_config()
        config["amsgrad"] = self.amsgrad
        return config
