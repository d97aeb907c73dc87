"""Fused dense layers."""

import keras
from keras import ops

from hftatf.api import hftatf_export
from hftatf.layers import registry
from hftatf.layers.base import FusedLayer
from hftatf.validation import check_model_axis


@hftatf_export
@registry.register(keras.layers.Dense)
class FusedDense(FusedLayer):
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

    Args:
        num_models: the number of models `B` in the array.
        units, activation, use_bias, kernel_initializer, bias_initializer,
        kernel_regularizer, bias_regularizer, activity_regularizer,
        kernel_constraint, bias_constraint: as in `keras.layers.Dense`;
            regularizers and constraints apply to each model's slice.
        lora_rank, lora_alpha, quantization_config: accepted for signature
            parity with `keras.layers.Dense`; must be `None` (LoRA and
            quantization are not supported in arrays).
    """

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
        for arg, value in (("lora_rank", lora_rank),
                           ("quantization_config", quantization_config)):
            if value is not None:
                raise ValueError(
                    f"FusedDense does not support `{arg}`. Received: "
                    f"{arg}={value!r}. Fuse the model before enabling LoRA or "
                    "quantization on the exported per-model models."
                )
        del lora_alpha
        self.units = units
        self.activation = keras.activations.get(activation)
        self.use_bias = use_bias
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.bias_initializer = keras.initializers.get(bias_initializer)
        self.kernel_regularizer = keras.regularizers.get(kernel_regularizer)
        self.bias_regularizer = keras.regularizers.get(bias_regularizer)
        self.kernel_constraint = keras.constraints.get(kernel_constraint)
        self.bias_constraint = keras.constraints.get(bias_constraint)
        self.input_spec = keras.layers.InputSpec(min_ndim=3)
        self.supports_masking = True

    def build(self, input_shape):
        check_model_axis(self.name, self.num_models, input_shape)
        self.input_spec = keras.layers.InputSpec(
            min_ndim=3, axes={1: self.num_models, -1: input_shape[-1]})
        self.kernel = self.add_model_weight(
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

    def call(self, inputs, training=None):
        outputs = ops.einsum("bm...i,mio->bm...o", inputs, self.kernel)
        if self.bias is not None:
            # [B, units] -> [B, 1, ..., 1, units], broadcast over batch. `+`,
            # not ops.add, whose TensorFlow bias_add shortcut picks the axis
            # from the shapes alone.
            inner = (1,) * (len(outputs.shape) - 3)
            outputs = outputs + ops.reshape(
                self.bias, (self.num_models, *inner, self.units))
        if self.activation is not None:
            outputs = self.activation(outputs)
        return outputs

    def compute_output_shape(self, input_shape):
        return (*input_shape[:-1], self.units)

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
        })
        return config
