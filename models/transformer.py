"""A decoder-only Transformer language model, and the blocks BERT shares.

The model is a plain functional Keras model made of stock layers
(`Embedding`, `LayerNormalization`, `MultiHeadAttention` with
`use_causal_mask=True`, `Dense`, `Dropout`, `Add`), so `hftatf.fuse` turns
it into an array and each exported model loads without hftatf. Position
ids are computed from the token ids with `keras.ops` inside the graph, so
the model takes token ids only.

With `tie_embeddings=True` the output projection reuses the token
embedding table (`ReversibleEmbedding`, a stock-side layer defined here
with its fused form); such models load with `keras.models.load_model` once
`hftatf.models.transformer` is imported.
"""

import keras
from keras import ops

from hftatf.api import hftatf_export
from hftatf.layers import registry
from hftatf.layers.embedding import FusedEmbedding
from hftatf.models import recipes, text

# GPT-2 "base" is 12 x 768; "tiny" and "small" train on a CPU.
SPECS = {
    "tiny": dict(num_layers=2, hidden_dim=128, num_heads=4,
                 intermediate_dim=512),
    "small": dict(num_layers=4, hidden_dim=256, num_heads=4,
                  intermediate_dim=1024),
    "base": dict(num_layers=12, hidden_dim=768, num_heads=12,
                 intermediate_dim=3072),
}


def resolve_spec(specs, size, **overrides):
    """`specs[size]` with the `overrides` that are not None."""
    if size not in specs:
        raise ValueError(
            f"Unknown size {size!r}. Available: {', '.join(specs)}.")
    spec = dict(specs[size])
    spec.update({k: v for k, v in overrides.items() if v is not None})
    if spec["hidden_dim"] % spec["num_heads"]:
        raise ValueError(
            f"`hidden_dim` ({spec['hidden_dim']}) must be a multiple of "
            f"`num_heads` ({spec['num_heads']}): each head gets "
            "hidden_dim // num_heads dimensions.")
    return spec


# -- blocks -----------------------------------------------------------------


def apply_position_ids(token_ids):
    """`[batch, T]` int32 positions 0..T-1, computed from the token ids with
    `keras.ops` (per sample, so an array folds them over its models)."""
    return ops.cumsum(ops.ones_like(token_ids, dtype="int32"), axis=1) - 1


def apply_padding_mask(token_ids):
    """The attention mask `[batch, 1, T]` that hides padding keys (id 0) from
    every query: the key padding mask of BERT."""
    return ops.expand_dims(ops.not_equal(token_ids, text.PAD_ID), 1)


def apply_transformer_block(x, num_heads, intermediate_dim, dropout=0.0,
                            norm_first=True, use_causal_mask=False,
                            attention_mask=None, layer_norm_epsilon=1e-5,
                            activation="gelu", kernel_initializer=None,
                            name="block"):
    """One Transformer block: self-attention and a feed-forward network,
    each with dropout, a residual connection and LayerNormalization.

    Args:
        x: `[batch, T, hidden_dim]`.
        num_heads: attention heads (`hidden_dim // num_heads` dims each).
        intermediate_dim: width of the feed-forward network.
        dropout: dropout rate of attention probabilities and of both
            residual branches.
        norm_first: pre-norm (GPT-2: normalise each branch's input) if
            True, post-norm (BERT: normalise after each residual sum) if
            False.
        use_causal_mask: whether position t attends to positions <= t only.
        attention_mask: an optional boolean mask broadcastable to
            `[batch, T, T]` (e.g. `apply_padding_mask`).
        layer_norm_epsilon: epsilon of the LayerNormalizations.
        activation: the feed-forward activation.
        kernel_initializer: initializer of every kernel (None: Keras').
        name: prefix of the layer names.
    """
    hidden_dim = x.shape[-1]
    init = {} if kernel_initializer is None else {
        "kernel_initializer": kernel_initializer}

    def norm(tensor, suffix):
        return keras.layers.LayerNormalization(
            epsilon=layer_norm_epsilon, name=f"{name}_{suffix}")(tensor)

    h = norm(x, "attention_norm") if norm_first else x
    h = keras.layers.MultiHeadAttention(
        num_heads, hidden_dim // num_heads, dropout=dropout,
        name=f"{name}_attention", **init)(
            h, h, attention_mask=attention_mask,
            use_causal_mask=use_causal_mask)
    h = keras.layers.Dropout(dropout, name=f"{name}_attention_dropout")(h)
    x = keras.layers.Add(name=f"{name}_attention_residual")([x, h])
    if not norm_first:
        x = norm(x, "attention_norm")
    h = norm(x, "ffn_norm") if norm_first else x
    h = keras.layers.Dense(intermediate_dim, activation=activation,
                           name=f"{name}_ffn_intermediate", **init)(h)
    h = keras.layers.Dense(hidden_dim, name=f"{name}_ffn_output", **init)(h)
    h = keras.layers.Dropout(dropout, name=f"{name}_ffn_dropout")(h)
    x = keras.layers.Add(name=f"{name}_ffn_residual")([x, h])
    if not norm_first:
        x = norm(x, "ffn_norm")
    return x


