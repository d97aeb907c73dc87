"""LoRA in arrays against its oracle: B stock models with LoRA enabled.

Each model of an array adapts its own frozen weight with its own factors:
its outputs, the weights it trains (only the factors and what the stock
model leaves trainable) and its weights after training with a learning
rate of its own are those of its stock twin. So are its weights after
unfusing, selecting, exporting and reloading.
"""

import keras
import numpy as np
import pytest
from testing import assert_close

import hftatf
from hftatf.layers import FusedConv2D, FusedDense, FusedEmbedding

B = 2
RATES = [0.05, 0.1]
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
L = keras.layers


def _dense():
    inputs = keras.Input((6,))
    hidden = L.Dense(8, activation="relu", name="adapted")(inputs)
    return keras.Model(inputs, L.Dense(3, name="head")(hidden)), (6,)


def _einsum_dense():
    inputs = keras.Input((4, 6))
    hidden = L.EinsumDense("abc,cd->abd", (4, 5), bias_axes="d",
                           name="adapted")(inputs)
    outputs = L.Dense(3, name="head")(L.Flatten()(hidden))
    return keras.Model(inputs, outputs), (4, 6)


def _embedding():
    inputs = keras.Input((5,), dtype="int32")
    hidden = L.GlobalAveragePooling1D()(L.Embedding(20, 6, name="adapted")(
        inputs))
    return keras.Model(inputs, L.Dense(3, name="head")(hidden)), None


def _conv():
    inputs = keras.Input((8, 8, 3))
    hidden = L.Conv2D(4, 3, activation="relu", name="adapted")(inputs)
    outputs = L.Dense(3, name="head")(L.GlobalAveragePooling2D()(hidden))
    return keras.Model(inputs, outputs), (8, 8, 3)


def _attention():
    """An attention block fine-tuned as keras-hub's `enable_lora` does:
    every layer frozen, LoRA on the query and value projections."""
    inputs = keras.Input((5, 8))
    attended = L.MultiHeadAttention(2, 4, name="attention")(inputs, inputs)
    hidden = L.LayerNormalization(name="norm")(attended + inputs)
    outputs = L.Dense(3, name="head")(L.GlobalAveragePooling1D()(hidden))
    model = keras.Model(inputs, outputs)
    attention = model.get_layer("attention")
    for layer in (attention, model.get_layer("norm")):
        layer.trainable = False
    for projection in (attention.query_dense, attention.value_dense):
        projection.trainable = True
        projection.enable_lora(2)
    return model, (5, 8)


def _inputs(shape, rng):
    if shape is None:
        return rng.integers(0, 20, (32, 5))
    return rng.normal(size=(32, *shape)).astype("float32")


def _adapted(build):
    """A stock model with LoRA on its layer 'adapted' (rank 3, scale 2)."""
    model, shape = build()
    if build is not _attention:
        model.get_layer("adapted").enable_lora(3, lora_alpha=6)
    return model, shape


def _with_random_factors(array, rng):
    """The array with its `b` factors random (they start at zero), so that
    each model's outputs depend on both of its factors."""
    for weight in array.weights:
        if weight.path.endswith("_b") and "lora" in weight.path:
            weight.assign(0.3 * rng.normal(size=weight.shape))
    return array


@pytest.fixture
def rng():
    return np.random.default_rng(0)


def _trainable_paths(model):
    return [weight.path for weight in model.trainable_weights]


BUILDERS = [_dense, _einsum_dense, _embedding, _conv, _attention]


@pytest.mark.parametrize("build", BUILDERS,
                         ids=lambda build: build.__name__[1:])
