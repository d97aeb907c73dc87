"""The Transformer language model: shapes, causality, arrays against stock
models, tied embeddings, export, and learning on CPython's documentation."""

import keras
import numpy as np
import pytest
from testing import (
    STEP_JIT,
    STOCK_NETWORK,
    assert_close,
    compare_layer_with_stock,
    randomize_weights,
    stacked_weights,
)

import hftatf
from hftatf.models import recipes, text, transformer

B = 3
VOCABULARY = 40
RATES = [0.05, 0.1, 0.2]


def small_lm(**kwargs):
    args = dict(num_layers=1, hidden_dim=16, num_heads=2, intermediate_dim=24,
                max_length=12, dropout=0.0)
    args.update(kwargs)
    return transformer.build(VOCABULARY, **args)


def token_batch(n=16, length=10, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, VOCABULARY, (n, length + 1)).astype("int32")
    return ids[:, :-1], ids[:, 1:]


# -- the stock model --------------------------------------------------------


@STOCK_NETWORK
@pytest.mark.parametrize("size", sorted(transformer.SPECS))
def test_spec_table_sizes(size):
    spec = transformer.SPECS[size]
    model = transformer.build(100, size=size, max_length=32)
    hidden, inner = spec["hidden_dim"], spec["intermediate_dim"]
    block = (4 * (hidden * hidden + hidden) + 2 * 2 * hidden
             + hidden * inner + inner + inner * hidden + hidden)
    expected = (100 * hidden + 32 * hidden + spec["num_layers"] * block
                + 2 * hidden + hidden * 100 + 100)
    assert model.count_params() == expected


def test_output_shape_and_overrides():
    model = small_lm(num_layers=3)
    ids, _ = token_batch(4)
    assert model(ids).shape == (4, 10, VOCABULARY)
    blocks = {layer.name.split("_")[1] for layer in model.layers
              if layer.name.startswith("block_")}
    assert blocks == {"0", "1", "2"}
    assert model.get_layer("block_0_attention").num_heads == 2


def test_heads_must_divide_hidden_dim():
    with pytest.raises(ValueError, match="multiple of `num_heads`"):
        small_lm(hidden_dim=10, num_heads=4)
    with pytest.raises(ValueError, match="Unknown size"):
        transformer.build(10, size="huge")


@pytest.mark.parametrize("norm_first", [True, False])
def test_positions_never_see_the_future(norm_first):
    # Two blocks: a leak in the first would reach earlier positions in the
    # second.
    model = small_lm(norm_first=norm_first, num_layers=2)
    ids, _ = token_batch(2)
    changed = ids.copy()
    changed[:, 6:] = (changed[:, 6:] % (VOCABULARY - 1)) + 1
    assert_close(model(ids)[:, :6], model(changed)[:, :6])
    assert not np.allclose(model(ids)[:, 6:], model(changed)[:, 6:])


def test_positions_matter():
    model = small_lm()
    ids = np.full((1, 6), 7, "int32")
    logits = keras.ops.convert_to_numpy(model(ids))
    assert not np.allclose(logits[0, 0], logits[0, 5])


# -- tied embeddings --------------------------------------------------------


@pytest.mark.parametrize("reverse", [False, True])
def test_fused_reversible_embedding_matches_stock(reverse):
    rng = np.random.default_rng(0)
    stock = [transformer.ReversibleEmbedding(VOCABULARY, 6)
             for _ in range(B)]
    for layer in stock:
        layer.build((None, 5))
        randomize_weights(layer, rng)
    fused = transformer.FusedReversibleEmbedding(B, VOCABULARY, 6)
    fused.build((None, B, 5))
    fused.set_weights(stacked_weights(stock))
    if reverse:
        inputs = rng.standard_normal((4, B, 5, 6)).astype("float32")
    else:
        inputs = rng.integers(0, VOCABULARY, (4, B, 5)).astype("int32")
    outputs = compare_layer_with_stock(stock, fused, [inputs], rng,
                                       reverse=reverse)
    expected = (4, B, 5, VOCABULARY) if reverse else (4, B, 5, 6)
    assert outputs[0].shape == expected


def test_fused_reversible_embedding_config_round_trip():
    layer = transformer.FusedReversibleEmbedding(B, VOCABULARY, 6,
                                                 mask_zero=True)
    again = transformer.FusedReversibleEmbedding.from_config(
        layer.get_config())
    assert again.get_config() == layer.get_config()
    stock = transformer.ReversibleEmbedding(VOCABULARY, 6)
    fused = hftatf.layers.resolve.fuse_layer(stock, B)
    assert type(fused) is transformer.FusedReversibleEmbedding


