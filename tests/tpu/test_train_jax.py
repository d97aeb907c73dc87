"""The launcher where the input is NumPy batches (JAX): whole-step epochs,
the stream reshuffled every pass and read on after a resumption, the same
validation batches every epoch; and, on JAX without TensorFlow, a run that
trains and exports, and TFRecord input refused before any training."""

import json
import os
import pathlib
import subprocess
import sys

import keras
import numpy as np
import pytest
from testing import Interrupt

from hftatf.models import data as zoo_data
from hftatf.models.batches import ArrayBatches
from hftatf.tpu import data, data_numpy, results, train
from hftatf.tpu.config import Config, ConfigError

ROOT = pathlib.Path(__file__).resolve().parents[2]
# scikit-learn's digits, split as the mlp recipe splits them.
TRAIN_SIZE, VALIDATION_SIZE = 1438, 359


def digits_source(seed=0):
    """The digits as the mlp recipe gives them on JAX (`ArrayBatches`,
    reshuffled every pass), on any backend."""
    (x, y), (x_val, y_val) = zoo_data.digits()

    def make(batch_size, context):
        return (ArrayBatches((x, y), batch_size, seed=seed),
                ArrayBatches((x_val, y_val), batch_size))

    return data.Source("recipe", "digits", make)


class Replicas:
    """A `Placement` whose distribution splits each batch `replicas` ways,
    read by `shards` input pipelines (this one `index`)."""

    def __init__(self, replicas=1, shards=1, index=0):
        self.num_replicas_in_sync = replicas
        self.context = data_numpy.InputContext(shards, index)


def inputs(global_batch_size, placement=None, **values):
    return data_numpy.distributed_inputs(
        placement or data_numpy.Placement(None), digits_source(),
        global_batch_size, **values)


def labels(dataset, start, stop):
    return [dataset[i][1] for i in range(start, stop)]


def test_epochs_are_whole_global_batches_of_the_training_set():
    run = inputs(64)
    assert run.steps_per_epoch == TRAIN_SIZE // 64
    # The last, smaller validation batch is read where nothing splits it.
    assert run.validation_steps == -(-VALIDATION_SIZE // 64)
    assert run.per_replica_batch_size == 64 and run.num_input_pipelines == 1
    x, y = run.train[0]
    assert x.shape == (64, 8, 8) and y.shape == (64,)
    assert tuple(run.element_spec[0].shape) == (None, 8, 8)
    # Split between 4 replicas: per replica 16, every batch whole.
    split = inputs(64, Replicas(4), steps_per_execution=4)
    assert split.per_replica_batch_size == 16
    assert split.steps_per_epoch == TRAIN_SIZE // 64 // 4 * 4
    assert split.validation_steps == VALIDATION_SIZE // 64 // 4 * 4
    assert split.train[0][0].shape == (64, 8, 8)


def test_the_stream_is_reshuffled_every_pass_and_never_ends():
    run = inputs(128)
    steps = run.steps_per_epoch
    first, second = labels(run.train, 0, steps), labels(
        run.train, steps, 2 * steps)
    source, _ = digits_source().datasets(128, None)
    assert all(np.array_equal(a, b) for a, b in zip(first, labels(
        source, 0, steps)))
    source.on_epoch_end()
    assert all(np.array_equal(a, b) for a, b in zip(second, labels(
        source, 0, steps)))
    assert not np.array_equal(np.concatenate(first),
                              np.concatenate(second))
    assert run.train.num_batches is None
    assert run.train[50 * steps][0].shape == (128, 8, 8)
    # Read back from the start (as Keras's second iterator reads), the
    # stream is what it was.
    assert np.array_equal(run.train[0][1], first[0])


def test_given_steps_run_across_passes():
    run = inputs(512, train_steps=7)
    assert run.steps_per_epoch == 7
    whole = TRAIN_SIZE // 512
    source, _ = digits_source().datasets(512, None)
    source.on_epoch_end()
    # Whole batches only: the second pass starts after the first's.
    assert np.array_equal(run.train[whole][1], source[0][1])


def test_resumed_run_reads_on_where_the_interrupted_one_stopped():
    whole = inputs(128)
    resumed = inputs(128, initial_epoch=2)
    steps = whole.steps_per_epoch
    for i in range(steps + 2):
        assert np.array_equal(resumed.train[i][1],
                              whole.train[2 * steps + i][1])


def test_validation_is_the_same_batches_every_epoch():
    run = inputs(64, eval_steps=3)
    assert run.validation_steps == len(run.validation) == 3
    first = labels(run.validation, 0, 3)
    run.validation.on_epoch_end()
    run.train.on_epoch_end()
    assert all(np.array_equal(a, b) for a, b in zip(
        first, labels(run.validation, 0, 3)))
    assert inputs(64, eval_steps=0).validation is None


def test_each_host_reads_its_own_shard():
    source, _ = digits_source().datasets(64, None)
    shards = [inputs(128, Replicas(2, shards=2, index=index))
              for index in range(2)]
    for index, shard in enumerate(shards):
        assert shard.steps_per_epoch == TRAIN_SIZE // 64 // 2
        assert np.array_equal(shard.train[0][1], source[index][1])
        assert np.array_equal(shard.train[1][1], source[2 + index][1])


def test_data_too_small_for_the_steps_is_an_error():
    with pytest.raises(ConfigError, match="not one step"):
        inputs(4096)
    with pytest.raises(ConfigError, match="not one step"):
        inputs(4096, train_steps=1)
    with pytest.raises(ConfigError, match="--eval_steps=7, but the "
                       "validation set .* has 6 steps"):
        inputs(64, eval_steps=7)
    with pytest.raises(ConfigError, match="split evenly between the 4"):
        inputs(66, Replicas(4))


@pytest.mark.backends("jax", reason="the NumPy input; on TensorFlow, a "
                      "killed process's resumption is tested in "
                      "test_processes.py")
def test_an_interrupted_run_resumes_to_the_uninterrupted_one(tmp_path):
    # Epochs of one pass: the stream is reshuffled every epoch, and the
    # resumed run must read the passes the uninterrupted one read.
    config = Config(num_models=2, epochs=3, batch_size=256, eval_steps=2,
                    learning_rate=[0.1, 0.03], model_args={
                        "hidden_units": [16]}, verbose=0, export_dir="",
                    model_dir=str(tmp_path / "whole"))
    whole = train.train(config)
    config = Config(**{**config.to_dict(),
                       "model_dir": str(tmp_path / "resumed")})
    with pytest.raises(KeyboardInterrupt):
        train.train(config, callbacks=[Interrupt(epoch=1)])
    resumed = train.train(config)
    assert resumed.initial_epoch == 1
    assert resumed.history == whole.history
    for actual, expected in zip(resumed.array.weights, whole.array.weights):
        np.testing.assert_array_equal(np.asarray(actual),
                                      np.asarray(expected))


# The launcher on JAX with TensorFlow blocked, as if not installed; argv:
# the command line. Prints the exit code and the TensorFlow modules
# imported.
LAUNCHER = """
import json, sys
sys.modules["tensorflow"] = None
sys.argv = sys.argv[1:]
from hftatf.tpu import train
try:
    train.run()
except SystemExit as exit:
    code = exit.code
print(json.dumps({"code": code, "tensorflow": sorted(
    m for m in sys.modules
    if m.startswith("tensorflow") and sys.modules[m] is not None)}))
"""


def launch_without_tensorflow(*argv):
    env = {**os.environ, "KERAS_BACKEND": "jax", "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-c", LAUNCHER, "hftatf-train", *argv], cwd=ROOT,
        env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.splitlines()[-1]), result


