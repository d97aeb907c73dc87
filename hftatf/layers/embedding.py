"""Fused embedding lookup: one table per model."""

import warnings

import keras
from keras import ops

from hftatf.api import hftatf_export
from hftatf.core.validation import check_model_axis
from hftatf.layers import registry
from hftatf.layers.backends import gather_clamps_ids, look_up
from hftatf.layers.base import FusedLayer
from hftatf.layers.lora import LoraLayer, lora_property

__all__ = ["FusedEmbedding"]


def _check_dim(name, value):
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(
            f"`{name}` must be a positive integer. Received: {name}={value} "
            f"(of type {type(value).__name__}).")


@hftatf_export
@registry.register(keras.layers.Embedding)
class FusedEmbedding(LoraLayer, FusedLayer):
    """`keras.layers.Embedding` for an array of `num_models` models.

    Layout:
        input: integer ids `[batch, B, ...]`; model `b` looks up `x[:, b]` in
            its own table.
        output: `[batch, B, ..., output_dim]`.
        mask (with `mask_zero=True`): `[batch, B, ...]`, `x != 0`.
        embeddings: `[B, input_dim, output_dim]`.

    Model `b` computes what the stock layer computes with table
    `embeddings[b]`: one gather on the flattened `[B * input_dim,
    output_dim]` table with the ids of model `b` offset by `b * input_dim`.
    Negative ids count from the end of the model's own table, as in the
    stock layer; an id out of range of its model's table never reads
    another model's rows. It behaves as an out-of-range id does in the
    stock layer on the same device: without XLA it is sent out of range of
    the whole flattened table (an error from TensorFlow's CPU kernel, zeros
    on GPU); under XLA, where a step cannot raise (and `jit_compile="auto"`
    compiles an array with XLA on a CPU too), it reads the first or last
    row of its model's own table, as XLA clamps the stock layer's gather,
    and its occurrence updates no row, as XLA drops the stock gradient's
    update out of range. Each
    table slice is initialised as a separate stock `Embedding` would be.

    On JAX an out-of-range id reads NaNs and updates no row, as the stock
    layer's `take` on JAX fills it.

    On TensorFlow the gradient of `embeddings` is sparse, as the stock
    layer's is: a `tf.IndexedSlices` of the table flattened to `[B * input_dim,
    output_dim]`, one row per id looked up (`hftatf.sparse`). Fused
    optimizers apply it as stock optimizers apply the stock layer's, each
    element-wise operation occurrence by occurrence (Adam's squares of the
    gradient, `clipnorm`'s norm), so that a batch that repeats an id
    updates each model as it updates the stock model. With an
    `embeddings_regularizer` the gradient is dense, as it is in the stock
    layer. So it is in a subclass that sets `sparse_gradient = False`, as
    one must that uses the table for more than the lookup (tied output
    embeddings): TensorFlow cannot add the sparse gradient of the
    flattened table to a dense one of the table. On JAX the gradient is
    dense, as stock Keras on JAX applies the stock layer's.

    Args:
        num_models: the number of models `B` in the array.
        input_dim, output_dim, embeddings_initializer,
        embeddings_regularizer, activity_regularizer, embeddings_constraint,
        mask_zero: as in `keras.layers.Embedding`; the regularizer and the
            constraint apply to each model's table.
        weights: optional initial tables, `[B, input_dim, output_dim]` (or a
            list holding that one array), as the stock `weights` argument
            with the model axis in front.
        lora_rank, lora_alpha: as in `keras.layers.Embedding`: LoRA
            enabled when the layer is built, each model with its own
            factors (`hftatf.layers.lora`; `enable_lora` enables it
            later). With LoRA the gradient is dense, as in the stock layer.
        quantization_config: accepted for signature parity with
            `keras.layers.Embedding`; must be `None` (quantization is not
            supported in arrays).
    """

    # Whether the table's gradient is sparse (see above).
    sparse_gradient = True
    # The weight that LoRA adapts (`hftatf.layers.lora`).
    lora_target = "embeddings"

    def __init__(
        self,
        num_models,
        input_dim,
        output_dim,
        embeddings_initializer="uniform",
        embeddings_regularizer=None,
        embeddings_constraint=None,
        mask_zero=False,
        weights=None,
        lora_rank=None,
        lora_alpha=None,
        quantization_config=None,
        **kwargs,
    ):
        _check_dim("input_dim", input_dim)
        _check_dim("output_dim", output_dim)
        if kwargs.pop("input_length", None) is not None:
            warnings.warn(
                "Argument `input_length` is deprecated. Just remove it.",
                stacklevel=2)
        super().__init__(num_models, **kwargs)
        if quantization_config:
            raise ValueError(
                "FusedEmbedding does not support `quantization_config`. "
                f"Received: quantization_config={quantization_config!r}. "
                "Quantize the exported per-model models instead.")
        if self.dtype_policy.quantization_mode is not None:
            raise ValueError(
                "FusedEmbedding does not support quantized dtype policies. "
                f"Received: dtype={self.dtype_policy.name!r}. Use a float "
                "dtype policy.")
        self.init_lora(lora_rank, lora_alpha)
        self.input_dim = input_dim
        self.output_dim = output_dim
        self.embeddings_initializer = keras.initializers.get(
            embeddings_initializer)
        self.embeddings_regularizer = keras.regularizers.get(
            embeddings_regularizer)
        self.embeddings_constraint = keras.constraints.get(
            embeddings_constraint)
        self.mask_zero = mask_zero
        self.supports_masking = mask_zero
        # Ids stay integers, as in the stock layer.
        self.autocast = False
        if weights is not None:
            self.build()
            if not (isinstance(weights, list) and len(weights) == 1):
                weights = [weights]
            self.set_weights(weights)

    def build(self, input_shape=None):
        if self.built:
            return
        if input_shape is not None:
            check_model_axis(self.name, self.num_models, input_shape)
        self.input_spec = keras.layers.InputSpec(
            min_ndim=2, axes={1: self.num_models})
        self._embeddings = self.add_model_weight(
            (self.input_dim, self.output_dim),
            name="embeddings",
            initializer=self.embeddings_initializer,
            regularizer=self.embeddings_regularizer,
            constraint=self.embeddings_constraint,
        )
        self.build_lora()

    embeddings = lora_property("embeddings")

    def call(self, inputs):
        if inputs.dtype != "int32" and inputs.dtype != "int64":
            inputs = ops.cast(inputs, "int32")
        size = self.num_models * self.input_dim
        ids = ops.where(ops.less(inputs, 0), inputs + self.input_dim, inputs)
        in_range = ops.logical_and(ops.greater_equal(ids, 0),
                                   ops.less(ids, self.input_dim))
        offsets = ops.reshape(
            ops.arange(0, size, self.input_dim, dtype=ids.dtype),
            (1, self.num_models) + (1,) * (len(ids.shape) - 2))
        xla = gather_clamps_ids()
        if xla:
            # XLA's gather clamps an id out of range of the flattened table
            # to its last row, another model's: clamp it to the model's own
            # table, as the stock layer's gather is clamped under XLA.
            ids = ops.clip(ids, 0, self.input_dim - 1) + offsets
        else:
            ids = ops.where(in_range, ids + offsets, size)
        if (self.sparse_gradient and self.embeddings_regularizer is None
                and not self.lora_enabled):
            outputs = look_up(self.embeddings, ids)
        else:
            # The regularizer's gradient is dense, and so is the sum of
            # the two, as in the stock layer.
            table = ops.reshape(self.embeddings, (size, self.output_dim))
            outputs = ops.take(table, ids, axis=0)
        if xla:
            # ... and, as XLA drops the stock gradient's updates out of
            # range, a clamped id's occurrence updates no row.
            outputs = ops.where(ops.expand_dims(in_range, -1), outputs,
                                ops.stop_gradient(outputs))
        return ops.cast(outputs, dtype=self.compute_dtype)

    def compute_mask(self, inputs, mask=None):
        if not self.mask_zero:
            return None
        return ops.not_equal(inputs, 0)

    def compute_output_shape(self, input_shape):
        return (*input_shape, self.output_dim)

    def get_config(self):
        config = super().get_config()
        config.update({
            "input_dim": self.input_dim,
            "output_dim": self.output_dim,
            "embeddings_initializer": keras.initializers.serialize(
                self.embeddings_initializer),
            "embeddings_regularizer": keras.regularizers.serialize(
                self.embeddings_regularizer),
            "embeddings_constraint": keras.constraints.serialize(
                self.embeddings_constraint),
            "mask_zero": self.mask_zero,
        })
        return self.with_lora_config(config)

