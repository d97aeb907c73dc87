"""How the zoo's data recipes hand batches to `fit`: `tf.data` on the
TensorFlow backend, a `keras.utils.PyDataset` of NumPy batches elsewhere.

`uses_tf_data` is the one place that chooses: on the TensorFlow backend the
recipes build `tf.data` pipelines (what `tf.distribute` and the launcher
read); on JAX (or any other backend) they build `ArrayBatches`, which need
no TensorFlow, so the zoo trains where TensorFlow is not installed.
`require_tensorflow` imports TensorFlow for the inputs that cannot do
without it (TFRecord files, tensorflow-datasets, users' `tf.data`
pipelines) and, where it is missing, says what to install.
"""

import contextlib
import importlib
import sys

import keras
import numpy as np

# Set inside `tf_data_input()`.
_TF_DATA = []


def uses_tf_data():
    """Whether the recipes build `tf.data` pipelines (the TensorFlow
    backend, or inside `tf_data_input()`) rather than `ArrayBatches`."""
    return bool(_TF_DATA) or keras.backend.backend() == "tensorflow"


@contextlib.contextmanager
def tf_data_input():
    """Inside the block the recipes build `tf.data` pipelines on every
    backend (Keras reads them on JAX too): the launcher shards, rebatches
    and distributes its input with `tf.data` and `tf.distribute`."""
    _TF_DATA.append(True)
    try:
        yield
    finally:
        _TF_DATA.pop()


def require_tensorflow(feature):
    """Imports and returns TensorFlow, which `feature` needs.

    Raises:
        ImportError: TensorFlow is not installed; the message names the
            feature and the fix.
    """
    # Imported already wherever a tf.data function (which AutoGraph
    # converts) calls this: AutoGraph would warn that it cannot convert
    # Python's import machinery.
    module = sys.modules.get("tensorflow")
    if module is not None:
        return module
    try:
        return importlib.import_module("tensorflow")
    except ImportError as error:
        raise ImportError(
            f"{feature} needs TensorFlow, which is not installed (Keras runs "
            f"on {keras.backend.backend()}). Install it (pip install "
            "tensorflow), or use the zoo's recipes, which give NumPy "
            "batches without it.") from error


def check_batch_size(batch_size):
    """Raises a ValueError unless `batch_size` is a positive integer."""
    if isinstance(batch_size, bool) or not isinstance(
            batch_size, (int, np.integer)) or batch_size < 1:
        raise ValueError(
            "`batch_size` must be a positive integer. Received: "
            f"batch_size={batch_size!r}.")


class ArrayBatches(keras.utils.PyDataset):
    """Batches of in-memory NumPy arrays, reshuffled every epoch.

    The `tf.data`-free twin of `Dataset.from_tensor_slices(...).shuffle(
    ..., reshuffle_each_iteration=True).batch(...)`: batch `i` of epoch `e`
    holds the samples `order(e)[i * batch_size:(i + 1) * batch_size]`, where
    `order(e)` is a permutation drawn from `(seed, e)` (the identity without
    a seed). `fit` moves to the next epoch through `on_epoch_end`.

    Args:
        arrays: one array or a tuple of arrays (e.g. `(x, y)`), with the
            samples along their first axis.
        batch_size: samples per batch.
        seed: seeds the shuffling; None keeps the samples in order.
        drop_remainder: whether a last, partial batch is left out.
        transform: `transform(batch, rng)` -> batch, applied to every batch
            (e.g. random augmentation or masking), or None.
        transform_seed: seeds `rng`, a NumPy generator drawn from
            `(transform_seed, epoch, index)`, or from `(transform_seed,
            index)` when `transform_each_epoch` is False (validation sets
            transformed the same way every epoch).
        transform_each_epoch: see `transform_seed`.
    """

    def __init__(self, arrays, batch_size, seed=None, drop_remainder=False,
                 transform=None, transform_seed=0, transform_each_epoch=True):
        super().__init__()
        check_batch_size(batch_size)
        self.arrays = arrays
        self.batch_size = int(batch_size)
        self.seed = seed
        self.drop_remainder = drop_remainder
        self.transform = transform
        self.transform_seed = int(transform_seed)
        self.transform_each_epoch = transform_each_epoch
        self.epoch = 0
        self._leaves = arrays if isinstance(arrays, tuple) else (arrays,)
        self.num_samples = len(self._leaves[0])
        if any(len(leaf) != self.num_samples for leaf in self._leaves):
            raise ValueError(
                "The arrays of a data set must hold the same number of "
                "samples. Received lengths "
                f"{[len(leaf) for leaf in self._leaves]}.")
        self._order = self._epoch_order()

    def __len__(self):
        if self.drop_remainder:
            return self.num_samples // self.batch_size
        return -(-self.num_samples // self.batch_size)

    def __getitem__(self, index):
        if not 0 <= index < len(self):
            raise IndexError(
                f"Batch {index} of a data set of {len(self)} batches.")
        rows = self._order[index * self.batch_size:
                           (index + 1) * self.batch_size]
        batch = tuple(leaf[rows] for leaf in self._leaves)
        if not isinstance(self.arrays, tuple):
            batch = batch[0]
        if self.transform is not None:
            key = ([self.transform_seed, self.epoch, index]
                   if self.transform_each_epoch
                   else [self.transform_seed, index])
            batch = self.transform(batch, np.random.default_rng(key))
        return batch

    def on_epoch_end(self):
        self.epoch += 1
        self._order = self._epoch_order()

    def _epoch_order(self):
        if self.seed is None:
            return np.arange(self.num_samples)
        return np.random.default_rng(
            [int(self.seed), self.epoch]).permutation(self.num_samples)


def tf_batches(arrays, batch_size, seed=None, drop_remainder=False):
    """`ArrayBatches` as a `tf.data` pipeline (without `transform`): the
    arrays sliced, shuffled every epoch from `seed` (if any), batched and
    prefetched."""
    tf = require_tensorflow("A tf.data pipeline")
    dataset = tf.data.Dataset.from_tensor_slices(arrays)
    if seed is not None:
        dataset = dataset.shuffle(len(np.asarray(
            arrays[0] if isinstance(arrays, tuple) else arrays)), seed=seed,
            reshuffle_each_iteration=True)
    return dataset.batch(batch_size, drop_remainder=drop_remainder).prefetch(
        tf.data.AUTOTUNE)


def batched(arrays, batch_size, seed=None, drop_remainder=False):
    """In-memory arrays as the batches of the running backend: `tf_batches`
    on TensorFlow, `ArrayBatches` elsewhere."""
    check_batch_size(batch_size)
    if uses_tf_data():
        return tf_batches(arrays, batch_size, seed, drop_remainder)
    return ArrayBatches(arrays, batch_size, seed, drop_remainder)
