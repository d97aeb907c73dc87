"""FusedEmbedding against its oracle: B stock `keras.layers.Embedding`.

Every test builds B stock layers with random tables, stacks the same tables
into one `FusedEmbedding`, and compares what model `b` computes on the ids
`x[:, b]` with what stock layer `b` computes on them.
"""

import keras
import numpy as np
import pytest
from testing import (
    assert_close,
    compare_layer_with_stock,
    stock_and_fused_embeddings,
)

from hftatf import optimizers
from hftatf.core import compat
from hftatf.layers import FusedEmbedding, resolve

BATCH = 4
VOCAB = 7
DIM = 3


def stock_and_fused(num_models, rng, **kwargs):
    return stock_and_fused_embeddings(num_models, VOCAB, DIM, rng, **kwargs)


@pytest.mark.parametrize("num_models", [1, 3])
@pytest.mark.parametrize("inner_shape", [(), (5,), (2, 5)],
                         ids=["rank1", "rank2", "rank3"])
@pytest.mark.parametrize("dtype", ["int32", "int64", "float32"])
def test_matches_stock_embedding(num_models, inner_shape, dtype):
    rng = np.random.default_rng(0)
    stock, fused = stock_and_fused(num_models, rng)
    assert [tuple(w.shape) for w in fused.weights] == [
        (num_models, VOCAB, DIM)]
    # Every id of the vocabulary, so every row of every table is read.
    ids = rng.integers(0, VOCAB, (2 * BATCH, num_models, *inner_shape))
    ids.reshape(-1)[:VOCAB] = np.arange(VOCAB)
    compare_layer_with_stock(stock, fused, [ids.astype(dtype)], rng)


def test_negative_ids_count_from_the_end_of_each_table():
    rng = np.random.default_rng(1)
    stock, fused = stock_and_fused(3, rng)
    ids = rng.integers(-VOCAB, VOCAB, (BATCH, 3, 5)).astype("int32")
    compare_layer_with_stock(stock, fused, [ids], rng)


@pytest.mark.backends("tensorflow",
                      reason="TensorFlow's CPU gather raises on it")
@pytest.mark.parametrize("bad_id", [VOCAB, -VOCAB - 1])
def test_out_of_range_id_fails_like_stock_on_cpu(bad_id):
    # Model 0's out-of-range id must not read model 1's table: on CPU the
    # lookup fails, as the stock lookup does.
    import tensorflow as tf

    rng = np.random.default_rng(2)
    stock, fused = stock_and_fused(2, rng)
    with pytest.raises(tf.errors.InvalidArgumentError):
        stock[0](np.array([[bad_id]], "int32"))
    ids = np.zeros((1, 2, 1), "int32")
    ids[0, 0, 0] = bad_id
    with pytest.raises(tf.errors.InvalidArgumentError):
        fused(ids)


@pytest.mark.backends("jax", reason="`jnp.take` fills; TensorFlow raises")
@pytest.mark.parametrize("bad_id", [VOCAB, -VOCAB - 1])
def test_out_of_range_id_reads_what_stock_reads_on_jax(bad_id):
    # Model 0's out-of-range id must not read model 1's table: it reads
    # what the stock `take` on JAX reads (NaNs), and updates no row.
    rng = np.random.default_rng(2)
    stock, fused = stock_and_fused(2, rng)
    ids = rng.integers(0, VOCAB, (BATCH, 2, 3)).astype("int32")
    ids[0, 0, 0] = bad_id
    ids[1, 1, 2] = bad_id
    compare_layer_with_stock(stock, fused, [ids], rng)
    assert np.isnan(np.asarray(fused(ids))[0, 0, 0]).all()


@pytest.mark.backends("tensorflow", reason="XLA by `tf.function`; on JAX "
                      "every call is compiled (test_stateless_jit.py)")
def test_matches_stock_under_xla():
    import tensorflow as tf

    rng = np.random.default_rng(3)
    stock, fused = stock_and_fused(3, rng)
    ids = rng.integers(0, VOCAB, (BATCH, 3, 5)).astype("int32")
    y = np.asarray(tf.function(fused, jit_compile=True)(ids))
    for b in range(3):
        assert_close(y[:, b], stock[b](ids[:, b]))


@pytest.mark.backends("tensorflow", reason="TensorFlow's XLA gather "
                      "clamps ids; JAX's `take` fills them")
