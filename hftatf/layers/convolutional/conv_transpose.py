"""Fused `Conv1DTranspose`, `Conv2DTranspose` and `Conv3DTranspose`."""

import keras
from keras import ops

from hftatf.api import hftatf_export
from hftatf.core import compat
from hftatf.layers import registry
from hftatf.layers.backends import conv_transpose_grouped, run_with_xla
from hftatf.layers.convolutional.base_conv import (
    FusedConvolutionBase,
    check_filters,
    check_implementation,
    folds_models,
    models_into_axis,
)


class FusedBaseConvTranspose(FusedConvolutionBase):
    """N-D transposed convolution (`keras.layers.ConvNDTranspose`) for an
    array of B models.

    Layout:
        input: `[batch, B, *spatial, channels]` (model `b` reads `x[:, b]`).
        output: `[batch, B, *new_spatial, filters]`.
        kernel: `[B, *kernel_size, filters, channels]` (the stock layout);
        bias: `[B, filters]`.

    Model `b` computes what the stock layer computes with weights
    `(kernel[b], bias[b])` on `x[:, b]`. TensorFlow's `conv_transpose` takes
    no `groups`, so the `"grouped"` kernel is the input gradient of a grouped
    convolution (`Conv2DBackpropInput`/`Conv3DBackpropInputV2` with the B
    kernels side by side, `[*kernel_size, filters, B * channels]`), compiled
    by XLA; `"per_model"` runs B stock transposed convolutions. Both are
    exact.

    Args:
        num_models: the number of models `B` in the array.
        rank: the number of spatial axes (1, 2 or 3).
        filters, kernel_size, strides, padding, output_padding,
        dilation_rate, activation, use_bias, kernel_initializer,
        bias_initializer, kernel_regularizer, bias_regularizer,
        activity_regularizer, kernel_constraint, bias_constraint: as in
            `keras.layers.ConvNDTranspose`; regularizers and constraints
            apply to each model's slice.
        data_format: `"channels_last"` (or `None` resolving to it);
            channels_first is refused.
        implementation: `"auto"`, `"grouped"` or `"per_model"` (module
            docstring).
    """

    def __init__(self, num_models, rank, filters, kernel_size, strides=1,
                 padding="valid", output_padding=None, data_format=None,
                 dilation_rate=1, activation=None, use_bias=True,
                 kernel_initializer="glorot_uniform",
                 bias_initializer="zeros", kernel_regularizer=None,
                 bias_regularizer=None, activity_regularizer=None,
                 kernel_constraint=None, bias_constraint=None,
                 implementation="auto", **kwargs):
        super().__init__(
            num_models, rank=rank, kernel_size=kernel_size, strides=strides,
            padding=padding, data_format=data_format,
            dilation_rate=dilation_rate, activation=activation,
            use_bias=use_bias, bias_initializer=bias_initializer,
            bias_regularizer=bias_regularizer,
            bias_constraint=bias_constraint,
            activity_regularizer=activity_regularizer, **kwargs)
        self.filters = filters
        self.output_padding = None if output_padding is None else (
            compat.standardize_tuple(output_padding, rank, "output_padding",
                              allow_zero=True))
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.kernel_regularizer = keras.regularizers.get(kernel_regularizer)
        self.kernel_constraint = keras.constraints.get(kernel_constraint)
        self.implementation = check_implementation(
            type(self).__name__, implementation)
        check_filters(filters)
        if self.output_padding is not None:
            for i, (pad, stride) in enumerate(
                    zip(self.output_padding, self.strides)):
                if pad >= stride:
                    raise ValueError(
                        "`output_padding` must be strictly less than "
                        f"`strides` for all dimensions. At dimension {i}, "
                        f"`output_padding` is {pad} but `strides` is "
                        f"{stride}. Received: output_padding="
                        f"{self.output_padding}, strides={self.strides}"
                    )
        self._check_strides_with_dilation()

    def build(self, input_shape):
        channels = self._input_channels(input_shape)
        self.kernel = self.add_model_weight(
            (*self.kernel_size, self.filters, channels),
            name="kernel",
            initializer=self.kernel_initializer,
            regularizer=self.kernel_regularizer,
            constraint=self.kernel_constraint,
        )
        self._add_bias(self.filters)

    def call(self, inputs):
        if folds_models(self.implementation):
            outputs = self._unfold(self._add_folded_bias(run_with_xla(
                self._grouped_transpose, self._fold(inputs),
                models_into_axis(self.kernel, -1))))
        else:
            outputs = self._per_model(
                lambda x, kernel: ops.conv_transpose(
                    x, kernel, output_padding=self.output_padding,
                    **self._conv_arguments()),
                inputs, self.kernel)
        return self._activate(outputs)

    def _grouped_transpose(self, inputs, kernel):
        """`[batch, *spatial, B * C]` and `[*k, F, B * C]` ->
        `[batch, *new_spatial, B * F]`, as the TensorFlow backend's
        `conv_transpose` computes it for one model."""
        output_shape = compat.compute_conv_transpose_output_shape(
            list(ops.shape(inputs)), self.kernel_size,
            self.num_models * self.filters, self.strides, self.padding,
            self.output_padding, self.data_format, self.dilation_rate)
        return conv_transpose_grouped(inputs, kernel, output_shape,
                                      self.strides, self.padding,
                                      self.dilation_rate)

    def compute_output_shape(self, input_shape):
        shape = compat.compute_conv_transpose_output_shape(
            self._per_model_shape(input_shape), self.kernel_size,
            self.filters, strides=self.strides, padding=self.padding,
            output_padding=self.output_padding, data_format=self.data_format,
            dilation_rate=self.dilation_rate)
        return self._fused_shape(tuple(shape))

    def get_config(self):
        config = super().get_config()
        config.update({
            "filters": self.filters,
            "output_padding": self.output_padding,
            "kernel_initializer": keras.initializers.serialize(
                self.kernel_initializer),
            "kernel_regularizer": keras.regularizers.serialize(
                self.kernel_regularizer),
            "kernel_constraint": keras.constraints.serialize(
                self.kernel_constraint),
            "implementation": self.implementation,
        })
        return config