# -- tied input and output embeddings ---------------------------------------


@hftatf_export
class ReversibleEmbedding(keras.layers.Embedding):
    """`keras.layers.Embedding` that can also project back to the vocabulary.

    `layer(ids)` looks ids up as `Embedding` does; `layer(x, reverse=True)`
    returns the logits `x @ embeddings.T` (`[..., output_dim]` ->
    `[..., input_dim]`), so a language model's output projection shares
    the input table (tied embeddings). Arguments are `Embedding`'s.
    """

    def call(self, inputs, reverse=False):
        if reverse:
            return ops.matmul(inputs, ops.transpose(
                ops.cast(self.embeddings, inputs.dtype)))
        return super().call(inputs)

    def compute_mask(self, inputs, mask=None):
        # Reverse calls take float features; logits carry no padding mask.
        if keras.backend.is_float_dtype(inputs.dtype):
            return None
        return super().compute_mask(inputs, mask)

    def compute_output_spec(self, inputs, reverse=False):
        if reverse:
            return keras.KerasTensor((*inputs.shape[:-1], self.input_dim),
                                     dtype=self.compute_dtype)
        return super().compute_output_spec(inputs)


@hftatf_export
@registry.register(ReversibleEmbedding)
class FusedReversibleEmbedding(FusedEmbedding):
    """`ReversibleEmbedding` for an array of `num_models` models.

    Layout:
        lookup: ids `[batch, B, ...]` -> `[batch, B, ..., output_dim]`, as
            `FusedEmbedding`.
        reverse: `[batch, B, ..., output_dim]` -> logits
            `[batch, B, ..., input_dim]`; model `b` multiplies by the
            transpose of its own table.
        embeddings: `[B, input_dim, output_dim]`.

    The table's gradient is dense: a tied table's is, in the stock layer
    too (the sum of the lookups' sparse gradient and the projection's dense
    one).

    Args:
        num_models: the number of models `B`.
        **kwargs: as for `FusedEmbedding` (the stock `Embedding` arguments).
    """

    sparse_gradient = False

    def call(self, inputs, reverse=False):
        if not reverse:
            return super().call(inputs)
        shape = ops.shape(inputs)
        flat = ops.reshape(inputs, (shape[0], self.num_models, -1,
                                    self.output_dim))
        logits = ops.einsum("bmtd,mvd->bmtv", flat, ops.cast(
            self.embeddings, inputs.dtype))
        return ops.reshape(logits, (*shape[:-1], self.input_dim))

    def compute_mask(self, inputs, mask=None):
        if keras.backend.is_float_dtype(inputs.dtype):
            return None
        return super().compute_mask(inputs, mask)

    def compute_output_spec(self, inputs, reverse=False):
        if reverse:
            return keras.KerasTensor((*inputs.shape[:-1], self.input_dim),
                                     dtype=self.compute_dtype)
        return keras.KerasTensor(self.compute_output_shape(inputs.shape),
                                 dtype=self.compute_dtype)


