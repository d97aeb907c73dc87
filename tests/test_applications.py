"""hftatf.fuse on real architectures: `keras.applications` models (built
offline with `weights=None`) and small text classifiers. Each model of the
array must compute what its stock twin computes, in inference and in
training mode, and unfuse must give the weights back."""

import keras
import numpy as np
import pytest
from keras import applications
from testing import assert_close, compiled_call

import hftatf

NUM_MODELS = 2
IMAGE = (32, 32, 3)
CLASSES = 5

APPLICATIONS = {
    "ResNet50": applications.ResNet50,
    "MobileNetV3Small": applications.MobileNetV3Small,
    "EfficientNetB0": applications.EfficientNetB0,
    "DenseNet121": applications.DenseNet121,
    "ConvNeXtTiny": applications.ConvNeXtTiny,
}


def build_application(name):
    kwargs = {"weights": None, "input_shape": IMAGE, "classes": CLASSES,
              "classifier_activation": None}
    if name == "MobileNetV3Small":
        kwargs["include_preprocessing"] = True
    return APPLICATIONS[name](**kwargs)


def assert_matches(models, array, x, training, atol, rtol):
    outputs = np.asarray(array(x, training=training))
    for b, model in enumerate(models):
        assert_close(outputs[:, b], model(x, training=training), atol, rtol,
                     err_msg=f"model {b}, training={training}")


def assert_matches_relative(models, array, x, training, tolerance):
    """Largest difference at most `tolerance` times the largest output
    (untrained networks' outputs range from 1e-5 to 10 in scale), or four
    times the stock model's own float32 noise: how far its output moves when
    the input moves by one unit in the last place. Deep networks in training
    mode amplify rounding through BatchNormalization over few values (a
    1-ulp input change moves ResNet50's logits by ~2e-4 of their scale), so
    another summation order cannot be held to less."""
    outputs = compiled_call(array, x, training)
    nudged = x * np.float32(1 + 2.0**-23)
    for b, model in enumerate(models):
        state = [np.array(w) for w in model.weights]
        nudged_output = compiled_call(model, nudged, training)
        # That call updated moving statistics: put them back.
        for weight, value in zip(model.weights, state):
            weight.assign(value)
        expected = compiled_call(model, x, training)
        noise = np.max(np.abs(nudged_output - expected))
        scale = np.max(np.abs(expected))
        assert scale > 0
        difference = np.max(np.abs(outputs[:, b] - expected))
        assert difference <= max(tolerance * scale, 4 * noise), (
            f"model {b}, training={training}: {difference} vs scale {scale}, "
            f"float32 noise {noise}")


def without_dropout(model):
    """The array draws other dropout masks than the stock models (each
    model its own); compare training mode with rate 0."""
    for layer in model.layers:
        if isinstance(layer, keras.layers.Dropout):
            layer.rate = 0.0
    return model


# The two smallest run with the suite (on TensorFlow: `slow`); the largest
# only when asked (their layers are checked here and in tests/layers).
@pytest.mark.parametrize("name", [
    pytest.param(name, marks=pytest.mark.slow if name in (
        "MobileNetV3Small", "EfficientNetB0") else pytest.mark.full_scale)
    for name in sorted(APPLICATIONS)])
def test_applications_fuse_exactly(name):
    models = [without_dropout(build_application(name))
              for _ in range(NUM_MODELS)]
    array = hftatf.fuse_models(models)
    assert array.count_params() == sum(m.count_params() for m in models)
    # Batch 8: in training mode, BatchNormalization over the 1x1 maps of the
    # last stages normalises 8 values; with 2 it amplifies rounding.
    x = np.random.default_rng(0).uniform(
        0, 255, (8, *IMAGE)).astype("float32")
    # Dozens of float32 layers, convolutions summed in another order:
    # differences grow to ~2e-5 of the outputs' scale.
    for model, unfused in zip(models, array.unfuse()):
        for ours, theirs in zip(unfused.get_weights(), model.get_weights()):
            np.testing.assert_array_equal(ours, theirs)
    assert_matches_relative(models, array, x, training=False,
                            tolerance=1e-4)
    # Training mode also updates the moving statistics of each model.
    assert_matches_relative(models, array, x, training=True, tolerance=1e-4)
    for model, unfused in zip(models, array.unfuse()):
        for ours, theirs in zip(unfused.get_weights(), model.get_weights()):
            assert_close(ours, theirs, atol=1e-5, rtol=1e-4)


def transformer_classifier(vocabulary=50, length=12, width=16, dropout=0.1):
    ids = keras.Input((length,), dtype="int32", name="ids")
    h = keras.layers.Embedding(vocabulary, width, mask_zero=True)(ids)
    attention = keras.layers.MultiHeadAttention(
        num_heads=2, key_dim=8, dropout=dropout)(h, h)
    h = keras.layers.LayerNormalization()(
        keras.layers.Add()([h, attention]))
    feed = keras.layers.Dense(width)(
        keras.layers.Dense(32, activation="gelu")(h))
    h = keras.layers.LayerNormalization()(keras.layers.Add()([h, feed]))
    h = keras.layers.GlobalAveragePooling1D()(h)
    return keras.Model(ids, keras.layers.Dense(3)(h), name="transformer")


def lstm_classifier(vocabulary=50, length=12, width=8):
    ids = keras.Input((length,), dtype="int32", name="ids")
    h = keras.layers.Embedding(vocabulary, width, mask_zero=True)(ids)
    h = keras.layers.Bidirectional(
        keras.layers.LSTM(6, return_sequences=True))(h)
    h = keras.layers.GRU(5)(h)
    return keras.Model(ids, keras.layers.Dense(3)(h), name="lstm")


@pytest.mark.parametrize("builder", [transformer_classifier, lstm_classifier])
def test_text_classifiers_fuse_exactly(builder):
    models = [builder() for _ in range(NUM_MODELS)]
    array = hftatf.fuse_models(models)
    rng = np.random.default_rng(1)
    ids = rng.integers(1, 50, (4, 12)).astype("int32")
    ids[:, 9:] = 0  # padding, masked by the embedding
    ids[0, 5:] = 0
    assert_matches(models, array, ids, training=False, atol=1e-5, rtol=1e-5)
    for model, unfused in zip(models, array.unfuse()):
        for ours, theirs in zip(unfused.get_weights(), model.get_weights()):
            np.testing.assert_array_equal(ours, theirs)


def test_text_classifier_trains_like_its_stock_models():
    # Without dropout: the array and the stock models draw different masks.
    models = [transformer_classifier(dropout=0.0) for _ in range(NUM_MODELS)]
    rates = [0.05, 0.01]
    array = hftatf.fuse_models(models)
    array.compile(optimizer=hftatf.optimizers.SGD(rates), loss=keras.losses
                  .SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(2)
    ids = rng.integers(1, 50, (8, 12)).astype("int32")
    labels = rng.integers(0, 3, (8,))
    array.fit(ids, labels, batch_size=4, epochs=1, shuffle=False, verbose=0)
    for model, rate in zip(models, rates):
        model.compile(optimizer=keras.optimizers.SGD(rate), loss=keras.losses
                      .SparseCategoricalCrossentropy(from_logits=True))
        model.fit(ids, labels, batch_size=4, epochs=1, shuffle=False,
                  verbose=0)
    for model, unfused in zip(models, array.unfuse()):
        for ours, theirs in zip(unfused.get_weights(), model.get_weights()):
            assert_close(ours, theirs, atol=1e-5, rtol=1e-4)
