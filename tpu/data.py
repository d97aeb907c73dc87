"""The launcher's input pipelines: which data, sharded per host, batched per
replica, fast-forwarded on resume.

A run's data comes from a `Source` (`resolve` picks it from the config): a
zoo recipe's own data (no download), TFRecord files (local or `gs://`), or
a tensorflow-datasets data directory. `distributed_inputs` builds the
training and validation pipelines with
`strategy.distribute_datasets_from_function`: the function runs once per
input pipeline (one per host of a TPU pod slice), and its
`tf.distribute.InputContext` says which shard that host reads (its own
TFRecord files where there are enough files, else every N-th batch) and the
per-replica batch size (the global batch divided by the replicas; a global
batch that does not divide evenly is an error).

Epochs are fixed numbers of steps: one pass over the training set (the
smallest host's shard, in whole global batches), or `--train_steps`. The
training stream repeats, reshuffled every pass, so a resumed run reads on
from where the interrupted one stopped (`initial_epoch`). Validation reads
the same batches every epoch.

That is the `tf.data` input, which imports TensorFlow when it is built.
Where the backend is not TensorFlow (JAX), a recipe's own data come as
NumPy batches instead, read by `data_numpy` with the same semantics;
TFRecord and tensorflow-datasets sources still need TensorFlow there.
"""

import contextlib
import dataclasses
import inspect

from hftatf.core import optional
from hftatf.models import batches, recipes
from hftatf.models import data as zoo_data
from hftatf.tpu.config import ConfigError
from hftatf.tpu.epochs import (
    Inputs,
    check_one_step,
    check_validation_steps,
    log_resumption,
    per_replica_batch_size,
    whole_steps,
)

# Data recipes of the zoo that make images, and the one that makes point
# clouds: TFRecord and tensorflow-datasets data are read the same way.
IMAGE_RECIPES = (zoo_data.digit_images, zoo_data.mnist_images)
POINT_RECIPES = (zoo_data.shapes,)

TFDS_PREFIX = "tfds:"
TFRECORD_PREFIX = "tfrecord:"


@dataclasses.dataclass(frozen=True)
class Source:
    """Where a run's examples come from.

    Attributes:
        kind: `"recipe"`, `"tfrecord"` or `"tfds"`.
        description: what the logs and the results call it.
        make: `make(batch_size, context)` -> `(train, validation)`, the
            batched (`batch_size` per replica) datasets of the input
            pipeline `context`, one pass each, validation possibly None.
        validation_description: what the messages call the validation
            set, where it has files of its own.
    """

    kind: str
    description: str
    make: object
    validation_description: str = None

    def datasets(self, batch_size, context):
        """`(train, validation)` batches of input pipeline `context`."""
        return self.make(batch_size, context)

    @property
    def tf_data(self):
        """Whether the source gives `tf.data` datasets (read through
        `tf.distribute`) rather than `keras.utils.PyDataset`s of NumPy
        batches (a recipe's own data where the backend is not
        TensorFlow, see `hftatf.models.batches.uses_tf_data`)."""
        return self.kind != "recipe" or batches.uses_tf_data()


def tensorflow(feature="The launcher's tf.data input"):
    """TensorFlow, which `feature` needs."""
    return optional.tensorflow(feature)


def is_tpu_strategy(strategy):
    """Whether `strategy` is a `tf.distribute.TPUStrategy` (there is none
    where TensorFlow was not imported)."""
    tf = optional.imported_tensorflow()
    return tf is not None and isinstance(strategy, tf.distribute.TPUStrategy)


