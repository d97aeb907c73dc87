"""MobileNetV2/V3: architecture against keras.applications, arrays against
stock models, export, recipes, and learning on scikit-learn's digits."""

import keras
import numpy as np
import pytest
from testing import STEP_JIT, STOCK_NETWORK, assert_close, compiled_call
from zoo_testing import (
    DIGITS_VALIDATION,
    EAGER,
    assert_export_round_trip,
    assert_fit_matches_stock,
)

import hftatf
from hftatf.models import data, mobilenet, recipes

CLASSES = 5
BUILDERS = {
    "v2": mobilenet.mobilenet_v2,
    "v3_small": mobilenet.mobilenet_v3_small,
    "v3_large": mobilenet.mobilenet_v3_large,
}


def tiny(name, size=16, **kwargs):
    kwargs = {"alpha": 0.35, **kwargs}
    if name != "v2":
        kwargs.setdefault("dropout", 0.0)
    return BUILDERS[name](input_shape=(size, size, 3), num_classes=CLASSES,
                          **kwargs)


def images(n=16, size=16, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.uniform(size=(n, size, size, 3)).astype("float32"),
            rng.integers(0, CLASSES, n))


# -- the stock model --------------------------------------------------------


def keras_application(name, alpha):
    kwargs = dict(input_shape=(32, 32, 3), alpha=alpha, weights=None,
                  classes=CLASSES)
    if name == "v2":
        return keras.applications.MobileNetV2(**kwargs)
    application = (keras.applications.MobileNetV3Small if name == "v3_small"
                   else keras.applications.MobileNetV3Large)
    return application(include_preprocessing=False, **kwargs)


@STOCK_NETWORK
@pytest.mark.parametrize("name, alpha", [("v2", 0.5), ("v3_small", 0.75),
                                         ("v3_large", 0.5)])
def test_same_network_as_keras_applications(name, alpha):
    # The same weights in the same layer order compute the same outputs:
    # the spec tables, channel rounding, squeeze-excitation, activations and
    # padding are those of keras.applications. (Its 1x1 convolutions on
    # pooled features are our Dense layers.)
    reference = keras_application(name, alpha)
    model = BUILDERS[name](input_shape=(32, 32, 3), num_classes=CLASSES,
                           alpha=alpha)
    ours = [layer for layer in model.layers if layer.weights]
    theirs = [layer for layer in reference.layers if layer.weights]
    assert len(ours) == len(theirs)
    rng = np.random.default_rng(0)
    for mine, their in zip(ours, theirs):
        values = [rng.uniform(0.5, 1.5, w.shape) if "variance" in w.path
                  else 0.3 * rng.standard_normal(w.shape)
                  for w in their.weights]
        their.set_weights(values)
        mine.set_weights([np.reshape(v, w.shape)
                          for v, w in zip(values, mine.weights)])
    x, _ = images(4, 32)
    assert_close(compiled_call(model, x), compiled_call(reference, x))


@STOCK_NETWORK
@pytest.mark.parametrize("name, channels, stem_strides, side", [
    ("v2", 1280, 2, 1), ("v3_small", 288, 1, 2), ("v3_large", 480, 1, 2)])
def test_32x32_inputs(name, channels, stem_strides, side):
    model = tiny(name, 32, alpha=0.5, stem_strides=stem_strides)
    assert model.get_layer("top_act").output.shape == (None, side, side,
                                                       channels)
    x, _ = images(2, 32)
    assert compiled_call(model, x).shape == (2, CLASSES)


@STOCK_NETWORK
def test_v3_blocks_follow_the_spec():
    model = mobilenet.mobilenet_v3_small(input_shape=(32, 32, 3))
    for index, (_, filters, kernel, strides, squeeze, activation) in (
            enumerate(mobilenet.MOBILENET_V3_SPECS["small"])):
        prefix = f"block{index + 1}"
        depthwise = model.get_layer(f"{prefix}_depthwise")
        assert depthwise.kernel_size == (kernel, kernel)
        assert depthwise.strides == (strides, strides)
        assert model.get_layer(f"{prefix}_project").filters == filters
        assert model.get_layer(f"{prefix}_depthwise_act").activation is (
            keras.activations.get(activation))
        names = {layer.name for layer in model.layers}
        assert (f"{prefix}_se_excite" in names) == squeeze
    assert model.get_layer("block4_se_expand").activation.__name__ == (
        "hard_sigmoid")


def test_make_divisible():
    assert [mobilenet.make_divisible(v) for v in (3, 8, 11.2, 13, 37, 100)] \
        == [8, 8, 16, 16, 40, 104]
    # Never more than 10% below the requested width.
    for value in np.linspace(1, 500, 97):
        rounded = mobilenet.make_divisible(value)
        assert rounded % 8 == 0 and rounded >= 0.9 * value


