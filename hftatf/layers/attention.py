"""Fused attention layers: multi-head, grouped-query, dot-product and
additive attention.

Multi-head and grouped-query attention: projections are `FusedEinsumDense`
sublayers built from the stock layer's own einsum equations, so every
weight is `[B, *stock weight shape]` in the stock order. Attention itself
has no weights and treats every sample of every model on its own: it runs
the stock equations on `[batch * B, ...]` tensors, the model axis folded
into the batch axis. Folded, the equations are the stock layer's exactly,
so the backend runs the kernels it runs for stock attention (TensorFlow's
Keras backend turns them into transposes and batched matmuls, which are
faster on CPU than a general einsum with an extra axis). Where the
projections compute with the models first (`per_model_matmul`), attention
folds the models first too (`swap_model_axis`, then `fold_models`), so
the projected tensors go into attention, and its output into the output
projection, without being moved back and forth.

Their `attention_mask`: a mask of the stock rank (e.g. `[batch, T, S]`) is
shared by all models; a mask with one more axis carries the model axis at 1
(e.g. `[batch, B, T, S]`), one with two more is per model and per head
(`[batch, B, heads, T, S]`). Keras masks of the inputs (e.g. from an
`Embedding` with `mask_zero=True`) are `[batch, B, T]` and are used as in
the stock layers.
"""

import math

import keras
from keras import ops
from keras.src.backend import get_keras_mask, set_keras_mask

# The stock equation builders: using them keeps the fused weights' shapes
# and the order of attention axes exactly those of the stock layer.
from keras.src.layers.attention.multi_head_attention import (
    _build_attention_equation,
    _build_proj_equation,
    _get_output_shape,
)

from hftatf.api import hftatf_export
from hftatf.core.axis import fold_models, swap_model_axis, unfold_models
from hftatf.core.validation import check_model_axis
from hftatf.layers import registry
from hftatf.layers.base import FusedLayer
from hftatf.layers.dense import FusedEinsumDense

__all__ = [
    "FusedAdditiveAttention",
    "FusedAttention",
    "FusedGroupQueryAttention",
    "FusedGroupedQueryAttention",
    "FusedMultiHeadAttention",
]


