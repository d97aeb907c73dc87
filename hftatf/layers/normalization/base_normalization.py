"""Fused normalization layers.

`BatchNormalization`, `LayerNormalization`, `GroupNormalization` and the
preprocessing layer `Normalization`, vectorised over the model axis. Every
activation is `[batch, B, ...]`; every weight, moving statistics included,
is `[B, *stock weight shape]`. Statistics are always taken per model: the
model axis is never normalised over.

Axis arguments keep their stock meaning: they name axes of the stock input
(`[batch, ...]`). Stock axis 0 (the batch) is fused axis 0, stock axis
`a >= 1` is fused axis `a + 1`, and a negative stock axis is resolved against
the stock rank first (so `-ndim` is still the batch axis).
"""


import keras
from keras import ops

from hftatf.core.validation import check_model_axis
from hftatf.layers.base import FusedLayer
from hftatf.layers.kernels import as_one_sample


def stock_shape(shape, model_axis=1):
    """The stock layer's input shape: `shape` without its model axis."""
    return (shape[1 - model_axis], *shape[2:])


def resolve_axis(layer_name, axis, ndim):
    """Stock `axis` of a rank-`ndim` stock input as a non-negative int."""
    if not -ndim <= axis < ndim:
        raise ValueError(
            f"Axis {axis} of layer '{layer_name}' is out of bounds for a "
            f"stock input of rank {ndim} (the fused input without its model "
            f"axis). Expected an axis in [{-ndim}, {ndim}).")
    return axis % ndim


def fused_axis(axis):
    """The fused axis of non-negative stock `axis`: the model axis is 1."""
    return axis if axis == 0 else axis + 1


def to_model_broadcast(weight, stock_broadcast_shape, model_axis=1):
    """`[B, *w]` -> a tensor that broadcasts against `[batch, B, ...]`
    (against `[B, batch, ...]` with `model_axis=0`).

    Each slice is reshaped as the stock layer reshapes its weight (to
    `stock_broadcast_shape`, a shape of the stock rank), then the model axis
    is moved to `model_axis`.
    """
    per_model = ops.reshape(weight, (-1, *stock_broadcast_shape))
    return ops.moveaxis(per_model, 0, model_axis)


def from_model_broadcast(statistic, weight_shape, model_axis=1):
    """Inverse of `to_model_broadcast`: keep-dims statistics -> `[B, *w]`."""
    return ops.reshape(ops.moveaxis(statistic, model_axis, 0),
                       (-1, *weight_shape))


class AffineNormalization(FusedLayer):
    """Base of the fused normalizations with a learned scale and offset.

    Holds what `BatchNormalization`, `LayerNormalization` and
    `GroupNormalization` share: `epsilon`, the optional `gamma` (scale) and
    `beta` (offset) weights, each `[B, *stock shape]`, with their
    initializers, regularizers and constraints (applied per model slice).
    Like the stock layers, every weight is read in its own dtype (float32)
    under a mixed precision policy, never autocast to the compute dtype.
    """

    def __init__(
        self,
        num_models,
        axis,
        epsilon,
        center,
        scale,
        beta_initializer,
        gamma_initializer,
        beta_regularizer,
        gamma_regularizer,
        beta_constraint,
        gamma_constraint,
        **kwargs,
    ):
        super().__init__(num_models, **kwargs)
        self.axis = axis
        self.epsilon = epsilon
        self.center = center
        self.scale = scale
        self.beta_initializer = keras.initializers.get(beta_initializer)
        self.gamma_initializer = keras.initializers.get(gamma_initializer)
        self.beta_regularizer = keras.regularizers.get(beta_regularizer)
        self.gamma_regularizer = keras.regularizers.get(gamma_regularizer)
        self.beta_constraint = keras.constraints.get(beta_constraint)
        self.gamma_constraint = keras.constraints.get(gamma_constraint)
        self.supports_masking = True
        self.gamma = None
        self.beta = None

    def add_model_weight(self, *args, autocast=False, **kwargs):
        # The stock layers create every weight with `autocast=False`: under
        # mixed precision they compute in float32 from float32 weights.
        return super().add_model_weight(*args, autocast=autocast, **kwargs)

    def _stock_input_shape(self, input_shape):
        check_model_axis(self.name, self.num_models, input_shape,
                         self.model_axis)
        return stock_shape(input_shape, self.model_axis)

    def _add_affine_weights(self, shape, scale, center):
        if scale:
            self.gamma = self.add_model_weight(
                shape,
                name="gamma",
                initializer=self.gamma_initializer,
                regularizer=self.gamma_regularizer,
                constraint=self.gamma_constraint,
            )
        if center:
            self.beta = self.add_model_weight(
                shape,
                name="beta",
                initializer=self.beta_initializer,
                regularizer=self.beta_regularizer,
                constraint=self.beta_constraint,
            )

    def _broadcast_weight(self, weight, dtype, stock_broadcast_shape, like):
        """`weight` (`[B, *w]`) as one sample of `like` (`[batch, B,
        ...]`), in `dtype`."""
        if weight is None:
            return None
        return as_one_sample(ops.cast(
            to_model_broadcast(weight, stock_broadcast_shape), dtype), like)

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        config = super().get_config()
        config.update({
            "axis": self.axis,
            "epsilon": self.epsilon,
            "center": self.center,
            "scale": self.scale,
            "beta_initializer": keras.initializers.serialize(
                self.beta_initializer),
            "gamma_initializer": keras.initializers.serialize(
                self.gamma_initializer),
            "beta_regularizer": keras.regularizers.serialize(
                self.beta_regularizer),
            "gamma_regularizer": keras.regularizers.serialize(
                self.gamma_regularizer),
            "beta_constraint": keras.constraints.serialize(
                self.beta_constraint),
            "gamma_constraint": keras.constraints.serialize(
                self.gamma_constraint),
        })
        return config
