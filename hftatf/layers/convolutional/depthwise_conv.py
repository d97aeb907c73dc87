"""Fused `DepthwiseConv1D` and `DepthwiseConv2D`."""

import keras
from keras import ops

from hftatf.api import hftatf_export
from hftatf.core import compat
from hftatf.layers import registry
from hftatf.layers.convolutional.base_conv import (
    FusedConvolutionBase,
    check_depth_multiplier,
    folds_models,
    models_into_axis,
)


class FusedBaseDepthwiseConv(FusedConvolutionBase):
    """N-D depthwise convolution (`keras.layers.DepthwiseConvND`) for an
    array of B models.

    Layout:
        input: `[batch, B, *spatial, channels]` (model `b` reads `x[:, b]`).
        output: `[batch, B, *new_spatial, channels * depth_multiplier]`.
        kernel: `[B, *kernel_size, channels, depth_multiplier]`;
        bias: `[B, channels * depth_multiplier]`.

    Model `b` computes what the stock layer computes with weights
    `(kernel[b], bias[b])` on `x[:, b]`. On a GPU or TPU the B models folded
    into the channel axis (`[batch, *spatial, B * channels]`, kernel
    `[*kernel_size, B * channels, depth_multiplier]`) are one plain depthwise
    convolution, which every device runs and differentiates; on a CPU each
    model runs its stock depthwise convolution (module docstring).

    Args:
        num_models: the number of models `B` in the array.
        rank: the number of spatial axes (1 or 2).
        depth_multiplier, kernel_size, strides, padding, dilation_rate,
        activation, use_bias, depthwise_initializer, bias_initializer,
        depthwise_regularizer, bias_regularizer, activity_regularizer,
        depthwise_constraint, bias_constraint: as in
            `keras.layers.DepthwiseConvND`; regularizers and constraints
            apply to each model's slice.
        data_format: `"channels_last"` (or `None` resolving to it);
            channels_first is refused.
    """

    def __init__(self, num_models, rank, depth_multiplier, kernel_size,
                 strides=1, padding="valid", data_format=None,
                 dilation_rate=1, activation=None, use_bias=True,
                 depthwise_initializer="glorot_uniform",
                 bias_initializer="zeros", depthwise_regularizer=None,
                 bias_regularizer=None, activity_regularizer=None,
                 depthwise_constraint=None, bias_constraint=None, **kwargs):
        super().__init__(
            num_models, rank=rank, kernel_size=kernel_size, strides=strides,
            padding=padding, data_format=data_format,
            dilation_rate=dilation_rate, activation=activation,
            use_bias=use_bias, bias_initializer=bias_initializer,
            bias_regularizer=bias_regularizer,
            bias_constraint=bias_constraint,
            activity_regularizer=activity_regularizer, **kwargs)
        self.depth_multiplier = depth_multiplier
        self.depthwise_initializer = keras.initializers.get(
            depthwise_initializer)
        self.depthwise_regularizer = keras.regularizers.get(
            depthwise_regularizer)
        self.depthwise_constraint = keras.constraints.get(
            depthwise_constraint)
        check_depth_multiplier(depth_multiplier)

    def build(self, input_shape):
        channels = self._input_channels(input_shape)
        self.compute_output_shape(input_shape)
        self.kernel = self.add_model_weight(
            (*self.kernel_size, channels, self.depth_multiplier),
            name="kernel",
            initializer=self.depthwise_initializer,
            regularizer=self.depthwise_regularizer,
            constraint=self.depthwise_constraint,
        )
        self._add_bias(channels * self.depth_multiplier)

    def call(self, inputs):
        arguments = self._conv_arguments()
        if not folds_models():
            return self._activate(self._per_model(
                lambda x, kernel: ops.depthwise_conv(x, kernel, **arguments),
                inputs, self.kernel))
        # Folded channel b*C + c yields outputs (b*C + c)*M + m: model b's
        # C*M outputs in the stock order, side by side.
        outputs = ops.depthwise_conv(
            self._fold(inputs), models_into_axis(self.kernel, -2),
            **arguments)
        return self._activate(self._unfold(self._add_folded_bias(outputs)))

    def compute_output_shape(self, input_shape):
        return self._fused_shape(compat.compute_conv_output_shape(
            self._per_model_shape(input_shape),
            self.depth_multiplier * input_shape[-1], self.kernel_size,
            strides=self.strides, padding=self.padding,
            data_format=self.data_format, dilation_rate=self.dilation_rate))

    def get_config(self):
        config = super().get_config()
        config.update({
            "depth_multiplier": self.depth_multiplier,
            "depthwise_initializer": keras.initializers.serialize(
                self.depthwise_initializer),
            "depthwise_regularizer": keras.regularizers.serialize(
                self.depthwise_regularizer),
            "depthwise_constraint": keras.constraints.serialize(
                self.depthwise_constraint),
        })
        return config


