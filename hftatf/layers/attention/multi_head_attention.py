"""Fused `MultiHeadAttention` (`FusedAttentionBase` holds the logic)."""

import math

import keras

from hftatf.api import hftatf_export
from hftatf.core import compat
from hftatf.layers import registry
from hftatf.layers.attention.base_attention import FusedAttentionBase


@hftatf_export
@registry.register(keras.layers.MultiHeadAttention)
class FusedMultiHeadAttention(FusedAttentionBase):
    """`keras.layers.MultiHeadAttention` for an array of `num_models` models.

    Layout (`T`, `S`: target and source lengths, `E`: query features):
        query: `[batch, B, T, E]`; value: `[batch, B, S, dv]`; key:
            `[batch, B, S, dk]` (defaults to value). With several attention
            axes, the stock inner axes follow the model axis.
        attention_mask: `[batch, T, S]` shared by all models (the stock
            shape), or `[batch, B, T, S]` per model (see the module doc).
        output: `[batch, B, T, E]` (or `[batch, B, T, *output_shape]`).
        attention scores: `[batch, B, num_heads, T, S]`.
        weights, in the stock order: query kernel `[B, E, num_heads,
            key_dim]` and bias `[B, num_heads, key_dim]`, key kernel and
            bias, (gate kernel and bias,) value kernel `[B, dv, num_heads,
            value_dim]` and bias, output kernel `[B, num_heads, value_dim,
            E]` and bias `[B, E]`.

    Model `b` computes what the stock layer computes with its weights
    `w[b]` on `query[:, b]`, `value[:, b]`, `key[:, b]`, including the
    Keras masks of the inputs (`[batch, B, T]`; the query mask is propagated
    to the output) and the causal and sliding-window masks. Attention
    dropout draws an independent mask per model.

    Args:
        num_models: the number of models `B` in the array.
        num_heads, key_dim, value_dim, dropout, use_bias, output_shape,
        attention_axes, sliding_window, flash_attention, kernel_initializer,
        bias_initializer, kernel_regularizer, bias_regularizer,
        activity_regularizer, kernel_constraint, bias_constraint, use_gate,
        seed: as in `keras.layers.MultiHeadAttention` (`attention_axes`
            count the stock axes, without the model axis); regularizers and
            constraints apply to each model's slice.

    Call arguments: as in `keras.layers.MultiHeadAttention.call`.
    """

    def __init__(self, num_models, num_heads, key_dim, value_dim=None,
                 dropout=0.0, use_bias=True, output_shape=None,
                 attention_axes=None, sliding_window=None,
                 flash_attention=None, kernel_initializer="glorot_uniform",
                 bias_initializer="zeros", kernel_regularizer=None,
                 bias_regularizer=None, activity_regularizer=None,
                 kernel_constraint=None, bias_constraint=None,
                 use_gate=False, seed=None, **kwargs):
        for arg, value in (("num_heads", num_heads), ("key_dim", key_dim),
                           ("value_dim", value_dim)):
            if (value is not None or arg != "value_dim") and (
                    not isinstance(value, int) or isinstance(value, bool)
                    or value <= 0):
                raise ValueError(
                    f"Received an invalid value for argument `{arg}`, "
                    "expected a positive integer"
                    f"{' or `None`' if arg == 'value_dim' else ''}. "
                    f"Received: {arg}={value}")
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
        self._num_heads = num_heads
        self._key_dim = key_dim
        self._value_dim = value_dim if value_dim else key_dim
        if output_shape:
            if isinstance(output_shape, int):
                output_shape = (output_shape,)
            try:
                output_shape = tuple(output_shape)
            except TypeError:
                raise ValueError(
                    f"Invalid `output_shape`: {output_shape}. When "
                    "specified, the `output_shape` should be of type tuple, "
                    "list, or int.") from None
        self._output_shape = output_shape
        if isinstance(attention_axes, int):
            attention_axes = (attention_axes,)
        elif attention_axes and not isinstance(attention_axes,
                                               (list, tuple)):
            raise ValueError(
                "`attention_axes` must be an int, list, or tuple."
                f"Received: attention_axes={attention_axes}")
        self._attention_axes = attention_axes
        self._scale = 1.0 / math.sqrt(float(key_dim))

    @property
    def num_heads(self):
        return self._num_heads

    @property
    def key_dim(self):
        return self._key_dim

    @property
    def value_dim(self):
        return self._value_dim

    @property
    def attention_axes(self):
        return self._attention_axes

    @property
    def query_dense(self):
        return self._query_dense

    @property
    def key_dense(self):
        return self._key_dense

    @property
    def value_dense(self):
        return self._value_dense

    @property
    def output_dense(self):
        return self._output_dense

    def build(self, query_shape, value_shape, key_shape=None):
        """Builds from fused shapes `[batch, B, ...]`, as the stock layer
        builds from the per-model shapes."""
        key_shape = value_shape if key_shape is None else key_shape
        self._check_shapes(query_shape, value_shape, key_shape)
        heads = self._num_heads
        self._query_dense = self._projection(
            query_shape, [heads, self._key_dim], "query")
        self._key_dense = self._projection(
            key_shape, [heads, self._key_dim], "key")
        if self._use_gate:
            self._gate_dense = self._projection(
                query_shape, [heads, self._value_dim], "gate", "sigmoid")
        self._value_dense = self._projection(
            value_shape, [heads, self._value_dim], "value")
        self._build_attention(len(value_shape))
        output_shape = self._output_shape or [query_shape[-1]]
        attended_shape = list(
            self._query_dense.compute_output_shape(query_shape))
        attended_shape[-1] = self._value_dim
        self._output_dense = self._projection(
            tuple(attended_shape), output_shape, "attention_output",
            bound_dims=2)

    def _projection(self, input_shape, last_dims, name, activation=None,
                    bound_dims=1):
        """A projection of fused `input_shape` onto `last_dims`, by the
        stock equation contracting its last `bound_dims` axes (the stock
        builder keeps the weights' shapes those of the stock layer)."""
        equation, bias_axes, output_rank = compat.build_proj_equation(
            len(input_shape) - 1 - bound_dims, bound_dims=bound_dims,
            output_dims=len(last_dims))
        return self._dense(
            equation,
            compat.projection_output_shape(output_rank - 1, last_dims),
            bias_axes, name, input_shape, activation)

    def _build_attention(self, rank):
        # `rank`: of a projected per-model tensor, as in the stock layer; it
        # equals the rank of a fused input.
        if self._attention_axes is None:
            self._attention_axes = tuple(range(1, rank - 2))
        else:
            self._attention_axes = tuple(
                axis if axis >= 0 else (rank - 1) + axis
                for axis in self._attention_axes)
        dot_product, combine, scores_rank = compat.build_attention_equation(
            rank, attn_axes=self._attention_axes)
        self._dot_product_equation = dot_product
        self._combine_equation = combine
        self._build_softmax_and_dropout(scores_rank,
                                        len(self._attention_axes))

    def call(self, query, value, key=None, query_mask=None, value_mask=None,
             key_mask=None, attention_mask=None,
             return_attention_scores=False, training=None,
             use_causal_mask=False):
        if key is None:
            key = value
        # As in the stock layer: the query's own Keras mask, and no masks
        # left on the inputs for the projections to warn about.
        query_mask = compat.get_keras_mask(query)
        compat.set_keras_mask(query, None)
        compat.set_keras_mask(value, None)
        compat.set_keras_mask(key, None)
        attention_output, attention_scores = self._attend(
            query, value, key, query_mask, value_mask, key_mask,
            attention_mask, training, return_attention_scores,
            use_causal_mask, num_axes=len(self._attention_axes))
        if query_mask is not None:
            compat.set_keras_mask(attention_output, query_mask)
        if return_attention_scores:
            return attention_output, attention_scores
        return attention_output

    def compute_output_shape(self, query_shape, value_shape, key_shape=None):
        query_shape = tuple(query_shape)
        value_shape = tuple(value_shape)
        key_shape = value_shape if key_shape is None else tuple(key_shape)
        self._check_shapes(query_shape, value_shape, key_shape)
        if self._output_shape:
            query_shape = query_shape[:-1] + self._output_shape
        return query_shape

    def _scores_shape(self, query_shape, value_shape, key_shape):
        """`[batch, B, *other axes, num_heads, *target axes, *source
        axes]`, the attention axes as in the stock layer."""
        inner = range(1, len(query_shape) - 2)
        axes = self._attention_axes or tuple(inner)
        return (query_shape[0], self.num_models,
                *(query_shape[a + 1] for a in inner if a not in axes),
                self._num_heads,
                *(query_shape[a + 1] for a in axes),
                *(value_shape[a + 1] for a in axes))

    def get_config(self):
        return {**super().get_config(),
                "num_heads": self._num_heads,
                "key_dim": self._key_dim,
                "value_dim": self._value_dim,
                "output_shape": self._output_shape,
                "attention_axes": self._attention_axes}
