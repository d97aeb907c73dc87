"""Fused wrappers against their oracle: B stock TimeDistributed,
Bidirectional and SpectralNormalization layers, with random weights stacked
into one fused wrapper."""

import keras
import numpy as np
import pytest
from test_recurrent import CallWith, per_model_mask
from testing import (
    assert_close,
    compare_layer_with_stock,
    randomize_weights,
    stacked_weights,
    trains_like_stock,
)

import hftatf
from hftatf.layers import (
    FusedBidirectional,
    FusedDense,
    FusedLSTM,
    FusedSpectralNormalization,
    FusedTimeDistributed,
    resolve,
)

BATCH = 3
STEPS = 4
FEATURES = 5
UNITS = 3
NUM_MODELS = 2


def stock_wrappers(make, input_shape, rng, num_models=NUM_MODELS):
    """B built stock wrappers made by `make()`, every weight random."""
    layers = []
    for _ in range(num_models):
        layer = make()
        layer.build((None, *input_shape))
        randomize_weights(layer, rng, scale=0.5)
        layers.append(layer)
    return layers


def fused_twin(stock, input_shape):
    """The fused form from the registry, holding the stock weights."""
    fused = resolve.fuse_layer(stock[0], len(stock))
    fused.build((None, len(stock), *input_shape))
    fused.set_weights(stacked_weights(stock))
    assert [tuple(w.shape) for w in fused.weights] == [
        (len(stock), *w.shape) for w in stock[0].weights]
    return fused


def per_model_inputs(rng, input_shape, num_models=NUM_MODELS):
    return rng.standard_normal(
        (BATCH, num_models, *input_shape)).astype("float32")


# TimeDistributed.


@pytest.mark.parametrize("input_shape", [(STEPS, FEATURES),
                                         (STEPS, 2, FEATURES)],
                         ids=["rank3", "rank4"])
def test_time_distributed_dense_matches_stock(input_shape):
    rng = np.random.default_rng(0)
    stock = stock_wrappers(lambda: keras.layers.TimeDistributed(
        keras.layers.Dense(UNITS, activation="tanh")), input_shape, rng)
    fused = fused_twin(stock, input_shape)
    assert type(fused) is FusedTimeDistributed
    assert type(fused.layer) is FusedDense
    outputs = compare_layer_with_stock(
        stock, fused, [per_model_inputs(rng, input_shape)], rng)
    assert outputs[0].shape == (BATCH, NUM_MODELS, *input_shape[:-1], UNITS)
    assert fused.compute_output_shape((None, NUM_MODELS, *input_shape)) == (
        None, NUM_MODELS, *input_shape[:-1], UNITS)


def test_nested_time_distributed_matches_stock():
    rng = np.random.default_rng(1)
    input_shape = (STEPS, 2, FEATURES)
    stock = stock_wrappers(lambda: keras.layers.TimeDistributed(
        keras.layers.TimeDistributed(keras.layers.Dense(UNITS))),
        input_shape, rng)
    fused = fused_twin(stock, input_shape)
    compare_layer_with_stock(stock, fused,
                             [per_model_inputs(rng, input_shape)], rng)


@pytest.mark.parametrize("training", [True, False])
def test_time_distributed_batch_norm_matches_stock(training):
    # In training, a batch normalization normalizes each timestep by its own
    # statistics and moves its moving statistics once per timestep.
    rng = np.random.default_rng(4)
    input_shape = (STEPS, FEATURES)
    stock = stock_wrappers(lambda: keras.layers.TimeDistributed(
        keras.layers.BatchNormalization(momentum=0.5)), input_shape, rng)
    fused = fused_twin(stock, input_shape)
    x = per_model_inputs(rng, input_shape)
    # Timesteps of different scales: statistics over all of them differ.
    x *= np.arange(1, STEPS + 1, dtype="float32")[None, None, :, None]
    compare_layer_with_stock(stock, fused, [x], rng, training=training)


def test_time_distributed_batch_norm_trains_like_stock():
    # keras.io's video classifiers: convolutions and batch normalization
    # applied to every frame.
    inputs = keras.Input((STEPS, 4, 4, 2))
    hidden = keras.layers.TimeDistributed(
        keras.layers.Conv2D(3, 3, padding="same"))(inputs)
    hidden = keras.layers.TimeDistributed(
        keras.layers.BatchNormalization(momentum=0.5))(hidden)
    hidden = keras.layers.TimeDistributed(
        keras.layers.GlobalAveragePooling2D())(hidden)
    outputs = keras.layers.Dense(2)(keras.layers.GRU(3)(hidden))
    rng = np.random.default_rng(5)
    x = rng.standard_normal((4, STEPS, 4, 4, 2)).astype("float32")
    x *= np.arange(1, STEPS + 1, dtype="float32")[None, :, None, None, None]
    trains_like_stock(keras.Model(inputs, outputs), x,
                      rng.standard_normal((4, 2)).astype("float32"))


