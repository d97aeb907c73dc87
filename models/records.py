"""Users' own data as `tf.data` pipelines: their `tf.data.Dataset`s of
images, TFRecord files and tensorflow-datasets data directories.

These inputs are TensorFlow's: every function imports TensorFlow when it is
called (on any Keras backend) and, where it is not installed, raises an
ImportError that says so at once (`batches.require_tensorflow`). The
TFRecord formats are `image_features()` / `point_features()` (also
`hftatf.models.data.IMAGE_FEATURES` / `POINT_FEATURES`).
"""

import numpy as np

from hftatf.models.batches import check_batch_size, require_tensorflow


def _tf():
    return require_tensorflow("Reading users' tf.data, TFRecord or "
                              "tensorflow-datasets input")


def from_datasets(train, validation, batch_size, seed=0, image_size=None,
                  channels=None, augment=False, shuffle_buffer=10_000,
                  cache=False):
    """Batches users' image datasets the way the image recipes do.

    Images are converted to float32 (integer pixels divided by 255), given
    a channel axis if they have none, resized and converted to `channels`.
    The training set is then shuffled every epoch, augmented if asked, and
    batched.

    Args:
        train, validation: unbatched `tf.data.Dataset`s of `(image, label)`
            pairs, images `[height, width]` or `[height, width, channels]`;
            `validation` may be None.
        batch_size: samples per batch.
        seed: seeds the shuffling and the augmentation.
        image_size: side of the square images to resize to (bilinear);
            None keeps the images' size (they must then share one size).
        channels: None to keep the images' channels; 3 for colour (a
            grey level is repeated, an alpha channel dropped) or 1 for grey
            levels (colours are converted by `tf.image.rgb_to_grayscale`).
        augment: random shifts of training images by up to 1/8 of their
            side (zero-padded random crops).
        shuffle_buffer: size of the shuffle buffer.
        cache: whether the converted images are kept in memory after the
            first epoch (for data sets that fit in memory).

    Returns:
        `(train, validation)` datasets of `(images, labels)` batches
        (validation is None if none was given).
    """
    tf = _tf()
    check_batch_size(batch_size)
    if channels not in (None, 1, 3):
        raise ValueError(
            "`channels` must be None (keep), 1 or 3. Received: "
            f"channels={channels!r}.")

    def prepare(image, label):
        return _prepare_image(image, image_size, channels), label

    train = _cached(train.map(prepare, num_parallel_calls=tf.data.AUTOTUNE),
                    cache)
    train = train.shuffle(shuffle_buffer, seed=seed,
                          reshuffle_each_iteration=True)
    if augment:
        train = _augmented(train, seed)
    train = train.batch(batch_size).prefetch(tf.data.AUTOTUNE)
    if validation is not None:
        validation = _cached(validation.map(
            prepare, num_parallel_calls=tf.data.AUTOTUNE), cache).batch(
            batch_size).prefetch(tf.data.AUTOTUNE)
    return train, validation


def _cached(dataset, cache):
    return dataset.cache() if cache else dataset


def _prepare_image(image, image_size, channels):
    """float32 `[h, w, c]` in [0, 1], resized and with `channels`."""
    tf = _tf()
    if image.dtype.is_integer:
        image = tf.cast(image, tf.float32) / 255.0
    image = tf.cast(image, tf.float32)
    if image.shape.rank == 2:
        image = image[..., tf.newaxis]
    if image_size is not None:
        image = tf.image.resize(image, (image_size, image_size))
    if channels is None:
        return image
    if image.shape[-1] is not None:
        return _convert_channels(image, channels, image.shape[-1] == 1)
    # Decoded files may tell their channel count only at run time.
    grey = tf.equal(tf.shape(image)[-1], 1)
    image = tf.cond(grey, lambda: _convert_channels(image, channels, True),
                    lambda: _convert_channels(image, channels, False))
    return tf.ensure_shape(image, (*image.shape[:-1], channels))


def _convert_channels(image, channels, grey):
    tf = _tf()
    if channels == 3:
        return tf.repeat(image[..., :1], 3, axis=-1) if grey else image[
            ..., :3]
    return image[..., :1] if grey else tf.image.rgb_to_grayscale(
        image[..., :3])


