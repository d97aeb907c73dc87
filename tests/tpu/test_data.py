"""The launcher's tf.data input: sources, per-host shards, per-replica
batches, whole epochs, and the stream a resumed run reads on from. (It
reads TFRecord files on any backend; on JAX a recipe's own data go
through NumPy instead: test_train_jax.py.)"""

import collections
import sys
import types

import numpy as np
import pytest

from hftatf.models import batches as zoo_batches
from hftatf.models import data as zoo_data
from hftatf.models import recipes
from hftatf.tpu import data
from hftatf.tpu.config import Config, ConfigError

tf = pytest.importorskip("tensorflow")

# scikit-learn's digits, split as the mlp recipe splits them.
TRAIN_SIZE, VALIDATION_SIZE = 1438, 359


@pytest.fixture(autouse=True)
def _tf_data_recipes():
    """The recipes' data as tf.data datasets on every backend, as the
    tf.data input reads them."""
    with zoo_batches.tf_data_input():
        yield


def source(**values):
    config = Config(**values)
    return data.resolve(config, recipes.get(config.model))


def cpu():
    return tf.distribute.OneDeviceStrategy("/cpu:0")


def batches(dataset, count=None):
    iterator = iter(dataset)
    taken = []
    while count is None or len(taken) < count:
        try:
            x, y = next(iterator)
        except StopIteration:
            break
        taken.append((np.asarray(x), np.asarray(y)))
    return taken


def context(pipelines, index, replicas):
    return tf.distribute.InputContext(num_input_pipelines=pipelines,
                                      input_pipeline_id=index,
                                      num_replicas_in_sync=replicas)


