"""Fused dense layers."""

import math

import keras
from keras import ops

from hftatf.api import hftatf_export
from hftatf.core.axis import (
    pieces_if_stacked,
    rearranged,
    repeat_models,
    split_models,
    stack_models,
)
from hftatf.core.validation import check_model_axis
from hftatf.layers import registry
from hftatf.layers.backends import compiling_with_xla
from hftatf.layers.base import FusedLayer
from hftatf.layers.kernels import add_bias_by_rows, as_one_sample, batch_matmul
from hftatf.layers.lora import LoraLayer, lora_property


def products_models_first(input_shape, num_models, size_in, size_out,
                          contracted=1):
    """Whether `per_model_matmul` computes inputs of `input_shape` (`[batch,
    B, *positions, *contracted axes]`) and a `[B, in, out]` kernel with the
    models moved first, between two transposes (see there)."""
    if num_models == 1:
        return False
    xla = compiling_with_xla()
    # A tuple: an empty TensorShape is true (its rank is known).
    positions = tuple(input_shape)[2:len(input_shape) - contracted]
    if not positions:
        return not xla
    if xla or None in positions:
        return True
    rows = math.prod(positions)
    return size_in * size_out > rows * (size_in + size_out)


def per_model_matmul(inputs, kernel, bias=None, activation=None,
                     contracted=1, output_dims=None, models_first=False):
    """`activation(x[:, b] @ kernel[b] + bias[b])` for every model `b`.

    Args:
        inputs: `[batch, B, *positions, *contracted axes]`, or `[B, batch,
            ...]` with `models_first`.
        kernel: `[B, in, out]`, `in` the size of the contracted axes.
        bias: None, or `[B, *t]` with `t` broadcasting from the right
            against one model's output `[*positions, *output_dims]`.
        activation: None or an elementwise function.
        contracted: how many trailing input axes the product contracts.
        output_dims: the trailing output axes `out` is reshaped to
            (default `(out,)`).
        models_first: whether inputs and outputs have the models first.

    Returns `[batch, B, *positions, *output_dims]` (`[B, batch, ...]` with
    `models_first`), each row exactly the stock product of that row and
    the model's kernel, plus its bias.

    The formulation is chosen for the kernels that will run it:

    * one model: the stock layer's computation on `x[:, 0]`;
    * inputs stacked by per-model layers, in a traced graph without XLA
      (`pieces_if_stacked`): each model's stock product on its own piece,
      stacked, so that the stacked input is never computed;
    * inputs with the models first: one batched matmul of each model's
      rows, `[B, rows, in] @ [B, in, out]`, without a transpose (on
      TensorFlow's Eigen kernel where it is small, see `batch_matmul`);
    * under XLA, inputs `[batch, B, in]`: one einsum (one batched matmul);
    * for TensorFlow's own kernels, inputs `[batch, B, in]`: one batched
      matmul between explicit transposes (its einsum kernel does the same
      transposes, more slowly);
    * inputs with positions (`[batch, B, S, in]`, `S` rows per sample and
      model): for TensorFlow's own kernels, where the kernel is small,
      `in * out <= S * (in + out)`, a broadcasting batched matmul (`B x
      batch` products `[S, in] @ [in, out]`: no copies, but a kernel
      gradient of `batch x in x out` per model, smaller than the
      activations); else the models moved first, `[B, batch * S, in]`, and
      one batched matmul between two transposes. Under XLA always the
      latter: XLA's CPU lowering of the einsum `bmsi,mio->bmso` (and of
      its gradients) is about 2x slower. Without XLA, with the products of
      a BERT-mini array of 8 (`[64, 8, 64, 256] @ [8, 256, 1024]`, with
      gradients), the transposes took 179 ms of processor time against
      248 ms for each model's product on its own `unstack`ed slice and 224
      ms broadcast.

    Between two transposes, everything elementwise (bias, activation) runs
    with the models first, and each transpose is the first or last op on
    the tensor it moves. So where one product's output goes straight into
    the next (a Dense with its activation into a Dense, a projection into
    attention's fold), TensorFlow's graph optimizer (and XLA) cancel the
    transpose back against the next transpose forth, in the gradients too:
    consecutive products keep the models-first layout without a copy.
    """
    num_models, size_in, size_out = kernel.shape
    output_dims = tuple(output_dims or (size_out,))
    rank = len(inputs.shape)
    kept = rank - 2 - contracted
    axis = 0 if models_first else 1
    if num_models == 1:
        # TensorFlow's oneDNN batched matmul also crashes on CPU when every
        # batch axis of the kernel broadcasts, as `[1, 1, in, out]` would.
        # Reshapes, not `kernel[0]`: a slice's gradient is a zero-filled
        # copy, a reshape's a reshape.
        outputs = _one_model_product(
            ops.squeeze(inputs, axis),
            ops.reshape(kernel, (size_in, size_out)),
            None if bias is None else ops.reshape(bias, bias.shape[1:]),
            activation, kept, output_dims, stock_bias=True)
        return rearranged(lambda t: ops.expand_dims(t, axis), outputs)
    pieces = None if compiling_with_xla() else pieces_if_stacked(
        inputs, num_models, axis)
    if pieces is not None:
        # Stacked from B per-model tensors (a per-model layer's outputs):
        # each model's stock product on its own piece, restacked for the
        # next layer, which may read the pieces in turn. The stacked input
        # is then never computed, nor its gradient unstacked.
        kernels = split_models(kernel, num_models, 0)
        biases = (split_models(bias, num_models, 0) if bias is not None
                  else [None] * num_models)
        return stack_models([
            _one_model_product(*arguments, activation, kept, output_dims)
            for arguments in zip(pieces, kernels, biases)], axis)
    shape = ops.shape(inputs)
    if bias is not None:
        # [B, *t] -> [B, 1, ..., 1, *t]: one model's full output rank.
        bias = ops.reshape(bias, (
            num_models, *(1,) * (kept + len(output_dims) + 1 - len(bias.shape)),
            *bias.shape[1:]))

    def activate(outputs):
        return outputs if activation is None else activation(outputs)

    if models_first:
        return activate(_models_first_products(inputs, kernel, bias,
                                               contracted, output_dims))
    if not products_models_first(inputs.shape, num_models, size_in, size_out,
                                 contracted):
        if kept:
            outputs = ops.matmul(
                ops.reshape(inputs, (shape[0], num_models, -1, size_in)),
                ops.expand_dims(kernel, 0))
        else:  # [batch, B, in] under XLA
            outputs = ops.einsum(
                "bmi,mio->bmo",
                ops.reshape(inputs, (shape[0], num_models, size_in)), kernel)
        outputs = ops.reshape(outputs, (*shape[:2 + kept], *output_dims))
        if bias is not None:
            # `+`, not ops.add, whose TensorFlow bias_add shortcut picks the
            # axis from the shapes alone.
            outputs = outputs + as_one_sample(bias, outputs)
        return activate(outputs)
    swap = (1, 0, *range(2, rank))
    outputs = activate(_models_first_products(
        ops.transpose(inputs, swap), kernel, bias, contracted, output_dims))
    return rearranged(
        lambda t: ops.transpose(t, (1, 0, *range(2, len(t.shape)))), outputs)