def test_time_distributed_batch_norm_with_unknown_timesteps():
    inputs = keras.Input((None, FEATURES))
    outputs = keras.layers.TimeDistributed(
        keras.layers.BatchNormalization(momentum=0.5))(inputs)
    array = hftatf.fuse(keras.Model(inputs, outputs), NUM_MODELS)
    stock = array.unfuse()
    rng = np.random.default_rng(6)
    x = rng.standard_normal((BATCH, STEPS, FEATURES)).astype("float32")
    x *= np.arange(1, STEPS + 1, dtype="float32")[None, :, None]
    y = np.asarray(array(x, training=True))
    trained = array.unfuse()
    for b, twin in enumerate(stock):
        assert_close(y[:, b], twin(x, training=True), err_msg=f"model {b}")
        for got, want in zip(trained[b].get_weights(), twin.get_weights()):
            assert_close(got, want, err_msg=f"model {b}")


def test_couples_batch():
    from hftatf.layers.wrappers import couples_batch

    dense = FusedDense(NUM_MODELS, UNITS)
    dense.build((None, NUM_MODELS, FEATURES))
    assert not couples_batch(dense)
    norm = resolve.fuse_layer(keras.layers.BatchNormalization(), NUM_MODELS)
    norm.build((None, NUM_MODELS, FEATURES))
    assert couples_batch(norm)
    norm.trainable = False  # a frozen batch normalization runs in inference
    assert not couples_batch(norm)


def test_time_distributed_dropout_per_model():
    input_shape = (STEPS, FEATURES)
    fused = FusedTimeDistributed.from_stock(keras.layers.TimeDistributed(
        keras.layers.Dropout(0.5)), NUM_MODELS)
    rng = np.random.default_rng(2)
    x = np.repeat(per_model_inputs(rng, input_shape, 1), NUM_MODELS, axis=1)
    np.testing.assert_array_equal(fused(x, training=False), x)
    y = np.asarray(fused(x, training=True))
    assert not np.allclose(y[:, 0], y[:, 1])
    kept = y != 0
    assert_close(y[kept], 2.0 * x[kept])


def test_time_distributed_passes_the_mask_through():
    fused = FusedTimeDistributed(FusedDense(NUM_MODELS, UNITS), NUM_MODELS)
    x = np.ones((BATCH, NUM_MODELS, STEPS, FEATURES), "float32")
    mask = per_model_mask()
    np.testing.assert_array_equal(fused.compute_mask(x, mask), mask)


def test_time_distributed_in_masked_model_matches_stock():
    rng = np.random.default_rng(3)

    def model():
        return keras.Sequential([
            keras.Input((STEPS, FEATURES)),
            keras.layers.Masking(),
            keras.layers.TimeDistributed(keras.layers.Dense(4)),
            keras.layers.LSTM(UNITS),
        ])

    models = [model() for _ in range(NUM_MODELS)]
    for m in models:
        for layer in m.layers:
            randomize_weights(layer, rng, scale=0.5)
    array = hftatf.fuse_models(models, shared_inputs=False)
    x = per_model_inputs(rng, (STEPS, FEATURES))
    x[~per_model_mask()] = 0.0
    y = np.asarray(array(x))
    for b, m in enumerate(models):
        assert_close(y[:, b], m(x[:, b]), err_msg=f"model {b}")


def test_time_distributed_config_round_trip(tmp_path):
    layer = FusedTimeDistributed(
        FusedDense(3, UNITS, activation="relu",
                   kernel_regularizer=keras.regularizers.L2(0.1)), 3,
        name="fused_td")
    config = layer.get_config()
    assert config["num_models"] == 3
    clone = FusedTimeDistributed.from_config(config)
    assert clone.get_config() == config
    restored = keras.saving.deserialize_keras_object(
        keras.saving.serialize_keras_object(layer))
    assert type(restored) is FusedTimeDistributed
    assert restored.get_config() == config

    rng = np.random.default_rng(4)
    inputs = keras.Input((3, STEPS, FEATURES))
    model = keras.Model(inputs, layer(inputs))
    for w in model.weights:
        w.assign(rng.standard_normal(w.shape).astype("float32"))
    path = tmp_path / "fused_td.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    x = per_model_inputs(rng, (STEPS, FEATURES), 3)
    np.testing.assert_array_equal(loaded(x), model(x))