def test_out_of_range_ids_under_xla_stay_in_their_models_table():
    """Under XLA (the array's default on a CPU) no step can raise: as the
    stock layer under XLA, an id out of range reads the first or last row
    of its model's own table and its occurrence updates no row, and a
    model of the array trains as the stock model compiled with XLA."""
    import tensorflow as tf

    rng = np.random.default_rng(4)
    num_models = 3
    stock, fused = stock_and_fused(num_models, rng)
    ids = rng.integers(0, VOCAB, (BATCH, num_models, 5)).astype("int32")
    ids[:, :, 0] = [VOCAB, -VOCAB - 1, 2 * VOCAB]
    ids[:, :, 1] = ids[:, :, 3]  # in range, and repeated
    targets = rng.standard_normal((BATCH, num_models, 5, DIM)).astype(
        "float32")

    def train(layer, ids, targets):
        optimizer = (keras.optimizers.Adam(0.1) if layer in stock else
                     optimizers.Adam(0.1))

        @tf.function(jit_compile=True)
        def step(ids, targets):
            with tf.GradientTape() as tape:
                outputs = layer(ids)
                loss = tf.reduce_sum((outputs - targets) ** 2)
            grads = tape.gradient(loss, layer.trainable_weights)
            optimizer.apply(grads, layer.trainable_weights)
            return outputs

        return np.asarray(step(ids, targets))

    tables = [layer.get_weights()[0] for layer in stock]
    outputs = train(fused, ids, targets)
    for b, layer in enumerate(stock):
        # The stock lookup under XLA: clamped to the model's own table.
        clamped = np.clip(np.where(ids[:, b] < 0, ids[:, b] + VOCAB,
                                   ids[:, b]), 0, VOCAB - 1)
        assert_close(outputs[:, b], tables[b][clamped], atol=0, rtol=0)
        assert_close(outputs[:, b], train(layer, ids[:, b], targets[:, b]))
        assert_close(fused.get_weights()[0][b], layer.get_weights()[0],
                     err_msg=f"model {b}")


@pytest.mark.parametrize("inner_shape", [(5,), (2, 5)],
                         ids=["rank2", "rank3"])
def test_mask_zero_masks_equal_stock_masks(inner_shape):
    rng = np.random.default_rng(4)
    stock, fused = stock_and_fused(3, rng, mask_zero=True)
    ids = rng.integers(0, 3, (BATCH, 3, *inner_shape)).astype("int32")
    y = fused(ids)
    mask = fused.compute_mask(ids)
    assert mask.shape == ids.shape
    np.testing.assert_array_equal(compat.get_keras_mask(y), mask)
    for b, layer in enumerate(stock):
        np.testing.assert_array_equal(
            mask[:, b], layer.compute_mask(ids[:, b]), err_msg=f"model {b}")
        np.testing.assert_array_equal(
            compat.get_keras_mask(y)[:, b],
            compat.get_keras_mask(layer(ids[:, b])))
    assert fused.compute_mask(ids) is not None
    compare_layer_with_stock(stock, fused, [ids], rng)


def test_no_mask_without_mask_zero():
    rng = np.random.default_rng(5)
    _, fused = stock_and_fused(2, rng)
    assert fused.compute_mask(np.zeros((BATCH, 2, 5), "int32")) is None


def test_symbolic_output_shape_and_mask():
    fused = FusedEmbedding(2, VOCAB, DIM, mask_zero=True)
    y = fused(keras.Input((2, 5), dtype="int32"))
    assert tuple(y.shape) == (None, 2, 5, DIM)
    assert tuple(compat.get_keras_mask(y).shape) == (None, 2, 5)


@pytest.mark.backends("tensorflow", reason="stock Keras on JAX takes dense "
                      "embedding gradients (`tf.IndexedSlices` on TF)")
def test_gradient_is_the_stock_sparse_one_per_model():
    # One row per id looked up, of the table flattened to
    # [B * VOCAB, DIM]; model b's rows are b * VOCAB + id. Optimizers
    # against stock: tests/optimizers/test_sparse_gradients.py.
    import tensorflow as tf

    rng = np.random.default_rng(6)
    stock, fused = stock_and_fused(3, rng)
    ids = rng.integers(0, VOCAB, (BATCH, 3, 5)).astype("int32")
    ids[:, :, 0] = -1  # counts from the end of each model's table
    target = rng.standard_normal((BATCH, 3, 5, DIM)).astype("float32")
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum((fused(ids) - target) ** 2)
    (gradient,) = tape.gradient(loss, fused.trainable_weights)
    assert isinstance(gradient, tf.IndexedSlices)
    assert tuple(np.asarray(gradient.dense_shape)) == (3 * VOCAB, DIM)
    dense = tf.reshape(tf.convert_to_tensor(gradient), (3, VOCAB, DIM))
    for b, layer in enumerate(stock):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum((layer(ids[:, b]) - target[:, b]) ** 2)
        (expected,) = tape.gradient(loss, layer.trainable_weights)
        assert isinstance(expected, tf.IndexedSlices)
        mine = np.asarray(gradient.indices) // VOCAB == b
        np.testing.assert_array_equal(
            np.asarray(gradient.indices)[mine] - b * VOCAB,
            np.asarray(expected.indices) % VOCAB)
        assert_close(np.asarray(gradient.values)[mine], expected.values,
                     err_msg=f"model {b}")
        assert_close(dense[b], tf.convert_to_tensor(expected),
                     err_msg=f"model {b}")