def _one_model_product(inputs, kernel, bias, activation, kept, output_dims,
                        stock_bias=False):
    """One model's product, the stock layer's: `inputs` `[batch, *positions,
    *contracted axes]` (the model axis dropped), `kernel` `[in, out]`, `bias`
    None or `[*t]`. The bias is added as the stock layers add theirs where
    `stock_bias`, else as the per-model convolutions add theirs,
    with `+` (an `AddV2`) and `add_bias_by_rows` (see
    `_FusedConvolution._per_model`)."""
    shape = ops.shape(inputs)
    rows = shape[:1 + kept]
    outputs = ops.matmul(ops.reshape(inputs, (*rows, kernel.shape[0])),
                         kernel)
    outputs = ops.reshape(outputs, (*rows, *output_dims))
    if bias is not None:
        if stock_bias:
            outputs = ops.add(outputs, bias)
        else:
            outputs = add_bias_by_rows(outputs, ops.reshape(
                bias, (1,) * (len(outputs.shape) - len(bias.shape))
                + tuple(bias.shape)))
    return outputs if activation is None else activation(outputs)


def _models_first_products(moved, kernel, bias, contracted, output_dims):
    """The products of `moved` (`[B, batch, ...]`) and `kernel`, plus
    `bias` (`[B, 1, ..., 1, *t]` of one model's full output rank, or None;
    `add_bias_by_rows`)."""
    num_models, size_in, _ = kernel.shape
    kept = len(moved.shape) - 2 - contracted
    # Shapes of the moved tensor, not of the caller's: where a transpose
    # into this layout cancels, so does everything that read it.
    moved_shape = ops.shape(moved)
    outputs = batch_matmul(ops.reshape(moved, (num_models, -1, size_in)),
                           kernel)
    outputs = ops.reshape(outputs, (num_models, *moved_shape[1:2 + kept],
                                    *output_dims))
    if bias is not None:
        outputs = add_bias_by_rows(outputs, ops.expand_dims(bias, 1),
                                   models=1)
    return outputs