def test_time_distributed_rejects_bad_input():
    with pytest.raises(ValueError, match="num_models=3"):
        FusedTimeDistributed(FusedDense(3, UNITS), 2)
    layer = FusedTimeDistributed(FusedDense(2, UNITS), 2)
    with pytest.raises(ValueError, match="at least 4 dimensions"):
        layer(np.zeros((BATCH, 2, FEATURES), "float32"))
    with pytest.raises(ValueError, match="num_models=2 on axis 1"):
        layer(np.zeros((BATCH, 3, STEPS, FEATURES), "float32"))


# Bidirectional.


def bidirectional(rnn_class=keras.layers.LSTM, merge_mode="concat",
                  backward=None, **kwargs):
    def make():
        backward_layer = None if backward is None else backward()
        return keras.layers.Bidirectional(
            rnn_class(UNITS, **kwargs), merge_mode=merge_mode,
            backward_layer=backward_layer)
    return make


@pytest.mark.parametrize("return_sequences", [False, True],
                         ids=["last", "sequences"])
@pytest.mark.parametrize("merge_mode", ["concat", "sum", "mul", "ave", None])
def test_bidirectional_lstm_matches_stock(merge_mode, return_sequences):
    rng = np.random.default_rng(5)
    input_shape = (STEPS, FEATURES)
    stock = stock_wrappers(bidirectional(
        merge_mode=merge_mode, return_sequences=return_sequences),
        input_shape, rng)
    fused = fused_twin(stock, input_shape)
    assert type(fused) is FusedBidirectional
    outputs = compare_layer_with_stock(
        stock, fused, [per_model_inputs(rng, input_shape)], rng)
    width = 2 * UNITS if merge_mode == "concat" else UNITS
    inner = (STEPS,) if return_sequences else ()
    expected = (BATCH, NUM_MODELS, *inner, width)
    assert [o.shape for o in outputs] == [expected] * (
        2 if merge_mode is None else 1)
    shape = fused.compute_output_shape((None, NUM_MODELS, *input_shape))
    assert keras.tree.flatten(shape)[-1] == width


@pytest.mark.parametrize("rnn_class,merge_mode", [
    (keras.layers.LSTM, "concat"), (keras.layers.LSTM, None),
    (keras.layers.GRU, "sum"), (keras.layers.SimpleRNN, "ave"),
], ids=["lstm-concat", "lstm-none", "gru-sum", "simple-ave"])
def test_bidirectional_return_state_matches_stock(rnn_class, merge_mode):
    rng = np.random.default_rng(6)
    input_shape = (STEPS, FEATURES)
    stock = stock_wrappers(bidirectional(
        rnn_class, merge_mode=merge_mode, return_sequences=True,
        return_state=True), input_shape, rng)
    fused = fused_twin(stock, input_shape)
    outputs = compare_layer_with_stock(
        stock, fused, [per_model_inputs(rng, input_shape)], rng)
    num_states = 2 * len(stock[0].forward_layer.state_size)
    num_outputs = 2 if merge_mode is None else 1
    assert len(outputs) == num_outputs + num_states
    for state in outputs[num_outputs:]:
        assert state.shape == (BATCH, NUM_MODELS, UNITS)


def test_bidirectional_with_backward_layer_matches_stock():
    rng = np.random.default_rng(7)
    input_shape = (STEPS, FEATURES)
    stock = stock_wrappers(bidirectional(
        return_sequences=True, backward=lambda: keras.layers.GRU(
            UNITS, activation="relu", return_sequences=True,
            go_backwards=True)), input_shape, rng)
    fused = fused_twin(stock, input_shape)
    assert type(fused.backward_layer) is hftatf.layers.FusedGRU
    compare_layer_with_stock(stock, fused,
                             [per_model_inputs(rng, input_shape)], rng)


@pytest.mark.parametrize("rnn_class", [keras.layers.LSTM, keras.layers.GRU],
                         ids=["lstm", "gru"])