@pytest.mark.backends("jax", reason="runs the launcher on JAX without "
                      "TensorFlow, in a process of its own; the TensorFlow "
                      "suite runs it in test_train.py")
def test_without_tensorflow_the_main_job_trains_and_exports(tmp_path):
    model_dir = tmp_path / "run"
    done, result = launch_without_tensorflow(
        "--backend", "jax", "--model", "mlp", "--num_models", "4",
        "--epochs", "2", "--train_steps", "3", "--verbose", "2",
        "--model_dir", str(model_dir))
    assert done == {"code": None, "tensorflow": []}, result.stderr[-3000:]
    assert "backend jax" in result.stdout
    assert "Exported 4 models" in result.stdout
    assert "No TensorBoard logs" in result.stderr
    rows = results.read_history(model_dir / results.HISTORY_FILE, 4)
    assert all(len(values) == 2 for values in rows.values())
    assert all(np.isfinite(rows[f"val_accuracy_{b}"]).all()
               for b in range(4))
    (_, _), (x_val, _) = zoo_data.digits()
    for b in range(4):
        path = model_dir / "export" / f"model_{b}" / "model.keras"
        model = keras.models.load_model(path)
        predictions = model.predict(x_val[:4, ..., None], verbose=0)
        assert predictions.shape == (4, 10)
        assert np.isfinite(predictions).all()


@pytest.mark.backends("jax", reason="runs the launcher on JAX without "
                      "TensorFlow, in a process of its own")
@pytest.mark.parametrize("dataset", ["tfrecord:{}/train-*.tfrecord",
                                     "tfds:mnist"])
def test_without_tensorflow_tfrecord_input_is_refused_before_training(
        tmp_path, dataset):
    model_dir = tmp_path / "run"
    dataset = dataset.format(tmp_path)
    argv = ["--dataset", dataset, "--model_dir", str(model_dir)]
    if dataset.startswith("tfds:"):
        argv += ["--data_dir", str(tmp_path)]
    done, result = launch_without_tensorflow(*argv)
    assert done["code"] == 2
    (message,) = result.stderr.strip().splitlines()[-1:]
    assert message.startswith(
        f"hftatf-train: error: --dataset={dataset} (the ")
    assert "needs TensorFlow, which is not installed" in message
    assert "pip install tensorflow" in message
    assert not model_dir.exists()
