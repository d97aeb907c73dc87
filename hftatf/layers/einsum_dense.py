"""Fused `EinsumDense`: the stock equation with a model axis added."""

import math
import re
import string

import keras
from keras import ops

from hftatf.api import hftatf_export
from hftatf.core.validation import check_model_axis
from hftatf.layers import registry
from hftatf.layers.backends import adds_vectors_as_biases, compiling_with_xla
from hftatf.layers.base import FusedLayer
from hftatf.layers.dense import (
    _models_first,
    per_model_matmul,
    products_models_first,
)
from hftatf.layers.kernels import as_one_sample
from hftatf.layers.lora import LoraLayer, lora_property

_EINSUM_FORMS = (
    ("plain", re.compile(r"([a-zA-Z]+),([a-zA-Z]+)->([a-zA-Z]+)")),
    ("left", re.compile(
        r"\.\.\.([a-zA-Z]+),([a-zA-Z]+)->\.\.\.([a-zA-Z]+)")),
    ("right", re.compile(
        r"([a-zA-Z]{2,})\.\.\.,([a-zA-Z]+)->([a-zA-Z]+)\.\.\.")),
)


def _split_einsum_equation(equation):
    """Returns `(form, input_spec, kernel_spec, output_spec)` of a stock
    `EinsumDense` equation, or raises a ValueError."""
    if isinstance(equation, str):
        for form, pattern in _EINSUM_FORMS:
            match = pattern.fullmatch(equation)
            if match:
                return (form, *match.groups())
    raise ValueError(
        f"Invalid einsum equation {equation!r}. Equations must be in the form "
        "[X],[Y]->[Z], ...[X],[Y]->...[Z], or [X]...,[Y]->[Z]..., as for "
        "keras.layers.EinsumDense; e.g. 'ab,bc->ac' or '...b,bc->...c'."
    )