def resolve(config, recipe):
    """The `Source` of `config.dataset` for the model `recipe`.

    Raises:
        ConfigError: for a dataset that is neither a zoo recipe, nor
            existing TFRecord files, nor a tensorflow-datasets name with
            `--data_dir` (and tensorflow-datasets installed), for
            `--validation_dataset` without TFRecord files or `--data_dir`
            without a tensorflow-datasets name (they would be ignored), or
            data arguments the loader does not take.
    """
    kind, name = _kind(config.dataset, recipe, config)
    if config.validation_dataset is not None and kind != "tfrecord":
        raise ConfigError(
            f"--validation_dataset={config.validation_dataset} goes with "
            f"TFRecord files in --dataset, but the training data is "
            f"{_described(kind, name)}, which brings its own validation "
            "set. Leave --validation_dataset out, or pass the training "
            "files as --dataset.")
    if config.data_dir is not None and kind != "tfds":
        raise ConfigError(
            f"--data_dir={config.data_dir} is where tensorflow-datasets "
            f"data is read from, but the training data is "
            f"{_described(kind, name)}. Leave --data_dir out, or name a "
            "tensorflow-datasets dataset with --dataset.")
    if kind == "recipe":
        return recipe_source(recipes.get(name), config.seed,
                             config.data_args)
    _check_tensorflow(config.dataset, _described(kind, name))
    if kind == "tfrecord":
        return _tfrecord_source(name, recipe, config)
    return _tfds_source(name, recipe, config)


def _kind(name, recipe, config):
    """`(kind, name)` of `--dataset=name`: `"recipe"`, `"tfrecord"` or
    `"tfds"`, and the name without its prefix."""
    if name is None:
        return "recipe", recipe.name
    if name.startswith(TFDS_PREFIX):
        return "tfds", name[len(TFDS_PREFIX):]
    if name.startswith(TFRECORD_PREFIX):
        return "tfrecord", name[len(TFRECORD_PREFIX):]
    if name in recipes.names():
        return "recipe", name
    if _looks_like_files(name):
        return "tfrecord", name
    if config.data_dir:
        return "tfds", name
    raise ConfigError(
        f"--dataset={name!r} is not a zoo recipe ({', '.join(recipes.names())}"
        "), not a TFRecord file name or glob, and there is no --data_dir to "
        "read it from as a tensorflow-datasets name. Pass one of those.")


def _check_tensorflow(dataset, described):
    """Raises a ConfigError, before anything is read, where TensorFlow,
    which reads `described` (TFRecord or tensorflow-datasets files), is
    not installed."""
    try:
        tensorflow(f"--dataset={dataset} ({described}, read with tf.data)")
    except ImportError as error:
        raise ConfigError(
            f"{error} A zoo recipe's own data need no TensorFlow: leave "
            "--dataset out, or pass a recipe name.") from None


def _described(kind, name):
    return {"recipe": "the zoo recipe", "tfrecord": "the TFRecord files",
            "tfds": "the tensorflow-datasets dataset"}[kind] + f" {name!r}"


def _looks_like_files(name):
    return "://" in name or any(c in name for c in "/*?[") or name.endswith(
        (".tfrecord", ".tfrecords", ".tfrec"))


def _check_args(function, args, fixed, what):
    parameters = inspect.signature(function).parameters
    unknown = sorted(set(args) - set(parameters) - set(fixed))
    taken = sorted(set(parameters) - set(fixed))
    if unknown:
        raise ConfigError(
            f"--data_args {unknown} are not arguments of {what}; it takes "
            f"{', '.join(taken)}.")
    overlap = sorted(set(args) & set(fixed))
    if overlap:
        raise ConfigError(
            f"--data_args cannot set {overlap}: the launcher sets them (use "
            "--batch_size and --seed).")


def recipe_source(recipe, seed, data_args=None):
    """The `Source` of the data recipe of `recipe`, seeded by `seed`, with
    `data_args` (the `--data_args` flag) over the recipe's own.

    Raises:
        ConfigError: for data arguments the recipe does not take (here) or
            refuses (when the data are made).
    """
    data_args = data_args or {}
    args = {**recipe.data_args, **data_args}
    _check_args(recipe.data, args, ("batch_size", "seed"),
                f"the data of recipe {recipe.name!r}")

    def make(batch_size, context):
        try:
            train, validation = recipe.data(batch_size=batch_size,
                                            seed=seed, **args)
        except (TypeError, ValueError) as error:
            if not data_args:
                raise
            raise ConfigError(
                f"--data_args {data_args}: the data of recipe "
                f"{recipe.name!r} refused them: {error}") from None
        return (_shard_batches(train, context),
                None if validation is None else _shard_batches(
                    validation, context))

    name = getattr(recipe.data, "__name__", None)
    return Source("recipe", f"{name} (recipe {recipe.name})" if name
                  else f"recipe {recipe.name}", make)


