"""Fused `LayerNormalization`."""

import warnings

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
@registry.register(keras.layers.LayerNormalization)
class FusedLayerNormalization(AffineNormalization):
    """`keras.layers.LayerNormalization` for an array of `num_models` models.

    Layout:
        input and output: `[batch, B, ...]`; a mask passes through.
        gamma, beta: `[B, *s]`, where `s` is the stock weight shape (the
            sizes of the stock `axis`, in sorted order).

    Model `b` computes exactly what the stock layer computes with
    `(gamma[b], beta[b])` on `x[:, b]`: per sample, mean and variance over
    `axis`, in (at least) float32 whatever the input dtype, then
    `(x - mean) * rsqrt(variance + epsilon) * gamma + beta`. With the
    deprecated `rms_scaling=True`, as in the stock layer, the input is
    scaled by `rsqrt(variance + epsilon)` and `gamma` only (no `beta`).

    Args:
        num_models: the number of models `B` in the array.
        axis: an int or a list of ints, axes of the stock input; stock axis
            `a >= 1` is fused axis `a + 1`.
        epsilon, center, scale, rms_scaling, beta_initializer,
        gamma_initializer, beta_regularizer, gamma_regularizer,
        beta_constraint, gamma_constraint: as in
            `keras.layers.LayerNormalization`.
    """

    def __init__(
        self,
        num_models,
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
        rms_scaling=False,
        **kwargs,
    ):
        if rms_scaling:
            warnings.warn(
                "You passed `rms_scaling=True`, which is deprecated. This "
                "argument incorrectly scales the input by the variance, not "
                "the root mean square. To correctly use RMS Normalization, "
                "please use `keras.layers.RMSNormalization` instead.",
                stacklevel=2)
        if isinstance(axis, (list, tuple)):
            axis = list(axis)
        elif not isinstance(axis, int):
            raise TypeError(
                "Expected an int or a list/tuple of ints for the argument "
                f"'axis', but received: {axis!r}")
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
        self.rms_scaling = rms_scaling
        # As the stock layer: float inputs are not cast to the compute dtype.
        self.autocast = False

    def build(self, input_shape):
        shape = self._stock_input_shape(input_shape)
        # The stock layer keeps its axes as a sorted list once built.
        self.axis = sorted(self.axis) if isinstance(
            self.axis, list) else [self.axis]
        axes = [resolve_axis(self.name, a, len(shape)) for a in self.axis]
        weight_shape = tuple(shape[a] for a in axes)
        self._norm_axes = [fused_axis(a) for a in axes]
        self._stock_broadcast_shape = [1] * len(shape)
        for a in axes:
            self._stock_broadcast_shape[a] = shape[a]
        self._add_affine_weights(
            weight_shape, self.scale or self.rms_scaling,
            self.center and not self.rms_scaling)

    def call(self, inputs):
        original_dtype = inputs.dtype
        dtype = keras.backend.result_type(inputs.dtype, "float32")
        x = ops.cast(inputs, dtype)
        epsilon = (keras.backend.epsilon() if self.epsilon is None
                   else self.epsilon)
        gamma = self._broadcast_weight(self.gamma, dtype,
                                       self._stock_broadcast_shape, x)
        beta = self._broadcast_weight(self.beta, dtype,
                                      self._stock_broadcast_shape, x)
        if self.rms_scaling:
            variance = ops.var(x, axis=self._norm_axes, keepdims=True)
            outputs = x * ops.rsqrt(variance + epsilon)
            if gamma is not None:
                outputs = outputs * gamma
        else:
            mean, variance = ops.moments(x, axes=self._norm_axes,
                                         keepdims=True)
            inv = ops.rsqrt(variance + epsilon)
            if gamma is not None:
                inv = inv * gamma
            shift = -mean * inv
            if beta is not None:
                shift = shift + beta
            outputs = x * inv + shift
        outputs = ops.cast(outputs, original_dtype)
        return ops.cast(outputs, self.compute_dtype)

    def get_config(self):
        return {**super().get_config(), "rms_scaling": self.rms_scaling}