def shared_matmul(inputs, kernel, bias=None):
    """`x @ kernel[b] + bias[b]` for every model `b` on one input batch all
    models share: `[batch, ..., in]`, `[B, in, out]` and `[B, out]` (or
    None) -> `[batch, B, ..., out]`.

    For TensorFlow's own kernels the B kernels side by side are one wide
    stock kernel `[in, B * out]`: one matmul (and one for the kernels'
    gradient), where the per-model form would first copy the input once
    per model. Under XLA, the per-model product of the input broadcast to
    every model (XLA does not materialise the broadcast). Each output is
    the stock product of the input and that model's kernel.
    """
    num_models, size_in, size_out = kernel.shape
    shape = ops.shape(inputs)
    if compiling_with_xla():
        # XLA fuses a broadcast into the per-model product, which it
        # compiles faster than the wide one (an MLP array of 8: 1.67 ms
        # against 1.91 ms of processor time per step).
        return per_model_matmul(
            ops.broadcast_to(ops.expand_dims(inputs, 1),
                             (shape[0], num_models, *shape[1:])),
            kernel, bias)
    if num_models > 1:
        kernel = ops.transpose(kernel, (1, 0, 2))
    wide = ops.reshape(kernel, (size_in, num_models * size_out))
    outputs = ops.matmul(inputs, wide)
    if bias is not None:
        outputs = ops.add(outputs, ops.reshape(bias, (-1,)))
    outputs = ops.reshape(outputs, (*shape[:-1], num_models, size_out))
    return ops.moveaxis(outputs, -2, 1) if len(inputs.shape) > 2 else outputs


def _models_first(equation):
    """A fused einsum equation (`"aMbc,Mcd->aMbd"`: the model letter after
    the batch letter of the input and output, first in the kernel) for the
    input and output with their first two axes swapped
    (`"Mabc,Mcd->Mabd"`)."""
    operands, output = equation.split("->")
    inputs, kernel = operands.split(",")
    return (f"{inputs[1]}{inputs[0]}{inputs[2:]},{kernel}->"
            f"{output[1]}{output[0]}{output[2:]}")