class _EinsumPlan:
    """The fused computation of a stock `EinsumDense` equation for per-model
    inputs of a given shape.

    The ellipsis, if any, is spelled out with fresh letters (its length is
    known from the input rank), so the model axis can be placed after the
    batch letter in the input and output and in front of the kernel.

    Attributes:
        equation: the fused einsum equation (input `[batch, B, ...]`, kernel
            `[B, *kernel_shape]`).
        kernel_shape, bias_shape: the stock weight shapes (`bias_shape` is
            `None` without `bias_axes`).
        bias_start: the per-model output axis where the bias starts.
        output_shape: the stock (per-model) output shape.
        input_axes, output_axes: the kernel axes that count as fan-in and
            fan-out, as the stock layer gives them to its initializer.
    """

    def __init__(self, equation, bias_axes, input_shape, partial_output_shape):
        form, input_spec, kernel_spec, output_spec = _split_einsum_equation(
            equation)
        rank = len(input_shape)
        elided = rank - len(input_spec)
        if elided < 0 or (form == "plain" and elided):
            raise ValueError(
                f"Einsum equation {equation!r} expects per-model inputs of "
                f"rank {len(input_spec)}{' or more' if form != 'plain' else ''}"
                f". Received per-model input shape {tuple(input_shape)}.")
        fresh = iter(c for c in string.ascii_letters if c not in equation)
        ellipsis = "".join(next(fresh) for _ in range(elided))
        inputs, outputs = input_spec, output_spec
        if form == "left":
            inputs, outputs = ellipsis + input_spec, ellipsis + output_spec
        elif form == "right":
            inputs, outputs = input_spec + ellipsis, output_spec + ellipsis
        batch = inputs[0]
        if outputs[0] != batch or batch in kernel_spec:
            raise ValueError(
                f"Einsum equation {equation!r} must keep the batch axis: the "
                f"first input axis ('{batch}') must be the first output axis "
                "and must not be in the kernel, since the model axis of an "
                "array is placed right after it.")
        for dim in output_spec:
            if dim not in input_spec and dim not in kernel_spec:
                raise ValueError(
                    f"Dimension '{dim}' was specified in the output "
                    f"'{output_spec}' but has no corresponding dim in the "
                    f"input spec '{input_spec}' or weight spec "
                    f"'{kernel_spec}'.")
        # `output_shape` names every output axis but the batch axis and the
        # ellipsis, as in the stock layer.
        named = [dim for dim in outputs[1:] if dim not in ellipsis]
        if len(partial_output_shape) != len(named):
            raise ValueError(
                f"Einsum equation {equation!r} needs an `output_shape` of "
                f"{len(named)} dimension(s) (for output axes '"
                f"{''.join(named)}'). Received: "
                f"output_shape={tuple(partial_output_shape)}.")
        sizes = dict(zip(inputs, input_shape))
        for dim, size in zip(named, partial_output_shape):
            if dim not in sizes or sizes[dim] is None:
                sizes[dim] = size
            elif size is not None and size != sizes[dim]:
                raise ValueError(
                    "Input shape and output shape do not match at shared "
                    f"dimension '{dim}'. Input shape is {sizes[dim]}, and "
                    f"output shape is {size}.")
        self.kernel_shape, self.input_axes, self.output_axes = [], [], []
        for axis, dim in enumerate(kernel_spec):
            if dim in outputs:
                self.output_axes.append(axis)
            elif dim in inputs:
                self.input_axes.append(axis)
            else:
                raise ValueError(
                    f"Weight dimension '{dim}' did not have a match in "
                    f"either the input spec '{input_spec}' or the output "
                    f"spec '{output_spec}'. For this layer, the weight must "
                    "be fully specified.")
            if sizes[dim] is None:
                raise ValueError(
                    f"The size of kernel dimension '{dim}' of einsum "
                    f"equation {equation!r} is unknown. Give it in "
                    "`output_shape` or in the input shape.")
            self.kernel_shape.append(sizes[dim])
        self.bias_shape, self.bias_start = None, None
        if bias_axes is not None:
            self._plan_bias(bias_axes, outputs, output_spec, sizes)
        self.output_shape = (input_shape[0],
                             *(sizes[dim] for dim in outputs[1:]))
        model = next(fresh)
        self.equation = (f"{batch}{model}{inputs[1:]},{model}{kernel_spec}->"
                         f"{batch}{model}{outputs[1:]}")
        self.matmul = _matmul_form(inputs, kernel_spec, outputs,
                                   self.kernel_shape)

    def _plan_bias(self, bias_axes, outputs, output_spec, sizes):
        for dim in bias_axes:
            if dim not in output_spec:
                raise ValueError(
                    f"Bias dimension '{dim}' was requested, but is not part "
                    f"of the output spec '{output_spec}'")
        if not bias_axes or outputs[0] in bias_axes:
            raise ValueError(
                "`bias_axes` must name one or more output axes other than "
                f"the batch axis ('{outputs[0]}'). Received: "
                f"bias_axes={bias_axes!r}.")
        # As in the stock layer: the bias spans the output axes from its
        # first axis on, with size 1 on the axes it does not name.
        self.bias_start = min(outputs.index(dim) for dim in bias_axes)
        self.bias_shape = [sizes[dim] if dim in bias_axes else 1
                           for dim in outputs[self.bias_start:]]
        if None in self.bias_shape:
            raise ValueError(
                f"The size of a bias dimension ('{bias_axes}') is unknown. "
                "Give it in `output_shape` or in the input shape.")


def _stock_bias_layout(output_shape, bias_shape):
    """The per-model layout in which the stock `EinsumDense` adds its bias
    of `bias_shape` to outputs of `output_shape` (batch axis first), where
    that is not plain broadcasting; else None.

    The stock layer adds with `keras.ops.add`, whose TensorFlow version
    takes a bias that squeezes to one axis of size `n` for
    `tf.nn.bias_add`: on the last output axis if its size is `n`, else on
    the first axis after the batch axis if that one's is. So a bias on
    another axis of the same size (`abc,cde->abde` with `bias_axes="d"`
    and `d == e`) is added on the last axis. An array must compute what
    the stock layer computes, and what each model computes after export.
    Other backends broadcast (`adds_vectors_as_biases`).
    """
    squeezed = [size for size in bias_shape if size is None or size > 1]
    if (not adds_vectors_as_biases() or len(squeezed) != 1
            or squeezed[0] is None
            or squeezed[0] not in (output_shape[1], output_shape[-1])):
        return None
    inner = (1,) * (len(output_shape) - 2)
    if output_shape[-1] == squeezed[0]:
        return (*inner, squeezed[0])
    return (squeezed[0], *inner)