def _shard_batches(dataset, context):
    """Every N-th batch, for input pipeline `context` of N. Hosts read the
    same seeded order, so their shards are disjoint."""
    if context.num_input_pipelines == 1:
        return dataset
    return dataset.shard(context.num_input_pipelines,
                         context.input_pipeline_id)


def _record_kind(recipe):
    """`"images"` or `"points"`: how files are read for `recipe`."""
    if recipe.data in POINT_RECIPES:
        return "points"
    if recipe.data in IMAGE_RECIPES or {"image_size", "channels"} & set(
            recipe.data_args):
        return "images"
    raise ConfigError(
        f"Model {recipe.name!r} trains on data that the launcher cannot read "
        "from TFRecord or tensorflow-datasets files (it reads images and "
        "point clouds). Use its own recipe (leave --dataset out).")


def _glob(pattern, flag):
    names = sorted(tensorflow().io.gfile.glob(pattern))
    if not names:
        raise ConfigError(
            f"{flag}: no file matches {pattern!r}. Pass existing TFRecord "
            "file names or glob patterns (gs:// paths work).")
    return names


def _tfrecord_source(pattern, recipe, config):
    kind = _record_kind(recipe)
    train_files = _glob(pattern, "--dataset")
    validation_files = None if config.validation_dataset is None else _glob(
        config.validation_dataset, "--validation_dataset")
    loader = (zoo_data.tfrecord_points if kind == "points"
              else zoo_data.tfrecord_images)
    # The recipe's own arguments that the file reader also takes (image
    # size, channels, segmentation, ...), then the user's.
    names = inspect.signature(loader).parameters
    args = {k: v for k, v in recipe.data_args.items() if k in names} | (
        config.data_args)
    fixed = ("train_files", "validation_files", "batch_size", "seed")
    _check_args(loader, args, fixed, f"{loader.__name__} ({kind} files)")
    seed = config.seed

    def make(batch_size, context):
        train, shard_train = _shard_files(train_files, context)
        validation, shard_validation = (None, False) if (
            validation_files is None) else _shard_files(
            validation_files, context)
        train_set, validation_set = loader(train, validation, batch_size,
                                           seed=seed, **args)
        if shard_train:
            train_set = _shard_batches(train_set, context)
        if validation_set is not None and shard_validation:
            validation_set = _shard_batches(validation_set, context)
        return train_set, validation_set

    return Source("tfrecord", f"TFRecord files {pattern}", make,
                  None if validation_files is None
                  else f"TFRecord files {config.validation_dataset}")


def _shard_files(files, context):
    """This pipeline's files, and whether batches must still be sharded
    (when there are fewer files than pipelines)."""
    count, index = context.num_input_pipelines, context.input_pipeline_id
    if count > 1 and len(files) >= count:
        return files[index::count], False
    return files, count > 1


def _tfds_source(name, recipe, config):
    if not config.data_dir:
        raise ConfigError(
            f"--dataset={TFDS_PREFIX}{name} is read from a tensorflow-datasets"
            " data directory: pass --data_dir (e.g. gs://bucket/"
            "tensorflow_datasets), prepared beforehand.")
    if _record_kind(recipe) != "images":
        raise ConfigError(
            f"tensorflow-datasets data is read as images; model "
            f"{recipe.name!r} needs point clouds.")
    try:
        import tensorflow_datasets  # noqa: F401
    except ImportError:
        raise ConfigError(
            f"--dataset={name} is a tensorflow-datasets name, and reading it "
            "needs tensorflow-datasets, which is not installed: pip install "
            "tensorflow-datasets.") from None
    loader = zoo_data.tfds_images
    names = inspect.signature(loader).parameters
    args = {k: v for k, v in recipe.data_args.items() if k in names} | (
        config.data_args)
    _check_args(loader, args, ("name", "data_dir", "batch_size", "seed"),
                "tfds_images")
    data_dir, seed = config.data_dir, config.seed

    def make(batch_size, context):
        train, validation = loader(name, data_dir, batch_size, seed=seed,
                                   **args)
        return (_shard_batches(train, context),
                None if validation is None else _shard_batches(
                    validation, context))

    return Source("tfds", f"tensorflow-datasets {name} in {data_dir}", make)