def test_each_model_trains_its_factors_as_its_stock_twin(build, rng):
    model, shape = _adapted(build)
    x, y = _inputs(shape, rng), rng.integers(0, 3, 32)
    array = _with_random_factors(hftatf.fuse(model, B), rng)
    assert _trainable_paths(array) == _trainable_paths(model)
    twins = array.unfuse()
    predicted = array.predict(x, verbose=0)
    # Adam, but SGD for the attention block: there Adam turns float32
    # rounding in small gradients (a projection's bias under a
    # normalization) into differences of a part in a thousand.
    name = "SGD" if build is _attention else "Adam"
    array.compile(getattr(hftatf.optimizers, name)(RATES), loss=LOSS)
    history = array.fit(x, y, batch_size=8, epochs=2, shuffle=False,
                        verbose=0)
    trained = array.unfuse(compile=False)
    for b, twin in enumerate(twins):
        assert _trainable_paths(twin) == _trainable_paths(model)
        assert_close(predicted[:, b], twin.predict(x, verbose=0),
                     err_msg=f"model {b}")
        twin.compile(getattr(keras.optimizers, name)(RATES[b]), loss=LOSS)
        expected = twin.fit(x, y, batch_size=8, epochs=2, shuffle=False,
                            verbose=0)
        assert_close(history.history[f"loss_{b}"], expected.history["loss"],
                     err_msg=f"loss of model {b}")
        for got, want in zip(trained[b].weights, twin.weights):
            assert_close(got, want, err_msg=f"{want.path}, model {b}")
    # The frozen weights did not move.
    for got, start in zip(array.weights, hftatf.fuse_models(twins).weights):
        if not got.trainable:
            np.testing.assert_array_equal(got, start)


@pytest.mark.parametrize("build", [_conv, _attention],
                         ids=lambda build: build.__name__[1:])
def test_factors_survive_saving_selecting_and_export(build, rng, tmp_path):
    model, shape = _adapted(build)
    x = _inputs(shape, rng)
    array = _with_random_factors(hftatf.fuse(model, B), rng)
    predicted = array.predict(x, verbose=0)

    array.save(tmp_path / "array.keras")
    loaded = keras.models.load_model(tmp_path / "array.keras")
    assert _trainable_paths(loaded) == _trainable_paths(array)
    assert_close(loaded.predict(x, verbose=0), predicted)

    selected = array.select([1])
    assert _trainable_paths(selected) == _trainable_paths(array)
    assert_close(selected.predict(x, verbose=0)[:, 0], predicted[:, 1])

    # As stock Keras saves a model with LoRA: the factors merged into the
    # weight they adapt.
    array.export_models(tmp_path / "export")
    exported = keras.models.load_model(
        tmp_path / "export" / "model_1" / "model.keras")
    assert_close(exported.predict(x, verbose=0), predicted[:, 1])


def test_fuse_models_serves_models_saved_after_lora(rng, tmp_path):
    """Models fine-tuned with LoRA and saved (factors merged, LoRA still
    enabled in their configs) fuse into an array that predicts as each."""
    paths = []
    for b in range(B):
        model, _ = _adapted(_dense)
        model.get_layer("adapted").lora_kernel_b.assign(
            rng.normal(size=(3, 8)))
        paths.append(tmp_path / f"model_{b}.keras")
        model.save(paths[-1])
    x = _inputs((6,), rng)
    array = hftatf.fuse_models(paths)
    for b, path in enumerate(paths):
        assert_close(array.predict(x, verbose=0)[:, b],
                     keras.models.load_model(path).predict(x, verbose=0))


def test_enable_lora_on_an_array_draws_factors_per_model(rng):
    model, shape = _dense()
    array = hftatf.fuse(model, B)
    layer = array.get_layer("adapted")
    layer.enable_lora(2, lora_alpha=4)
    assert (layer.lora_rank, layer.lora_alpha) == (2, 4)
    assert not layer._kernel.trainable
    factors = keras.ops.convert_to_numpy(layer.lora_kernel_a)
    assert not np.allclose(factors[0], factors[1])
    np.testing.assert_array_equal(layer.lora_kernel_b, 0.0)
    # Each unfused model has LoRA with the array's scale: it predicts as
    # the array once its factors are random.
    _with_random_factors(array, rng)
    x = _inputs(shape, rng)
    for b, twin in enumerate(array.unfuse()):
        assert twin.get_layer("adapted").lora_alpha == 4
        assert_close(array.predict(x, verbose=0)[:, b],
                     twin.predict(x, verbose=0))


