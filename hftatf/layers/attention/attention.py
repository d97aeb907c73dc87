"""Fused dot-product and additive attention (`Attention`,
`AdditiveAttention`)."""


import keras
from keras import ops

# The stock equation builders: using them keeps the fused weights' shapes
# and the order of attention axes exactly those of the stock layer.
from hftatf.api import hftatf_export
from hftatf.core.validation import check_model_axis
from hftatf.layers import registry
from hftatf.layers.base import FusedLayer


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