def test_tied_model_shares_one_table():
    tied = small_lm(tie_embeddings=True)
    untied = small_lm()
    assert untied.count_params() - tied.count_params() == (
        16 * VOCABULARY + VOCABULARY)
    assert "lm_head" not in [layer.name for layer in tied.layers]


# -- arrays against stock models --------------------------------------------


@pytest.mark.parametrize("norm_first, tie_embeddings",
                         [(True, False), (False, True)])
def test_array_trains_as_stock_models(norm_first, tie_embeddings):
    model = small_lm(norm_first=norm_first, tie_embeddings=tie_embeddings)
    array = hftatf.fuse(model, B)
    stock = array.unfuse()
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    ids, targets = token_batch(24)
    # SGD: a fused Embedding's dense gradient equals the stock sparse
    # update only for optimizers without per-row state.
    array.compile(hftatf.optimizers.SGD(RATES, momentum=0.9), loss=loss,
                  jit_compile=STEP_JIT)
    history = array.fit(ids, targets, batch_size=8, epochs=1, shuffle=False,
                        verbose=0)
    for b, reference in enumerate(stock):
        reference.compile(keras.optimizers.SGD(RATES[b], momentum=0.9),
                          loss=loss)
        stock_history = reference.fit(ids, targets, batch_size=8, epochs=1,
                                      shuffle=False, verbose=0)
        for ours, theirs in zip(array.unfuse()[b].weights,
                                reference.weights):
            assert_close(ours, theirs, err_msg=f"model {b} {theirs.path}")
        assert_close(history.history[f"loss_{b}"],
                     stock_history.history["loss"])


def test_per_model_token_batches():
    array = hftatf.fuse(small_lm(), B, shared_inputs=False)
    stock = array.unfuse()
    rng = np.random.default_rng(3)
    ids = rng.integers(1, VOCABULARY, (5, B, 10)).astype("int32")
    logits = keras.ops.convert_to_numpy(array(ids))
    for b, model in enumerate(stock):
        assert_close(logits[:, b], model(ids[:, b]))


@pytest.mark.parametrize("tie_embeddings", [False, True])
def test_export_round_trip(tmp_path, tie_embeddings):
    array = hftatf.fuse(small_lm(tie_embeddings=tie_embeddings), 2)
    array.compile(hftatf.optimizers.SGD([0.1, 0.2]),
                  loss=keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True), jit_compile=STEP_JIT)
    ids, targets = token_batch(8)
    array.fit(ids, targets, batch_size=8, epochs=1, verbose=0)
    hftatf.export_models(array, tmp_path, format="keras")
    logits = array.predict(ids, verbose=0)
    assert not np.allclose(logits[:, 0], logits[:, 1])
    for b in range(2):
        model = keras.models.load_model(tmp_path / f"model_{b}" /
                                        "model.keras")
        assert_close(model.predict(ids, verbose=0), logits[:, b])


def test_recipe():
    recipe = recipes.get("transformer_lm")
    model = recipe.build(**recipe.model_args)
    train, _ = recipe.data(4, **recipe.data_args)
    ids, targets = next(iter(train))
    assert model(ids).shape == (4, 64, recipe.model_args["vocabulary_size"])
    assert int(np.max(targets)) < recipe.model_args["vocabulary_size"]


# -- convergence ------------------------------------------------------------


@pytest.mark.full_scale
def test_array_perplexity_falls_well_below_the_unigram_baseline():
    data_args = dict(sequence_length=32, vocabulary_size=1000)
    train, validation = text.language_model_data(32, **data_args)
    baseline = text.language_model_baseline(**data_args)
    model = transformer.build(1000, num_layers=2, hidden_dim=64, num_heads=4,
                              intermediate_dim=128, max_length=32,
                              dropout=0.0)
    array = hftatf.fuse(model, 3)
    array.compile(hftatf.optimizers.Adam([3e-3, 1e-3, 3e-4]),
                  loss=keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True))
    history = array.fit(train, epochs=3, validation_data=validation,
                        verbose=0)
    perplexities = [np.exp(history.history[f"val_loss_{b}"][-1])
                    for b in range(3)]
    # The unigram model of these windows scores about 159; after 3 epochs
    # the best model is near 57, the worst near 134.
    assert min(perplexities) < 0.5 * baseline, (perplexities, baseline)
    assert all(p < baseline for p in perplexities), (perplexities, baseline)
