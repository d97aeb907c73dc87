"""BERT: a Transformer encoder with a masked-language-model head.

Plain functional Keras models of stock layers (token, position and segment
`Embedding`s, `LayerNormalization`, `Dropout`, post-norm Transformer blocks
of `MultiHeadAttention` and a GELU feed-forward network), so `hftatf.fuse`
turns them into arrays and each exported model loads without hftatf.

Inputs are a dict of `token_ids` and `segment_ids`, `[batch, T]` int each.
Token id 0 is padding: position ids and the attention mask (padding keys
hidden from every query) are computed from the token ids with `keras.ops`
inside the graph; padded positions' outputs are computed but mean nothing.
"""

import keras

from hftatf.models import masked_lm, recipes
from hftatf.models.transformer import (
    ReversibleEmbedding,
    apply_padding_mask,
    apply_position_ids,
    apply_transformer_block,
    resolve_spec,
)

# The sizes of Google's BERT releases (Turc et al., 2019, for the small
# ones): layers L, hidden size H, heads H / 64, feed-forward 4H.
SPECS = {
    "tiny": dict(num_layers=2, hidden_dim=128, num_heads=2,
                 intermediate_dim=512),
    "mini": dict(num_layers=4, hidden_dim=256, num_heads=4,
                 intermediate_dim=1024),
    "small": dict(num_layers=4, hidden_dim=512, num_heads=8,
                  intermediate_dim=2048),
    "medium": dict(num_layers=8, hidden_dim=512, num_heads=8,
                   intermediate_dim=2048),
    "base": dict(num_layers=12, hidden_dim=768, num_heads=12,
                 intermediate_dim=3072),
}

# BERT initialises every weight matrix from N(0, 0.02) truncated at 2 sigma.
INITIALIZER_STDDEV = 0.02


def _initializer():
    return keras.initializers.TruncatedNormal(stddev=INITIALIZER_STDDEV)


def _inputs(sequence_length):
    return {
        "token_ids": keras.Input((sequence_length,), dtype="int32",
                                 name="token_ids"),
        "segment_ids": keras.Input((sequence_length,), dtype="int32",
                                   name="segment_ids"),
    }


def apply_encoder(inputs, vocabulary_size, spec, max_length=512,
                  num_segments=2, dropout=0.1, layer_norm_epsilon=1e-12,
                  token_embedding=None):
    """BERT's encoder on `inputs` (the dict of `_inputs`): the summed
    embeddings, normalised, then `spec["num_layers"]` post-norm blocks.

    Returns the sequence output `[batch, T, hidden_dim]`.
    """
    token_ids = inputs["token_ids"]
    hidden_dim = spec["hidden_dim"]
    if token_embedding is None:
        token_embedding = keras.layers.Embedding(
            vocabulary_size, hidden_dim,
            embeddings_initializer=_initializer(), name="token_embedding")
    embeddings = [
        token_embedding(token_ids),
        keras.layers.Embedding(
            max_length, hidden_dim, embeddings_initializer=_initializer(),
            name="position_embedding")(apply_position_ids(token_ids)),
        keras.layers.Embedding(
            num_segments, hidden_dim, embeddings_initializer=_initializer(),
            name="segment_embedding")(inputs["segment_ids"]),
    ]
    x = keras.layers.Add(name="embeddings")(embeddings)
    x = keras.layers.LayerNormalization(epsilon=layer_norm_epsilon,
                                        name="embeddings_norm")(x)
    x = keras.layers.Dropout(dropout, name="embeddings_dropout")(x)
    mask = apply_padding_mask(token_ids)
    for index in range(spec["num_layers"]):
        x = apply_transformer_block(
            x, spec["num_heads"], spec["intermediate_dim"], dropout=dropout,
            norm_first=False, attention_mask=mask,
            layer_norm_epsilon=layer_norm_epsilon,
            kernel_initializer=_initializer(), name=f"block_{index}")
    return x