def _augmented(dataset, seed):
    """Shifts every image at random: zero padding by 1/8 of its side, then a
    crop back to its size at a random offset. Offsets come from a seeded
    stream that differs every epoch."""
    tf = _tf()
    seeds = tf.data.Dataset.random(
        seed=seed, rerandomize_each_iteration=True).batch(2)

    def shift(example, pair):
        image, label = example
        shape = tf.shape(image)
        pad = tf.maximum(1, shape[0] // 8)
        padded = tf.pad(image, [[pad, pad], [pad, pad], [0, 0]])
        image = tf.image.stateless_random_crop(padded, shape, seed=pair)
        return image, label

    return tf.data.Dataset.zip((dataset, seeds)).map(
        shift, num_parallel_calls=tf.data.AUTOTUNE)


# -- Users' image files -----------------------------------------------------

# The features `tfrecord_images` reads from each `tf.train.Example`
# (`image_features()`):
#   image: the PNG- or JPEG-encoded image (any size and channel count that
#          tf.io.decode_image reads);
#   label: its class id.
def image_features():
    """The `tf.train.Example` features of an image TFRecord file."""
    tf = _tf()
    return {
        "image": tf.io.FixedLenFeature([], tf.string),
        "label": tf.io.FixedLenFeature([], tf.int64),
    }


def write_image_tfrecords(path, images, labels):
    """Writes images in [0, 1] (`[n, h, w]` or `[n, h, w, c]`) and their
    labels to one TFRecord file in the `image_features()` format."""
    tf = _tf()
    images = np.asarray(images)
    if images.ndim == 3:
        images = images[..., np.newaxis]
    pixels = np.clip(np.round(images * 255.0), 0, 255).astype("uint8")
    with tf.io.TFRecordWriter(str(path)) as writer:
        for image, label in zip(pixels, np.asarray(labels)):
            example = tf.train.Example(features=tf.train.Features(feature={
                "image": _bytes_feature(tf.io.encode_png(image).numpy()),
                "label": _int_feature([int(label)]),
            }))
            writer.write(example.SerializeToString())


def tfrecord_images(train_files, validation_files, batch_size, seed=0,
                    image_size=None, channels=None, augment=False):
    """Images from TFRecord files in the `image_features()` format.

    Args:
        train_files, validation_files: a file name, a glob pattern or a
            list of them (`validation_files` may be None).
        batch_size, seed, image_size, channels, augment: as for
            `from_datasets`.

    Returns:
        `(train, validation)` datasets of `(images, labels)` batches:
        images float32 in [0, 1], labels int32.
    """
    tf = _tf()
    def parse(record):
        example = tf.io.parse_single_example(record, image_features())
        image = tf.io.decode_image(example["image"], expand_animations=False)
        return image, tf.cast(example["label"], tf.int32)

    return from_datasets(
        _records(train_files).map(parse),
        None if validation_files is None else _records(
            validation_files).map(parse),
        batch_size, seed=seed, image_size=image_size, channels=channels,
        augment=augment)


def _records(files):
    """A dataset of the serialized records of `files` (names or globs)."""
    tf = _tf()
    patterns = [files] if isinstance(files, (str, bytes)) or hasattr(
        files, "__fspath__") else list(files)
    names = sorted({str(name) for pattern in patterns
                    for name in tf.io.gfile.glob(str(pattern))})
    if not names:
        raise ValueError(
            f"No TFRecord file matches {files!r}. Pass existing file names "
            "or glob patterns.")
    return tf.data.TFRecordDataset(names)


def _bytes_feature(value):
    tf = _tf()
    return tf.train.Feature(bytes_list=tf.train.BytesList(value=[value]))


def _int_feature(values):
    tf = _tf()
    return tf.train.Feature(int64_list=tf.train.Int64List(value=values))


def _float_feature(values):
    tf = _tf()
    return tf.train.Feature(float_list=tf.train.FloatList(value=values))


def tfds_images(name, data_dir, batch_size, seed=0, splits=("train", "test"),
                image_size=None, channels=None, augment=False):
    """Images from a tensorflow-datasets data directory, without download.

    The dataset must already be prepared in `data_dir` (e.g. by
    `tfds.builder(name, data_dir=...).download_and_prepare()` on a machine
    with network access); it is read with `tfds.load(name,
    data_dir=data_dir, download=False, as_supervised=True)`.

    Args:
        name: the tensorflow-datasets name, e.g. `"cifar10"`.
        data_dir: the data directory that holds it.
        batch_size, seed, image_size, channels, augment: as for
            `from_datasets`.
        splits: the training and validation split names.

    Raises:
        ImportError: tensorflow-datasets is missing
            (`pip install tensorflow-datasets`).
    """
    _tf()
    try:
        import tensorflow_datasets as tfds
    except ImportError as error:
        raise ImportError(
            "Reading a tensorflow-datasets data directory needs "
            "tensorflow-datasets: pip install tensorflow-datasets") from error
    train, validation = tfds.load(name, split=list(splits), data_dir=data_dir,
                                  download=False, as_supervised=True)
    return from_datasets(train, validation, batch_size, seed=seed,
                         image_size=image_size, channels=channels,
                         augment=augment)


# -- Users' point-cloud files -----------------------------------------------

# The features `tfrecord_points` reads from each `tf.train.Example`
# (`point_features()`):
#   points: the cloud's coordinates, x0, y0, z0, x1, y1, z1, ... (float);
#   label:  its class id (read for classification);
#   parts:  one part id per point (read for segmentation).
def point_features():
    """The `tf.train.Example` features of a point-cloud TFRecord file."""
    tf = _tf()
    return {
        "points": tf.io.VarLenFeature(tf.float32),
        "label": tf.io.FixedLenFeature([], tf.int64),
        "parts": tf.io.VarLenFeature(tf.int64),
    }


def write_point_tfrecords(path, points, labels=None, parts=None):
    """Writes clouds `[n, num_points, 3]` with labels `[n]` and/or parts
    `[n, num_points]` to one TFRecord file in the `point_features()` format."""
    tf = _tf()
    points = np.asarray(points, "float32")
    with tf.io.TFRecordWriter(str(path)) as writer:
        for index, cloud in enumerate(points):
            feature = {"points": _float_feature(cloud.reshape(-1).tolist())}
            if labels is not None:
                feature["label"] = _int_feature([int(labels[index])])
            if parts is not None:
                feature["parts"] = _int_feature(
                    np.asarray(parts[index]).astype(int).tolist())
            example = tf.train.Example(
                features=tf.train.Features(feature=feature))
            writer.write(example.SerializeToString())


def tfrecord_points(train_files, validation_files, batch_size, seed=0,
                    segmentation=False, shuffle_buffer=10_000, cache=False):
    """Point clouds from TFRecord files in the `point_features()` format.

    All clouds must have the same number of points (to be batched).

    Args:
        train_files, validation_files: a file name, a glob pattern or a
            list of them (`validation_files` may be None).
        batch_size: clouds per batch.
        seed: seeds the shuffling.
        segmentation: whether to read per-point `parts` (part
            segmentation) rather than one `label` per cloud.
        shuffle_buffer: size of the shuffle buffer.
        cache: whether parsed clouds are kept in memory after the first
            epoch.

    Returns:
        `(train, validation)` datasets of `(points, labels)` batches: points
        `[batch, num_points, 3]` float32, labels `[batch]` int32 or, with
        `segmentation`, `[batch, num_points]` int32.
    """
    tf = _tf()
    check_batch_size(batch_size)

    target = "parts" if segmentation else "label"
    features = {name: point_features()[name] for name in ("points", target)}

    def parse(record):
        example = tf.io.parse_single_example(record, features)
        points = tf.reshape(tf.sparse.to_dense(example["points"]), (-1, 3))
        labels = example[target]
        if segmentation:
            labels = tf.sparse.to_dense(labels)
        return points, tf.cast(labels, tf.int32)

    train = _cached(_records(train_files).map(parse), cache).shuffle(
        shuffle_buffer, seed=seed, reshuffle_each_iteration=True)
    train = train.batch(batch_size).prefetch(tf.data.AUTOTUNE)
    validation = None
    if validation_files is not None:
        validation = _cached(_records(validation_files).map(parse),
                             cache).batch(batch_size).prefetch(
            tf.data.AUTOTUNE)
    return train, validation