@hftatf_export
@registry.register(keras.layers.Dense)
class FusedDense(LoraLayer, FusedLayer):
    """`keras.layers.Dense` for an array of `num_models` models.

    Layout:
        input: `[batch, B, ..., in_features]` (model `b` reads `x[:, b]`).
        output: `[batch, B, ..., units]`.
        kernel: `[B, in_features, units]`; bias: `[B, units]`.

    Model `b` computes `activation(x[:, b] @ kernel[b] + bias[b])`, exactly
    the stock layer with weights `(kernel[b], bias[b])`. Each kernel slice is
    initialised as a separate stock `Dense` would be (its own seed, fans of
    `[in_features, units]`). Masks pass through unchanged, as in the stock
    layer.

    With `shared_input=True` the input is one batch that every model reads,
    `[batch, ..., in_features]` (no model axis), computed without a copy
    per model by `shared_matmul` (for TensorFlow's kernels one wide stock
    Dense of `B * units`). `hftatf.fuse` builds the first Dense after a
    shared input this way.

    With `models_first=True` activations have the models first (`[B,
    batch, ..., in_features]` -> `[B, batch, ..., units]`; the output
    alone with `shared_input`), and each model's rows are one product
    without a transpose. `hftatf.fuse` builds a Dense this way where its
    input has the models first (after a convolution, on a CPU).

    Args:
        num_models: the number of models `B` in the array.
        units, activation, use_bias, kernel_initializer, bias_initializer,
        kernel_regularizer, bias_regularizer, activity_regularizer,
        kernel_constraint, bias_constraint: as in `keras.layers.Dense`;
            regularizers and constraints apply to each model's slice.
        lora_rank, lora_alpha: as in `keras.layers.Dense`: LoRA enabled
            when the layer is built, each model with its own factors
            (`hftatf.layers.lora`; `enable_lora` enables it later).
        quantization_config: accepted for signature parity with
            `keras.layers.Dense`; must be `None` (quantization is not
            supported in arrays).
        shared_input: whether the input is one batch shared by all models
            (`[batch, ..., in_features]`) rather than `[batch, B, ...]`.
        models_first: whether activations have the models first.
    """

    supports_models_first = True

    def __init__(
        self,
        num_models,
        units,
        activation=None,
        use_bias=True,
        kernel_initializer="glorot_uniform",
        bias_initializer="zeros",
        kernel_regularizer=None,
        bias_regularizer=None,
        activity_regularizer=None,
        kernel_constraint=None,
        bias_constraint=None,
        lora_rank=None,
        lora_alpha=None,
        quantization_config=None,
        shared_input=False,
        **kwargs,
    ):
        super().__init__(
            num_models, activity_regularizer=activity_regularizer, **kwargs
        )
        if isinstance(units, bool) or not isinstance(units, int) or units <= 0:
            raise ValueError(
                "Received an invalid value for `units`, expected a positive "
                f"integer. Received: units={units!r}"
            )
        if quantization_config is not None:
            raise ValueError(
                "FusedDense does not support `quantization_config`. "
                f"Received: quantization_config={quantization_config!r}. "
                "Quantize the exported per-model models instead.")
        self.init_lora(lora_rank, lora_alpha)
        self.units = units
        self.activation = keras.activations.get(activation)
        self.use_bias = use_bias
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.bias_initializer = keras.initializers.get(bias_initializer)
        self.kernel_regularizer = keras.regularizers.get(kernel_regularizer)
        self.bias_regularizer = keras.regularizers.get(bias_regularizer)
        self.kernel_constraint = keras.constraints.get(kernel_constraint)
        self.bias_constraint = keras.constraints.get(bias_constraint)
        self.shared_input = bool(shared_input)
        self.input_spec = keras.layers.InputSpec(
            min_ndim=2 if self.shared_input else 3)
        self.supports_masking = True

    @classmethod
    def fuses_shared_input(cls, layer):
        return True

    def build(self, input_shape):
        if self.shared_input:
            self.input_spec = keras.layers.InputSpec(
                min_ndim=2, axes={-1: input_shape[-1]})
        else:
            check_model_axis(self.name, self.num_models, input_shape,
                             self.model_axis)
            self.input_spec = keras.layers.InputSpec(
                min_ndim=3, axes={self.model_axis: self.num_models,
                                  -1: input_shape[-1]})
        self._kernel = self.add_model_weight(
            (input_shape[-1], self.units),
            name="kernel",
            initializer=self.kernel_initializer,
            regularizer=self.kernel_regularizer,
            constraint=self.kernel_constraint,
        )
        self.bias = None
        if self.use_bias:
            self.bias = self.add_model_weight(
                (self.units,),
                name="bias",
                initializer=self.bias_initializer,
                regularizer=self.bias_regularizer,
                constraint=self.bias_constraint,
            )
        self.build_lora()

    kernel = lora_property("kernel")

    def call(self, inputs, training=None):
        if not self.shared_input:
            return per_model_matmul(inputs, self.kernel, self.bias,
                                    activation=self.activation,
                                    models_first=self.models_first)
        outputs = shared_matmul(inputs, self.kernel, self.bias)
        if self.activation is not None:
            outputs = self.activation(outputs)
        return ops.swapaxes(outputs, 0, 1) if self.models_first else outputs

    def compute_output_shape(self, input_shape):
        if self.shared_input:
            shape = (input_shape[0], self.num_models, *input_shape[1:-1],
                     self.units)
            return (shape[1], shape[0], *shape[2:]) if self.models_first \
                else shape
        return (*input_shape[:-1], self.units)

    def compute_mask(self, inputs, mask=None):
        if mask is not None and self.shared_input:
            # As BroadcastToModels gives a shared input's mask to every model.
            mask = repeat_models(mask, self.num_models)
            return ops.swapaxes(mask, 0, 1) if self.models_first else mask
        return mask

    def get_config(self):
        config = super().get_config()
        config.update({
            "units": self.units,
            "activation": keras.activations.serialize(self.activation),
            "use_bias": self.use_bias,
            "kernel_initializer": keras.initializers.serialize(
                self.kernel_initializer),
            "bias_initializer": keras.initializers.serialize(
                self.bias_initializer),
            "kernel_regularizer": keras.regularizers.serialize(
                self.kernel_regularizer),
            "bias_regularizer": keras.regularizers.serialize(
                self.bias_regularizer),
            "kernel_constraint": keras.constraints.serialize(
                self.kernel_constraint),
            "bias_constraint": keras.constraints.serialize(
                self.bias_constraint),
            "shared_input": self.shared_input,
        })
        return self.with_lora_config(config)


# The three equation forms of `keras.layers.EinsumDense`: no ellipsis, an
# ellipsis leading input and output, or one trailing them.
