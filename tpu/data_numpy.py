"""The launcher's input as NumPy batches, where the Keras backend is not
TensorFlow (JAX): a zoo recipe's own data, as the recipes give them there
(`keras.utils.PyDataset`s, see `hftatf.models.batches`), fed to `fit`
under the run's `keras.distribution`. No TensorFlow is imported.

The semantics are those of the `tf.data` input (`data`): epochs of fixed
numbers of whole steps (one pass over the smallest shard, or
`--train_steps`), an endless training stream reshuffled every pass (the
recipe's own `on_epoch_end`), read on from where an interrupted run
stopped (`initial_epoch`), and validation on the same batches every epoch.
The batch fed is the global one (per process of a pod slice, its share):
`keras.distribution` splits it between the devices, so it must split
evenly between the distribution's replicas.
"""

import contextlib
import dataclasses

import keras

from hftatf import distribute
from hftatf.tpu import epochs
from hftatf.tpu.config import ConfigError


@dataclasses.dataclass(frozen=True)
class InputContext:
    """Which shard of the data an input pipeline reads, as a
    `tf.distribute.InputContext` says it."""

    num_input_pipelines: int = 1
    input_pipeline_id: int = 0


class Placement:
    """The devices of a run fed NumPy batches: the `keras.distribution` set
    for it (None: one device), with what the launcher reads of a
    `tf.distribute.Strategy`.

    Attributes:
        distribution: the `keras.distribution.Distribution`, or None.
        num_replicas_in_sync: the slices each batch is split into (the
            distribution's model replicas).
        context: the `InputContext` of this process: the data shards (one
            per process of a pod slice that holds replicas of its own;
            Keras's `data_shard_id`) and the one it reads.
    """

    def __init__(self, distribution):
        self.distribution = distribution
        self.num_replicas_in_sync = 1
        self.context = InputContext()
        if distribution is None:
            return
        self.num_replicas_in_sync = distribution.num_model_replicas
        self.context = InputContext(
            min(distribution.num_processes, self.num_replicas_in_sync),
            distribution.data_shard_id)
        # Each process reads its own shard here (Keras shards `tf.data`
        # datasets only, and refuses others where it would).
        distribution.auto_shard_dataset = False

    def scope(self):
        """The distribution is set for the whole run (`placement`)."""
        return contextlib.nullcontext()


def placement(name, num_models):
    """Sets the `keras.distribution` that the strategy `name` stands for
    on JAX (`hftatf.distribute.JAX_DISTRIBUTIONS`) for an array of
    `num_models` models, and returns its `Placement`.

    Raises:
        ValueError: where the devices cannot hold the array that way.
    """
    return Placement(distribute.set_jax_distribution(name, num_models))


class TrainingStream(keras.utils.PyDataset):
    """The endless training batches of one data shard: pass after pass of
    the recipe's training set, reshuffled every pass (its `on_epoch_end`),
    `pass_steps` batches of the shard each, from batch `start` on.

    Batch `i` depends on `i` alone: every iterator Keras opens (one to
    build the model, then `fit`'s, kept over its epochs) reads the same
    stream, and a resumed run, which starts `initial_epoch` epochs on,
    reads what the uninterrupted run read there.

    Args:
        open_pass: `open_pass()` -> the recipe's training `PyDataset`, at
            its first pass.
        pass_steps: the batches of the shard read per pass.
        context: the `InputContext` of the shard: batches `id`, `id + N`,
            ... of each pass.
        start: the stream's first batch.
        opened: the recipe's training set, as `open_pass()` returns it,
            where one is at hand.
    """

    def __init__(self, open_pass, pass_steps, context, start=0, opened=None):
        super().__init__()
        self._open_pass = open_pass
        self._pass_steps = pass_steps
        self._context = context
        self._start = start
        self._pass = None if opened is None else (0, opened)

    @property
    def num_batches(self):
        # Endless: `fit`'s `steps_per_epoch` cuts the epochs.
        return None

    def __getitem__(self, index):
        number, step = divmod(self._start + index, self._pass_steps)
        shards = self._context.num_input_pipelines
        return self._dataset(number)[
            step * shards + self._context.input_pipeline_id]

    def _dataset(self, number):
        """The recipe's training set at pass `number`."""
        if self._pass is None or self._pass[0] > number:
            self._pass = (0, self._open_pass())
        done, dataset = self._pass
        for _ in range(number - done):
            dataset.on_epoch_end()
        self._pass = (number, dataset)
        return dataset