def encoder(vocabulary_size, size="tiny", num_layers=None, hidden_dim=None,
            num_heads=None, intermediate_dim=None, max_length=512,
            num_segments=2, sequence_length=None, dropout=0.1,
            layer_norm_epsilon=1e-12, name="bert_encoder"):
    """The BERT encoder alone: inputs as `build`, output the sequence of
    hidden states `[batch, T, hidden_dim]`. Arguments as for `build`."""
    spec = resolve_spec(SPECS, size, num_layers=num_layers,
                        hidden_dim=hidden_dim, num_heads=num_heads,
                        intermediate_dim=intermediate_dim)
    inputs = _inputs(sequence_length)
    outputs = apply_encoder(inputs, vocabulary_size, spec, max_length,
                            num_segments, dropout, layer_norm_epsilon)
    return keras.Model(inputs, outputs, name=name)


def build(vocabulary_size, size="tiny", num_layers=None, hidden_dim=None,
          num_heads=None, intermediate_dim=None, max_length=512,
          num_segments=2, sequence_length=None, dropout=0.1,
          tie_embeddings=False, layer_norm_epsilon=1e-12,
          name="bert_mlm"):
    """BERT with its masked-language-model head.

    Inputs: `{"token_ids": [batch, T], "segment_ids": [batch, T]}` int
    (token id 0 is padding; T <= `max_length`).
    Output: logits `[batch, T, vocabulary_size]` at every position; train
    with `hftatf.models.masked_lm.masked_lm_loss()`, which counts only the
    masked positions.

    The head is BERT's: `Dense(hidden_dim, gelu)`, LayerNormalization and
    the projection to the vocabulary, a `Dense` of its own by default
    (untied), or the transposed token embedding with
    `tie_embeddings=True` (as the original BERT; then the model holds a
    `hftatf.models.transformer.ReversibleEmbedding`, and the projection
    has no bias).

    Args:
        vocabulary_size: number of token ids.
        size: a key of `SPECS` (`"tiny"` 2x128 ... `"base"` 12x768); the
            next four arguments override its entries.
        num_layers, hidden_dim, num_heads, intermediate_dim: the
            architecture.
        max_length: the longest sequence (rows of the position table).
        num_segments: rows of the segment table.
        sequence_length: a fixed input length, or None for any length.
        dropout: dropout rate of embeddings, attention and residual
            branches.
        tie_embeddings: whether the output projection reuses the token
            embedding table.
        layer_norm_epsilon: epsilon of every LayerNormalization.
        name: the model's name.
    """
    spec = resolve_spec(SPECS, size, num_layers=num_layers,
                        hidden_dim=hidden_dim, num_heads=num_heads,
                        intermediate_dim=intermediate_dim)
    inputs = _inputs(sequence_length)
    token_embedding = None
    if tie_embeddings:
        token_embedding = ReversibleEmbedding(
            vocabulary_size, spec["hidden_dim"],
            embeddings_initializer=_initializer(), name="token_embedding")
    x = apply_encoder(inputs, vocabulary_size, spec, max_length,
                      num_segments, dropout, layer_norm_epsilon,
                      token_embedding=token_embedding)
    x = keras.layers.Dense(spec["hidden_dim"], activation="gelu",
                           kernel_initializer=_initializer(),
                           name="mlm_transform")(x)
    x = keras.layers.LayerNormalization(epsilon=layer_norm_epsilon,
                                        name="mlm_norm")(x)
    if tie_embeddings:
        logits = token_embedding(x, reverse=True)
    else:
        logits = keras.layers.Dense(vocabulary_size,
                                    kernel_initializer=_initializer(),
                                    name="mlm_logits")(x)
    return keras.Model(inputs, logits, name=name)


def _register_recipe(size, learning_rate, epochs):
    recipes.register(recipes.Recipe(
        name=f"bert_{size}",
        build=build,
        data=masked_lm.masked_lm_data,
        loss=masked_lm.masked_lm_loss(),
        metrics=(),
        optimizer="adam",
        learning_rate=learning_rate,
        epochs=epochs,
        model_args=dict(vocabulary_size=2000, size=size, sequence_length=64,
                        max_length=64, dropout=0.1),
        data_args=dict(sequence_length=64, vocabulary_size=2000),
        monitor="val_loss",
        monitor_mode="min",
    ))


_register_recipe("tiny", learning_rate=1e-3, epochs=10)
_register_recipe("mini", learning_rate=5e-4, epochs=5)
