"""Fused `GroupQueryAttention` (`FusedAttentionBase` holds the logic)."""

import math

import keras
from keras import ops

from hftatf.api import hftatf_export
from hftatf.layers import registry
from hftatf.layers.attention.base_attention import FusedAttentionBase


@hftatf_export
@registry.register(keras.layers.GroupQueryAttention)
class FusedGroupQueryAttention(FusedAttentionBase):
    """`keras.layers.GroupQueryAttention` for an array of `num_models`
    models.

    Layout (`T`, `S`: target and source lengths, `E`: features):
        query: `[batch, B, T, E]`; value and key: `[batch, B, S, E]`.
        attention_mask: `[batch, T, S]` shared by all models, or
            `[batch, B, T, S]` per model (see the module doc).
        output: `[batch, B, T, E]`.
        attention scores: `[batch, B, num_query_heads, T, S]`.
        weights, in the stock order: query kernel `[B, E, num_query_heads,
            head_dim]` and bias `[B, num_query_heads, head_dim]`, key and
            value kernels `[B, E, num_key_value_heads, head_dim]` and biases
            (the gate's between them with `use_gate`), output kernel
            `[B, num_query_heads, head_dim, E]` and bias `[B, E]`.

    Model `b` computes what the stock layer computes with its weights `w[b]`
    on `query[:, b]`, `value[:, b]`, `key[:, b]`, with the masks handled as
    the stock layer handles them. Attention dropout draws an independent
    mask per model. The activity regularizer applies, as in the stock layer,
    to every projection's output and to the layer's outputs, per model.

    Args:
        num_models: the number of models `B` in the array.
        head_dim, num_query_heads, num_key_value_heads, dropout, use_bias,
        sliding_window, flash_attention, kernel_initializer,
        bias_initializer, kernel_regularizer, bias_regularizer,
        activity_regularizer, kernel_constraint, bias_constraint, use_gate,
        seed: as in `keras.layers.GroupQueryAttention`.

    Call arguments: as in `keras.layers.GroupQueryAttention.call`.
    """

    def __init__(self, num_models, head_dim, num_query_heads,
                 num_key_value_heads, dropout=0.0, use_bias=True,
                 sliding_window=None, flash_attention=None,
                 kernel_initializer="glorot_uniform",
                 bias_initializer="zeros", kernel_regularizer=None,
                 bias_regularizer=None, activity_regularizer=None,
                 kernel_constraint=None, bias_constraint=None,
                 use_gate=False, seed=None, **kwargs):
        super().__init__(
            num_models, dropout=dropout, use_bias=use_bias,
            sliding_window=sliding_window, flash_attention=flash_attention,
            kernel_initializer=kernel_initializer,
            bias_initializer=bias_initializer,
            kernel_regularizer=kernel_regularizer,
            bias_regularizer=bias_regularizer,
            activity_regularizer=activity_regularizer,
            kernel_constraint=kernel_constraint,
            bias_constraint=bias_constraint, use_gate=use_gate, seed=seed,
            **kwargs)
        # The stock layer regularizes its own outputs too.
        self.model_activity_regularizer = self._activity_regularizer
        if num_query_heads % num_key_value_heads != 0:
            raise ValueError(
                "`num_query_heads` must be divisible by "
                f"`num_key_value_heads`. Received: num_query_heads="
                f"{num_query_heads}, num_key_value_heads="
                f"{num_key_value_heads}.")
        self.head_dim = head_dim
        self.num_query_heads = num_query_heads
        self.num_key_value_heads = num_key_value_heads
        self.num_repeats = num_query_heads // num_key_value_heads
        self._scale = 1.0 / math.sqrt(float(head_dim))
        self._dot_product_equation = "bquh,bkuh->buqk"
        self._combine_equation = "buqk,bkuh->bquh"

    def build(self, query_shape, value_shape, key_shape=None):
        """Builds from fused shapes `[batch, B, ...]`."""
        key_shape = value_shape if key_shape is None else key_shape
        self._check_shapes(query_shape, value_shape, key_shape)
        self.feature_dim = query_shape[-1]
        query_heads = (None, self.num_query_heads, self.head_dim)
        kv_heads = (None, self.num_key_value_heads, self.head_dim)
        self._query_dense = self._dense(
            "bqm,muh->bquh", query_heads, "uh", "query", query_shape)
        self._key_dense = self._dense(
            "bkm,mvh->bkvh", kv_heads, "vh", "key", key_shape)
        if self._use_gate:
            self._gate_dense = self._dense(
                "bqm,muh->bquh", query_heads, "uh", "gate", query_shape,
                "sigmoid")
        self._value_dense = self._dense(
            "bkm,mvh->bkvh", kv_heads, "vh", "value", value_shape)
        self._build_softmax_and_dropout(4, 1)
        self._output_dense = self._dense(
            "bquh,uhm->bqm", (None, self.feature_dim), "m",
            "attention_output",
            (None, self.num_models, None, self.num_query_heads,
             self.head_dim))

    def _attention_logits(self, query, key):
        return ops.einsum(self._dot_product_equation, query, key)

    def _fold_key_or_value(self, x, models_first):
        # Key and value heads repeat along the heads axis (2 once folded),
        # as in the stock layer.
        return ops.repeat(super()._fold_key_or_value(x, models_first),
                          self.num_repeats, axis=2)

    def call(self, query, value, key=None, query_mask=None, value_mask=None,
             key_mask=None, attention_mask=None,
             return_attention_scores=False, training=None,
             use_causal_mask=False):
        output, scores = self._attend(
            query, value, value if key is None else key, query_mask,
            value_mask, key_mask, attention_mask, training,
            return_attention_scores, use_causal_mask)
        if return_attention_scores:
            return output, scores
        return output

    def compute_output_shape(self, query_shape, value_shape, key_shape=None):
        key_shape = value_shape if key_shape is None else key_shape
        if query_shape[-1] != value_shape[-1]:
            raise ValueError(
                "The last dimension of `query_shape` and `value_shape` must "
                f"be equal, but are {query_shape[-1]}, {value_shape[-1]}. "
                f"Received: query_shape={query_shape}, "
                f"value_shape={value_shape}")
        self._check_shapes(query_shape, value_shape, key_shape)
        return query_shape

    def _scores_shape(self, query_shape, value_shape, key_shape):
        """`[batch, B, num_query_heads, T, S]`."""
        return (query_shape[0], self.num_models, self.num_query_heads,
                query_shape[2], key_shape[2])

    def get_config(self):
        return {**super().get_config(),
                "head_dim": self.head_dim,
                "num_query_heads": self.num_query_heads,
                "num_key_value_heads": self.num_key_value_heads}


# The stock class is exported as `GroupQueryAttention` but named
# `GroupedQueryAttention`; both fused names are offered.
FusedGroupedQueryAttention = FusedGroupQueryAttention
