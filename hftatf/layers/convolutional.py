"""Fused convolutions: `ConvND`, `ConvNDTranspose`, `DepthwiseConvND` and
`SeparableConvND` for an array of B models.

Layout (channels_last only): every activation is
`[batch, B, *spatial, channels]` and every weight is `[B, *stock weight
shape]`, in the order of the stock layer's `get_weights()`.

Choice of kernel. A fused convolution (or transposed convolution) is
computed in one of two exact ways, chosen by the `implementation` argument:

* `"grouped"`: ONE grouped convolution of the B models folded into the
  channel axis, `[batch, *spatial, B * channels]`, with `B * groups` groups
  and the B kernels side by side on the output-channel axis. This is HFTA's
  kernel, the fast one on GPU and TPU. It runs through XLA, as
  `keras.ops.conv` runs stock grouped convolutions, because TensorFlow's
  CPU kernels cannot differentiate grouped convolutions.
* `"per_model"`: B convolutions in one graph, one per model slice, stacked
  on axis 1. Under XLA on CPU a training step of 8 grouped convolutions ran
  about 12x slower than 8 separate ones, so this is the CPU kernel.
* `"auto"` (the default) decides each time the layer's call is traced:
  1. under a `tf.distribute` strategy, grouped if the strategy's worker
     devices are GPUs or TPUs, per-model otherwise;
  2. otherwise, from the device the call is placed on: a `tf.device` scope
     while tracing a graph, the device an eager op runs on when eager;
     grouped on a GPU or TPU, per-model on a CPU;
  3. with no placement requested (a graph traced outside any device scope),
     grouped if TensorFlow sees a logical GPU or TPU (it then places the
     convolution there), per-model otherwise.

Depthwise and separable convolutions follow the same device rule without
an argument. On a GPU or TPU the B models folded into the channel axis are
one plain depthwise convolution (a separable convolution adds a per-model
pointwise step, an einsum over channels). On a CPU each model runs its
stock depthwise (or separable) convolution: the fold's transposes cost
more than the kernel launches they save there (a training step of 8
folded 3x3 depthwise convolutions on 64x16x16x64 inputs took 0.49x the
processor time of 8 stock ones, 0.56x when per model; under XLA 0.66x
against 1.00x).

A convolution whose input is one batch shared by all models (the first
convolution of an image model, after its shared input) is neither: with
`shared_input=True` the B kernels side by side on the output-channel axis
are one stock convolution of `B * filters` filters, with no copy of the
input per model (`hftatf.fuse` builds such convolutions this way).

Per-model kernels take their slices with one `unstack` of the input and
return them with one `stack`, adding each model's bias as the stock layer
does; folded kernels add the bias in the folded layout, where it is one
stock bias of `B * filters` channels.

With `models_first=True` every family computes on activations with the
models first, `[B, batch, *spatial, channels]`, and returns them so. That
is the layout `hftatf.fuse` keeps between the convolutions of a CPU array:
there the per-model slices of the input are views of it, where those of
`[batch, B, ...]` are copies (and so are the gradients that stack them
back). Folded kernels move the models next to the channels either way.
"""

import keras
import tensorflow as tf
from keras import ops
from keras.src.backend.common.backend_utils import (
    compute_conv_transpose_output_shape,
)
from keras.src.ops.operation_utils import compute_conv_output_shape
from keras.src.utils.argument_validation import (
    standardize_padding,
    standardize_tuple,
)

from hftatf.api import hftatf_export
from hftatf.core.axis import map_models, split_models, stack_models
from hftatf.core.devices import runs_on_accelerator
from hftatf.core.validation import check_model_axis
from hftatf.layers import registry
from hftatf.layers.base import FusedLayer
from hftatf.layers.kernels import add_bias_by_rows

__all__ = [
    "FusedBaseConv",
    "FusedBaseConvTranspose",
    "FusedBaseDepthwiseConv",
    "FusedBaseSeparableConv",
    "FusedConv1D",
    "FusedConv1DTranspose",
    "FusedConv2D",
    "FusedConv2DTranspose",
    "FusedConv3D",
    "FusedConv3DTranspose",
    "FusedDepthwiseConv1D",
    "FusedDepthwiseConv2D",
    "FusedSeparableConv1D",
    "FusedSeparableConv2D",
]

