"""BERT with its masked-language-model head: shapes, padding and segments,
arrays against stock models, export, and learning on CPython's docs."""

import keras
import numpy as np
import pytest
from testing import STEP_JIT, STOCK_NETWORK, assert_close

import hftatf
from hftatf.core.devices import compiling_with_xla
from hftatf.layers import dense
from hftatf.models import bert, masked_lm, recipes, text

B = 3
VOCABULARY = 50
RATES = [0.05, 0.1, 0.2]


def small_bert(**kwargs):
    args = dict(num_layers=1, hidden_dim=16, num_heads=2, intermediate_dim=24,
                max_length=16, dropout=0.0)
    args.update(kwargs)
    return bert.build(VOCABULARY, **args)


def mlm_batch(n=16, length=10, seed=0):
    """Random sentence pairs with padding, masked as BERT masks them."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(len(text.SPECIAL_TOKENS), VOCABULARY,
                       (n, length)).astype("int32")
    lengths = rng.integers(4, length + 1, n)
    segments = np.zeros_like(ids)
    for row, size in enumerate(lengths):
        ids[row, size:] = text.PAD_ID
        segments[row, size // 2:size] = 1
    masked, labels = masked_lm.mask_token_array(ids, rng, VOCABULARY,
                                                mask_rate=0.3)
    return {"token_ids": masked, "segment_ids": segments}, labels


# -- the stock model --------------------------------------------------------


@STOCK_NETWORK
@pytest.mark.parametrize("size", ["tiny", "base"])
def test_spec_table_sizes(size):
    spec = bert.SPECS[size]
    model = bert.build(100, size=size, max_length=32)
    hidden, inner = spec["hidden_dim"], spec["intermediate_dim"]
    block = (4 * (hidden * hidden + hidden) + 2 * 2 * hidden
             + hidden * inner + inner + inner * hidden + hidden)
    embeddings = (100 + 32 + 2) * hidden + 2 * hidden
    head = hidden * hidden + hidden + 2 * hidden + hidden * 100 + 100
    assert model.count_params() == (
        embeddings + spec["num_layers"] * block + head)


def test_output_shape_and_encoder():
    inputs, _ = mlm_batch(4)
    assert small_bert()(inputs).shape == (4, 10, VOCABULARY)
    encoder = bert.encoder(VOCABULARY, num_layers=1, hidden_dim=16,
                           num_heads=2, intermediate_dim=24, max_length=16)
    assert encoder(inputs).shape == (4, 10, 16)


def test_padding_is_invisible_to_real_tokens():
    model = small_bert(num_layers=2)
    inputs, _ = mlm_batch(4, length=6)
    inputs["token_ids"][:, :] = np.maximum(inputs["token_ids"], 5)
    padded = {key: np.pad(value, ((0, 0), (0, 4)))
              for key, value in inputs.items()}
    assert_close(model(padded)[:, :6], model(inputs), atol=2e-5)
    # Without the mask the padding would be attended to: the outputs of
    # real tokens change when a padded position becomes a token.
    unpadded = {key: value.copy() for key, value in padded.items()}
    unpadded["token_ids"][:, 6] = 7
    assert not np.allclose(model(unpadded)[:, :6], model(inputs))


def test_segments_matter():
    model = small_bert()
    inputs, _ = mlm_batch(2)
    other = dict(inputs, segment_ids=1 - inputs["segment_ids"])
    assert not np.allclose(model(inputs), model(other))


def test_tied_head_reuses_the_token_table():
    tied = small_bert(tie_embeddings=True)
    assert small_bert().count_params() - tied.count_params() == (
        16 * VOCABULARY + VOCABULARY)
    inputs, _ = mlm_batch(2)
    assert tied(inputs).shape == (2, 10, VOCABULARY)


def test_masked_lm_loss_counts_masked_positions_only():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 5, 7)).astype("float32")
    labels = np.full((3, 5), text.IGNORED_LABEL)
    labels[0, 1], labels[2, 4] = 3, 6
    expected = np.mean([
        keras.losses.sparse_categorical_crossentropy(
            labels[i, j], logits[i, j], from_logits=True)
        for i, j in ((0, 1), (2, 4))])
    assert_close(masked_lm.masked_lm_loss()(labels, logits), expected)


# -- arrays against stock models --------------------------------------------


@pytest.mark.parametrize("sizes", [{}, {"hidden_dim": 32,
                                       "intermediate_dim": 128}],
                         ids=["broadcast-products", "models-first-products"])
def test_array_trains_as_stock_models(sizes):
    # (Tied heads train as stock ones in test_transformer.py.) Wider
    # layers take the models-first products, which keep that layout from
    # one product to the next and through attention; under XLA (every
    # step on JAX) all products do.
    hidden = sizes.get("hidden_dim", 16)
    inner = sizes.get("intermediate_dim", 24)
    assert dense.products_models_first(
        (8, B, 10, hidden), B, hidden, inner) == (
            bool(sizes) or compiling_with_xla())
    array = hftatf.fuse(small_bert(**sizes), B)
    stock = array.unfuse()
    inputs, labels = mlm_batch(24)
    # SGD: a fused Embedding's dense gradient equals the stock sparse
    # update only for optimizers without per-row state.
    array.compile(hftatf.optimizers.SGD(RATES, momentum=0.9),
                  loss=masked_lm.masked_lm_loss(), jit_compile=STEP_JIT)
    history = array.fit(inputs, labels, batch_size=8, epochs=1,
                        shuffle=False, verbose=0)
    for b, reference in enumerate(stock):
        reference.compile(keras.optimizers.SGD(RATES[b], momentum=0.9),
                          loss=masked_lm.masked_lm_loss())
        stock_history = reference.fit(inputs, labels, batch_size=8,
                                      epochs=1, shuffle=False, verbose=0)
        for ours, theirs in zip(array.unfuse()[b].weights,
                                reference.weights):
            assert_close(ours, theirs, err_msg=f"model {b} {theirs.path}")
        assert_close(history.history[f"loss_{b}"],
                     stock_history.history["loss"])


def test_export_round_trip(tmp_path):
    array = hftatf.fuse(small_bert(), 2)
    array.compile(hftatf.optimizers.SGD([0.1, 0.3]),
                  loss=masked_lm.masked_lm_loss(), jit_compile=STEP_JIT)
    inputs, labels = mlm_batch(8)
    array.fit(inputs, labels, batch_size=8, epochs=1, verbose=0)
    hftatf.export_models(array, tmp_path, format="keras")
    logits = array.predict(inputs, verbose=0)
    assert not np.allclose(logits[:, 0], logits[:, 1])
    for b in range(2):
        model = keras.models.load_model(tmp_path / f"model_{b}" /
                                        "model.keras")
        assert_close(model.predict(inputs, verbose=0), logits[:, b])


@pytest.mark.parametrize("name", ["bert_tiny", "bert_mini"])
def test_recipes(name):
    recipe = recipes.get(name)
    model = recipe.build(**recipe.model_args)
    assert model.get_layer("block_0_attention").num_heads == bert.SPECS[
        recipe.model_args["size"]]["num_heads"]
    train, _ = recipe.data(2, **recipe.data_args)
    inputs, labels = next(iter(train))
    logits = model(inputs)
    assert logits.shape == (2, 64, recipe.model_args["vocabulary_size"])
    assert np.isfinite(float(recipe.loss(labels, logits)))


# -- convergence ------------------------------------------------------------


@pytest.mark.full_scale
def test_array_masked_lm_loss_decreases_clearly():
    data_args = dict(sequence_length=32, vocabulary_size=1000)
    train, validation = masked_lm.masked_lm_data(32, **data_args)
    model = bert.build(1000, num_layers=2, hidden_dim=64, num_heads=4,
                       intermediate_dim=128, max_length=32, dropout=0.0)
    array = hftatf.fuse(model, 3)
    array.compile(hftatf.optimizers.Adam([2e-3, 1e-3, 5e-4]),
                  loss=masked_lm.masked_lm_loss())
    start = array.evaluate(validation, verbose=0, return_dict=True)
    # After 2 epochs the models are at 5.0-5.1.
    history = array.fit(train, epochs=2, validation_data=validation,
                        verbose=0)
    for b in range(3):
        initial = start[f"loss_{b}"]
        final = history.history[f"val_loss_{b}"][-1]
        # From about log(1000) = 6.9 (uniform guesses).
        assert final < initial - 1.5, (b, initial, final)