# The `weights` argument.


def test_weights_argument_sets_the_tables():
    tables = np.random.default_rng(7).standard_normal(
        (2, VOCAB, DIM)).astype("float32")
    for weights in (tables, [tables]):
        layer = FusedEmbedding(2, VOCAB, DIM, weights=weights)
        np.testing.assert_array_equal(layer.embeddings, tables)
    ids = np.array([[[1, 2], [3, 4]]], "int32")
    y = np.asarray(layer(ids))
    for b in range(2):
        stock = keras.layers.Embedding(VOCAB, DIM, weights=tables[b])
        np.testing.assert_array_equal(y[:, b], stock(ids[:, b]))


def test_weights_argument_of_wrong_shape_is_refused():
    with pytest.raises(ValueError):
        FusedEmbedding(2, VOCAB, DIM, weights=np.zeros((VOCAB, DIM)))


# Initialisation, regularizers and constraints, per model.


def test_seeded_slices_equal_stock_layers_seeded_per_model():
    fused = FusedEmbedding(
        3, VOCAB, DIM,
        embeddings_initializer=keras.initializers.RandomUniform(seed=11))
    fused.build()
    for b in range(3):
        stock = keras.layers.Embedding(
            VOCAB, DIM,
            embeddings_initializer=keras.initializers.RandomUniform(
                seed=11 + b))
        stock.build()
        assert_close(fused.embeddings[b], stock.embeddings, atol=0, rtol=0)


def test_regularizers_give_per_model_losses():
    rng = np.random.default_rng(8)
    kwargs = {"embeddings_regularizer": keras.regularizers.L2(0.01),
              "activity_regularizer": keras.regularizers.L1(0.02)}
    stock, fused = stock_and_fused(3, rng, **kwargs)
    ids = rng.integers(0, VOCAB, (BATCH, 3, 5)).astype("int32")
    fused(ids)
    losses = [np.asarray(loss) for loss in fused.losses]
    assert [loss.shape for loss in losses] == [(3,), (3,)]
    for b, layer in enumerate(stock):
        layer(ids[:, b])
        assert_close(sorted(loss[b] for loss in losses),
                     sorted(np.asarray(loss) for loss in layer.losses),
                     err_msg=f"model {b}")


def test_constraint_applies_per_table():
    rng = np.random.default_rng(9)
    kwargs = {"embeddings_constraint": keras.constraints.MaxNorm(1.0)}
    stock, fused = stock_and_fused(3, rng, **kwargs)
    constrained = np.asarray(fused.embeddings.constraint(fused.embeddings))
    for b, layer in enumerate(stock):
        assert_close(constrained[b],
                     layer.embeddings.constraint(layer.embeddings))


# Serialization and the registry.


def configured_layer():
    return FusedEmbedding(
        3, VOCAB, DIM,
        embeddings_initializer=keras.initializers.RandomNormal(seed=3),
        embeddings_regularizer=keras.regularizers.L2(0.01),
        activity_regularizer=keras.regularizers.L1(0.02),
        embeddings_constraint=keras.constraints.NonNeg(),
        mask_zero=True,
        name="fused_embedding_under_test",
    )


def test_config_round_trip():
    layer = configured_layer()
    config = layer.get_config()
    assert config["num_models"] == 3
    assert config["mask_zero"] is True
    clone = FusedEmbedding.from_config(config)
    assert clone.get_config() == config
    restored = keras.saving.deserialize_keras_object(
        keras.saving.serialize_keras_object(layer))
    assert type(restored) is FusedEmbedding
    assert restored.get_config() == config


def test_registry_builds_from_stock_config():
    stock = keras.layers.Embedding(VOCAB, DIM, mask_zero=True, name="emb")
    fused = resolve.fuse_layer(stock, 2)
    assert type(fused) is FusedEmbedding
    assert (fused.name, fused.input_dim, fused.output_dim, fused.mask_zero) \
        == ("emb", VOCAB, DIM, True)


# Bad input.


def test_rejects_quantization():
    with pytest.raises(ValueError, match="quantization_config"):
        FusedEmbedding(2, VOCAB, DIM, quantization_config=4)


@pytest.mark.parametrize("arg,value", [("input_dim", 0), ("output_dim", 2.0),
                                       ("input_dim", True)])
def test_rejects_bad_dims_like_stock(arg, value):
    kwargs = {"input_dim": VOCAB, "output_dim": DIM, arg: value}
    with pytest.raises(ValueError, match=arg):
        keras.layers.Embedding(**kwargs)
    with pytest.raises(ValueError, match=arg):
        FusedEmbedding(2, **kwargs)


def test_rejects_wrong_model_axis():
    layer = FusedEmbedding(3, VOCAB, DIM)
    with pytest.raises(ValueError, match="num_models=3 on axis 1"):
        layer(np.zeros((BATCH, 2, 5), "int32"))