# -- distribution -----------------------------------------------------------


def input_contexts(strategy):
    """The `tf.distribute.InputContext` of each input pipeline (host) of
    `strategy`, as `distribute_datasets_from_function` passes them."""
    tf = tensorflow()
    contexts = []

    def probe(context):
        contexts.append(context)
        return tf.data.Dataset.from_tensors(tf.zeros([1]))

    strategy.distribute_datasets_from_function(probe)
    if not contexts:
        contexts = [tf.distribute.InputContext(
            1, 0, strategy.num_replicas_in_sync)]
    return contexts


def count_batches(dataset):
    """The number of elements of one pass of `dataset` (read once where
    its cardinality is unknown)."""
    tf = tensorflow()
    cardinality = int(dataset.cardinality())
    if cardinality == tf.data.INFINITE_CARDINALITY:
        raise ConfigError(
            "The dataset repeats forever: pass --train_steps (and "
            "--eval_steps) to say how long an epoch is.")
    if cardinality >= 0:
        return cardinality
    return int(dataset.reduce(tf.constant(0, tf.int64),
                              lambda count, _: count + 1))


@contextlib.contextmanager
def _reading(source):
    """Turns TensorFlow's errors on reading files that are not what the
    launcher reads (another format, other feature names) into a
    `ConfigError` that names them."""
    tf = tensorflow()
    try:
        yield
    except tf.errors.OpError as error:
        if source.kind == "recipe":
            raise
        hint = ""
        if source.kind == "tfrecord":
            hint = (" The launcher reads TFRecord files of tf.train.Example "
                    "records with the features of hftatf.models.data."
                    "IMAGE_FEATURES (images: 'image', PNG or JPEG bytes, "
                    "and 'label') or POINT_FEATURES (point clouds).")
        message = (error.message or str(error)).strip().splitlines()[0]
        described = source.description + (
            f" (validation: {source.validation_description})"
            if source.validation_description else "")
        raise ConfigError(
            f"Cannot read the {described}: {message}.{hint}") from None


def _shapes_read(dataset):
    """`dataset`'s element spec, with the sizes of its first element where
    the spec leaves them unknown (images decoded without resizing), so
    that a model that cannot take them is refused before training."""
    tf = tensorflow()
    spec = dataset.element_spec
    specs = tf.nest.flatten(spec)
    if all(not isinstance(s, tf.TensorSpec) or s.shape[1:].is_fully_defined()
           for s in specs):
        return spec
    first = tf.nest.flatten(next(iter(dataset.take(1))))
    return tf.nest.pack_sequence_as(spec, [
        tf.TensorSpec((None, *t.shape[1:]), s.dtype, s.name)
        if isinstance(s, tf.TensorSpec) else s
        for s, t in zip(specs, first)])