def _matmul_form(inputs, kernel_spec, outputs, kernel_shape):
    """How an `EinsumDense` equation is a plain matmul, or None.

    It is one when the kernel's first axes are the input's last axes, in
    order, and the output is the input's other axes followed by the
    kernel's other axes (e.g. `"abc,cde->abde"`, `"abcd,cde->abe"`, the
    projections of multi-head attention). Then the product is
    `x.reshape(..., in) @ kernel.reshape(in, out)`, reshaped back.

    Returns:
        `(contracted, size_in, size_out, output_dims)`: the number of
        contracted (trailing input) axes, their total size, the total size
        of the kernel's output axes, and those axes' sizes.
    """
    for contracted in range(1, len(kernel_spec) + 1):
        kept = len(inputs) - contracted
        if (kept >= 1 and inputs[kept:] == kernel_spec[:contracted]
                and outputs == inputs[:kept] + kernel_spec[contracted:]):
            output_dims = tuple(kernel_shape[contracted:])
            return (contracted, math.prod(kernel_shape[:contracted]),
                    math.prod(output_dims), output_dims)
    return None


def _with_fan_axes(initializer, input_axes, output_axes):
    """The stock `EinsumDense` tells a `VarianceScaling` kernel initializer
    which kernel axes are fan-in and fan-out; so does its fused form, per
    slice."""
    if not isinstance(initializer, keras.initializers.VarianceScaling) or (
            initializer.input_axes is not None
            and initializer.output_axes is not None):
        return initializer
    config = initializer.get_config()
    config.update(seed=initializer.seed, input_axes=input_axes,
                  output_axes=output_axes)
    return type(initializer).from_config(config)