@hftatf_export
@registry.register(keras.layers.Conv1DTranspose)
class FusedConv1DTranspose(FusedBaseConvTranspose):
    """`keras.layers.Conv1DTranspose` for an array of `num_models` models.

    Layout:
        input: `[batch, B, steps, channels]`.
        output: `[batch, B, new_steps, filters]`.
        kernel: `[B, kernel_size, filters, channels]`; bias: `[B, filters]`.

    Args: `num_models`, then the arguments of
    `keras.layers.Conv1DTranspose`, then `implementation`; see
    `FusedBaseConvTranspose`.
    """

    def __init__(self, num_models, filters, kernel_size, strides=1,
                 padding="valid", output_padding=None, data_format=None,
                 dilation_rate=1, activation=None, use_bias=True,
                 kernel_initializer="glorot_uniform",
                 bias_initializer="zeros", kernel_regularizer=None,
                 bias_regularizer=None, activity_regularizer=None,
                 kernel_constraint=None, bias_constraint=None,
                 implementation="auto", **kwargs):
        super().__init__(
            num_models, rank=1, filters=filters, kernel_size=kernel_size,
            strides=strides,
            padding=padding, output_padding=output_padding,
            data_format=data_format, dilation_rate=dilation_rate,
            activation=activation, use_bias=use_bias,
            kernel_initializer=kernel_initializer,
            bias_initializer=bias_initializer,
            kernel_regularizer=kernel_regularizer,
            bias_regularizer=bias_regularizer,
            activity_regularizer=activity_regularizer,
            kernel_constraint=kernel_constraint,
            bias_constraint=bias_constraint,
            implementation=implementation, **kwargs)


@hftatf_export
@registry.register(keras.layers.Conv2DTranspose)
class FusedConv2DTranspose(FusedBaseConvTranspose):
    """`keras.layers.Conv2DTranspose` for an array of `num_models` models.

    Layout:
        input: `[batch, B, height, width, channels]`.
        output: `[batch, B, new_height, new_width, filters]`.
        kernel: `[B, kernel_height, kernel_width, filters, channels]`;
        bias: `[B, filters]`.

    Args: `num_models`, then the arguments of
    `keras.layers.Conv2DTranspose`, then `implementation`; see
    `FusedBaseConvTranspose`.
    """

    def __init__(self, num_models, filters, kernel_size, strides=(1, 1),
                 padding="valid", output_padding=None, data_format=None,
                 dilation_rate=(1, 1), activation=None, use_bias=True,
                 kernel_initializer="glorot_uniform",
                 bias_initializer="zeros", kernel_regularizer=None,
                 bias_regularizer=None, activity_regularizer=None,
                 kernel_constraint=None, bias_constraint=None,
                 implementation="auto", **kwargs):
        super().__init__(
            num_models, rank=2, filters=filters, kernel_size=kernel_size,
            strides=strides,
            padding=padding, output_padding=output_padding,
            data_format=data_format, dilation_rate=dilation_rate,
            activation=activation, use_bias=use_bias,
            kernel_initializer=kernel_initializer,
            bias_initializer=bias_initializer,
            kernel_regularizer=kernel_regularizer,
            bias_regularizer=bias_regularizer,
            activity_regularizer=activity_regularizer,
            kernel_constraint=kernel_constraint,
            bias_constraint=bias_constraint,
            implementation=implementation, **kwargs)


@hftatf_export
@registry.register(keras.layers.Conv3DTranspose)
class FusedConv3DTranspose(FusedBaseConvTranspose):
    """`keras.layers.Conv3DTranspose` for an array of `num_models` models.

    Layout:
        input: `[batch, B, depth, height, width, channels]`.
        output: `[batch, B, new_depth, new_height, new_width, filters]`.
        kernel: `[B, kernel_depth, kernel_height, kernel_width, filters,
        channels]`; bias: `[B, filters]`.

    Args: `num_models`, then the arguments of
    `keras.layers.Conv3DTranspose` (in its order: `data_format` before
    `output_padding`), then `implementation`; see `FusedBaseConvTranspose`.
    """

    def __init__(self, num_models, filters, kernel_size, strides=(1, 1, 1),
                 padding="valid", data_format=None, output_padding=None,
                 dilation_rate=(1, 1, 1), activation=None, use_bias=True,
                 kernel_initializer="glorot_uniform",
                 bias_initializer="zeros", kernel_regularizer=None,
                 bias_regularizer=None, activity_regularizer=None,
                 kernel_constraint=None, bias_constraint=None,
                 implementation="auto", **kwargs):
        super().__init__(
            num_models, rank=3, filters=filters, kernel_size=kernel_size,
            strides=strides,
            padding=padding, output_padding=output_padding,
            data_format=data_format, dilation_rate=dilation_rate,
            activation=activation, use_bias=use_bias,
            kernel_initializer=kernel_initializer,
            bias_initializer=bias_initializer,
            kernel_regularizer=kernel_regularizer,
            bias_regularizer=bias_regularizer,
            activity_regularizer=activity_regularizer,
            kernel_constraint=kernel_constraint,
            bias_constraint=bias_constraint,
            implementation=implementation, **kwargs)