def test_bidirectional_mask_and_initial_state_match_stock(rnn_class):
    rng = np.random.default_rng(8)
    input_shape = (STEPS, FEATURES)
    stock = stock_wrappers(bidirectional(
        rnn_class, return_sequences=True, return_state=True), input_shape,
        rng)
    fused = fused_twin(stock, input_shape)
    num_states = 2 * len(stock[0].forward_layer.state_size)
    states = [rng.standard_normal((BATCH, NUM_MODELS, UNITS))
              .astype("float32") for _ in range(num_states)]
    compare_layer_with_stock(
        [CallWith(layer, with_mask=True) for layer in stock],
        CallWith(fused, with_mask=True),
        [per_model_inputs(rng, input_shape), per_model_mask(), *states], rng)


def test_bidirectional_weights_in_stock_order():
    rng = np.random.default_rng(9)
    stock = stock_wrappers(bidirectional(), (STEPS, FEATURES), rng)
    fused = fused_twin(stock, (STEPS, FEATURES))
    # Same sublayer names (forward_..., backward_...) and weight names as
    # the stock wrapper it was fused from.
    names = [w.path.split("/", 1)[1] for w in stock[0].weights]
    assert [w.path.split("/", 1)[1] for w in fused.weights] == names
    assert names[0].startswith("forward_") and names[-1].startswith(
        "backward_")
    for b, layer in enumerate(stock):
        for got, expected in zip(fused.get_weights(), layer.get_weights()):
            np.testing.assert_array_equal(got[b], expected)


def test_bidirectional_config_round_trip(tmp_path):
    layer = FusedBidirectional(
        FusedLSTM(3, UNITS, return_sequences=True, dropout=0.1), 3,
        merge_mode="mul", name="fused_bidirectional")
    config = layer.get_config()
    assert config["num_models"] == 3
    assert config["merge_mode"] == "mul"
    clone = FusedBidirectional.from_config(config)
    assert clone.get_config() == config
    restored = keras.saving.deserialize_keras_object(
        keras.saving.serialize_keras_object(layer))
    assert type(restored) is FusedBidirectional
    assert restored.get_config() == config

    rng = np.random.default_rng(10)
    inputs = keras.Input((3, STEPS, FEATURES))
    model = keras.Model(inputs, layer(inputs))
    for w in model.weights:
        w.assign(rng.standard_normal(w.shape).astype("float32"))
    path = tmp_path / "fused_bidirectional.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    x = per_model_inputs(rng, (STEPS, FEATURES), 3)
    np.testing.assert_array_equal(loaded(x), model(x))


def test_bidirectional_rejects_bad_layers():
    with pytest.raises(TypeError, match="fused recurrent layer"):
        FusedBidirectional(keras.layers.LSTM(UNITS), 2)
    with pytest.raises(ValueError, match="num_models=3"):
        FusedBidirectional(FusedLSTM(3, UNITS), 2)
    with pytest.raises(ValueError, match="merge mode"):
        FusedBidirectional(FusedLSTM(2, UNITS), 2, merge_mode="max")


# A small text classifier through hftatf.fuse_models.


def text_classifier(vocabulary):
    return keras.Sequential([
        keras.Input((STEPS,), dtype="int32"),
        keras.layers.Embedding(vocabulary, 4, mask_zero=True),
        keras.layers.Bidirectional(
            keras.layers.LSTM(UNITS, return_sequences=True)),
        keras.layers.GRU(UNITS),
        keras.layers.Dense(2, activation="softmax"),
    ])


def masked_float_classifier():
    return keras.Sequential([
        keras.Input((STEPS, FEATURES)),
        keras.layers.Masking(),
        keras.layers.Bidirectional(
            keras.layers.LSTM(UNITS, return_sequences=True)),
        keras.layers.GRU(UNITS),
        keras.layers.Dense(2, activation="softmax"),
    ])


def random_models(make, rng):
    models = [make() for _ in range(NUM_MODELS)]
    for m in models:
        for layer in m.layers:
            randomize_weights(layer, rng, scale=0.5)
    return models


def test_fuse_models_text_classifier():
    rng = np.random.default_rng(11)
    vocabulary = 7
    models = random_models(lambda: text_classifier(vocabulary), rng)
    array = hftatf.fuse_models(models)
    ids = rng.integers(1, vocabulary, (BATCH, STEPS))
    ids[0, -2:] = 0  # Padding: masked steps.
    ids[1, :1] = 0
    y = np.asarray(array(ids))
    assert y.shape == (BATCH, NUM_MODELS, 2)
    for b, m in enumerate(models):
        assert_close(y[:, b], m(ids), err_msg=f"model {b}")


