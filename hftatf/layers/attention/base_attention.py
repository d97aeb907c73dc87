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


import keras
from keras import ops

from hftatf.core.axis import fold_models, swap_model_axis, unfold_models
from hftatf.core.validation import check_model_axis
from hftatf.layers.base import FusedLayer
from hftatf.layers.einsum_dense import FusedEinsumDense


class FusedAttentionBase(FusedLayer):
    """Shared machinery of the fused attention layers.

    Subclasses build their projections `_query_dense`, `_key_dense`,
    `_value_dense`, `_output_dense` (and `_gate_dense` with `use_gate`)
    with `_dense`, set the stock `_dot_product_equation` and
    `_combine_equation`, `_softmax`, `_dropout_layer` and `_scale`, say
    the shape of their attention scores (`_scores_shape`), and call
    `_attend`.

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

    @property
    def dropout(self):
        return self._dropout

    @property
    def use_bias(self):
        return self._use_bias

    def _dense(self, equation, output_shape, bias_axes, name, input_shape,
               activation=None):
        """A projection sublayer, configured as the stock layer configures
        its `EinsumDense` sublayers (each gets its own copy of the
        initializers, as in the stock layer), built for the fused
        `input_shape`."""
        kernel_initializer = type(self._kernel_initializer).from_config(
            self._kernel_initializer.get_config())
        bias_initializer = type(self._bias_initializer).from_config(
            self._bias_initializer.get_config())
        dense = FusedEinsumDense(
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
        dense.build(input_shape)
        return dense

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

    def _attend(self, query, value, key, query_mask, value_mask, key_mask,
                attention_mask, training, return_attention_scores,
                use_causal_mask, num_axes=1):
        """`(output, scores)` of the stock layer's call on fused inputs
        (`key` given): the masks merged, query, key and value projected,
        attention, the gate, the output projection."""
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
        output, scores = self._compute_attention(
            self._query_dense(query), self._key_dense(key),
            self._value_dense(value), attention_mask, training,
            return_attention_scores, use_causal_mask=causal_only,
            num_axes=num_axes, models_first=models_first)
        if self._use_gate:
            output = ops.multiply(output, gate)
        return self._output_dense(output), scores

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
        return output_spec, keras.KerasTensor(
            self._scores_shape(query.shape, value.shape,
                               value.shape if key is None else key.shape),
            dtype=self.compute_dtype)

    def get_config(self):
        config = super().get_config()
        config.update({
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
        })
        return config