def distributed_inputs(strategy, source, global_batch_size, train_steps=None,
                       eval_steps=None, steps_per_execution=1,
                       initial_epoch=0, static_shapes=False):
    """Builds the training and validation inputs of a run.

    Args:
        strategy: the `tf.distribute.Strategy` the array trains under.
        source: the `Source` of the examples.
        global_batch_size: examples per step, over all replicas.
        train_steps: training steps per epoch; None for one pass over the
            smallest host's shard (in whole steps).
        eval_steps: validation steps per epoch; None for one pass, 0 for
            no validation.
        steps_per_execution: epochs are rounded down to a multiple of it.
        initial_epoch: the epoch a resumed run starts at: the training
            stream skips the steps of the epochs before it.
        static_shapes: whether every batch must be full (TPUs); training
            batches always are.

    Returns:
        An `Inputs`.

    Raises:
        ConfigError: where a training shard holds not one step.
    """
    tf = tensorflow()
    replicas = strategy.num_replicas_in_sync
    batch = per_replica_batch_size(global_batch_size, replicas)
    contexts = input_contexts(strategy)
    local = max(1, replicas // len(contexts))

    def one_pass(context):
        """This pipeline's `(train, validation)`, one pass each."""
        train, validation = source.datasets(batch, context)
        # Every training step takes whole batches on every replica.
        train = train.rebatch(batch, drop_remainder=True)
        if validation is not None and static_shapes:
            validation = validation.rebatch(batch, drop_remainder=True)
        return train, validation

    validation_description = (source.validation_description
                              or source.description)

    def fewest_batches(datasets, needed):
        """The batches of the smallest of `datasets`, counted up to
        `needed` (reading that many at most, not a pass)."""
        return min(count_batches(dataset.take(needed))
                   for dataset in datasets)

    with _reading(source):
        passes = [one_pass(context) for context in contexts]
        trains = [train for train, _ in passes]
        validations = [validation for _, validation in passes]
        if train_steps:
            check_one_step(fewest_batches(trains, local), local, batch,
                           source.description)
        steps_per_epoch = train_steps or whole_steps(
            min(map(count_batches, trains)), local, batch, steps_per_execution,
            "training", source.description)
        if validations[0] is None or eval_steps == 0:
            validation_steps = 0
        elif eval_steps:
            check_validation_steps(
                fewest_batches(validations, eval_steps * local), eval_steps,
                local, batch, validation_description)
            validation_steps = eval_steps
        else:
            validation_steps = whole_steps(
                min(map(count_batches, validations)), local, batch,
                steps_per_execution, "validation", validation_description)
        element_spec = _shapes_read(trains[0])
    del passes, trains, validations
    skip = initial_epoch * steps_per_epoch * local

    def stream(context):
        """This pipeline's endless training stream, from `initial_epoch`."""
        dataset, _ = one_pass(context)
        if train_steps is None:
            # An epoch is one pass: the same number of whole steps on
            # every host.
            dataset = dataset.take(steps_per_epoch * local)
        dataset = dataset.repeat()
        if skip:
            dataset = dataset.skip(skip)
        return dataset

    def train_fn(context):
        # A pipeline reshuffled every pass draws each pass's order from one
        # seed generator shared by all of its iterators, so every iterator
        # opened on it (Keras opens one to build the model, prefetching
        # reads ahead) shifts the passes of the next. Built anew for every
        # iterator, the stream draws the same passes whatever was opened
        # before it: a resumed run, which skips the epochs run, then reads
        # what the uninterrupted run read.
        # (Not converted by AutoGraph: the stream is built in Python, the
        # data recipe's loading code included.)
        return tf.data.Dataset.range(1).flat_map(
            tf.autograph.experimental.do_not_convert(
                lambda _: stream(context))).prefetch(tf.data.AUTOTUNE)

    def validation_fn(context):
        # Repeated: Keras keeps one iterator of a distributed dataset for
        # the whole run and reads `validation_steps` steps of it every
        # epoch (the second epoch's validation ran out: StopIteration);
        # each epoch reads the same steps.
        _, dataset = one_pass(context)
        return dataset.take(validation_steps * local).repeat().prefetch(
            tf.data.AUTOTUNE)

    train = strategy.distribute_datasets_from_function(train_fn)
    validation = None
    if validation_steps:
        validation = strategy.distribute_datasets_from_function(
            validation_fn)
    log_resumption(initial_epoch, skip)
    return Inputs(train=train, validation=validation,
                  steps_per_epoch=steps_per_epoch,
                  validation_steps=validation_steps,
                  per_replica_batch_size=batch,
                  num_input_pipelines=len(contexts),
                  element_spec=element_spec)
