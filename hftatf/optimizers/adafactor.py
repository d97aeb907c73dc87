"""Fused Adafactor."""

import math

from keras import ops

from hftatf import sparse
from hftatf.api import hftatf_export
from hftatf.core import compat
from hftatf.core.axis import to_model_rank
from hftatf.core.validation import shared
from hftatf.optimizers.base import FusedOptimizer
from hftatf.optimizers.hyperparameters import RANGES
from hftatf.optimizers.lamb import check_required

__all__ = ["Adafactor"]


def model_axes(x):
    """Every axis of a `[B, ...]` tensor but the model axis."""
    return tuple(range(1, len(x.shape)))


def model_rms(x):
    """The root mean square of each model's slice, `[B, 1, ..., 1]`."""
    return ops.sqrt(ops.mean(ops.square(x), axis=model_axes(x),
                             keepdims=True))


@hftatf_export
class Adafactor(FusedOptimizer):
    """`keras.optimizers.Adafactor` for an array: per-model hyper-parameters.

    Model `b`'s slice of every `[B, ...]` variable is updated exactly as the
    stock optimizer with model b's `learning_rate`, `beta_2_decay`,
    `epsilon_1`, `epsilon_2` and `clip_threshold` updates the stock variable
    of shape `shape[1:]`. Everything Adafactor takes from a whole variable is
    taken from each model's slice: the root mean squares of the weights and
    of the update, and the factored second moments. As in Keras, a variable
    whose per-model rank is 2 or more has its second moment factored over
    its last two axes (slots `r` of shape `[B, *shape[1:-1]]` and `c` of
    shape `[B, *shape[1:-2], shape[-1]]`, then `v` of the variable's shape);
    one of per-model rank 0 or 1 keeps an unfactored `v` and placeholder
    `r` and `c` slots of shape `[B]`.

    As in Keras, the step size is `min(learning_rate, 1 / sqrt(step))`
    whatever `relative_step` is, so `relative_step` changes nothing.

    Args:
        learning_rate: a float, a length-B sequence, a
            `LearningRateSchedule`, or a length-B sequence of schedules.
            Defaults to 0.001.
        beta_2_decay, epsilon_1, epsilon_2, clip_threshold: floats or
            length-B sequences; defaults -0.8, 1e-30, 1e-3 and 1.0, as in
            Keras.
        relative_step: as in Keras (shared by all models).
        **kwargs: the other arguments of `hftatf.optimizers.FusedOptimizer`
            (`weight_decay`, `clipnorm`, `clipvalue`, `global_clipnorm`,
            `use_ema`, ..., `name`, `num_models`).
    """

    applies_sparse_gradients = True

    hyperparameter_ranges = {"epsilon_1": RANGES["epsilon"],
                             "epsilon_2": RANGES["epsilon"]}

    def __init__(self, learning_rate=0.001, beta_2_decay=-0.8,
                 epsilon_1=1e-30, epsilon_2=1e-3, clip_threshold=1.0,
                 relative_step=True, **kwargs):
        check_required(self, beta_2_decay=beta_2_decay, epsilon_1=epsilon_1,
                       epsilon_2=epsilon_2, clip_threshold=clip_threshold)
        super().__init__(
            learning_rate=learning_rate,
            hyperparameters={"beta_2_decay": beta_2_decay,
                             "epsilon_1": epsilon_1,
                             "epsilon_2": epsilon_2,
                             "clip_threshold": clip_threshold},
            **kwargs,
        )
        self.relative_step = bool(shared("relative_step", relative_step))

    def build(self, variables):
        if self.built:
            return
        super().build(variables)
        self._r = []
        self._c = []
        self._v = []
        for variable in variables:
            shape = tuple(variable.shape)
            if variable.overwrite_with_gradient:
                self._r.append(None)
                self._c.append(None)
                self._v.append(None)
                continue
            if len(shape) < 3:
                # Per-model rank < 2: not factored. Keras keeps a scalar
                # placeholder per variable; here one per model.
                r_shape = c_shape = shape[:1]
            else:
                r_shape = shape[:-1]
                c_shape = shape[:-2] + shape[-1:]
            self._r.append(self.add_variable(
                shape=r_shape, dtype=variable.dtype, name=variable.name))
            self._c.append(self.add_variable(
                shape=c_shape, dtype=variable.dtype, name=variable.name))
            self._v.append(self.add_variable_from_reference(
                reference_variable=variable, name="velocity"))

    def update_step(self, gradient, variable, learning_rate):
        lr = self._per_model(learning_rate, variable)
        gradient = ops.cast(gradient, variable.dtype)
        beta_2_decay = self._hyper("beta_2_decay", variable)
        epsilon_1 = self._hyper("epsilon_1", variable)
        epsilon_2 = self._hyper("epsilon_2", variable)
        clip_threshold = self._hyper("clip_threshold", variable)
        one = ops.cast(1.0, variable.dtype)
        local_step = self._local_step(variable)

        index = compat.variable_index(self, variable)
        r = self._r[index]
        c = self._c[index]
        v = self._v[index]

        # Keras caps the rate once more when `relative_step` is on and the
        # rate is not a schedule: a no-op after this minimum.
        rho_t = ops.minimum(lr, 1 / ops.sqrt(local_step))
        alpha_t = ops.maximum(epsilon_2, model_rms(variable)) * rho_t
        # `+`, not ops.add: on TensorFlow, ops.add turns into bias_add (along
        # the last axis) whenever the shapes allow it, mixing models.
        # A sparse gradient's occurrences are squared one by one, as stock.
        regulated_grad_square = self._summed(ops.square(gradient),
                                             variable) + epsilon_1
        beta_2_t = 1 - ops.power(local_step, beta_2_decay)

        if len(variable.shape) >= 3:
            self.assign(r, beta_2_t[..., 0] * r + (1 - beta_2_t[..., 0])
                        * ops.mean(regulated_grad_square, axis=-1))
            self.assign(c, beta_2_t[..., 0] * c + (1 - beta_2_t[..., 0])
                        * ops.mean(regulated_grad_square, axis=-2))
            self.assign(
                v,
                ops.expand_dims(r / ops.mean(r, axis=-1, keepdims=True),
                                axis=-1) * ops.expand_dims(c, -2))
        else:
            self.assign(v, beta_2_t * v
                        + (1 - beta_2_t) * regulated_grad_square)

        u_t = self._summed(gradient, variable) / ops.sqrt(v)
        if sparse.is_sparse(gradient):
            # The root mean square of the step's occurrences, as stock.
            u_rows = gradient.values / self._at_rows(ops.sqrt(v), gradient)
            mean_square = sparse.sum_per_model(
                gradient, self.num_models, ops.square(u_rows)) / math.prod(
                    variable.shape[1:])
            u_rms = to_model_rank(ops.sqrt(mean_square),
                                        len(variable.shape))
        else:
            u_rms = model_rms(u_t)
        u_t_hat = u_t / ops.maximum(one, u_rms / clip_threshold)
        self.assign_sub(variable, alpha_t * u_t_hat)

    def get_config(self):
        config = super().get_config()
        config["relative_step"] = self.relative_step
        return config
