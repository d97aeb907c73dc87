"""What every fused convolution shares: the kernel choice, the model
axis folded into the channel axis, geometry, bias and activation.

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
from keras import ops

from hftatf.core import compat
from hftatf.core.axis import map_models, split_models, stack_models
from hftatf.core.validation import check_model_axis
from hftatf.layers.backends import runs_on_accelerator
from hftatf.layers.base import FusedLayer
from hftatf.layers.kernels import add_bias_by_rows

IMPLEMENTATIONS = ("auto", "grouped", "per_model")


# -- Choosing the kernel ----------------------------------------------------


def check_implementation(layer_class, implementation):
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"{layer_class} got an unknown `implementation`. Expected one of "
            f"{IMPLEMENTATIONS}. Received: implementation={implementation!r}. "
            "Use 'auto' to let the layer choose for the device."
        )
    return implementation


def folds_models(implementation="auto"):
    """Whether a fused convolution computes on the models folded into the
    channel axis (one grouped, depthwise or separable convolution) rather
    than once per model: as `implementation` says, or by the device rule
    for `"auto"` (GPUs and TPUs fold; see the module docstring)."""
    if implementation == "auto":
        return runs_on_accelerator()
    return implementation == "grouped"


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


def models_into_axis(kernel, axis):
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
    if folds_models(implementation):
        return _unfold(ops.conv(_fold(inputs, num_models),
                                models_into_axis(kernel, -1), **arguments),
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
    return isinstance(layer, FusedConvolutionBase)


class FusedConvolutionBase(FusedLayer):
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

    def __init__(self, num_models, *, rank, kernel_size, strides, padding,
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
        self.kernel_size = compat.standardize_tuple(
            kernel_size, rank, "kernel_size")
        self.strides = compat.standardize_tuple(strides, rank, "strides")
        self.dilation_rate = compat.standardize_tuple(
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
        self.padding = compat.standardize_padding(
            padding, allow_causal=allow_causal)
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


def check_filters(filters):
    if filters is not None and filters <= 0:
        raise ValueError(
            "Invalid value for argument `filters`. Expected a strictly "
            f"positive value. Received filters={filters}."
        )


def check_depth_multiplier(depth_multiplier):
    if depth_multiplier is not None and depth_multiplier <= 0:
        raise ValueError(
            "Invalid value for argument `depth_multiplier`. Expected a "
            "strictly positive value. Received "
            f"depth_multiplier={depth_multiplier}."
        )