@pytest.mark.parametrize("kwargs, match", [
    ({"alpha": 0}, "alpha"),
    ({"stem_strides": 4}, "stem_strides"),
    ({"input_shape": (32, 32)}, "input_shape"),
])
def test_bad_arguments_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        mobilenet.mobilenet_v2(**kwargs)
    with pytest.raises(ValueError, match=match):
        mobilenet.mobilenet_v3_small(**kwargs)
    with pytest.raises(ValueError, match="size"):
        mobilenet.mobilenet_v3("medium")


# -- arrays against stock models --------------------------------------------

# In training mode, the deep 1x1 feature maps of these tiny networks have
# near-constant channels, whose batch normalisation amplifies float32
# rounding: two stock runs that differ only in summation order (XLA or not)
# differ by up to 2.2e-4 after one MobileNetV2 step (about 2% of the step),
# and by 2.4e-4 after two MobileNetV3-Large steps. Those comparisons check
# each weight's change to this fraction of the model's largest change: a
# neighbour's learning rate, a wrong gradient or missing statistics updates
# differ by far more.
UPDATE_RTOL = 0.1


def test_v2_array_trains_as_stock_models_with_frozen_statistics():
    # With frozen BatchNormalization layers (normalising with their moving
    # statistics) the network is well conditioned: two steps agree to
    # float32 rounding.
    model = tiny("v2")
    for layer in model.layers:
        if isinstance(layer, keras.layers.BatchNormalization):
            layer.trainable = False
    x, y = images()
    assert_fit_matches_stock(model, x, y, [0.5, 0.25, 0.1])


@pytest.mark.slow  # About 40 s on JAX, where each model's convolutions
# compile on their own; the other MobileNets here test the same layers.
def test_v2_array_trains_as_stock_models_in_training_mode():
    # One step on a batch of 16 (see UPDATE_RTOL): gradients through each
    # model's batch statistics, and its moving statistics. Even the loss at
    # the start, in training mode, differs from stock by ~2e-5 (relative).
    x, y = images()
    assert_fit_matches_stock(tiny("v2"), x, y, [1e-4, 7e-5, 4e-5],
                             batch_size=16, update_rtol=UPDATE_RTOL,
                             loss_rtol=1e-4)


def test_v3_small_array_trains_as_stock_models():
    x, y = images()
    assert_fit_matches_stock(tiny("v3_small"), x, y, [0.02, 0.01, 0.005])


@pytest.mark.slow  # About a minute on JAX (see above).
def test_v3_large_array_trains_as_stock_models():
    x, y = images()
    assert_fit_matches_stock(tiny("v3_large"), x, y, [0.005, 0.002, 0.001],
                             update_rtol=UPDATE_RTOL)


def test_dropout_draws_per_model():
    x, _ = images(4)
    array = hftatf.fuse(tiny("v3_small", dropout=0.5), 2)
    # The same weights in both models: only dropout can tell them apart.
    array.set_model_weights(1, array.get_model_weights(0))
    outputs = compiled_call(array, x, training=False)
    assert_close(outputs[:, 0], outputs[:, 1])
    outputs = compiled_call(array, x, training=True)
    assert not np.allclose(outputs[:, 0], outputs[:, 1])


def test_export_round_trip(tmp_path):
    x, y = images(8)
    array = hftatf.fuse(tiny("v3_small"), 2)
    array.compile(hftatf.optimizers.SGD([0.05, 0.02]),
                  loss="sparse_categorical_crossentropy", run_eagerly=EAGER)
    array.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert_export_round_trip(array, x, tmp_path)


@pytest.mark.parametrize("name", ["mobilenet_v2", "mobilenet_v3_small",
                                  "mobilenet_v3_large"])
def test_recipes(name):
    recipe = recipes.get(name)
    model = recipe.build(**recipe.model_args)
    train, _ = recipe.data(4, **recipe.data_args)
    x, _ = next(iter(train))
    assert x.shape == (4, *model.input_shape[1:])
    assert compiled_call(model, x).shape == (
        4, recipe.model_args["num_classes"])


# -- learning ---------------------------------------------------------------


@pytest.mark.full_scale
def test_array_learns_digits():
    keras.utils.set_random_seed(0)
    train, validation = data.digit_images(
        128, image_size=32, channels=3, validation_fraction=DIGITS_VALIDATION)
    model = mobilenet.mobilenet_v3_small(
        input_shape=(32, 32, 3), num_classes=10, alpha=0.35, dropout=0.0)
    array = hftatf.fuse(model, 3)
    array.compile(hftatf.optimizers.Adam([5e-3, 2e-3, 1e-3]),
                  loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"], jit_compile=STEP_JIT)
    # The best model is past 0.9 after 6 epochs on either backend.
    history = array.fit(train, validation_data=validation, epochs=6,
                        verbose=0)
    best = max(history.history[f"val_accuracy_{b}"][-1] for b in range(3))
    assert best > 0.9, history.history