def test_fuse_models_masked_classifier():
    rng = np.random.default_rng(12)
    models = random_models(masked_float_classifier, rng)
    array = hftatf.fuse_models(models)
    x = rng.standard_normal((BATCH, STEPS, FEATURES)).astype("float32")
    x[0, -2:] = 0.0
    x[1, :1] = 0.0
    y = np.asarray(array(x))
    for b, m in enumerate(models):
        assert_close(y[:, b], m(x), err_msg=f"model {b}")
    for m, unfused in zip(models, array.unfuse()):
        for got, expected in zip(unfused.get_weights(), m.get_weights()):
            np.testing.assert_array_equal(got, expected)


# SpectralNormalization.


def spectral(layer, **kwargs):
    return keras.layers.SpectralNormalization(layer, **kwargs)


SPECTRAL_CASES = {
    "Dense": (lambda: spectral(keras.layers.Dense(UNITS, activation="tanh")),
              (FEATURES,)),
    "Dense_sequence_3_iterations": (lambda: spectral(
        keras.layers.Dense(UNITS), power_iterations=3), (STEPS, FEATURES)),
    "Conv2D": (lambda: spectral(keras.layers.Conv2D(
        UNITS, 3, padding="same", activation="relu")), (5, 5, 2)),
    "Conv1DTranspose": (lambda: spectral(keras.layers.Conv1DTranspose(
        UNITS, 2, strides=2)), (STEPS, 2)),
    "EinsumDense": (lambda: spectral(keras.layers.EinsumDense(
        "abc,cd->abd", (None, UNITS), bias_axes="d")), (STEPS, FEATURES)),
}


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("case", sorted(SPECTRAL_CASES))
def test_spectral_normalization_matches_stock(case, training):
    make, input_shape = SPECTRAL_CASES[case]
    rng = np.random.default_rng(20)
    stock = stock_wrappers(make, input_shape, rng)
    fused = fused_twin(stock, input_shape)
    assert type(fused) is FusedSpectralNormalization
    kernel = fused.get_weights()[0]
    # Outputs, gradients, and after the call the normalized kernels and
    # vectors (assigned in training), per model.
    compare_layer_with_stock(stock, fused, [per_model_inputs(
        rng, input_shape)], rng, training=training)
    assert np.allclose(fused.get_weights()[0], kernel) != training


def test_spectral_normalization_of_an_embedding_and_a_zero_kernel():
    rng = np.random.default_rng(21)
    stock = []
    for _ in range(NUM_MODELS):
        layer = spectral(keras.layers.Embedding(7, UNITS))
        layer.build((None, STEPS))
        randomize_weights(layer, rng, scale=0.5)
        stock.append(layer)
    # Model 0's table is all zeros: it keeps it and its vector, as the
    # stock layer does, while model 1 is normalized.
    weights = stock[0].get_weights()
    stock[0].set_weights([np.zeros_like(weights[0]), *weights[1:]])
    fused = resolve.fuse_layer(stock[0], NUM_MODELS)
    fused.build((None, NUM_MODELS, STEPS))
    fused.set_weights(stacked_weights(stock))
    before = fused.get_weights()
    ids = rng.integers(0, 7, (BATCH, NUM_MODELS, STEPS))
    y = np.asarray(fused(ids, training=True))
    after = fused.get_weights()
    for b, layer in enumerate(stock):
        assert_close(y[:, b], layer(ids[:, b], training=True))
        for got, expected in zip(after, layer.get_weights()):
            assert_close(got[b], expected)
    for got, old in zip(after, before):
        np.testing.assert_array_equal(got[0], old[0])
    assert not np.allclose(after[0][1], before[0][1])


def spectral_model():
    inputs = keras.Input((6, 6, 2))
    hidden = spectral(keras.layers.Conv2D(4, 3, activation="relu"),
                      power_iterations=2)(inputs)
    hidden = keras.layers.Flatten()(hidden)
    hidden = spectral(keras.layers.Dense(5, activation="tanh"))(hidden)
    return keras.Model(inputs, keras.layers.Dense(1)(hidden))


