"""ResNet-18/34: architecture, arrays against stock models, export, the
recipe, and learning on scikit-learn's digits."""

import keras
import numpy as np
import pytest
from testing import STEP_JIT, STOCK_NETWORK, compiled_call
from zoo_testing import (
    DIGITS_VALIDATION,
    EAGER,
    assert_export_round_trip,
    assert_fit_matches_stock,
)

import hftatf
from hftatf.models import data, recipes, resnet

CLASSES = 5


def tiny_resnet(stem="cifar", size=16, **kwargs):
    return resnet.resnet18(input_shape=(size, size, 3), num_classes=CLASSES,
                           width=1 / 16, stem=stem, **kwargs)


def images(n=16, size=16, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.uniform(size=(n, size, size, 3)).astype("float32"),
            rng.integers(0, CLASSES, n))


# -- the stock model --------------------------------------------------------


@STOCK_NETWORK
@pytest.mark.parametrize("depth, parameters", [(18, 11_689_512),
                                               (34, 21_797_672)])
def test_imagenet_sizes_match_the_reference(depth, parameters):
    # The trainable parameters of the reference (torchvision) ImageNet
    # models; parameter counts do not depend on the image size.
    model = resnet.build(depth, input_shape=(64, 64, 3), num_classes=1000,
                         stem="imagenet")
    assert sum(int(np.prod(w.shape)) for w in model.trainable_weights) == (
        parameters)


@STOCK_NETWORK
@pytest.mark.parametrize("stem, size, final", [("cifar", 32, 4),
                                               ("imagenet", 64, 2)])
def test_stems_and_stage_resolutions(stem, size, final):
    model = resnet.resnet18(input_shape=(size, size, 3), num_classes=7,
                            width=0.25, stem=stem)
    # The CIFAR stem keeps the resolution, the ImageNet one divides it by 4;
    # stages 2-4 halve it each.
    first = size if stem == "cifar" else size // 4
    for stage, channels in enumerate((16, 32, 64, 128)):
        shape = model.get_layer(f"stage{stage + 1}_block2_out").output.shape
        side = first // 2 ** stage
        assert shape == (None, side, side, channels)
    assert side == final
    assert model.output_shape == (None, 7)
    assert (model.get_layer("stem_conv").kernel_size ==
            ((3, 3) if stem == "cifar" else (7, 7)))
    assert any(isinstance(layer, keras.layers.MaxPooling2D)
               for layer in model.layers) == (stem == "imagenet")


def test_blocks_per_stage():
    for depth, blocks in resnet.RESNET_SPECS.items():
        model = resnet.build(depth, input_shape=(32, 32, 3), width=1 / 16)
        for stage, count in enumerate(blocks):
            names = {layer.name.split("_")[1] for layer in model.layers
                     if layer.name.startswith(f"stage{stage + 1}_")}
            assert len(names) == count


def test_probabilities_and_logits():
    x, _ = images(2)
    probabilities = tiny_resnet()(x)
    np.testing.assert_allclose(np.sum(probabilities, axis=-1), 1.0,
                               rtol=1e-5)
    assert tiny_resnet(classifier_activation=None).get_layer(
        "classifier").activation.__name__ == "linear"


@pytest.mark.parametrize("kwargs, match", [
    ({"depth": 50}, "depth"),
    ({"stem": "tiny"}, "stem"),
    ({"width": 0}, "width"),
    ({"input_shape": (32, 32)}, "input_shape"),
])
def test_bad_arguments_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        resnet.build(**kwargs)


# -- arrays against stock models --------------------------------------------


@pytest.mark.parametrize("stem, size", [("cifar", 16), ("imagenet", 32)])
def test_array_trains_as_stock_models(stem, size):
    x, y = images(16, size)
    # Two SGD steps in training mode: BatchNormalization uses each model's
    # batch statistics and updates its moving ones.
    assert_fit_matches_stock(tiny_resnet(stem, size), x, y,
                             [0.01, 0.005, 0.002])


def test_export_round_trip(tmp_path):
    x, y = images(8)
    array = hftatf.fuse(tiny_resnet(), 2)
    array.compile(hftatf.optimizers.SGD([0.05, 0.02]),
                  loss="sparse_categorical_crossentropy", run_eagerly=EAGER)
    array.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert_export_round_trip(array, x, tmp_path)


@pytest.mark.parametrize("name", ["resnet18", "resnet34"])
def test_recipes(name):
    recipe = recipes.get(name)
    model = recipe.build(**recipe.model_args)
    train, validation = recipe.data(4, **recipe.data_args)
    x, y = next(iter(train))
    assert x.shape == (4, *model.input_shape[1:])
    assert compiled_call(model, x).shape == (
        4, recipe.model_args["num_classes"])
    assert next(iter(validation))[1].dtype == "int32"
    assert recipe.monitor == "val_accuracy"


# -- learning ---------------------------------------------------------------


@pytest.mark.full_scale
def test_array_learns_digits():
    keras.utils.set_random_seed(0)
    train, validation = data.digit_images(
        128, image_size=32, channels=3, validation_fraction=DIGITS_VALIDATION)
    model = resnet.resnet18(input_shape=(32, 32, 3), num_classes=10,
                            width=1 / 16)
    array = hftatf.fuse(model, 3)
    array.compile(hftatf.optimizers.SGD([0.2, 0.1, 0.05], momentum=0.9),
                  loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"], jit_compile=STEP_JIT)
    # The best model is past 0.9 after 6 epochs on either backend.
    history = array.fit(train, validation_data=validation, epochs=6,
                        verbose=0)
    best = max(history.history[f"val_accuracy_{b}"][-1] for b in range(3))
    assert best > 0.9, history.history