# -- the language model -----------------------------------------------------


def build(vocabulary_size, size="tiny", num_layers=None, hidden_dim=None,
          num_heads=None, intermediate_dim=None, max_length=256,
          sequence_length=None, dropout=0.1, norm_first=True,
          tie_embeddings=False, layer_norm_epsilon=1e-5,
          name="transformer_lm"):
    """A decoder-only Transformer language model (GPT-2 style).

    Token and learned position embeddings are summed, passed through
    `num_layers` causal Transformer blocks and a final LayerNormalization
    (pre-norm; post-norm blocks end without one) and projected to
    next-token logits.

    Input: `token_ids`, `[batch, T]` int (T <= `max_length`).
    Output: logits `[batch, T, vocabulary_size]`; position t predicts token
    t + 1. Train with
    `keras.losses.SparseCategoricalCrossentropy(from_logits=True)`.

    Args:
        vocabulary_size: number of token ids.
        size: a key of `SPECS` (`"tiny"`, `"small"`, `"base"`); the next
            four arguments override its entries.
        num_layers, hidden_dim, num_heads, intermediate_dim: the
            architecture.
        max_length: the longest sequence (rows of the position table).
        sequence_length: a fixed input length, or None for any length.
        dropout: dropout rate of embeddings, attention and residual
            branches.
        norm_first: pre-norm blocks (True) or post-norm (False).
        tie_embeddings: whether the output projection is the transposed
            token embedding (`ReversibleEmbedding`) rather than its own
            `Dense` layer.
        layer_norm_epsilon: epsilon of every LayerNormalization.
        name: the model's name.
    """
    spec = resolve_spec(SPECS, size, num_layers=num_layers,
                        hidden_dim=hidden_dim, num_heads=num_heads,
                        intermediate_dim=intermediate_dim)
    token_ids = keras.Input((sequence_length,), dtype="int32",
                            name="token_ids")
    embedding_class = (ReversibleEmbedding if tie_embeddings
                       else keras.layers.Embedding)
    token_embedding = embedding_class(vocabulary_size, spec["hidden_dim"],
                                      name="token_embedding")
    x = token_embedding(token_ids)
    positions = keras.layers.Embedding(
        max_length, spec["hidden_dim"], name="position_embedding")(
            apply_position_ids(token_ids))
    x = keras.layers.Add(name="embeddings")([x, positions])
    x = keras.layers.Dropout(dropout, name="embeddings_dropout")(x)
    for index in range(spec["num_layers"]):
        x = apply_transformer_block(
            x, spec["num_heads"], spec["intermediate_dim"], dropout=dropout,
            norm_first=norm_first, use_causal_mask=True,
            layer_norm_epsilon=layer_norm_epsilon, name=f"block_{index}")
    if norm_first:
        x = keras.layers.LayerNormalization(
            epsilon=layer_norm_epsilon, name="final_norm")(x)
    if tie_embeddings:
        logits = token_embedding(x, reverse=True)
    else:
        logits = keras.layers.Dense(vocabulary_size, name="lm_head")(x)
    return keras.Model(token_ids, logits, name=name)


recipes.register(recipes.Recipe(
    name="transformer_lm",
    build=build,
    data=text.language_model_data,
    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    metrics=(),
    optimizer="adam",
    learning_rate=1e-3,
    epochs=10,
    model_args=dict(vocabulary_size=2000, size="tiny", sequence_length=64,
                    max_length=64, dropout=0.1),
    data_args=dict(sequence_length=64, vocabulary_size=2000),
    monitor="val_loss",
    monitor_mode="min",
))