def test_spectral_normalization_trains_each_model_like_stock():
    rng = np.random.default_rng(22)
    learning_rates = [0.1, 0.05, 0.01]
    array = hftatf.fuse(spectral_model(), len(learning_rates))
    assert sum(isinstance(layer, FusedSpectralNormalization)
               for layer in array.layers) == 2
    stock = array.unfuse()
    x = rng.standard_normal((16, 6, 6, 2)).astype("float32")
    y = rng.standard_normal((16, 1)).astype("float32")
    array.compile(hftatf.optimizers.SGD(learning_rates), loss="mse")
    array.fit(x, y, epochs=2, batch_size=8, shuffle=False, verbose=0)
    for b, (model, rate) in enumerate(zip(stock, learning_rates)):
        model.compile(keras.optimizers.SGD(rate), loss="mse")
        model.fit(x, y, epochs=2, batch_size=8, shuffle=False, verbose=0)
        trained = array.unfuse()[b]
        assert [w.path for w in trained.weights] == [
            w.path for w in model.weights]
        for got, expected in zip(trained.get_weights(), model.get_weights()):
            assert_close(got, expected, err_msg=f"model {b}")
    # fuse_models stacks the stock models back, vectors included.
    again = hftatf.fuse_models(stock)
    assert_close(again.predict(x, verbose=0), np.stack(
        [m.predict(x, verbose=0) for m in stock], axis=1))


def test_spectral_normalization_trains_in_one_pass_and_keeps_frozen_models():
    rng = np.random.default_rng(23)
    inputs = keras.Input((4,))
    hidden = spectral(keras.layers.Dense(8, activation="relu"))(inputs)
    array = hftatf.fuse(keras.Model(inputs, keras.layers.Dense(1)(hidden)),
                        NUM_MODELS)
    with pytest.raises(ValueError, match="assigns trainable weights"):
        array.compile("sgd", loss="mse", models_per_pass=1)
    array.compile("sgd", loss="mse", jit_compile=True)
    array.freeze_models([1])
    before = array.get_weights()
    x = rng.standard_normal((8, 4)).astype("float32")
    array.fit(x, np.ones((8, 1)), epochs=1, batch_size=4, verbose=0)
    assert array.models_per_pass == NUM_MODELS
    after = array.get_weights()
    for old, new in zip(before, after):
        np.testing.assert_array_equal(new[1], old[1])
    assert not np.allclose(after[0][0], before[0][0])


def test_spectral_normalization_config_round_trip(tmp_path):
    array = hftatf.fuse(spectral_model(), NUM_MODELS)
    path = tmp_path / "array.keras"
    array.save(path)
    loaded = keras.saving.load_model(path)
    x = np.random.default_rng(24).standard_normal((4, 6, 6, 2)).astype(
        "float32")
    np.testing.assert_array_equal(loaded.predict(x, verbose=0),
                                  array.predict(x, verbose=0))
    layer = [la for la in loaded.layers
             if isinstance(la, FusedSpectralNormalization)][0]
    assert layer.power_iterations == 2
    with pytest.raises(ValueError, match="power_iterations"):
        FusedSpectralNormalization(FusedDense(2, UNITS), 2,
                                   power_iterations=0)
    with pytest.raises(ValueError, match="num_models=3"):
        FusedSpectralNormalization(FusedDense(3, UNITS), 2)


# The wrappers' own activity regularizers.


@pytest.mark.parametrize("wrap", [
    pytest.param(lambda reg: keras.layers.TimeDistributed(
        keras.layers.Dense(2), activity_regularizer=reg),
        id="TimeDistributed"),
    pytest.param(lambda reg: keras.layers.Bidirectional(
        keras.layers.GRU(2, return_sequences=True),
        activity_regularizer=reg), id="Bidirectional"),
    pytest.param(lambda reg: keras.layers.SpectralNormalization(
        keras.layers.Dense(2), activity_regularizer=reg),
        id="SpectralNormalization"),
])
def test_wrapper_activity_regularizer_is_per_model(wrap):
    rng = np.random.default_rng(25)
    inputs = keras.Input((STEPS, FEATURES))
    hidden = wrap(keras.regularizers.L2(0.3))(inputs)
    outputs = keras.layers.Dense(1)(keras.layers.Flatten()(hidden))
    x = rng.standard_normal((8, STEPS, FEATURES)).astype("float32")
    y = rng.standard_normal((8, 1)).astype("float32")
    trains_like_stock(keras.Model(inputs, outputs), x, y)
    fused = resolve.fuse_layer(wrap(keras.regularizers.L1(0.1)), 2)
    clone = type(fused).from_config(fused.get_config())
    assert keras.regularizers.serialize(
        clone.model_activity_regularizer) == keras.regularizers.serialize(
            keras.regularizers.L1(0.1))
