"""PointNet: architecture, the orthogonality loss (per model in an array),
arrays against stock models, export, recipes, and learning on point clouds
of parametric shapes."""

import keras
import numpy as np
import pytest
from testing import STEP_JIT, STOCK_NETWORK, assert_close, compiled_call
from zoo_testing import (
    EAGER,
    assert_export_round_trip,
    assert_fit_matches_stock,
)

import hftatf
from hftatf.models import data, pointnet, recipes

POINTS = 32
CLASSES = 4
PARTS = 5
TRANSFORMS = ("input_transform_net_matrix", "feature_transform_net_matrix")


def tiny_classifier(**kwargs):
    kwargs = {"num_points": POINTS, "num_classes": CLASSES, "width": 0.125,
              "dropout": 0.0, **kwargs}
    return pointnet.pointnet(**kwargs)


def tiny_segmenter(**kwargs):
    return pointnet.pointnet_segmentation(POINTS, PARTS, width=0.125,
                                          **kwargs)


def clouds(n=16, segmentation=False, seed=0):
    rng = np.random.default_rng(seed)
    points = rng.standard_normal((n, POINTS, 3)).astype("float32")
    if segmentation:
        return points, rng.integers(0, PARTS, (n, POINTS))
    return points, rng.integers(0, CLASSES, n)


def tilt_transforms(model, rng, scale=0.1):
    """Moves the transform nets away from their identity start, so that
    the orthogonality loss is not zero."""
    for name in TRANSFORMS:
        layer = model.get_layer(name)
        kernel, bias = layer.get_weights()
        layer.set_weights([scale * rng.standard_normal(kernel.shape),
                           bias + scale * rng.standard_normal(bias.shape)])
    return model


def orthogonality(matrices, weight=0.001):
    """The reference: weight * mean over the batch of ||I - A A^T||^2."""
    eye = np.eye(matrices.shape[-1])
    products = matrices @ np.swapaxes(matrices, -1, -2)
    return weight * np.mean(np.sum((eye - products) ** 2, axis=(-2, -1)))


# -- the stock model --------------------------------------------------------


@STOCK_NETWORK
def test_output_shapes():
    x, _ = clouds(2)
    assert tiny_classifier()(x).shape == (2, CLASSES)
    assert tiny_segmenter()(x).shape == (2, POINTS, PARTS)
    # Classification takes clouds of any size.
    model = tiny_classifier(num_points=None)
    assert model(np.concatenate([x, x], axis=1)).shape == (2, CLASSES)


def test_order_of_points_does_not_matter():
    x, _ = clouds(2)
    order = np.random.default_rng(1).permutation(POINTS)
    classifier = tilt_transforms(tiny_classifier(),
                                 np.random.default_rng(2))
    assert_close(classifier(x[:, order]), classifier(x))
    segmenter = tilt_transforms(tiny_segmenter(), np.random.default_rng(2))
    assert_close(segmenter(x[:, order]), np.asarray(segmenter(x))[:, order])


def test_transforms_start_as_identity():
    model = tiny_classifier()
    x, _ = clouds(2)
    aligned = keras.Model(model.input,
                          model.get_layer("input_transform_apply").output)
    assert_close(aligned(x), x)
    assert model.get_layer("feature_transform_net_reshape").output.shape == (
        None, 8, 8)


def test_width_scales_every_layer():
    model = pointnet.pointnet(num_classes=10, width=0.5)
    assert model.get_layer("input_transform_net_mlp3_dense").units == 512
    assert model.get_layer("feature_mlp3_dense").units == 512
    assert model.get_layer("head2_dense").units == 128
    assert model.get_layer("feature_transform_net_reshape").output.shape == (
        None, 32, 32)


@pytest.mark.parametrize("kwargs, match", [
    ({"width": 0}, "width"),
    ({"num_points": 0}, "num_points"),
])
def test_bad_arguments_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        pointnet.pointnet(**kwargs)
    with pytest.raises(ValueError, match="num_points"):
        pointnet.pointnet_segmentation(None, 4)


# -- the orthogonality loss -------------------------------------------------


def test_regularizer_value_and_config():
    rng = np.random.default_rng(0)
    matrices = rng.standard_normal((5, 3, 3)).astype("float32")
    regularizer = pointnet.OrthogonalityRegularizer(3, weight=0.01)
    assert_close(regularizer(matrices.reshape(5, 9)) / 5,
                 orthogonality(matrices, 0.01), rtol=1e-5)
    rotation, _ = np.linalg.qr(rng.standard_normal((3, 3)))
    assert_close(regularizer(rotation.reshape(1, 9).astype("float32")), 0.0)
    copy = keras.regularizers.deserialize(
        keras.regularizers.serialize(regularizer))
    assert isinstance(copy, pointnet.OrthogonalityRegularizer)
    assert copy.get_config() == {"num_features": 3, "weight": 0.01}


