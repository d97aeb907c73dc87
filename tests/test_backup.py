"""Preemption-safe training: a run killed with SIGKILL and started again
ends with the weights of an uninterrupted run."""

import json
import pathlib
import signal
import subprocess
import sys

import keras
import numpy as np
import pytest
from testing import Interrupt

import hftatf
from hftatf.backup import METADATA, BackupAndRestore

HERE = pathlib.Path(__file__).parent


def run(backup_dir, out, kill_epoch=-1, kill_batch=0):
    return subprocess.run(
        [sys.executable, str(HERE / "resume_training.py"), str(backup_dir),
         str(out), str(kill_epoch), str(kill_batch)],
        capture_output=True, text=True, timeout=600)


def load(path):
    with np.load(path) as data:
        return [data[k] for k in sorted(data, key=lambda k: int(k[4:]))]


def test_killed_run_resumes_to_the_uninterrupted_weights(tmp_path):
    whole = run(tmp_path / "whole_backup", tmp_path / "whole.npz")
    assert whole.returncode == 0, whole.stderr[-3000:]
    expected = load(tmp_path / "whole.npz")
    # Killed inside an epoch, and as an epoch begins.
    for kill_epoch, kill_batch in [(1, 3), (2, 0)]:
        case = tmp_path / f"killed_{kill_epoch}_{kill_batch}"
        killed = run(case / "backup", case / "resumed.npz", kill_epoch,
                     kill_batch)
        assert killed.returncode == -signal.SIGKILL
        assert not (case / "resumed.npz").exists()
        # The backup of the last completed epoch is there.
        metadata = json.loads((case / "backup" / METADATA).read_text())
        assert metadata["epoch"] == kill_epoch
        resumed = run(case / "backup", case / "resumed.npz")
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        actual = load(case / "resumed.npz")
        assert len(expected) == len(actual)
        for ours, theirs in zip(actual, expected):
            np.testing.assert_array_equal(ours, theirs)


def small_array(num_models=2, units=2):
    x = keras.Input((3,))
    array = hftatf.fuse(keras.Model(x, keras.layers.Dense(units)(x)),
                        num_models)
    array.compile(optimizer=hftatf.optimizers.SGD(0.1), loss="mse")
    return array


def fit(array, backup):
    data = np.ones((4, 3), "float32"), np.zeros((4, 2), "float32")
    return array.fit(*data, epochs=2, verbose=0, callbacks=[backup])


def test_corrupt_backup_is_reported_not_loaded(tmp_path):
    fit(small_array(), BackupAndRestore(tmp_path, delete_checkpoint=False))
    metadata = json.loads((tmp_path / METADATA).read_text())
    weights = tmp_path / metadata["weights"]
    weights.write_bytes(weights.read_bytes()[:-100])  # truncated
    array = small_array()
    before = [np.asarray(w) for w in array.weights]
    with pytest.raises(ValueError, match="corrupt"):
        fit(array, BackupAndRestore(tmp_path))
    for ours, theirs in zip(array.weights, before):
        np.testing.assert_array_equal(np.asarray(ours), theirs)


def test_backup_of_another_array_is_reported_not_loaded(tmp_path):
    fit(small_array(), BackupAndRestore(tmp_path, delete_checkpoint=False))
    with pytest.raises(ValueError, match="holds an array of 2 models; this "
                                         "run has 3"):
        fit(small_array(num_models=3), BackupAndRestore(tmp_path))
    # Same size, other weights (a backup written before `num_models` was
    # recorded, or another architecture): one line, no weight dump.
    metadata = json.loads((tmp_path / METADATA).read_text())
    del metadata["num_models"]
    (tmp_path / METADATA).write_text(json.dumps(metadata))
    with pytest.raises(ValueError, match="does not fit this array") as error:
        fit(small_array(num_models=3), BackupAndRestore(tmp_path))
    assert len(str(error.value)) < 800


def test_unreadable_metadata_is_reported(tmp_path):
    (tmp_path / METADATA).write_text("{not json")
    with pytest.raises(ValueError, match="unreadable"):
        fit(small_array(), BackupAndRestore(tmp_path))


def test_backup_keeps_one_weights_file_and_is_deleted_at_the_end(tmp_path):
    fit(small_array(), BackupAndRestore(tmp_path / "a",
                                        delete_checkpoint=False))
    assert len(list((tmp_path / "a").glob("*.weights.h5"))) == 1
    fit(small_array(), BackupAndRestore(tmp_path / "b"))
    assert not list((tmp_path / "b").iterdir())


def test_per_model_callbacks_resume_where_they_were(tmp_path):
    # Early stopping's patience and best weights, the plateau's counters:
    # backed up with the array (they restarted: a model's weights 0.116
    # off), and backups run after the other callbacks whatever the list's
    # order (listed first, the backup missed the freeze of its epoch).
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 3)).astype("float32")
    y = rng.normal(size=(32, 2)).astype("float32")
    start = small_array(num_models=3).get_weights()

    def train(backup_dir, extra=()):
        array = small_array(num_models=3)
        array.set_weights(start)
        array.compile(optimizer=hftatf.optimizers.SGD([0.05, 0.3, 0.9]),
                      loss="mse")
        stopping = hftatf.callbacks.EarlyStopping(
            monitor="loss", patience=1, min_delta=0.02,
            restore_best_weights=True)
        plateau = hftatf.callbacks.ReduceLROnPlateau(
            monitor="loss", patience=1, factor=0.5, min_delta=0.05)
        array.fit(x, y, batch_size=8, epochs=7, shuffle=False, verbose=0,
                  callbacks=[BackupAndRestore(backup_dir), stopping,
                             plateau, *extra])
        return array, stopping

    whole, stopping = train(tmp_path / "whole")
    # Models stop at different epochs, some after the interruption.
    assert len(set(stopping.stopped_epoch)) > 1
    with pytest.raises(KeyboardInterrupt):
        train(tmp_path / "killed", [Interrupt(3)])
    resumed, resumed_stopping = train(tmp_path / "killed")
    assert resumed_stopping.stopped_epoch == stopping.stopped_epoch
    assert resumed_stopping.best_epoch == stopping.best_epoch
    np.testing.assert_array_equal(
        resumed.optimizer.get_hyperparameter("learning_rate"),
        whole.optimizer.get_hyperparameter("learning_rate"))
    for ours, theirs in zip(resumed.get_weights(), whole.get_weights()):
        np.testing.assert_array_equal(ours, theirs)