IMPLEMENTATIONS = ("auto", "grouped", "per_model")


# -- Choosing the kernel ----------------------------------------------------


def _check_implementation(layer_class, implementation):
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"{layer_class} got an unknown `implementation`. Expected one of "
            f"{IMPLEMENTATIONS}. Received: implementation={implementation!r}. "
            "Use 'auto' to let the layer choose for the device."
        )
    return implementation


def _uses_grouped_kernel(implementation):
    if implementation == "auto":
        return runs_on_accelerator()
    return implementation == "grouped"


def _xla(function, *args):
    """Runs `function(*args)` compiled by XLA, which (unlike TensorFlow's CPU
    kernels) can differentiate grouped convolutions on every device."""
    return tf.function(function, jit_compile=True)(*args)


# -- The model axis and the channel axis -----------------------------------


def _fold(inputs, num_models, model_axis=1):
    """`[batch, B, *spatial, C]` (or `[B, batch, *spatial, C]` for
    `model_axis=0`) -> `[batch, *spatial, B * C]`, model `b`'s channels at
    `b * C : (b + 1) * C`."""
    if num_models == 1:
        # Moving an axis of size one is a reshape: no transpose to pay.
        return ops.squeeze(inputs, model_axis)
    inputs = ops.moveaxis(inputs, model_axis, -2)
    shape = ops.shape(inputs)
    return ops.reshape(inputs, (-1, *shape[1:-2], num_models * shape[-1]))