class ValidationBatches(keras.utils.PyDataset):
    """The first `steps` batches of a shard of the recipe's validation
    set (`context`, as for `TrainingStream`): the same every epoch."""

    def __init__(self, dataset, steps, context):
        super().__init__()
        self._dataset = dataset
        self._steps = steps
        self._context = context

    def __len__(self):
        return self._steps

    def __getitem__(self, index):
        shards = self._context.num_input_pipelines
        return self._dataset[index * shards + self._context.input_pipeline_id]


def _leading_size(batch):
    return keras.tree.flatten(batch)[0].shape[0]


def _batches(dataset, batch, whole):
    """The batches of one pass of `dataset`; only those of `batch`
    examples where `whole` (a last, smaller batch left out)."""
    count = dataset.num_batches
    if count is None:
        raise ConfigError(
            "The dataset repeats forever: pass --train_steps (and "
            "--eval_steps) to say how long an epoch is.")
    if whole and count and _leading_size(dataset[count - 1]) < batch:
        count -= 1
    return count


def _check_batches(dataset, source):
    if not isinstance(dataset, keras.utils.PyDataset):
        raise ConfigError(
            f"The {source.description} gave a {type(dataset).__name__} on "
            f"the {keras.backend.backend()} backend, where the launcher "
            "reads a keras.utils.PyDataset of NumPy batches (as the zoo "
            "recipes give there). Make the recipe's data return "
            "PyDatasets.")


def _spec(batch):
    """`keras.KerasTensor`s of the examples of `batch`, any batch size."""
    return keras.tree.map_structure(
        lambda array: keras.KerasTensor(
            (None, *array.shape[1:]),
            keras.backend.standardize_dtype(array.dtype)), batch)


def distributed_inputs(placement, source, global_batch_size,
                       train_steps=None, eval_steps=None,
                       steps_per_execution=1, initial_epoch=0,
                       static_shapes=False):
    """Builds the training and validation inputs of a run on NumPy
    batches; as `data.distributed_inputs`, with the `Placement` of the
    run's `keras.distribution` in place of a strategy. Validation batches
    are all whole where the distribution splits them (or
    `static_shapes`)."""
    replicas = placement.num_replicas_in_sync
    epochs.per_replica_batch_size(global_batch_size, replicas)
    context = placement.context
    shards = context.num_input_pipelines
    batch = global_batch_size // shards
    static_shapes = static_shapes or replicas > 1

    def one_pass():
        train, validation = source.datasets(batch, InputContext())
        for dataset in (train, validation):
            if dataset is not None:
                _check_batches(dataset, source)
        return train, validation

    train, validation = one_pass()
    # The fewest batches of any shard: every process steps together.
    smallest = _batches(train, batch, whole=True) // shards
    pass_steps = smallest
    if train_steps:
        epochs.check_one_step(smallest, 1, batch, source.description)
    else:
        pass_steps = epochs.whole_steps(
            smallest, 1, batch, steps_per_execution, "training",
            source.description)
    steps_per_epoch = train_steps or pass_steps
    validation_steps = 0
    if validation is not None and eval_steps != 0:
        fewest = _batches(validation, batch, static_shapes) // shards
        if eval_steps:
            epochs.check_validation_steps(
                fewest, eval_steps, 1, batch, source.description)
            validation_steps = eval_steps
        else:
            validation_steps = epochs.whole_steps(
                fewest, 1, batch, steps_per_execution, "validation",
                source.description)
    skip = initial_epoch * steps_per_epoch
    epochs.log_resumption(initial_epoch, skip)
    return epochs.Inputs(
        train=TrainingStream(lambda: one_pass()[0], pass_steps, context,
                             start=skip, opened=train),
        validation=ValidationBatches(validation, validation_steps, context)
        if validation_steps else None,
        steps_per_epoch=steps_per_epoch, validation_steps=validation_steps,
        per_replica_batch_size=global_batch_size // replicas,
        num_input_pipelines=shards, element_spec=_spec(train[0]))