def test_lora_rank_in_the_constructor_enables_it_when_built():
    layer = FusedEmbedding(B, 10, 4, lora_rank=2, name="table")
    layer.build()
    assert layer.lora_enabled
    assert [w.path for w in layer.trainable_weights] == [
        "table/lora_embeddings_a", "table/lora_embeddings_b"]
    assert [tuple(w.shape) for w in layer.weights] == [
        (B, 10, 4), (B, 10, 2), (B, 2, 4)]
    assert layer.get_config()["lora_rank"] == 2


def test_enable_lora_refuses_as_the_stock_layer(rng):
    unbuilt = FusedDense(B, 3)
    with pytest.raises(ValueError, match="isn't yet built"):
        unbuilt.enable_lora(2)
    constrained = FusedConv2D(B, 2, 3, kernel_constraint="max_norm")
    constrained.build((1, B, 5, 5, 2))
    with pytest.raises(ValueError, match="kernel_constraint"):
        constrained.enable_lora(2)
    layer = FusedDense(B, 3)
    layer.build((1, B, 4))
    with pytest.raises(ValueError, match="positive integer.*rank=0"):
        layer.enable_lora(0)
    layer.enable_lora(2)
    with pytest.raises(ValueError, match="already enabled"):
        layer.enable_lora(2)


def test_a_frozen_projection_in_a_trainable_attention_layer_stays_frozen():
    # No LoRA: a flag the attention layer's config leaves out.
    inputs = keras.Input((5, 8))
    attention = L.MultiHeadAttention(2, 4, name="attention")
    model = keras.Model(inputs, attention(inputs, inputs))
    attention.key_dense.trainable = False
    array = hftatf.fuse(model, B)
    assert _trainable_paths(array) == _trainable_paths(model)
    assert "attention/key/kernel" not in _trainable_paths(array)
    for twin in array.unfuse():
        assert _trainable_paths(twin) == _trainable_paths(model)


class AttentionBlock(keras.layers.Layer):
    """A block of one's own around an attention layer: the array runs it
    once per model."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.attention = L.MultiHeadAttention(2, 4, name="attention")

    def build(self, input_shape):
        self.attention.build(input_shape, input_shape)

    def call(self, inputs):
        return self.attention(inputs, inputs) + inputs


def test_lora_inside_a_frozen_layer_run_per_model_trains_as_stock(rng):
    # keras-hub's `backbone.enable_lora`: the block frozen, its query
    # projection trainable with LoRA.
    inputs = keras.Input((5, 8))
    block = AttentionBlock(name="block")
    outputs = L.Dense(3, name="head")(L.GlobalAveragePooling1D()(
        block(inputs)))
    model = keras.Model(inputs, outputs)
    block.trainable = False
    block.attention.query_dense.trainable = True
    block.attention.query_dense.enable_lora(2)
    x, y = _inputs((5, 8), rng), rng.integers(0, 3, 32)
    with pytest.warns(UserWarning, match="once per model"):
        array = _with_random_factors(hftatf.fuse(model, B), rng)
    # The query's bias and factors, and the head's kernel and bias.
    assert len(array.trainable_weights) == len(model.trainable_weights) == 5
    twins = array.unfuse()
    array.compile(hftatf.optimizers.SGD(RATES), loss=LOSS)
    array.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    trained = array.unfuse(compile=False)
    for b, twin in enumerate(twins):
        assert _trainable_paths(twin) == _trainable_paths(model)
        twin.compile(keras.optimizers.SGD(RATES[b]), loss=LOSS)
        twin.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        for got, want in zip(trained[b].weights, twin.weights):
            assert_close(got, want, err_msg=f"{want.path}, model {b}")
