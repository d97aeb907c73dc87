"""Fused `GroupNormalization`."""
import keras
from keras import ops

from hftatf.api import hftatf_export
from hftatf.layers import registry
from hftatf.layers.normalization.base_normalization import (
    AffineNormalization,
    fused_axis,
    resolve_axis,
)


@hftatf_export
@registry.register(keras.layers.GroupNormalization)
class FusedGroupNormalization(AffineNormalization):
    """`keras.layers.GroupNormalization` for an array of `num_models` models.

    Layout (`C` = size of the stock `axis`):
        input and output: `[batch, B, ...]`; a mask passes through.
        gamma, beta: `[B, C]`.

    Model `b` computes exactly what the stock layer computes with
    `(gamma[b], beta[b])` on `x[:, b]`: the `C` channels are split into
    `groups` groups, and each sample is normalised per group over the
    group's channels and every other non-batch axis, in (at least) float32.

    Args:
        num_models: the number of models `B` in the array.
        groups: as in `keras.layers.GroupNormalization` (`-1`: one group per
            channel, replaced by `C` when the layer is built).
        axis: one axis of the stock input (an int, not the batch axis);
            stock axis `a >= 1` is fused axis `a + 1`.
        epsilon, center, scale, beta_initializer, gamma_initializer,
        beta_regularizer, gamma_regularizer, beta_constraint,
        gamma_constraint: as in `keras.layers.GroupNormalization`.
    """

    def __init__(
        self,
        num_models,
        groups=32,
        axis=-1,
        epsilon=1e-3,
        center=True,
        scale=True,
        beta_initializer="zeros",
        gamma_initializer="ones",
        beta_regularizer=None,
        gamma_regularizer=None,
        beta_constraint=None,
        gamma_constraint=None,
        **kwargs,
    ):
        if not isinstance(groups, int) or (groups <= 0 and groups != -1):
            raise ValueError(
                "Received an invalid value for argument `groups`, expected "
                "a positive integer (or `-1` for instance normalization). "
                f"Received: groups={groups}")
        if isinstance(axis, bool) or not isinstance(axis, int):
            raise TypeError(
                "keras.layers.GroupNormalization takes one channel axis, an "
                f"int. Received: axis={axis!r}.")
        super().__init__(
            num_models,
            axis=axis,
            epsilon=epsilon,
            center=center,
            scale=scale,
            beta_initializer=beta_initializer,
            gamma_initializer=gamma_initializer,
            beta_regularizer=beta_regularizer,
            gamma_regularizer=gamma_regularizer,
            beta_constraint=beta_constraint,
            gamma_constraint=gamma_constraint,
            **kwargs,
        )
        self.groups = groups
        # As the stock layer: float inputs are not cast to the compute dtype.
        self.autocast = False

    def build(self, input_shape):
        shape = self._stock_input_shape(input_shape)
        axis = resolve_axis(self.name, self.axis, len(shape))
        if axis == 0:
            raise ValueError(
                f"Layer '{self.name}' cannot take the batch axis as its "
                f"channel axis. Received: axis={self.axis}. Pass the axis "
                "of the channels, e.g. axis=-1.")
        dim = shape[axis]
        if dim is None:
            raise ValueError(
                f"Axis {self.axis} of input tensor should have a defined "
                "dimension but the layer received an input with shape "
                f"{tuple(input_shape)}.")
        if self.groups == -1:
            self.groups = dim
        if dim < self.groups:
            raise ValueError(
                f"Number of groups ({self.groups}) cannot be more than the "
                f"number of channels ({dim}).")
        if dim % self.groups != 0:
            raise ValueError(
                f"Number of groups ({self.groups}) must be a multiple of the "
                f"number of channels ({dim}).")
        self._channel_axis = fused_axis(axis)
        self.input_spec = keras.layers.InputSpec(
            ndim=len(input_shape),
            axes={1: self.num_models, self._channel_axis: dim})
        # The stock weight broadcast: `[..., groups, dim // groups, ...]`.
        self._stock_broadcast_shape = [1] * len(shape)
        self._stock_broadcast_shape[axis] = dim // self.groups
        self._stock_broadcast_shape.insert(axis, self.groups)
        self._add_affine_weights((dim,), self.scale, self.center)

    def call(self, inputs):
        input_shape = ops.shape(inputs)
        group_shape = [-1, *input_shape[1:]]
        axis = self._channel_axis
        group_shape[axis] = input_shape[axis] // self.groups
        group_shape.insert(axis, self.groups)
        grouped = ops.reshape(inputs, group_shape)
        dtype = keras.backend.result_type(grouped.dtype, "float32")
        x = ops.cast(grouped, dtype)
        # Each group of each sample of each model: every axis but the batch,
        # model and group axes.
        reduction_axes = [a for a in range(2, len(group_shape)) if a != axis]
        mean, variance = ops.moments(x, axes=reduction_axes, keepdims=True)
        inv = ops.rsqrt(variance + self.epsilon)
        gamma = self._broadcast_weight(self.gamma, dtype,
                                       self._stock_broadcast_shape, x)
        beta = self._broadcast_weight(self.beta, dtype,
                                      self._stock_broadcast_shape, x)
        if gamma is not None:
            inv = inv * gamma
        shift = -mean * inv
        if beta is not None:
            shift = shift + beta
        outputs = ops.cast(x * inv + shift, grouped.dtype)
        outputs = ops.reshape(outputs, input_shape)
        return ops.cast(outputs, self.compute_dtype)

    def get_config(self):
        return {**super().get_config(), "groups": self.groups}