def test_epochs_are_whole_global_batches_of_the_training_set():
    inputs = data.distributed_inputs(cpu(), source(), 64)
    assert inputs.per_replica_batch_size == 64
    assert inputs.steps_per_epoch == TRAIN_SIZE // 64
    # Validation keeps its last partial batch: every example counts.
    assert inputs.validation_steps == -(-VALIDATION_SIZE // 64)
    x, y = next(iter(inputs.train))
    assert tuple(x.shape) == (64, 8, 8, 1) and tuple(y.shape) == (64,)
    # Each epoch's steps read the validation set once; the next epoch's
    # read it again (Keras keeps one iterator for the whole fit).
    taken = batches(inputs.validation, 2 * inputs.validation_steps)
    epoch, next_epoch = (taken[:inputs.validation_steps],
                         taken[inputs.validation_steps:])
    assert sum(len(y) for _, y in epoch) == VALIDATION_SIZE
    for (x, y), (x_again, y_again) in zip(epoch, next_epoch):
        np.testing.assert_array_equal(x, x_again)
        np.testing.assert_array_equal(y, y_again)


def test_steps_per_execution_and_static_shapes_round_epochs_down():
    inputs = data.distributed_inputs(cpu(), source(), 64,
                                     steps_per_execution=4,
                                     static_shapes=True)
    assert inputs.steps_per_epoch == TRAIN_SIZE // 64 // 4 * 4
    assert inputs.validation_steps == VALIDATION_SIZE // 64 // 4 * 4
    sizes = {len(y) for _, y in batches(inputs.validation,
                                        inputs.validation_steps)}
    assert sizes == {64}


def test_given_steps_are_kept_and_the_stream_never_ends():
    inputs = data.distributed_inputs(cpu(), source(), 512, train_steps=7,
                                     eval_steps=0)
    assert inputs.steps_per_epoch == 7 and inputs.validation is None
    # 7 steps of 512 are more than one pass (1438): the stream repeats.
    assert len(batches(inputs.train, 7)) == 7


def test_more_validation_steps_than_the_validation_set_holds_is_an_error():
    # 359 examples: 6 batches of 64 (the last one partial).
    inputs = data.distributed_inputs(cpu(), source(), 64, eval_steps=6)
    assert inputs.validation_steps == 6
    assert len(batches(inputs.validation, 6)) == 6
    with pytest.raises(ConfigError, match="--eval_steps=7.*has 6 steps"):
        data.distributed_inputs(cpu(), source(), 64, eval_steps=7)


def test_data_args_the_recipe_refuses_are_a_config_error():
    refused = source(model="pointnet", data_args="samples_per_shape=-3")
    with pytest.raises(ConfigError, match="--data_args .* the data of "
                       "recipe 'pointnet' refused them: .*must be positive"):
        data.distributed_inputs(cpu(), refused, 8)


def test_a_batch_larger_than_the_training_set_is_an_error():
    with pytest.raises(ValueError, match="not one step"):
        data.distributed_inputs(cpu(), source(), 4096)


def test_given_steps_still_need_one_step_of_training_data():
    with pytest.raises(ConfigError, match="not one step"):
        data.distributed_inputs(cpu(), source(), 4096, train_steps=1)


def test_resumed_run_reads_on_where_the_interrupted_one_stopped():
    steps = TRAIN_SIZE // 128
    whole = batches(data.distributed_inputs(cpu(), source(), 128).train,
                    2 * steps + 3)
    resumed = batches(data.distributed_inputs(
        cpu(), source(), 128, initial_epoch=2).train, 3)
    for (x, y), (x_whole, y_whole) in zip(resumed, whole[2 * steps:]):
        np.testing.assert_array_equal(x, x_whole)
        np.testing.assert_array_equal(y, y_whole)
    # Each epoch is a new shuffle of the same examples.
    first = np.concatenate([y for _, y in whole[:steps]])
    second = np.concatenate([y for _, y in whole[steps:2 * steps]])
    assert not np.array_equal(first, second)
    assert np.array_equal(np.bincount(first, minlength=10) > 0,
                          np.bincount(second, minlength=10) > 0)


def examples(dataset):
    return collections.Counter(
        x.tobytes() + bytes([int(label)]) for images, labels in batches(
            dataset) for x, label in zip(images, labels))


@pytest.mark.parametrize("training", [True, False])
def test_each_host_reads_its_own_shard(training):
    recipe_source = source()
    index = 0 if training else 1
    whole = examples(recipe_source.datasets(8, context(1, 0, 2))[index])
    shards = [examples(recipe_source.datasets(8, context(2, i, 4))[index])
              for i in range(2)]
    assert not set(shards[0]) & set(shards[1])
    assert shards[0] + shards[1] == whole
    assert sum(whole.values()) == (TRAIN_SIZE if training
                                   else VALIDATION_SIZE)


@pytest.fixture
def tfrecords(tmp_path):
    (x, y), (x_val, y_val) = zoo_data.digits()
    for index, size in enumerate((10, 20, 30)):
        start = sum((10, 20, 30)[:index])
        zoo_data.write_image_tfrecords(
            tmp_path / f"train-{index}.tfrecord", x[start:start + size],
            y[start:start + size])
    zoo_data.write_image_tfrecords(tmp_path / "validation.tfrecord",
                                   x_val[:12], y_val[:12])
    return tmp_path


def test_tfrecord_files_are_sharded_by_file(tfrecords):
    files = source(dataset=str(tfrecords / "train-*.tfrecord"),
                   validation_dataset=str(tfrecords / "validation.tfrecord"))
    assert files.kind == "tfrecord"
    train, validation = files.datasets(4, context(1, 0, 1))
    assert sum(len(y) for _, y in batches(train)) == 60
    assert sum(len(y) for _, y in batches(validation)) == 12
    x, _ = batches(train, 1)[0]
    assert x.shape == (4, 8, 8, 1) and x.dtype == np.float32
    # Files 0 and 2 to the first host, file 1 to the second.
    counts = [sum(len(y) for _, y in batches(
        files.datasets(4, context(2, i, 2))[0])) for i in range(2)]
    assert counts == [40, 20]


def test_no_validation_without_validation_files(tfrecords):
    files = source(dataset=str(tfrecords / "train-*.tfrecord"))
    inputs = data.distributed_inputs(cpu(), files, 8, eval_steps=2)
    assert inputs.validation is None and inputs.validation_steps == 0
    assert inputs.steps_per_epoch == 60 // 8


def test_tfrecord_prefix_and_model_kinds(tfrecords):
    pattern = str(tfrecords / "train-*.tfrecord")
    assert source(dataset=f"tfrecord:{pattern}").kind == "tfrecord"
    with pytest.raises(ConfigError, match="cannot read"):
        source(model="transformer_lm", dataset=pattern)


def test_tensorflow_datasets_are_read_from_data_dir(monkeypatch, tmp_path):
    calls = []
    (x, y), (x_val, y_val) = zoo_data.digits()

    def load(name, split, data_dir, download, as_supervised):
        calls.append((name, list(split), data_dir, download, as_supervised))
        pixels = (x * 255).astype("uint8")[..., None]
        val_pixels = (x_val * 255).astype("uint8")[..., None]
        return (tf.data.Dataset.from_tensor_slices((pixels[:40], y[:40])),
                tf.data.Dataset.from_tensor_slices((val_pixels[:8],
                                                    y_val[:8])))

    monkeypatch.setitem(sys.modules, "tensorflow_datasets",
                        types.SimpleNamespace(load=load))
    for name in ("digits_tfds", "tfds:digits_tfds"):
        tfds = source(dataset=name, data_dir=str(tmp_path))
        assert tfds.kind == "tfds"
        train, validation = tfds.datasets(8, context(1, 0, 1))
        assert sum(len(y) for _, y in batches(train)) == 40
        assert sum(len(y) for _, y in batches(validation)) == 8
    assert calls[0] == ("digits_tfds", ["train", "test"], str(tmp_path),
                        False, True)
    with pytest.raises(ConfigError, match="pass --data_dir"):
        source(dataset="tfds:digits_tfds")


def test_data_flags_that_would_be_ignored_are_errors(tfrecords):
    pattern = str(tfrecords / "train-*.tfrecord")
    validation = str(tfrecords / "validation.tfrecord")
    with pytest.raises(ConfigError, match="recipe 'mlp'.*--validation_data"):
        source(validation_dataset=validation)
    with pytest.raises(ConfigError, match="tensorflow-datasets dataset"):
        source(dataset="tfds:cifar10", data_dir=str(tfrecords),
               validation_dataset=validation)
    with pytest.raises(ConfigError, match="--data_dir=.*TFRecord files"):
        source(dataset=pattern, data_dir=str(tfrecords))
    with pytest.raises(ConfigError, match="--data_dir=.*recipe 'mlp'"):
        source(dataset="mlp", data_dir=str(tfrecords))


def test_tensorflow_datasets_missing_is_a_config_error(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "tensorflow_datasets", None)
    with pytest.raises(ConfigError, match="pip install tensorflow-datasets"):
        source(dataset="cifar10", data_dir=str(tmp_path))


def test_count_batches_reads_a_pass_when_cardinality_is_unknown():
    dataset = tf.data.Dataset.range(10).filter(lambda v: v % 3 == 0)
    assert int(dataset.cardinality()) < 0
    assert data.count_batches(dataset) == 4
    assert data.count_batches(tf.data.Dataset.range(5)) == 5


def test_input_contexts_of_one_device():
    (only,) = data.input_contexts(cpu())
    assert (only.num_input_pipelines, only.input_pipeline_id,
            only.num_replicas_in_sync) == (1, 0, 1)


def test_files_the_launcher_cannot_read_are_a_config_error(tfrecords):
    # Before: TensorFlow's InvalidArgumentError / DataLossError traceback.
    other = tfrecords / "other.tfrecord"
    with tf.io.TFRecordWriter(str(other)) as writer:
        writer.write(tf.train.Example(features=tf.train.Features(feature={
            "pixels": tf.train.Feature(
                float_list=tf.train.FloatList(value=[0.5]))})
        ).SerializeToString())
    not_records = tfrecords / "arrays.npz"
    np.savez(not_records, x=np.zeros(3))
    for path, reason in ((other, "image"), (not_records, "corrupted")):
        files = source(dataset=str(path))
        with pytest.raises(ConfigError, match=f"Cannot read the TFRecord "
                           f"files {path}: .*{reason}.*IMAGE_FEATURES"):
            data.distributed_inputs(cpu(), files, 4)
    files = source(dataset=str(tfrecords / "train-*.tfrecord"),
                   validation_dataset=str(other))
    with pytest.raises(ConfigError, match=f"validation: TFRecord files "
                       f"{other}"):
        data.distributed_inputs(cpu(), files, 4)
