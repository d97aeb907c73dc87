"""Fused `SeparableConv1D` and `SeparableConv2D`."""

import keras
from keras import ops

from hftatf.api import hftatf_export
from hftatf.core import compat
from hftatf.layers import registry
from hftatf.layers.convolutional.base_conv import (
    FusedConvolutionBase,
    check_depth_multiplier,
    check_filters,
    folds_models,
    models_into_axis,
)


class FusedBaseSeparableConv(FusedConvolutionBase):
    """N-D separable convolution (`keras.layers.SeparableConvND`) for an
    array of B models.

    Layout:
        input: `[batch, B, *spatial, channels]` (model `b` reads `x[:, b]`).
        output: `[batch, B, *new_spatial, filters]`.
        depthwise_kernel: `[B, *kernel_size, channels, depth_multiplier]`;
        pointwise_kernel: `[B, 1, ..., 1, channels * depth_multiplier,
        filters]`; bias: `[B, filters]`.

    Model `b` computes what the stock layer computes with weights
    `(depthwise_kernel[b], pointwise_kernel[b], bias[b])` on `x[:, b]`: the
    depthwise step runs once for all models (as in
    `FusedBaseDepthwiseConv`), the pointwise step is a per-model einsum over
    channels.

    Args:
        num_models: the number of models `B` in the array.
        rank: the number of spatial axes (1 or 2).
        depth_multiplier, filters, kernel_size, strides, padding,
        dilation_rate, activation, use_bias, depthwise_initializer,
        pointwise_initializer, bias_initializer, depthwise_regularizer,
        pointwise_regularizer, bias_regularizer, activity_regularizer,
        depthwise_constraint, pointwise_constraint, bias_constraint: as in
            `keras.layers.SeparableConvND`; regularizers and constraints
            apply to each model's slice.
        data_format: `"channels_last"` (or `None` resolving to it);
            channels_first is refused.
    """

    def __init__(self, num_models, rank, depth_multiplier, filters,
                 kernel_size, strides=1, padding="valid", data_format=None,
                 dilation_rate=1, activation=None, use_bias=True,
                 depthwise_initializer="glorot_uniform",
                 pointwise_initializer="glorot_uniform",
                 bias_initializer="zeros", depthwise_regularizer=None,
                 pointwise_regularizer=None, bias_regularizer=None,
                 activity_regularizer=None, depthwise_constraint=None,
                 pointwise_constraint=None, bias_constraint=None, **kwargs):
        super().__init__(
            num_models, rank=rank, kernel_size=kernel_size, strides=strides,
            padding=padding, data_format=data_format,
            dilation_rate=dilation_rate, activation=activation,
            use_bias=use_bias, bias_initializer=bias_initializer,
            bias_regularizer=bias_regularizer,
            bias_constraint=bias_constraint,
            activity_regularizer=activity_regularizer, **kwargs)
        self.depth_multiplier = depth_multiplier
        self.filters = filters
        self.depthwise_initializer = keras.initializers.get(
            depthwise_initializer)
        self.pointwise_initializer = keras.initializers.get(
            pointwise_initializer)
        self.depthwise_regularizer = keras.regularizers.get(
            depthwise_regularizer)
        self.pointwise_regularizer = keras.regularizers.get(
            pointwise_regularizer)
        self.depthwise_constraint = keras.constraints.get(
            depthwise_constraint)
        self.pointwise_constraint = keras.constraints.get(
            pointwise_constraint)
        check_depth_multiplier(depth_multiplier)
        check_filters(filters)

    def build(self, input_shape):
        channels = self._input_channels(input_shape)
        self.compute_output_shape(input_shape)
        self.depthwise_kernel = self.add_model_weight(
            (*self.kernel_size, channels, self.depth_multiplier),
            name="depthwise_kernel",
            initializer=self.depthwise_initializer,
            regularizer=self.depthwise_regularizer,
            constraint=self.depthwise_constraint,
        )
        self.pointwise_kernel = self.add_model_weight(
            (*(1,) * self.rank, channels * self.depth_multiplier,
             self.filters),
            name="pointwise_kernel",
            initializer=self.pointwise_initializer,
            regularizer=self.pointwise_regularizer,
            constraint=self.pointwise_constraint,
        )
        self._add_bias(self.filters)

    def call(self, inputs):
        if not folds_models():
            # On CPU the stock separable convolution of each model costs
            # no more than the folded form and needs no transposes.
            return self._activate(self._per_model(
                lambda x, depthwise, pointwise: ops.separable_conv(
                    x, depthwise, pointwise, **self._conv_arguments()),
                inputs, self.depthwise_kernel, self.pointwise_kernel))
        depthwise = ops.depthwise_conv(
            self._fold(inputs),
            models_into_axis(self.depthwise_kernel, -2),
            **self._conv_arguments())
        shape = ops.shape(depthwise)
        depthwise = ops.reshape(
            depthwise, (-1, *shape[1:-1], self.num_models,
                        shape[-1] // self.num_models))
        pointwise = ops.reshape(
            self.pointwise_kernel,
            (self.num_models, *self.pointwise_kernel.shape[-2:]))
        spatial = "xyz"[:self.rank]
        models = "mn" if self.models_first else "nm"
        outputs = ops.einsum(
            f"n{spatial}mi,mio->{models}{spatial}o", depthwise, pointwise)
        if self.bias is not None:
            # [B, F] -> [B, 1, ..., 1, F] (with the models first, [B, 1,
            # 1, ..., 1, F]). `+`, not ops.add, whose TensorFlow bias_add
            # shortcut picks the axis from the shapes alone.
            outputs = outputs + ops.reshape(
                self.bias, (self.num_models, *(1,) * (
                    self.rank + self.models_first), -1))
        return self._activate(outputs)

    def compute_output_shape(self, input_shape):
        return self._fused_shape(compat.compute_conv_output_shape(
            self._per_model_shape(input_shape), self.filters,
            self.kernel_size, strides=self.strides, padding=self.padding,
            data_format=self.data_format, dilation_rate=self.dilation_rate))

    def get_config(self):
        config = super().get_config()
        config.update({
            "depth_multiplier": self.depth_multiplier,
            "filters": self.filters,
            "depthwise_initializer": keras.initializers.serialize(
                self.depthwise_initializer),
            "pointwise_initializer": keras.initializers.serialize(
                self.pointwise_initializer),
            "depthwise_regularizer": keras.regularizers.serialize(
                self.depthwise_regularizer),
            "pointwise_regularizer": keras.regularizers.serialize(
                self.pointwise_regularizer),
            "depthwise_constraint": keras.constraints.serialize(
                self.depthwise_constraint),
            "pointwise_constraint": keras.constraints.serialize(
                self.pointwise_constraint),
        })
        return config


@hftatf_export
@registry.register(keras.layers.SeparableConv1D)
class FusedSeparableConv1D(FusedBaseSeparableConv):
    """`keras.layers.SeparableConv1D` for an array of `num_models` models.

    Layout:
        input: `[batch, B, steps, channels]`.
        output: `[batch, B, new_steps, filters]`.
        depthwise_kernel: `[B, kernel_size, channels, depth_multiplier]`;
        pointwise_kernel: `[B, 1, channels * depth_multiplier, filters]`;
        bias: `[B, filters]`.

    Args: `num_models`, then the arguments of
    `keras.layers.SeparableConv1D`; see `FusedBaseSeparableConv`.
    """

    def __init__(self, num_models, filters, kernel_size, strides=1,
                 padding="valid", data_format=None, dilation_rate=1,
                 depth_multiplier=1, activation=None, use_bias=True,
                 depthwise_initializer="glorot_uniform",
                 pointwise_initializer="glorot_uniform",
                 bias_initializer="zeros", depthwise_regularizer=None,
                 pointwise_regularizer=None, bias_regularizer=None,
                 activity_regularizer=None, depthwise_constraint=None,
                 pointwise_constraint=None, bias_constraint=None, **kwargs):
        super().__init__(
            num_models, rank=1, depth_multiplier=depth_multiplier,
            filters=filters, kernel_size=kernel_size,
            strides=strides, padding=padding, data_format=data_format,
            dilation_rate=dilation_rate, activation=activation,
            use_bias=use_bias, depthwise_initializer=depthwise_initializer,
            pointwise_initializer=pointwise_initializer,
            bias_initializer=bias_initializer,
            depthwise_regularizer=depthwise_regularizer,
            pointwise_regularizer=pointwise_regularizer,
            bias_regularizer=bias_regularizer,
            activity_regularizer=activity_regularizer,
            depthwise_constraint=depthwise_constraint,
            pointwise_constraint=pointwise_constraint,
            bias_constraint=bias_constraint, **kwargs)


@hftatf_export
@registry.register(keras.layers.SeparableConv2D)
class FusedSeparableConv2D(FusedBaseSeparableConv):
    """`keras.layers.SeparableConv2D` for an array of `num_models` models.

    Layout:
        input: `[batch, B, height, width, channels]`.
        output: `[batch, B, new_height, new_width, filters]`.
        depthwise_kernel: `[B, kernel_height, kernel_width, channels,
        depth_multiplier]`; pointwise_kernel: `[B, 1, 1,
        channels * depth_multiplier, filters]`; bias: `[B, filters]`.

    Args: `num_models`, then the arguments of
    `keras.layers.SeparableConv2D`; see `FusedBaseSeparableConv`.
    """

    def __init__(self, num_models, filters, kernel_size, strides=(1, 1),
                 padding="valid", data_format=None, dilation_rate=(1, 1),
                 depth_multiplier=1, activation=None, use_bias=True,
                 depthwise_initializer="glorot_uniform",
                 pointwise_initializer="glorot_uniform",
                 bias_initializer="zeros", depthwise_regularizer=None,
                 pointwise_regularizer=None, bias_regularizer=None,
                 activity_regularizer=None, depthwise_constraint=None,
                 pointwise_constraint=None, bias_constraint=None, **kwargs):
        super().__init__(
            num_models, rank=2, depth_multiplier=depth_multiplier,
            filters=filters, kernel_size=kernel_size,
            strides=strides, padding=padding, data_format=data_format,
            dilation_rate=dilation_rate, activation=activation,
            use_bias=use_bias, depthwise_initializer=depthwise_initializer,
            pointwise_initializer=pointwise_initializer,
            bias_initializer=bias_initializer,
            depthwise_regularizer=depthwise_regularizer,
            pointwise_regularizer=pointwise_regularizer,
            bias_regularizer=bias_regularizer,
            activity_regularizer=activity_regularizer,
            depthwise_constraint=depthwise_constraint,
            pointwise_constraint=pointwise_constraint,
            bias_constraint=bias_constraint, **kwargs)