def _unfold(outputs, num_models, model_axis=1):
    """`[batch, *spatial, B * F]` -> `[batch, B, *spatial, F]` (or
    `[B, batch, *spatial, F]` for `model_axis=0`)."""
    if num_models == 1:
        return ops.expand_dims(outputs, model_axis)
    shape = ops.shape(outputs)
    outputs = ops.reshape(
        outputs, (-1, *shape[1:-1], num_models, shape[-1] // num_models))
    return ops.moveaxis(outputs, -2, model_axis)


def _models_into_axis(kernel, axis):
    """`[B, *k, i, o]` -> the stock-rank kernel whose axis `axis` (-1 or -2)
    holds the B kernels side by side: `[*k, i, B * o]` or `[*k, B * i, o]`."""
    kernel = ops.moveaxis(kernel, 0, axis - 1)
    shape = tuple(kernel.shape)
    if axis == -1:
        return ops.reshape(kernel, (*shape[:-2], shape[-2] * shape[-1]))
    return ops.reshape(kernel, (*shape[:-3], shape[-3] * shape[-2], shape[-1]))


def per_model_conv(inputs, kernel, implementation="auto", **arguments):
    """Model `b`'s inputs convolved with `kernel[b]`, for every `b`.

    `inputs` `[batch, B, *spatial, C]`, `kernel` `[B, *k, C, F]`; the
    result is `[batch, B, *spatial', F]`. `arguments` are `ops.conv`'s
    (`strides`, `padding`, `dilation_rate`; channels last). As the fused
    convolutions choose: one grouped convolution on a GPU or TPU, B
    convolutions on a CPU (`implementation`).
    """
    num_models = kernel.shape[0]
    if _uses_grouped_kernel(implementation):
        return _unfold(ops.conv(_fold(inputs, num_models),
                                _models_into_axis(kernel, -1), **arguments),
                       num_models)
    return ops.stack([ops.conv(inputs[:, b], kernel[b], **arguments)
                      for b in range(num_models)], axis=1)


def channels_last(layer_class, data_format):
    resolved = (keras.config.image_data_format() if data_format is None
                else data_format)
    if isinstance(resolved, str) and resolved.lower() == "channels_last":
        return "channels_last"
    source = (f", which keras.config.image_data_format() resolves to "
              f"{resolved!r}" if data_format is None else "")
    raise ValueError(
        f"{layer_class} supports only data_format='channels_last' (fused "
        "activations are [batch, num_models, *spatial, channels]). Received: "
        f"data_format={data_format!r}{source}. Pass "
        "data_format='channels_last' (and permute channels_first inputs, "
        "e.g. with keras.layers.Permute), or call "
        "keras.config.set_image_data_format('channels_last') before building "
        "the model."
    )


# -- What every fused convolution shares -----------------------------------


def is_convolution(layer):
    """Whether `layer` is a fused convolution of any family (plain,
    transposed, depthwise or separable)."""
    return isinstance(layer, _FusedConvolution)


class _FusedConvolution(FusedLayer):
    """Geometry, layout checks, bias and activation of fused convolutions.

    Subclasses (one per family) create the kernels in `build` and compute
    the convolution in `call`: per model with `_per_model`, or on the models
    folded into the channel axis, followed by `_add_folded_bias` and
    `_unfold`; then `_activate`.
    """

    supports_models_first = True
    # Per-model kernels unstack the model axis: views of the input with
    # the models first, copies with them second.
    prefers_models_first = True

    def __init__(self, num_models, rank, kernel_size, strides, padding,
                 data_format, dilation_rate, activation, use_bias,
                 bias_initializer, bias_regularizer, bias_constraint,
                 activity_regularizer, allow_causal=False, **kwargs):
        for arg in ("lora_rank", "lora_alpha"):
            value = kwargs.pop(arg, None)
            if value is not None:
                raise ValueError(
                    f"{type(self).__name__} does not support `{arg}`. "
                    f"Received: {arg}={value!r}. Fuse the model before "
                    "enabling LoRA on the exported per-model models."
                )
        super().__init__(
            num_models, activity_regularizer=activity_regularizer, **kwargs)
        self.rank = rank
        self.kernel_size = standardize_tuple(kernel_size, rank, "kernel_size")
        self.strides = standardize_tuple(strides, rank, "strides")
        self.dilation_rate = standardize_tuple(
            dilation_rate, rank, "dilation_rate")
        if not isinstance(padding, str):
            allowed = "'valid', 'same' or 'causal'" if allow_causal else (
                "'valid' or 'same'")
            raise ValueError(
                f"{type(self).__name__} takes `padding` as {allowed}, as the "
                "stock layer does on the TensorFlow backend. Received: "
                f"padding={padding!r}. Pad explicitly with a ZeroPadding "
                "layer and use padding='valid'."
            )
        self.padding = standardize_padding(padding, allow_causal=allow_causal)
        self.data_format = channels_last(type(self).__name__, data_format)
        self.activation = keras.activations.get(activation)
        self.use_bias = use_bias
        self.bias_initializer = keras.initializers.get(bias_initializer)
        self.bias_regularizer = keras.regularizers.get(bias_regularizer)
        self.bias_constraint = keras.constraints.get(bias_constraint)

    @classmethod
    def from_stock(cls, layer, num_models, **kwargs):
        # Checked here, as Keras's `from_config` turns errors into TypeErrors.
        if layer.data_format != "channels_last":
            raise ValueError(
                f"hftatf cannot fuse layer '{layer.name}' "
                f"({type(layer).__name__}) with data_format="
                f"{layer.data_format!r}: {cls.__name__} supports only "
                "'channels_last'. Build the stock model with "
                "data_format='channels_last' (or call keras.config."
                "set_image_data_format('channels_last') before building it)."
            )
        return super().from_stock(layer, num_models, **kwargs)

    def _check_strides_with_dilation(self):
        # As the stock layer: TensorFlow's convolutions refuse both at once.
        if max(self.strides) > 1 and max(self.dilation_rate) > 1:
            raise ValueError(
                "`strides > 1` not supported in conjunction with "
                f"`dilation_rate > 1`. Received: strides={self.strides} and "
                f"dilation_rate={self.dilation_rate}"
            )

    def _input_channels(self, input_shape):
        """Checks the `[batch, B, *spatial, C]` layout; returns `C`."""
        input_shape = tuple(input_shape)
        if len(input_shape) != self.rank + 3:
            spatial = ", ".join(f"spatial_{i}" for i in range(self.rank))
            raise ValueError(
                f"Layer '{self.name}' ({type(self).__name__}) expects inputs "
                f"of shape [batch, num_models, {spatial}, channels] (rank "
                f"{self.rank + 3}). Received input shape {input_shape}. Give "
                "the input its model axis at 1 (hftatf.fuse does, or use "
                "hftatf.layers.BroadcastToModels on a shared batch)."
            )
        check_model_axis(self.name, self.num_models, input_shape,
                         self.model_axis)
        channels = input_shape[-1]
        if channels is None:
            raise ValueError(
                f"Layer '{self.name}' needs a known channel axis (the last). "
                f"Received input shape {input_shape}."
            )
        self.input_spec = keras.layers.InputSpec(
            ndim=self.rank + 3,
            axes={self.model_axis: self.num_models, -1: channels})
        return channels

    def _add_bias(self, filters):
        self.bias = None
        if self.use_bias:
            self.bias = self.add_model_weight(
                (filters,),
                name="bias",
                initializer=self.bias_initializer,
                regularizer=self.bias_regularizer,
                constraint=self.bias_constraint,
            )

    def _per_model(self, convolution, inputs, *kernels, shared=False):
        """Model `b`'s stock convolution and bias on its own input slice,
        for every `b`: `convolution(x[:, b], *(k[b] for k in kernels))`,
        stacked on the model axis; on `x` itself for an input all models
        share (`shared`).

        The slices come from one `unstack` (and go back with one `stack`),
        whose gradients are one `stack` and one `unstack`: slicing `x[:, b]`
        B times would cost B gradients of the size of the whole input. An
        input stacked by a per-model layer gives its pieces instead
        (`split_models`): no copy either way.
        """
        per_kernel = [split_models(kernel, self.num_models, 0)
                      for kernel in kernels]
        biases = (split_models(self.bias, self.num_models, 0)
                  if self.bias is not None else [None] * self.num_models)
        outputs = []
        slices = ([inputs] * self.num_models if shared
                  else split_models(inputs, self.num_models, self.model_axis))
        for index, x in enumerate(slices):
            y = convolution(x, *(k[index] for k in per_kernel))
            if biases[index] is not None:
                bias = ops.reshape(biases[index],
                                   (1,) * (self.rank + 1) + (-1,))
                # An AddV2, not the stock layer's BiasAdd: TensorFlow's CPU
                # graph optimizer fuses a BiasAdd's gradient into a filter
                # gradient that reads the same output gradient, and where
                # the models' output gradients are the outputs of one op
                # (an unstack) it can pair them across models: the biases
                # then train with another model's gradient, in some
                # processes and not others. The bias's gradient is summed
                # by `add_bias_by_rows` instead.
                y = add_bias_by_rows(y, bias)
            outputs.append(y)
        return stack_models(outputs, self.model_axis)

    def _fold(self, inputs):
        """The input folded for one kernel over all models: `[batch,
        *spatial, B * C]`, from either layout."""
        return _fold(inputs, self.num_models, self.model_axis)

    def _unfold(self, outputs):
        """Folded outputs `[batch, *spatial, B * F]` in this layer's
        layout."""
        return _unfold(outputs, self.num_models, self.model_axis)

    def _add_folded_bias(self, outputs):
        """Adds the bias to outputs folded as `[batch, *spatial, B * F]`:
        model `b`'s bias lies on its own channels, so the `[B, F]` bias
        flattened is one stock bias."""
        if self.bias is None:
            return outputs
        return ops.add(outputs, ops.reshape(
            self.bias, (1,) * (self.rank + 1) + (-1,)))

    def _activate(self, outputs):
        if self.activation is None:
            return outputs
        return map_models(self.activation, outputs, self.num_models,
                          self.model_axis)

    def _conv_arguments(self, padding=None):
        return {
            "strides": self.strides,
            "padding": padding or self.padding,
            "dilation_rate": self.dilation_rate,
            "data_format": self.data_format,
        }

    def _per_model_shape(self, input_shape):
        return (input_shape[1 - self.model_axis], *input_shape[2:])

    def _fused_shape(self, shape):
        if self.models_first:
            return (self.num_models, *shape)
        return (shape[0], self.num_models, *shape[1:])

    def get_config(self):
        config = super().get_config()
        config.update({
            "kernel_size": self.kernel_size,
            "strides": self.strides,
            "padding": self.padding,
            "data_format": self.data_format,
            "dilation_rate": self.dilation_rate,
            "activation": keras.activations.serialize(self.activation),
            "use_bias": self.use_bias,
            "bias_initializer": keras.initializers.serialize(
                self.bias_initializer),
            "bias_regularizer": keras.regularizers.serialize(
                self.bias_regularizer),
            "bias_constraint": keras.constraints.serialize(
                self.bias_constraint),
        })
        return config


def _check_filters(filters):
    if filters is not None and filters <= 0:
        raise ValueError(
            "Invalid value for argument `filters`. Expected a strictly "
            f"positive value. Received filters={filters}."
        )


def _check_depth_multiplier(depth_multiplier):
    if depth_multiplier is not None and depth_multiplier <= 0:
        raise ValueError(
            "Invalid value for argument `depth_multiplier`. Expected a "
            "strictly positive value. Received "
            f"depth_multiplier={depth_multiplier}."
        )


# -- Convolutions -----------------------------------------------------------


class FusedBaseConv(_FusedConvolution):
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
                 implementation="auto", shared_input=False, **kwargs):
        super().__init__(
            num_models, rank, kernel_size, strides, padding, data_format,
            dilation_rate, activation, use_bias, bias_initializer,
            bias_regularizer, bias_constraint, activity_regularizer,
            allow_causal=rank == 1, **kwargs)
        self.filters = filters
        self.groups = groups
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.kernel_regularizer = keras.regularizers.get(kernel_regularizer)
        self.kernel_constraint = keras.constraints.get(kernel_constraint)
        self.implementation = _check_implementation(
            type(self).__name__, implementation)
        self.shared_input = bool(shared_input)
        _check_filters(filters)
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
        self.kernel = self.add_model_weight(
            (*self.kernel_size, channels // self.groups, self.filters),
            name="kernel",
            initializer=self.kernel_initializer,
            regularizer=self.kernel_regularizer,
            constraint=self.kernel_constraint,
        )
        self._add_bias(self.filters)

    def call(self, inputs):
        padding = self.padding
        if padding == "causal":
            # As stock Conv1D: pad on the left, then a valid convolution.
            left = self.dilation_rate[0] * (self.kernel_size[0] - 1)
            inputs = ops.pad(inputs, [[0, 0]] * (len(inputs.shape) - 2)
                             + [[left, 0], [0, 0]])
            padding = "valid"
        arguments = self._conv_arguments(padding)
        grouped = _uses_grouped_kernel(self.implementation)
        if self.shared_input and grouped:
            # Model b's filters at b*F .. b*F + F - 1 of one stock
            # convolution.
            outputs = self._unfold(self._add_folded_bias(ops.conv(
                inputs, _models_into_axis(self.kernel, -1), **arguments)))
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
                self._fold(inputs), _models_into_axis(self.kernel, -1),
                **arguments)))
        else:
            outputs = self._per_model(
                lambda x, kernel: ops.conv(x, kernel, **arguments),
                inputs, self.kernel)
        return self._activate(outputs)

    def compute_output_shape(self, input_shape):
        per_model = (tuple(input_shape) if self.shared_input
                     else self._per_model_shape(input_shape))
        return self._fused_shape(compute_conv_output_shape(
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
        return config


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
            num_models, 1, filters, kernel_size, strides=strides,
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
            num_models, 2, filters, kernel_size, strides=strides,
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
            num_models, 3, filters, kernel_size, strides=strides,
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


# -- Transposed convolutions ------------------------------------------------


class FusedBaseConvTranspose(_FusedConvolution):
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
            num_models, rank, kernel_size, strides, padding, data_format,
            dilation_rate, activation, use_bias, bias_initializer,
            bias_regularizer, bias_constraint, activity_regularizer, **kwargs)
        self.filters = filters
        self.output_padding = None if output_padding is None else (
            standardize_tuple(output_padding, rank, "output_padding",
                              allow_zero=True))
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.kernel_regularizer = keras.regularizers.get(kernel_regularizer)
        self.kernel_constraint = keras.constraints.get(kernel_constraint)
        self.implementation = _check_implementation(
            type(self).__name__, implementation)
        _check_filters(filters)
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
        if _uses_grouped_kernel(self.implementation):
            outputs = self._unfold(self._add_folded_bias(_xla(
                self._grouped_transpose, self._fold(inputs),
                _models_into_axis(self.kernel, -1))))
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
        shape = [size if size is not None else tf.shape(inputs)[i]
                 for i, size in enumerate(inputs.shape)]
        output_shape = compute_conv_transpose_output_shape(
            shape, self.kernel_size, self.num_models * self.filters,
            self.strides, self.padding, self.output_padding,
            self.data_format, self.dilation_rate)
        return tf.nn.conv_transpose(
            inputs, kernel, output_shape, list(self.strides),
            padding=self.padding.upper(), dilations=self.dilation_rate)

    def compute_output_shape(self, input_shape):
        return self._fused_shape(tuple(compute_conv_transpose_output_shape(
            self._per_model_shape(input_shape), self.kernel_size,
            self.filters, strides=self.strides, padding=self.padding,
            output_padding=self.output_padding, data_format=self.data_format,
            dilation_rate=self.dilation_rate)))

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
            num_models, 1, filters, kernel_size, strides=strides,
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
            num_models, 2, filters, kernel_size, strides=strides,
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
            num_models, 3, filters, kernel_size, strides=strides,
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


# -- Depthwise convolutions -------------------------------------------------


class FusedBaseDepthwiseConv(_FusedConvolution):
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
            num_models, rank, kernel_size, strides, padding, data_format,
            dilation_rate, activation, use_bias, bias_initializer,
            bias_regularizer, bias_constraint, activity_regularizer, **kwargs)
        self.depth_multiplier = depth_multiplier
        self.depthwise_initializer = keras.initializers.get(
            depthwise_initializer)
        self.depthwise_regularizer = keras.regularizers.get(
            depthwise_regularizer)
        self.depthwise_constraint = keras.constraints.get(
            depthwise_constraint)
        _check_depth_multiplier(depth_multiplier)

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
        if not runs_on_accelerator():
            return self._activate(self._per_model(
                lambda x, kernel: ops.depthwise_conv(x, kernel, **arguments),
                inputs, self.kernel))
        # Folded channel b*C + c yields outputs (b*C + c)*M + m: model b's
        # C*M outputs in the stock order, side by side.
        outputs = ops.depthwise_conv(
            self._fold(inputs), _models_into_axis(self.kernel, -2),
            **arguments)
        return self._activate(self._unfold(self._add_folded_bias(outputs)))

    def compute_output_shape(self, input_shape):
        return self._fused_shape(compute_conv_output_shape(
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
            num_models, 1, depth_multiplier, kernel_size, strides=strides,
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
            num_models, 2, depth_multiplier, kernel_size, strides=strides,
            padding=padding, data_format=data_format,
            dilation_rate=dilation_rate, activation=activation,
            use_bias=use_bias, depthwise_initializer=depthwise_initializer,
            bias_initializer=bias_initializer,
            depthwise_regularizer=depthwise_regularizer,
            bias_regularizer=bias_regularizer,
            activity_regularizer=activity_regularizer,
            depthwise_constraint=depthwise_constraint,
            bias_constraint=bias_constraint, **kwargs)


# -- Separable convolutions -------------------------------------------------


class FusedBaseSeparableConv(_FusedConvolution):
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
            num_models, rank, kernel_size, strides, padding, data_format,
            dilation_rate, activation, use_bias, bias_initializer,
            bias_regularizer, bias_constraint, activity_regularizer, **kwargs)
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
        _check_depth_multiplier(depth_multiplier)
        _check_filters(filters)

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
        if not runs_on_accelerator():
            # On CPU the stock separable convolution of each model costs
            # no more than the folded form and needs no transposes.
            return self._activate(self._per_model(
                lambda x, depthwise, pointwise: ops.separable_conv(
                    x, depthwise, pointwise, **self._conv_arguments()),
                inputs, self.depthwise_kernel, self.pointwise_kernel))
        depthwise = ops.depthwise_conv(
            self._fold(inputs),
            _models_into_axis(self.depthwise_kernel, -2),
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
        return self._fused_shape(compute_conv_output_shape(
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
            num_models, 1, depth_multiplier, filters, kernel_size,
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
            num_models, 2, depth_multiplier, filters, kernel_size,
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
