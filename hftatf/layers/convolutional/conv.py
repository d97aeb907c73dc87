"""Fused `Conv1D`, `Conv2D` and `Conv3D` (`FusedBaseConv` holds the
logic; each rank is a docstring and a constructor)."""

import keras
from keras import ops

from hftatf.api import hftatf_export
from hftatf.core import compat
from hftatf.layers import registry
from hftatf.layers.convolutional.base_conv import (
    FusedConvolutionBase,
    check_filters,
    check_implementation,
    folds_models,
    models_into_axis,
)
from hftatf.layers.lora import LoraLayer, lora_property


class FusedBaseConv(LoraLayer, FusedConvolutionBase):
    """N-D convolution (`keras.layers.ConvND`) for an array of B models.

    Layout:
        input: `[batch, B, *spatial, channels]` (model `b` reads `x[:, b]`).
        output: `[batch, B, *new_spatial, filters]`.
        kernel: `[B, *kernel_size, channels // groups, filters]`;
        bias: `[B, filters]`.

    Model `b` computes what the stock `ConvND` computes with weights
    `(kernel[b], bias[b])` on `x[:, b]`. Each kernel slice is initialised as
    a separate stock layer would be (its own seed; fans of the stock kernel,
    never counting B).

    Args:
        num_models: the number of models `B` in the array.
        rank: the number of spatial axes (1, 2 or 3).
        filters, kernel_size, strides, padding, dilation_rate, groups,
        activation, use_bias, kernel_initializer, bias_initializer,
        kernel_regularizer, bias_regularizer, activity_regularizer,
        kernel_constraint, bias_constraint: as in `keras.layers.ConvND`
            (`padding="causal"` for rank 1); regularizers and constraints
            apply to each model's slice.
        data_format: `"channels_last"` (or `None` where
            `keras.config.image_data_format()` is channels_last);
            channels_first is refused.
        lora_rank, lora_alpha: as in `keras.layers.ConvND`: LoRA enabled
            when the layer is built, each model with its own factors
            (`hftatf.layers.lora`; `enable_lora` enables it later).
        implementation: `"auto"`, `"grouped"` or `"per_model"`: the kernel
            that computes the B convolutions (module docstring).
        shared_input: whether the input is one batch shared by all models,
            `[batch, *spatial, channels]` (no model axis): the B models are
            then one stock convolution of `B * filters` filters. Needs
            `groups=1`.
    """

    def __init__(self, num_models, rank, filters, kernel_size, strides=1,
                 padding="valid", data_format=None, dilation_rate=1,
                 groups=1, activation=None, use_bias=True,
                 kernel_initializer="glorot_uniform",
                 bias_initializer="zeros", kernel_regularizer=None,
                 bias_regularizer=None, activity_regularizer=None,
                 kernel_constraint=None, bias_constraint=None,
                 lora_rank=None, lora_alpha=None,
                 implementation="auto", shared_input=False, **kwargs):
        super().__init__(
            num_models, rank=rank, kernel_size=kernel_size, strides=strides,
            padding=padding, data_format=data_format,
            dilation_rate=dilation_rate, activation=activation,
            use_bias=use_bias, bias_initializer=bias_initializer,
            bias_regularizer=bias_regularizer,
            bias_constraint=bias_constraint,
            activity_regularizer=activity_regularizer,
            allow_causal=rank == 1, **kwargs)
        self.filters = filters
        self.groups = groups
        self.init_lora(lora_rank, lora_alpha)
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.kernel_regularizer = keras.regularizers.get(kernel_regularizer)
        self.kernel_constraint = keras.constraints.get(kernel_constraint)
        self.implementation = check_implementation(
            type(self).__name__, implementation)
        self.shared_input = bool(shared_input)
        check_filters(filters)
        if groups <= 0:
            raise ValueError(
                "The number of groups must be a positive integer. "
                f"Received: groups={groups}."
            )
        if self.shared_input and groups != 1:
            raise ValueError(
                f"{type(self).__name__} takes a shared input only with "
                f"groups=1. Received: groups={groups}, shared_input=True.")
        if filters is not None and filters % groups != 0:
            raise ValueError(
                "The number of filters must be evenly divisible by the "
                f"number of groups. Received: groups={groups}, "
                f"filters={filters}."
            )
        self._check_strides_with_dilation()

    @classmethod
    def fuses_shared_input(cls, layer):
        return layer.groups == 1

    def _shared_input_channels(self, input_shape):
        """Checks a shared `[batch, *spatial, C]` input; returns `C`."""
        input_shape = tuple(input_shape)
        if len(input_shape) != self.rank + 2 or input_shape[-1] is None:
            raise ValueError(
                f"Layer '{self.name}' ({type(self).__name__}) with "
                "shared_input=True expects one batch shared by all models, "
                f"of rank {self.rank + 2} with a known channel axis (the "
                f"last). Received input shape {input_shape}.")
        self.input_spec = keras.layers.InputSpec(
            ndim=self.rank + 2, axes={-1: input_shape[-1]})
        return input_shape[-1]

    def build(self, input_shape):
        channels = (self._shared_input_channels(input_shape)
                    if self.shared_input else self._input_channels(input_shape))
        if channels % self.groups != 0:
            raise ValueError(
                "The number of input channels must be evenly divisible by "
                f"the number of groups. Received groups={self.groups}, but "
                f"the input has {channels} channels (full input shape is "
                f"{tuple(input_shape)})."
            )
        # Validates the spatial sizes as the stock layer does.
        self.compute_output_shape(input_shape)
        self._kernel = self.add_model_weight(
            (*self.kernel_size, channels // self.groups, self.filters),
            name="kernel",
            initializer=self.kernel_initializer,
            regularizer=self.kernel_regularizer,
            constraint=self.kernel_constraint,
        )
        self._add_bias(self.filters)
        self.build_lora()

    kernel = lora_property("kernel")

    def call(self, inputs):
        padding = self.padding
        if padding == "causal":
            # As stock Conv1D: pad on the left, then a valid convolution.
            left = self.dilation_rate[0] * (self.kernel_size[0] - 1)
            inputs = ops.pad(inputs, [[0, 0]] * (len(inputs.shape) - 2)
                             + [[left, 0], [0, 0]])
            padding = "valid"
        arguments = self._conv_arguments(padding)
        grouped = folds_models(self.implementation)
        if self.shared_input and grouped:
            # Model b's filters at b*F .. b*F + F - 1 of one stock
            # convolution.
            outputs = self._unfold(self._add_folded_bias(ops.conv(
                inputs, models_into_axis(self.kernel, -1), **arguments)))
        elif self.shared_input:
            # On CPU, moving the model axis out of the wide output costs
            # more than B convolutions of the shared batch.
            outputs = self._per_model(
                lambda x, kernel: ops.conv(x, kernel, **arguments),
                inputs, self.kernel, shared=True)
        elif grouped:
            # Model b's input channels form groups b*g .. b*g + g - 1 and
            # meet exactly its filters: one convolution, B * groups groups.
            outputs = self._unfold(self._add_folded_bias(ops.conv(
                self._fold(inputs), models_into_axis(self.kernel, -1),
                **arguments)))
        else:
            outputs = self._per_model(
                lambda x, kernel: ops.conv(x, kernel, **arguments),
                inputs, self.kernel)
        return self._activate(outputs)

    def compute_output_shape(self, input_shape):
        per_model = (tuple(input_shape) if self.shared_input
                     else self._per_model_shape(input_shape))
        return self._fused_shape(compat.compute_conv_output_shape(
            per_model, self.filters,
            self.kernel_size, strides=self.strides, padding=self.padding,
            data_format=self.data_format, dilation_rate=self.dilation_rate))

    def get_config(self):
        config = super().get_config()
        config.update({
            "filters": self.filters,
            "groups": self.groups,
            "shared_input": self.shared_input,
            "kernel_initializer": keras.initializers.serialize(
                self.kernel_initializer),
            "kernel_regularizer": keras.regularizers.serialize(
                self.kernel_regularizer),
            "kernel_constraint": keras.constraints.serialize(
                self.kernel_constraint),
            "implementation": self.implementation,
        })
        return self.with_lora_config(config)


@hftatf_export
@registry.register(keras.layers.Conv1D)
class FusedConv1D(FusedBaseConv):
    """`keras.layers.Conv1D` for an array of `num_models` models.

    Layout:
        input: `[batch, B, steps, channels]`.
        output: `[batch, B, new_steps, filters]`.
        kernel: `[B, kernel_size, channels // groups, filters]`;
        bias: `[B, filters]`.

    Args: `num_models`, then the arguments of `keras.layers.Conv1D`
    (`padding` may be `"causal"`), then `implementation`; see
    `FusedBaseConv`.
    """

    def __init__(self, num_models, filters, kernel_size, strides=1,
                 padding="valid", data_format=None, dilation_rate=1,
                 groups=1, activation=None, use_bias=True,
                 kernel_initializer="glorot_uniform",
                 bias_initializer="zeros", kernel_regularizer=None,
                 bias_regularizer=None, activity_regularizer=None,
                 kernel_constraint=None, bias_constraint=None,
                 implementation="auto", **kwargs):
        super().__init__(
            num_models, rank=1, filters=filters, kernel_size=kernel_size,
            strides=strides,
            padding=padding, data_format=data_format,
            dilation_rate=dilation_rate, groups=groups,
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
@registry.register(keras.layers.Conv2D)
class FusedConv2D(FusedBaseConv):
    """`keras.layers.Conv2D` for an array of `num_models` models.

    Layout:
        input: `[batch, B, height, width, channels]`.
        output: `[batch, B, new_height, new_width, filters]`.
        kernel: `[B, kernel_height, kernel_width, channels // groups,
        filters]`; bias: `[B, filters]`.

    Args: `num_models`, then the arguments of `keras.layers.Conv2D`, then
    `implementation`; see `FusedBaseConv`.
    """

    def __init__(self, num_models, filters, kernel_size, strides=(1, 1),
                 padding="valid", data_format=None, dilation_rate=(1, 1),
                 groups=1, activation=None, use_bias=True,
                 kernel_initializer="glorot_uniform",
                 bias_initializer="zeros", kernel_regularizer=None,
                 bias_regularizer=None, activity_regularizer=None,
                 kernel_constraint=None, bias_constraint=None,
                 implementation="auto", **kwargs):
        super().__init__(
            num_models, rank=2, filters=filters, kernel_size=kernel_size,
            strides=strides,
            padding=padding, data_format=data_format,
            dilation_rate=dilation_rate, groups=groups,
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
@registry.register(keras.layers.Conv3D)
class FusedConv3D(FusedBaseConv):
    """`keras.layers.Conv3D` for an array of `num_models` models.

    Layout:
        input: `[batch, B, depth, height, width, channels]`.
        output: `[batch, B, new_depth, new_height, new_width, filters]`.
        kernel: `[B, kernel_depth, kernel_height, kernel_width,
        channels // groups, filters]`; bias: `[B, filters]`.

    Args: `num_models`, then the arguments of `keras.layers.Conv3D`, then
    `implementation`; see `FusedBaseConv`.
    """

    def __init__(self, num_models, filters, kernel_size, strides=(1, 1, 1),
                 padding="valid", data_format=None, dilation_rate=(1, 1, 1),
                 groups=1, activation=None, use_bias=True,
                 kernel_initializer="glorot_uniform",
                 bias_initializer="zeros", kernel_regularizer=None,
                 bias_regularizer=None, activity_regularizer=None,
                 kernel_constraint=None, bias_constraint=None,
                 implementation="auto", **kwargs):
        super().__init__(
            num_models, rank=3, filters=filters, kernel_size=kernel_size,
            strides=strides,
            padding=padding, data_format=data_format,
            dilation_rate=dilation_rate, groups=groups,
            activation=activation, use_bias=use_bias,
            kernel_initializer=kernel_initializer,
            bias_initializer=bias_initializer,
            kernel_regularizer=kernel_regularizer,
            bias_regularizer=bias_regularizer,
            activity_regularizer=activity_regularizer,
            kernel_constraint=kernel_constraint,
            bias_constraint=bias_constraint,
            implementation=implementation, **kwargs)