@hftatf_export
@registry.register(keras.layers.EinsumDense)
class FusedEinsumDense(LoraLayer, FusedLayer):
    """`keras.layers.EinsumDense` for an array of `num_models` models.

    The stock equation is rewritten with a model axis: a fresh letter after
    the batch letter of the input and output, and in front of the kernel
    (an ellipsis is spelled out for the input rank the layer is built for).
    E.g. `"ab,bc->ac"` becomes `"amb,mbc->amc"`, and `"...b,bc->...c"` on
    per-model inputs `[batch, T, b]` becomes `"xmyb,mbc->xmyc"`.

    Layout:
        input: `[batch, B, *stock input shape without batch]`; model `b`
            reads `x[:, b]`, which has the stock layer's input rank.
        output: `[batch, B, *stock output shape without batch]`.
        kernel: `[B, *stock kernel shape]`; bias: `[B, *stock bias shape]`.

    Model `b` computes what the stock layer computes with weights
    `(kernel[b], bias[b])` on `x[:, b]`. Each kernel slice is initialised as
    a separate stock `EinsumDense` would be (its own seed, the fan axes the
    stock layer derives from the equation).

    Args:
        num_models: the number of models `B` in the array.
        equation, output_shape, activation, bias_axes, kernel_initializer,
        bias_initializer, kernel_regularizer, bias_regularizer,
        activity_regularizer, kernel_constraint, bias_constraint: as in
            `keras.layers.EinsumDense` (`output_shape` excludes the batch
            axis, the model axis and the ellipsis); regularizers and
            constraints apply to each model's slice.
        lora_rank, lora_alpha: as in `keras.layers.EinsumDense`: LoRA
            enabled when the layer is built, each model with its own
            factors (`hftatf.layers.lora`; `enable_lora` enables it later).
        gptq_unpacked_column_size, quantization_config: accepted for
            signature parity with `keras.layers.EinsumDense`; must be `None`
            (quantization is not supported in arrays).
    """

    def __init__(
        self,
        num_models,
        equation,
        output_shape,
        activation=None,
        bias_axes=None,
        kernel_initializer="glorot_uniform",
        bias_initializer="zeros",
        kernel_regularizer=None,
        bias_regularizer=None,
        kernel_constraint=None,
        bias_constraint=None,
        lora_rank=None,
        lora_alpha=None,
        gptq_unpacked_column_size=None,
        quantization_config=None,
        **kwargs,
    ):
        super().__init__(num_models, **kwargs)
        for arg, value in (
                ("gptq_unpacked_column_size", gptq_unpacked_column_size),
                ("quantization_config", quantization_config)):
            if value:
                raise ValueError(
                    f"FusedEinsumDense does not support `{arg}`. Received: "
                    f"{arg}={value!r}. Quantize the exported per-model "
                    "models instead.")
        if self.dtype_policy.quantization_mode is not None:
            raise ValueError(
                "FusedEinsumDense does not support quantized dtype policies. "
                f"Received: dtype={self.dtype_policy.name!r}. Use a float "
                "dtype policy.")
        self.init_lora(lora_rank, lora_alpha)
        _split_einsum_equation(equation)
        self.equation = equation
        if isinstance(output_shape, int):
            self.partial_output_shape = (output_shape,)
        else:
            self.partial_output_shape = tuple(output_shape)
        self.bias_axes = bias_axes
        self.activation = keras.activations.get(activation)
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.bias_initializer = keras.initializers.get(bias_initializer)
        self.kernel_regularizer = keras.regularizers.get(kernel_regularizer)
        self.bias_regularizer = keras.regularizers.get(bias_regularizer)
        self.kernel_constraint = keras.constraints.get(kernel_constraint)
        self.bias_constraint = keras.constraints.get(bias_constraint)

    def _plan(self, input_shape):
        check_model_axis(self.name, self.num_models, input_shape)
        per_model = (input_shape[0], *input_shape[2:])
        return _EinsumPlan(self.equation, self.bias_axes, per_model,
                           self.partial_output_shape)

    def build(self, input_shape):
        plan = self._plan(input_shape)
        self.input_spec = keras.layers.InputSpec(
            ndim=len(input_shape), axes={1: self.num_models})
        self._fused_equation = plan.equation
        self._matmul = plan.matmul
        self._kernel = self.add_model_weight(
            plan.kernel_shape,
            name="kernel",
            initializer=_with_fan_axes(self.kernel_initializer,
                                       plan.input_axes, plan.output_axes),
            regularizer=self.kernel_regularizer,
            constraint=self.kernel_constraint,
        )
        self.bias = None
        if plan.bias_shape is not None:
            self.bias = self.add_model_weight(
                plan.bias_shape,
                name="bias",
                initializer=self.bias_initializer,
                regularizer=self.bias_regularizer,
                constraint=self.bias_constraint,
            )
            # [B, *bias] -> [B, 1, ..., 1, *bias]: the stock bias broadcasts
            # from the right over the per-model output, which here starts at
            # the model axis; or laid out on the axis where the stock layer
            # actually adds it.
            layout = _stock_bias_layout(plan.output_shape, plan.bias_shape)
            self._bias_shape = (self.num_models, *(layout or (
                *(1,) * (plan.bias_start - 1), *plan.bias_shape)))
        self.build_lora()

    kernel = lora_property("kernel")

    def products_models_first(self, input_shape):
        """Whether `call` on inputs of `input_shape` computes with the
        models first and ends with `per_model_matmul`'s transpose back,
        which a following `swap_model_axis` cancels."""
        if self._matmul is None:
            return False
        contracted, size_in, size_out, _ = self._matmul
        return products_models_first(input_shape, self.num_models, size_in,
                                     size_out, contracted)

    def call(self, inputs, training=None):
        bias = None if self.bias is None else ops.reshape(self.bias,
                                                          self._bias_shape)
        if self._matmul is not None:
            # A plain matmul of flattened axes: the formulation each backend
            # runs fastest (`per_model_matmul`), where an einsum with a
            # model axis is a general (slower) einsum kernel.
            contracted, size_in, size_out, output_dims = self._matmul
            return per_model_matmul(
                inputs,
                ops.reshape(self.kernel, (self.num_models, size_in, size_out)),
                bias, activation=self.activation, contracted=contracted,
                output_dims=output_dims)
        if self.num_models > 1 and compiling_with_xla():
            # Models first: XLA:CPU lowers the einsum (and its gradients)
            # about 2x faster when the model axis leads both operands, as
            # for `per_model_matmul`.
            outputs = ops.swapaxes(ops.einsum(
                _models_first(self._fused_equation),
                ops.swapaxes(inputs, 0, 1), self.kernel), 0, 1)
        else:
            outputs = ops.einsum(self._fused_equation, inputs, self.kernel)
        if bias is not None:
            # `+`, not ops.add, whose TensorFlow bias_add shortcut picks the
            # axis from the shapes alone.
            outputs = outputs + as_one_sample(bias, outputs)
        if self.activation is not None:
            outputs = self.activation(outputs)
        return outputs

    def compute_output_shape(self, input_shape):
        plan = self._plan(input_shape)
        return (plan.output_shape[0], input_shape[1], *plan.output_shape[1:])

    def get_config(self):
        config = super().get_config()
        config.update({
            "output_shape": self.partial_output_shape,
            "equation": self.equation,
            "activation": keras.activations.serialize(self.activation),
            "bias_axes": self.bias_axes,
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
        })
        return self.with_lora_config(config)
