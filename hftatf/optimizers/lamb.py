"""Fused LAMB: Adam moments with a per-model, per-variable trust ratio."""

from keras import ops

from hftatf.api import hftatf_export
from hftatf.core import compat
from hftatf.optimizers.base import FusedOptimizer

__all__ = ["Lamb"]


def check_required(optimizer, **values):
    """Raises a TypeError for a hyper-parameter that is None: unlike
    `weight_decay` or the clipping arguments, these cannot be turned off."""
    for name, value in values.items():
        if value is None:
            raise TypeError(
                f"`{name}` of {type(optimizer).__name__} cannot be None: "
                "pass a float or a sequence of floats (one per model). "
                f"Received: {name}=None.")


def model_norm(x):
    """The L2 norm of each model's slice of a `[B, ...]` tensor, as
    `[B, 1, ..., 1]`: a layer-wise norm is a norm per model, never across
    models."""
    # ops.power, not ops.square: the stock optimizers' formula.
    return ops.sqrt(ops.sum(ops.power(x, 2),
                            axis=tuple(range(1, len(x.shape))), keepdims=True))


@hftatf_export
class Lamb(FusedOptimizer):
    """`keras.optimizers.Lamb` for an array: per-model hyper-parameters and
    per-model trust ratios.

    Model `b`'s slice of every `[B, ...]` variable is updated exactly as the
    stock optimizer with model b's `learning_rate`, `beta_1`, `beta_2` and
    `epsilon` updates the stock variable of shape `shape[1:]`:

        m = beta_1 * m + (1 - beta_1) * g
        v = beta_2 * v + (1 - beta_2) * g ** 2
        update = (m / (1 - beta_1 ** t)) / (sqrt(v / (1 - beta_2 ** t)) + eps)
        ratio = ||w[b]|| / ||update[b]||   (1 where either norm is 0)
        w = w - ratio * learning_rate * update

    The norms are taken over each model's slice of the variable, so one
    model's weights or gradients (however large, or non-finite) never change
    another model's step. Slots `_momentums` and `_velocities` have the
    variables' shapes.

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
    complemented_hyperparameters = ("beta_1", "beta_2")

    def __init__(self, learning_rate=0.001, beta_1=0.9, beta_2=0.999,
                 epsilon=1e-7, **kwargs):
        check_required(self, beta_1=beta_1, beta_2=beta_2, epsilon=epsilon)
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
        self._momentums, self._velocities = self.add_optimizer_variables(
            variables, ["momentum", "velocity"])

    def update_step(self, gradient, variable, learning_rate):
        lr = self._per_model(learning_rate, variable)
        gradient = ops.cast(gradient, variable.dtype)
        # A sparse gradient's occurrences are squared one by one, as stock.
        squared = self._summed(ops.square(gradient), variable)
        gradient = self._summed(gradient, variable)
        beta_1 = self._hyper("beta_1", variable)
        beta_2 = self._hyper("beta_2", variable)
        epsilon = self._hyper("epsilon", variable)
        local_step = self._local_step(variable)
        beta_1_power = ops.power(beta_1, local_step)
        beta_2_power = ops.power(beta_2, local_step)

        index = compat.variable_index(self, variable)
        m = self._momentums[index]
        v = self._velocities[index]

        self.assign_add(m, ops.multiply(ops.subtract(gradient, m),
                                        self._complement("beta_1", variable)))
        self.assign_add(
            v, ops.multiply(ops.subtract(squared, v),
                            self._complement("beta_2", variable)))
        m_t_hat = ops.divide(m, 1.0 - beta_1_power)
        # `+`, not ops.add: on TensorFlow, ops.add turns into bias_add (along
        # the last axis) whenever the shapes allow it, mixing models.
        v_sqrt = ops.sqrt(ops.divide(v, 1.0 - beta_2_power)) + epsilon
        update = ops.divide(m_t_hat, v_sqrt)
        w_norm = model_norm(variable)
        g_norm = model_norm(update)
        ratio = trust_ratio(w_norm, g_norm, w_norm, g_norm)
        self.assign_sub(variable, ratio * lr * update)


def trust_ratio(w_norm, g_norm, numerator, denominator):
    """`numerator / denominator` per model, or 1 for a model whose weight
    norm or gradient norm is not positive (LAMB's and LARS's rule for an
    all-zero variable or update); all `[B, 1, ..., 1]`."""
    positive = ops.logical_and(ops.greater(w_norm, 0),
                               ops.greater(g_norm, 0))
    safe = ops.where(positive, denominator, ops.ones_like(denominator))
    return ops.where(positive, numerator / safe, ops.ones_like(numerator))