@pytest.mark.parametrize("kwargs, match", [
    ({"num_features": 0}, "num_features"),
    ({"num_features": 3, "weight": -1.0}, "weight"),
])
def test_bad_regularizer_arguments_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        pointnet.OrthogonalityRegularizer(**kwargs)


def test_stock_model_adds_the_orthogonality_losses():
    model = tilt_transforms(tiny_classifier(), np.random.default_rng(0))
    x, _ = clouds(4)
    probe = keras.Model(model.input, [
        model.get_layer("input_transform_net_reshape").output,
        model.get_layer("feature_transform_net_reshape").output])
    matrices = [np.asarray(m, "float64") for m in probe(x, training=False)]
    model(x, training=False)
    assert len(model.losses) == 2
    assert_close(sorted(float(loss) for loss in model.losses),
                 sorted(orthogonality(m) for m in matrices), rtol=1e-5)
    assert not tiny_classifier(orthogonality_weight=0).get_layer(
        TRANSFORMS[0]).activity_regularizer


@pytest.mark.parametrize("builder", [tiny_classifier, tiny_segmenter])
def test_array_losses_are_each_models_own(builder):
    rng = np.random.default_rng(0)
    models = [tilt_transforms(builder(), rng, scale=0.3) for _ in range(3)]
    array = hftatf.fuse_models(models)
    x, y = clouds(8, segmentation=builder is tiny_segmenter)
    array.compile(hftatf.optimizers.SGD(0.01),
                  loss="sparse_categorical_crossentropy")
    results = array.evaluate(x, y, batch_size=8, verbose=0,
                             return_dict=True)
    # One [B] loss per transform: entry b is model b's orthogonality loss
    # (the models' differ: 1e-4 apart and more on either backend's draws;
    # one loss given to every model would repeat it exactly).
    array(x, training=False)
    losses = np.asarray(array.losses)
    assert losses.shape == (2, 3)
    assert np.min(np.abs(losses[:, :, None] - losses[:, None, :])
                  + np.eye(3)) > 1e-5, losses
    for b, model in enumerate(models):
        model.compile(loss="sparse_categorical_crossentropy")
        assert_close(results[f"loss_{b}"],
                     model.evaluate(x, y, batch_size=8, verbose=0))
        model(x, training=False)
        assert_close(losses[:, b], [float(loss) for loss in model.losses])


# -- arrays against stock models --------------------------------------------


def test_classifier_array_trains_as_stock_models():
    x, y = clouds()
    assert_fit_matches_stock(tiny_classifier(), x, y, [0.02, 0.01, 0.005])


@pytest.mark.slow  # About 40 s on JAX, whose eager steps compile each
# operation on its own.
def test_segmenter_array_trains_as_stock_models():
    x, y = clouds(segmentation=True)
    # Eagerly on every backend: compiled on JAX, XLA's fusions round the
    # segmenter's array and its stock twins apart by up to 3.6e-5 in two
    # steps, past the float32 tolerance the rest of the zoo holds.
    assert_fit_matches_stock(tiny_segmenter(), x, y, [0.02, 0.01, 0.005],
                             eager=True)


def test_export_round_trip(tmp_path):
    x, y = clouds(8)
    array = hftatf.fuse(tiny_classifier(), 2)
    array.compile(hftatf.optimizers.SGD([0.05, 0.02]),
                  loss="sparse_categorical_crossentropy", run_eagerly=EAGER)
    array.fit(x, y, batch_size=8, epochs=1, verbose=0)
    # Every format: the transforms' regularizer is a custom Keras object.
    assert_export_round_trip(array, x, tmp_path,
                             format=("keras", "saved_model"))
    import tensorflow as tf

    served = tf.saved_model.load(str(tmp_path / "model_1" / "saved_model"))
    assert_close(served.serve(x), array.predict(x, verbose=0)[:, 1])


@pytest.mark.parametrize("name, target", [("pointnet", ()),
                                          ("pointnet_seg", (256,))])
def test_recipes(name, target):
    recipe = recipes.get(name)
    model = recipe.build(**recipe.model_args)
    train, _ = recipe.data(4, **{**recipe.data_args, "samples_per_shape": 2})
    x, y = next(iter(train))
    assert x.shape == (4, 256, 3) and y.shape == (4, *target)
    assert compiled_call(model, x).shape[:-1] == y.shape


# -- learning ---------------------------------------------------------------


@pytest.mark.full_scale
def test_array_learns_shapes():
    keras.utils.set_random_seed(0)
    train, validation = data.shapes(32, num_points=128)
    model = pointnet.pointnet(128, len(data.SHAPES), width=0.25)
    array = hftatf.fuse(model, 3)
    array.compile(hftatf.optimizers.Adam([3e-3, 1e-3, 3e-4]),
                  loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"], jit_compile=STEP_JIT)
    # The best model is near 0.78 in epochs 4-6.
    history = array.fit(train, validation_data=validation, epochs=6,
                        verbose=0)
    best = max(max(history.history[f"val_accuracy_{b}"][-3:])
               for b in range(3))
    # Chance is 1/6.
    assert best > 0.6, history.history