@hftatf_export
@registry.register(keras.layers.DepthwiseConv1D)
class FusedDepthwiseConv1D(FusedBaseDepthwiseConv):
    """`keras.layers.DepthwiseConv1D` for an array of `num_models` models.

    Layout:
        input: `[batch, B, steps, channels]`.
        output: `[batch, B, new_steps, channels * depth_multiplier]`.
        kernel: `[B, kernel_size, channels, depth_multiplier]`;
        bias: `[B, channels * depth_multiplier]`.

    Args: `num_models`, then the arguments of
    `keras.layers.DepthwiseConv1D`; see `FusedBaseDepthwiseConv`.
    """

    def __init__(self, num_models, kernel_size, strides=1, padding="valid",
                 depth_multiplier=1, data_format=None, dilation_rate=1,
                 activation=None, use_bias=True,
                 depthwise_initializer="glorot_uniform",
                 bias_initializer="zeros", depthwise_regularizer=None,
                 bias_regularizer=None, activity_regularizer=None,
                 depthwise_constraint=None, bias_constraint=None, **kwargs):
        super().__init__(
            num_models, rank=1, depth_multiplier=depth_multiplier,
            kernel_size=kernel_size, strides=strides,
            padding=padding, data_format=data_format,
            dilation_rate=dilation_rate, activation=activation,
            use_bias=use_bias, depthwise_initializer=depthwise_initializer,
            bias_initializer=bias_initializer,
            depthwise_regularizer=depthwise_regularizer,
            bias_regularizer=bias_regularizer,
            activity_regularizer=activity_regularizer,
            depthwise_constraint=depthwise_constraint,
            bias_constraint=bias_constraint, **kwargs)


@hftatf_export
@registry.register(keras.layers.DepthwiseConv2D)
class FusedDepthwiseConv2D(FusedBaseDepthwiseConv):
    """`keras.layers.DepthwiseConv2D` for an array of `num_models` models.

    Layout:
        input: `[batch, B, height, width, channels]`.
        output: `[batch, B, new_height, new_width,
        channels * depth_multiplier]`.
        kernel: `[B, kernel_height, kernel_width, channels,
        depth_multiplier]`; bias: `[B, channels * depth_multiplier]`.

    Args: `num_models`, then the arguments of
    `keras.layers.DepthwiseConv2D`; see `FusedBaseDepthwiseConv`.
    """

    def __init__(self, num_models, kernel_size, strides=(1, 1),
                 padding="valid", depth_multiplier=1, data_format=None,
                 dilation_rate=(1, 1), activation=None, use_bias=True,
                 depthwise_initializer="glorot_uniform",
                 bias_initializer="zeros", depthwise_regularizer=None,
                 bias_regularizer=None, activity_regularizer=None,
                 depthwise_constraint=None, bias_constraint=None, **kwargs):
        super().__init__(
            num_models, rank=2, depth_multiplier=depth_multiplier,
            kernel_size=kernel_size, strides=strides,
            padding=padding, data_format=data_format,
            dilation_rate=dilation_rate, activation=activation,
            use_bias=use_bias, depthwise_initializer=depthwise_initializer,
            bias_initializer=bias_initializer,
            depthwise_regularizer=depthwise_regularizer,
            bias_regularizer=bias_regularizer,
            activity_regularizer=activity_regularizer,
            depthwise_constraint=depthwise_constraint,
            bias_constraint=bias_constraint, **kwargs)