class FusedAttentionBase(FusedLayer):
    """Shared machinery of the fused attention layers.

    Subclasses build their projections with `_dense`, set the stock
    `_dot_product_equation` and `_combine_equation`, `_softmax`,
    `_dropout_layer` and `_scale`, and call `_compute_attention`.

    Randomness: attention dropout draws over the whole `[batch, B, ...]`
    probability tensor, so each model gets its own independent mask.
    """

    def __init__(self, num_models, dropout=0.0, use_bias=True,
                 sliding_window=None, flash_attention=None,
                 kernel_initializer="glorot_uniform",
                 bias_initializer="zeros", kernel_regularizer=None,
                 bias_regularizer=None, activity_regularizer=None,
                 kernel_constraint=None, bias_constraint=None,
                 use_gate=False, seed=None, **kwargs):
        # `activity_regularizer` goes to the projections, as in the stock
        # layers; the layer's own outputs are not regularized by default.
        super().__init__(num_models, **kwargs)
        self.supports_masking = True
        if sliding_window is not None and (
                not isinstance(sliding_window, int) or sliding_window <= 0):
            raise ValueError(
                "`sliding_window` must be `None` or a positive integer. "
                f"Received: sliding_window={sliding_window}")
        self._dropout = dropout
        self._use_bias = use_bias
        self._use_gate = use_gate
        self._sliding_window = sliding_window
        self._flash_attention = (
            flash_attention or keras.config.is_flash_attention_enabled())
        if self._flash_attention and dropout > 0.0:
            raise ValueError(
                "Dropout is not supported when flash attention is enabled. "
                "Please set dropout to 0.0 to use flash attention.")
        self._kernel_initializer = keras.initializers.get(kernel_initializer)
        self._bias_initializer = keras.initializers.get(bias_initializer)
        self._kernel_regularizer = keras.regularizers.get(kernel_regularizer)
        self._bias_regularizer = keras.regularizers.get(bias_regularizer)
        self._activity_regularizer = keras.regularizers.get(
            activity_regularizer)
        self._kernel_constraint = keras.constraints.get(kernel_constraint)
        self._bias_constraint = keras.constraints.get(bias_constraint)
        self.seed = seed

    def _dense(self, equation, output_shape, bias_axes, name,
               activation=None):
        """A projection sublayer, configured as the stock layer configures
        its `EinsumDense` sublayers (each gets its own copy of the
        initializers, as in the stock layer)."""
        kernel_initializer = type(self._kernel_initializer).from_config(
            self._kernel_initializer.get_config())
        bias_initializer = type(self._bias_initializer).from_config(
            self._bias_initializer.get_config())
        return FusedEinsumDense(
            self.num_models,
            equation,
            output_shape=output_shape,
            activation=activation,
            bias_axes=bias_axes if self._use_bias else None,
            kernel_initializer=kernel_initializer,
            bias_initializer=bias_initializer,
            kernel_regularizer=self._kernel_regularizer,
            bias_regularizer=self._bias_regularizer,
            activity_regularizer=self._activity_regularizer,
            kernel_constraint=self._kernel_constraint,
            bias_constraint=self._bias_constraint,
            dtype=self.dtype_policy,
            name=name,
        )

    def _build_softmax_and_dropout(self, scores_rank, num_axes):
        """Softmax over the last `num_axes` axes of per-model scores of rank
        `scores_rank`, and the attention dropout."""
        self._softmax = keras.layers.Softmax(
            axis=tuple(range(scores_rank - num_axes, scores_rank)),
            dtype=self.dtype_policy)
        self._dropout_layer = keras.layers.Dropout(
            rate=self._dropout, dtype=self.dtype_policy, seed=self.seed)

    def _check_shapes(self, query_shape, value_shape, key_shape):
        for shape in (query_shape, value_shape, key_shape):
            check_model_axis(self.name, self.num_models, shape)
        if value_shape[1:-1] != key_shape[1:-1]:
            raise ValueError(
                "All dimensions of `value` and `key`, except the last one, "
                f"must be equal. Received: value_shape={value_shape} and "
                f"key_shape={key_shape}")

    # Masks. Sequence axes are axis 2 of fused tensors (1 in stock ones).

    def _model_attention_mask(self, attention_mask, query, num_axes):
        """Returns `attention_mask` with a model axis at 1 (size B or 1)."""
        if attention_mask is None:
            return None
        stock_rank = len(query.shape) - 2 + num_axes
        rank = len(attention_mask.shape)
        if rank == stock_rank:
            return ops.expand_dims(attention_mask, 1)
        models = attention_mask.shape[1] if rank > 1 else None
        if rank in (stock_rank + 1, stock_rank + 2) and models in (
                None, 1, self.num_models):
            return attention_mask
        raise ValueError(
            f"Layer '{self.name}' expects an `attention_mask` shared by all "
            f"models, of the stock rank {stock_rank} (e.g. [batch, T, S]), "
            f"or one per model, of rank {stock_rank + 1} (or "
            f"{stock_rank + 2}, per head) with num_models={self.num_models} "
            f"on axis 1 (e.g. [batch, {self.num_models}, T, S]). Received "
            f"shape {tuple(attention_mask.shape)}.")

    def _compute_attention_mask(self, query, value, query_mask=None,
                                value_mask=None, key_mask=None,
                                attention_mask=None, use_causal_mask=False):
        """The stock mask merge on fused masks: query mask
        `[batch, B, T, 1]`, value and key masks `[batch, B, 1, S]`, causal
        and sliding-window masks `[1, 1, T, S]`, all and-ed with the
        attention mask."""
        auto_mask = None
        if query_mask is not None:
            auto_mask = ops.expand_dims(ops.cast(query_mask, "bool"), -1)
        for mask in (value_mask, key_mask):
            if mask is not None:
                mask = ops.expand_dims(ops.cast(mask, "bool"), -2)
                auto_mask = mask if auto_mask is None else auto_mask & mask
        if use_causal_mask:
            mask = self._compute_causal_mask(query, value)
            auto_mask = mask if auto_mask is None else auto_mask & mask
        if self._sliding_window is not None:
            mask = self._compute_sliding_window_mask(query, value)
            auto_mask = mask if auto_mask is None else auto_mask & mask
        if attention_mask is not None:
            attention_mask = ops.cast(attention_mask, "bool")
        if auto_mask is not None:
            attention_mask = (auto_mask if attention_mask is None
                              else attention_mask & auto_mask)
        return attention_mask

    def _compute_causal_mask(self, query, value=None):
        """A `[1, 1, T, S]` lower-triangular mask."""
        q_length = ops.shape(query)[2]
        v_length = q_length if value is None else ops.shape(value)[2]
        ones = ops.ones((1, 1, q_length, v_length), dtype="int32")
        return ops.greater_equal(ops.cumsum(ones, axis=-2),
                                 ops.cumsum(ones, axis=-1))

    def _compute_sliding_window_mask(self, query, value=None):
        """A `[1, 1, T, S]` band of half-width `sliding_window - 1`."""
        q_length = ops.shape(query)[2]
        v_length = q_length if value is None else ops.shape(value)[2]
        rows = ops.reshape(ops.arange(q_length, dtype="int32"),
                           (1, 1, q_length, 1))
        columns = ops.reshape(ops.arange(v_length, dtype="int32"),
                              (1, 1, 1, v_length))
        return ops.less(ops.abs(rows - columns), self._sliding_window)

    def _fold(self, x, models_first):
        """Folds `[batch, B, ...]` as attention runs: models first
        (`[B * batch, ...]`; moved first, the models cancel the transpose
        back of a models-first product) or batch first."""
        return fold_models(swap_model_axis(x) if models_first else x)

    def _fold_key_or_value(self, x, models_first):
        """A projected key or value, folded as attention runs."""
        return self._fold(x, models_first)

    def _unfold(self, x, models_first):
        if models_first:
            # Moved second, the models cancel against the transpose forth
            # of a following models-first product.
            return swap_model_axis(unfold_models(x, self.num_models, True))
        return unfold_models(x, self.num_models)

    def _fold_mask(self, mask, batch, models_first):
        """A fused mask `[batch or 1, B or 1, ...]` broadcast over the
        batch and the models, then folded as attention runs."""
        lead = (batch, self.num_models)
        if models_first:
            mask, lead = ops.swapaxes(mask, 0, 1), lead[::-1]
        return fold_models(ops.broadcast_to(
            mask, (*lead, *ops.shape(mask)[2:])))

    def _masked_softmax(self, scores, attention_mask=None, num_axes=1,
                        models_first=False):
        """The stock masked softmax of folded scores `[batch * B, ...]`
        under a fused mask `[batch or 1, B or 1, ...]`."""
        if attention_mask is not None:
            # Inserts the heads axis (and any missing leading axes) in front
            # of the attention axes, as the stock layer does.
            for _ in range(len(scores.shape) + 1 - len(attention_mask.shape)):
                attention_mask = ops.expand_dims(attention_mask,
                                                 axis=-2 * num_axes - 1)
            attention_mask = self._fold_mask(
                attention_mask, ops.shape(scores)[0] // self.num_models,
                models_first)
        return self._softmax(scores, mask=attention_mask)

    # Attention.

    def _attention_logits(self, query, key):
        return ops.einsum(self._dot_product_equation, key, query)

    def _compute_attention(self, query, key, value, attention_mask=None,
                           training=None, return_attention_scores=False,
                           use_causal_mask=False, num_axes=1,
                           models_first=False):
        """Attention of projected `[batch, B, T, heads, dim]` tensors (more
        axes with several attention axes), as the stock layer computes it
        for each model, including its choice between the backend's fused
        `dot_product_attention` and explicit scores. `models_first`: fold
        the models first (where the projections computed that way)."""
        if self._flash_attention and return_attention_scores:
            raise ValueError(
                "Returning attention scores is not supported when flash "
                "attention is enabled. Please disable flash attention to "
                "access attention scores.")
        if not (self._dropout > 0.0 or return_attention_scores
                or len(query.shape) != 5):
            return self._folded_dot_product_attention(
                query, key, value, attention_mask, use_causal_mask,
                models_first), None
        if use_causal_mask:
            causal_mask = self._compute_causal_mask(query, value)
            attention_mask = (
                causal_mask if attention_mask is None else ops.logical_and(
                    ops.cast(attention_mask, "bool"), causal_mask))
        # Scaled once folded: the fold's move then directly follows the
        # query projection's, and both cancel.
        query = self._fold(query, models_first)
        query = ops.multiply(query, ops.cast(self._scale, query.dtype))
        scores = self._attention_logits(
            query, self._fold_key_or_value(key, models_first))
        scores = self._masked_softmax(scores, attention_mask, num_axes,
                                      models_first)
        if self._dropout > 0.0:
            final_scores = self._dropout_layer(scores, training=training)
        else:
            final_scores = scores
        output = ops.einsum(self._combine_equation, final_scores,
                            self._fold_key_or_value(value, models_first))
        return (self._unfold(output, models_first),
                self._unfold(scores, models_first))

    def _folded_dot_product_attention(self, query, key, value, mask,
                                      is_causal, models_first=False):
        """`ops.dot_product_attention` (4-D only) with the model axis folded
        into the batch axis, masks broadcast over both first."""
        if mask is not None:
            for _ in range(5 - len(mask.shape)):
                mask = ops.expand_dims(mask, axis=-3)
            mask = self._fold_mask(ops.cast(mask, "bool"),
                                   ops.shape(query)[0], models_first)
        output = ops.dot_product_attention(
            query=self._fold(query, models_first),
            key=self._fold_key_or_value(key, models_first),
            value=self._fold_key_or_value(value, models_first),
            bias=None,
            mask=mask,
            scale=self._scale,
            is_causal=is_causal,
            flash_attention=self._flash_attention,
        )
        return self._unfold(output, models_first)

    def _causal_only(self, use_causal_mask, *masks):
        """Whether only a causal mask applies, which the stock layers hand
        to the backend's causal kernel instead of building a mask."""
        return (use_causal_mask and all(m is None for m in masks)
                and self._sliding_window is None
                and type(self)._compute_attention
                is FusedAttentionBase._compute_attention)

    def _sublayer_config(self):
        return {
            "dropout": self._dropout,
            "use_bias": self._use_bias,
            "use_gate": self._use_gate,
            "sliding_window": self._sliding_window,
            "kernel_initializer": keras.initializers.serialize(
                self._kernel_initializer),
            "bias_initializer": keras.initializers.serialize(
                self._bias_initializer),
            "kernel_regularizer": keras.regularizers.serialize(
                self._kernel_regularizer),
            "bias_regularizer": keras.regularizers.serialize(
                self._bias_regularizer),
            "activity_regularizer": keras.regularizers.serialize(
                self._activity_regularizer),
            "kernel_constraint": keras.constraints.serialize(
                self._kernel_constraint),
            "bias_constraint": keras.constraints.serialize(
                self._bias_constraint),
            "seed": self.seed,
        }


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
    def dropout(self):
        return self._dropout

    @property
    def use_bias(self):
        return self._use_bias

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
        equation, bias_axes, output_rank = _build_proj_equation(
            len(query_shape) - 2, bound_dims=2,
            output_dims=len(output_shape))
        self._output_dense = self._dense(
            equation, _get_output_shape(output_rank - 1, output_shape),
            bias_axes, "attention_output")
        dense_input_shape = list(
            self._query_dense.compute_output_shape(query_shape))
        dense_input_shape[-1] = self._value_dim
        self._output_dense.build(tuple(dense_input_shape))

    def _projection(self, input_shape, last_dims, name, activation=None):
        equation, bias_axes, output_rank = _build_proj_equation(
            len(input_shape) - 2, bound_dims=1, output_dims=2)
        dense = self._dense(
            equation, _get_output_shape(output_rank - 1, last_dims),
            bias_axes, name, activation)
        dense.build(input_shape)
        return dense

    def _build_attention(self, rank):
        # `rank`: of a projected per-model tensor, as in the stock layer; it
        # equals the rank of a fused input.
        if self._attention_axes is None:
            self._attention_axes = tuple(range(1, rank - 2))
        else:
            self._attention_axes = tuple(
                axis if axis >= 0 else (rank - 1) + axis
                for axis in self._attention_axes)
        dot_product, combine, scores_rank = _build_attention_equation(
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
        query_mask = get_keras_mask(query)
        set_keras_mask(query, None)
        set_keras_mask(value, None)
        set_keras_mask(key, None)
        num_axes = len(self._attention_axes)
        attention_mask = self._model_attention_mask(attention_mask, query,
                                                    num_axes)
        causal_only = self._causal_only(use_causal_mask, query_mask,
                                        value_mask, key_mask, attention_mask)
        if not causal_only:
            attention_mask = self._compute_attention_mask(
                query, value, query_mask=query_mask, value_mask=value_mask,
                key_mask=key_mask, attention_mask=attention_mask,
                use_causal_mask=use_causal_mask)
        models_first = self._query_dense.products_models_first(query.shape)
        if self._use_gate:
            gate = self._gate_dense(query)
        query = self._query_dense(query)
        key = self._key_dense(key)
        value = self._value_dense(value)
        attention_output, attention_scores = self._compute_attention(
            query, key, value, attention_mask, training,
            return_attention_scores, use_causal_mask=causal_only,
            num_axes=num_axes, models_first=models_first)
        if self._use_gate:
            attention_output = ops.multiply(attention_output, gate)
        attention_output = self._output_dense(attention_output)
        if query_mask is not None:
            set_keras_mask(attention_output, query_mask)
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

    def compute_output_spec(self, query, value, key=None, query_mask=None,
                            value_mask=None, key_mask=None,
                            attention_mask=None,
                            return_attention_scores=False, training=None,
                            use_causal_mask=False):
        output_spec = keras.KerasTensor(
            self.compute_output_shape(
                query.shape, value.shape,
                None if key is None else key.shape),
            dtype=self.compute_dtype)
        if not return_attention_scores:
            return output_spec
        inner = range(1, len(query.shape) - 2)
        axes = self._attention_axes or tuple(inner)
        scores_shape = (
            query.shape[0], self.num_models,
            *(query.shape[a + 1] for a in inner if a not in axes),
            self._num_heads,
            *(query.shape[a + 1] for a in axes),
            *(value.shape[a + 1] for a in axes))
        return output_spec, keras.KerasTensor(scores_shape,
                                              dtype=self.compute_dtype)

    def get_config(self):
        config = super().get_config()
        config.update({
            "num_heads": self._num_heads,
            "key_dim": self._key_dim,
            "value_dim": self._value_dim,
            "output_shape": self._output_shape,
            "attention_axes": self._attention_axes,
            **self._sublayer_config(),
        })
        return config


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

    @property
    def dropout(self):
        return self._dropout

    @property
    def use_bias(self):
        return self._use_bias

    def build(self, query_shape, value_shape, key_shape=None):
        """Builds from fused shapes `[batch, B, ...]`."""
        key_shape = value_shape if key_shape is None else key_shape
        self._check_shapes(query_shape, value_shape, key_shape)
        self.feature_dim = query_shape[-1]
        query_heads = (None, self.num_query_heads, self.head_dim)
        kv_heads = (None, self.num_key_value_heads, self.head_dim)
        self._query_dense = self._dense(
            "bqm,muh->bquh", query_heads, "uh", "query")
        self._query_dense.build(query_shape)
        self._key_dense = self._dense("bkm,mvh->bkvh", kv_heads, "vh", "key")
        self._key_dense.build(key_shape)
        if self._use_gate:
            self._gate_dense = self._dense(
                "bqm,muh->bquh", query_heads, "uh", "gate", "sigmoid")
            self._gate_dense.build(query_shape)
        self._value_dense = self._dense(
            "bkm,mvh->bkvh", kv_heads, "vh", "value")
        self._value_dense.build(value_shape)
        self._build_softmax_and_dropout(4, 1)
        self._output_dense = self._dense(
            "bquh,uhm->bqm", (None, self.feature_dim), "m",
            "attention_output")
        self._output_dense.build(
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
        if key is None:
            key = value
        attention_mask = self._model_attention_mask(attention_mask, query, 1)
        causal_only = self._causal_only(use_causal_mask, query_mask,
                                        value_mask, key_mask, attention_mask)
        if not causal_only:
            attention_mask = self._compute_attention_mask(
                query, value, query_mask=query_mask, value_mask=value_mask,
                key_mask=key_mask, attention_mask=attention_mask,
                use_causal_mask=use_causal_mask)
        models_first = self._query_dense.products_models_first(query.shape)
        if self._use_gate:
            gate = self._gate_dense(query)
        output, scores = self._compute_attention(
            self._query_dense(query), self._key_dense(key),
            self._value_dense(value), attention_mask, training,
            return_attention_scores, use_causal_mask=causal_only,
            models_first=models_first)
        if self._use_gate:
            output = ops.multiply(output, gate)
        output = self._output_dense(output)
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

    def compute_output_spec(self, query, value, key=None, query_mask=None,
                            value_mask=None, key_mask=None,
                            attention_mask=None,
                            return_attention_scores=False, training=None,
                            use_causal_mask=False):
        output_spec = keras.KerasTensor(
            self.compute_output_shape(
                query.shape, value.shape,
                None if key is None else key.shape),
            dtype=self.compute_dtype)
        if not return_attention_scores:
            return output_spec
        source = value if key is None else key
        scores_shape = (query.shape[0], self.num_models,
                        self.num_query_heads, query.shape[2],
                        source.shape[2])
        return output_spec, keras.KerasTensor(scores_shape,
                                              dtype=self.compute_dtype)

    def get_config(self):
        config = super().get_config()
        config.update({
            "head_dim": self.head_dim,
            "num_query_heads": self.num_query_heads,
            "num_key_value_heads": self.num_key_value_heads,
            **self._sublayer_config(),
        })
        return config


# The stock class is exported as `GroupQueryAttention` but named
# `GroupedQueryAttention`; both fused names are offered.
FusedGroupedQueryAttention = FusedGroupQueryAttention


@hftatf_export
@registry.register(keras.layers.Attention)
class FusedAttention(FusedLayer):
    """`keras.layers.Attention` (dot-product attention) for an array of
    `num_models` models.

    Layout (`Tq`, `Tv`: query and value lengths):
        inputs: `[query, value]` or `[query, value, key]`, query
            `[batch, B, Tq, dim]`, value `[batch, B, Tv, dim_v]`, key
            `[batch, B, Tv, dim]`.
        mask: `[query_mask, value_mask]`, `[batch, B, Tq]` and
            `[batch, B, Tv]` (either may be `None`).
        output: `[batch, B, Tq, dim_v]`; attention scores
            `[batch, B, Tq, Tv]`.
        weights, in the stock order: `scale` `[B]` (with `use_scale`),
            `concat_score_weight` `[B]` (with `score_mode="concat"`).

    Model `b` computes what the stock layer computes with its weights `w[b]`
    on `inputs[i][:, b]` and `mask[i][:, b]`. Dropout on the attention
    distribution draws an independent mask per model.

    Args:
        num_models: the number of models `B` in the array.
        use_scale, score_mode, dropout, seed: as in
            `keras.layers.Attention`.

    Call arguments: as in `keras.layers.Attention.call`.
    """

    def __init__(self, num_models, use_scale=False, score_mode="dot",
                 dropout=0.0, seed=None, **kwargs):
        super().__init__(num_models, **kwargs)
        self.use_scale = use_scale
        self.score_mode = score_mode
        self.dropout = dropout
        self.seed = seed
        if self.dropout > 0:
            self.seed_generator = keras.random.SeedGenerator(seed=seed)
        if self.score_mode not in ["dot", "concat"]:
            raise ValueError(
                "Invalid value for argument score_mode. "
                "Expected one of {'dot', 'concat'}. "
                f"Received: score_mode={score_mode}")

    def build(self, input_shape):
        self._validate_inputs(input_shape)
        self.scale = None
        self.concat_score_weight = None
        if self.use_scale:
            self.scale = self.add_model_weight((), "scale", "ones")
        if self.score_mode == "concat":
            self.concat_score_weight = self.add_model_weight(
                (), "concat_score_weight", "ones")

    def _model_weight(self, weight, rank):
        """`[B, *s]` -> `[1, B, 1, ..., 1, *s]` of rank `rank`, to broadcast
        over `[batch, B, ...]` tensors."""
        inner = (1,) * (rank - 2 - (len(weight.shape) - 1))
        return ops.reshape(weight, (1, self.num_models, *inner,
                                    *weight.shape[1:]))

    def _calculate_scores(self, query, key):
        """`[batch, B, Tq, Tv]` scores of query `[batch, B, Tq, dim]` and key
        `[batch, B, Tv, dim]`."""
        if self.score_mode == "dot":
            scores = ops.matmul(query, ops.swapaxes(key, -2, -1))
            if self.scale is not None:
                scores = ops.multiply(
                    scores, self._model_weight(self.scale, len(scores.shape)))
            return scores
        sums = ops.expand_dims(query, axis=-2) + ops.expand_dims(key, axis=-3)
        if self.scale is not None:
            sums = self._model_weight(self.scale, len(sums.shape)) * sums
        weight = self._model_weight(self.concat_score_weight, len(sums.shape)
                                    - 1)
        return weight * ops.sum(ops.tanh(sums), axis=-1)

    def _apply_scores(self, scores, value, scores_mask=None, training=False):
        if scores_mask is not None:
            padding_mask = ops.logical_not(scores_mask)
            max_value = 65504.0 if scores.dtype == "float16" else 1.0e9
            scores = ops.where(padding_mask, scores - max_value, scores)
        weights = ops.softmax(scores, axis=-1)
        if training and self.dropout > 0:
            weights = keras.random.dropout(weights, self.dropout,
                                           seed=self.seed_generator)
        return ops.matmul(weights, value), weights

    def _calculate_score_mask(self, scores, v_mask, use_causal_mask):
        # The value mask `[batch, B, Tv]` always gets its query axis here:
        # the stock layer only adds it to a rank-2 mask, which a fused mask
        # never is.
        if v_mask is not None:
            v_mask = ops.expand_dims(v_mask, axis=-2)
        if not use_causal_mask:
            return v_mask
        shape = ops.shape(scores)
        ones = ops.ones((1, 1, shape[-2], shape[-1]), dtype="int32")
        causal_mask = ops.greater_equal(ops.cumsum(ones, axis=-2),
                                        ops.cumsum(ones, axis=-1))
        if v_mask is None:
            return causal_mask
        return ops.logical_and(v_mask, causal_mask)

    def call(self, inputs, mask=None, training=False,
             return_attention_scores=False, use_causal_mask=False):
        self._validate_inputs(inputs=inputs, mask=mask)
        query, value = inputs[0], inputs[1]
        key = inputs[2] if len(inputs) > 2 else value
        q_mask = mask[0] if mask else None
        v_mask = mask[1] if mask else None
        scores = self._calculate_scores(query=query, key=key)
        scores_mask = self._calculate_score_mask(scores, v_mask,
                                                 use_causal_mask)
        output, attention_scores = self._apply_scores(
            scores=scores, value=value, scores_mask=scores_mask,
            training=training)
        if q_mask is not None:
            output = ops.where(ops.expand_dims(q_mask, axis=-1), output, 0)
        if return_attention_scores:
            return output, attention_scores
        return output

    def compute_mask(self, inputs, mask=None):
        self._validate_inputs(inputs=inputs, mask=mask)
        if mask is None or mask[0] is None:
            return None
        return ops.convert_to_tensor(mask[0])

    def compute_output_shape(self, input_shape):
        return (*input_shape[0][:-1], input_shape[1][-1])

    def compute_output_spec(self, inputs, mask=None,
                            return_attention_scores=False, training=None,
                            use_causal_mask=False):
        self._validate_inputs(inputs, mask)
        query, value = inputs[0], inputs[1]
        key = inputs[2] if len(inputs) > 2 else value
        output_spec = keras.KerasTensor(
            self.compute_output_shape([query.shape, value.shape, key.shape]),
            dtype=self.compute_dtype)
        if not return_attention_scores:
            return output_spec
        return output_spec, keras.KerasTensor(
            (*query.shape[:-1], key.shape[-2]), dtype=self.compute_dtype)

    def _validate_inputs(self, inputs, mask=None):
        name = type(self).__name__
        if not isinstance(inputs, list):
            raise ValueError(
                f"{name} layer must be called on a list of inputs, namely "
                "[query, value] or [query, value, key]. Received: "
                f"inputs={inputs}.")
        if len(inputs) < 2 or len(inputs) > 3:
            raise ValueError(
                f"{name} layer accepts inputs list of length 2 or 3, namely "
                "[query, value] or [query, value, key]. Received length: "
                f"{len(inputs)}.")
        for x in inputs:
            shape = x if isinstance(x, (tuple, list)) else x.shape
            check_model_axis(self.name, self.num_models, tuple(shape))
        if mask is not None:
            if not isinstance(mask, list):
                raise ValueError(
                    f"{name} layer mask must be a list, namely "
                    f"[query_mask, value_mask]. Received: mask={mask}.")
            if len(mask) < 2 or len(mask) > 3:
                raise ValueError(
                    f"{name} layer accepts mask list of length 2 or 3. "
                    f"Received: inputs={inputs}, mask={mask}.")

    def get_config(self):
        config = super().get_config()
        config.update({"use_scale": self.use_scale,
                       "score_mode": self.score_mode,
                       "dropout": self.dropout, "seed": self.seed})
        return config


@hftatf_export
@registry.register(keras.layers.AdditiveAttention)
class FusedAdditiveAttention(FusedAttention):
    """`keras.layers.AdditiveAttention` for an array of `num_models` models.

    Layout: as `FusedAttention`; the one weight is `scale` `[B, dim]` (with
    `use_scale`). Model `b` computes what the stock layer computes with
    `scale[b]`. Each scale slice is initialised as a separate stock layer
    would be.

    Args:
        num_models: the number of models `B` in the array.
        use_scale, dropout, seed: as in `keras.layers.AdditiveAttention`.
    """

    def __init__(self, num_models, use_scale=True, dropout=0.0, **kwargs):
        super().__init__(num_models, use_scale=use_scale, dropout=dropout,
                         **kwargs)

    def build(self, input_shape):
        self._validate_inputs(input_shape)
        self.scale = None
        if self.use_scale:
            self.scale = self.add_model_weight(
                (input_shape[0][-1],), "scale", "glorot_uniform")

    def _calculate_scores(self, query, key):
        sums = ops.expand_dims(query, axis=-2) + ops.expand_dims(key, axis=-3)
        scale = (1.0 if self.scale is None
                 else self._model_weight(self.scale, len(sums.shape)))
        return ops.sum(scale * ops.tanh(sums), axis=-1)

    def get_config(self):
        config = super().get_config()
        del config["score_mode"]
        return config
