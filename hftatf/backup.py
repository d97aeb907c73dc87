"""Preemption-safe training: back up an array every epoch, resume exactly.

TPU VMs and shared GPU queues kill jobs without warning. With
`BackupAndRestore` in its callbacks, rerunning the same `fit` after a kill
resumes from the last completed epoch with every model's weights, optimizer
state (slots, step counts, per-model hyper-parameters), frozen or
diverged status, random generator states and the state of the fit's
per-model callbacks (`hftatf.callbacks.EarlyStopping`'s patience and best
weights, `ReduceLROnPlateau`'s, `ModelCheckpoint`'s best values), so the
run ends as an uninterrupted one would (given a deterministic input
pipeline and, on TensorFlow, `tf.config.experimental
.enable_op_determinism()`). Stock
callbacks start afresh, as they do after a stock `BackupAndRestore`.
"""

import hashlib
import json
import logging
import os
import pathlib
import tempfile

import keras
import numpy as np

from hftatf.core import compat

METADATA = "backup.json"


class BackupAndRestore(keras.callbacks.Callback):
    """Backs up the array at the end of every epoch; restores it at the
    start of `fit` if a backup exists.

    Unlike the stock callback, a backup is written atomically (to a
    temporary file, then renamed over the previous one, the metadata last)
    and carries a SHA-256 checksum of its weights: a truncated or corrupted
    backup is reported with a ValueError, never loaded.

    `FusedModel.fit` runs backups after its other callbacks (whatever their
    order in the list), so that a backup holds what they did at the end of
    the epoch (a model early stopping froze), and gives each backup those
    callbacks (`callbacks`): the state of those that name it
    (`backup_state`, attribute names) is backed up and restored too.

    Args:
        backup_dir: where the backup lives (one per run).
        delete_checkpoint: whether to delete the backup when `fit` ends
            normally, as the stock callback does.
    """

    def __init__(self, backup_dir, delete_checkpoint=True):
        super().__init__()
        if not backup_dir:
            raise ValueError("`backup_dir` must be a directory path.")
        self.backup_dir = pathlib.Path(backup_dir)
        self.delete_checkpoint = delete_checkpoint
        self.callbacks = []

    def _stateful_callbacks(self):
        return [c for c in self.callbacks if getattr(c, "backup_state", ())]

    @property
    def _metadata_path(self):
        return self.backup_dir / METADATA

    def on_train_begin(self, logs=None):
        for leftover in self.backup_dir.glob(".tmp-*"):
            leftover.unlink(missing_ok=True)  # From a killed run.
        metadata = read_metadata(self.backup_dir)
        if metadata is None:
            return
        if not self.model.built:
            raise ValueError(
                "BackupAndRestore needs a built model to restore into: call "
                "the array on a batch (or fuse a built model) before fit().")
        weights = self.backup_dir / metadata["weights"]
        check_num_models(metadata, self.backup_dir,
                         getattr(self.model, "num_models", None))
        optimizer = self.model.optimizer
        if optimizer is not None and not optimizer.built:
            optimizer.build(self.model.trainable_variables)
        try:
            self.model.load_weights(weights)
        except ValueError as error:
            # Keras names the first weight that differs, with its values.
            reason = str(error).split("\n")[0][:300]
            raise ValueError(
                f"The backup in {self.backup_dir} does not fit this array "
                f"({reason}): it was written by another architecture or "
                "array size. Resume with the backed-up settings, or delete "
                "the directory to start over.") from None
        states = metadata.get("random_states", [])
        generators = _seed_generators(self.model)
        if len(states) != len(generators):
            raise ValueError(
                f"The backup in {self.backup_dir} holds {len(states)} random "
                f"generator states; the array has {len(generators)}. It was "
                "written by another architecture: delete it to start over.")
        global_state_value = metadata.get("global_random_state")
        if global_state_value is not None:
            # Unseeded random ops (e.g. stochastic depth) draw from it.
            generators.append(compat.global_seed_generator(create=True))
            states = [*states, global_state_value]
        for generator, state in zip(generators, states):
            generator.state.assign(np.asarray(
                state, dtype=generator.state.dtype))
        self._restore_callbacks(metadata)
        compat.set_initial_epoch(self.model, metadata["epoch"])
        logging.info("Resumed array '%s' from %s at epoch %d.",
                     self.model.name, self.backup_dir, metadata["epoch"])

    def on_epoch_end(self, epoch, logs=None):
        self.backup_dir.mkdir(parents=True, exist_ok=True)
        # A new weights file, then the metadata that points to it, then the
        # old file goes: a kill at any moment leaves a consistent backup.
        name = f"epoch-{epoch + 1}.weights.h5"
        weights = _temporary(self.backup_dir, ".weights.h5")
        self.model.save_weights(weights, overwrite=True)
        digest = _sha256(weights)
        os.replace(weights, self.backup_dir / name)
        metadata = _temporary(self.backup_dir, ".json")
        # Random states are not weights, but dropout masks after the
        # restart must be those of an uninterrupted run.
        states = [np.asarray(g.state).tolist()
                  for g in _seed_generators(self.model)]
        global_generator = compat.global_seed_generator(create=False)
        callbacks = self._save_callbacks(epoch)
        metadata.write_text(json.dumps(
            {"epoch": epoch + 1, "weights": name, "sha256": digest,
             "num_models": getattr(self.model, "num_models", None),
             "random_states": states,
             "global_random_state": None if global_generator is None
             else np.asarray(global_generator.state).tolist(),
             "callbacks": callbacks}))
        os.replace(metadata, self._metadata_path)
        kept = {name, (callbacks or {}).get("arrays")}
        for old in self.backup_dir.glob("epoch-*"):
            if old.name not in kept:
                old.unlink(missing_ok=True)

    def on_train_end(self, logs=None):
        if self.delete_checkpoint:
            delete_backup(self.backup_dir)

    # -- the state of the other callbacks ------------------------------------

    def _save_callbacks(self, epoch):
        """Writes the arrays of the stateful callbacks' states to a file of
        their own; returns what the metadata holds of them (None if no
        callback has state)."""
        callbacks = self._stateful_callbacks()
        if not callbacks:
            return None
        arrays = {}
        states = [{"class": type(c).__name__,
                   "state": _without_arrays(
                       {a: getattr(c, a) for a in c.backup_state}, arrays)}
                  for c in callbacks]
        name = f"epoch-{epoch + 1}.callbacks.npz"
        path = _temporary(self.backup_dir, ".npz")
        with open(path, "wb") as file:
            np.savez(file, **arrays)
        digest = _sha256(path)
        os.replace(path, self.backup_dir / name)
        return {"states": states, "arrays": name, "sha256": digest}

    def _restore_callbacks(self, metadata):
        saved = metadata.get("callbacks")
        callbacks = self._stateful_callbacks()
        if not saved and not callbacks:
            return
        states = (saved or {}).get("states", [])
        if [s["class"] for s in states] != [
                type(c).__name__ for c in callbacks]:
            logging.warning(
                "The backup in %s holds the state of the callbacks %s; this "
                "fit has %s, which start afresh.", self.backup_dir,
                [s["class"] for s in states],
                [type(c).__name__ for c in callbacks])
            return
        path = self.backup_dir / saved["arrays"]
        if not path.exists() or _sha256(path) != saved["sha256"]:
            raise ValueError(
                f"The backup in {self.backup_dir} is corrupt: the state of "
                f"its callbacks ({saved['arrays']}) is missing or does not "
                "match its checksum. Delete the directory to start over.")
        with np.load(path) as arrays:
            for callback, state in zip(callbacks, states):
                for attribute, value in _with_arrays(
                        state["state"], arrays).items():
                    setattr(callback, attribute, value)


def delete_backup(backup_dir):
    """Deletes the backup in `backup_dir` (its metadata first: a backup
    without it is none), as `BackupAndRestore` does when `fit` ends."""
    backup_dir = pathlib.Path(backup_dir)
    if backup_dir.exists():
        (backup_dir / METADATA).unlink(missing_ok=True)
        for path in backup_dir.glob("epoch-*"):
            path.unlink(missing_ok=True)


def read_metadata(backup_dir):
    """The metadata of the backup in `backup_dir`, its `epoch` an integer;
    None where there is no backup.

    Raises:
        ValueError: the metadata is unreadable or names a missing weights
            file, or one that does not match its checksum.
    """
    backup_dir = pathlib.Path(backup_dir)
    path = backup_dir / METADATA
    if not path.exists():
        return None
    try:
        metadata = json.loads(path.read_text())
        metadata["epoch"] = int(metadata["epoch"])
        metadata["sha256"]  # noqa: B018
        weights = backup_dir / metadata["weights"]
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(
            f"The backup metadata {path} is unreadable ({error}). Delete "
            f"{backup_dir} to start over.") from None
    if not weights.exists():
        raise ValueError(
            f"The backup in {backup_dir} names the weights file "
            f"{metadata['weights']}, which is missing. Delete {backup_dir} "
            "to start over.")
    digest = _sha256(weights)
    if digest != metadata["sha256"]:
        raise ValueError(
            f"The backup in {backup_dir} is corrupt: its weights file does "
            f"not match its checksum ({digest} instead of "
            f"{metadata['sha256']}). Delete the directory to start over.")
    return metadata


def check_num_models(metadata, backup_dir, num_models):
    """Refuses to resume the backup `metadata` (from `read_metadata`) with
    an array of another number of models."""
    backed_up = (metadata or {}).get("num_models")
    if backed_up is not None and backed_up != num_models:
        raise ValueError(
            f"The backup in {backup_dir} holds an array of {backed_up} "
            f"models; this run has {num_models}, so it cannot resume it. "
            "Resume with the backed-up run's settings, or delete the "
            "directory to start over.")


def _seed_generators(model):
    """Every seed generator the model's layers draw from, in a fixed
    order."""
    generators = []
    for layer in compat.inner_layers(model):
        for generator in compat.seed_generators(layer):
            if all(generator is not g for g in generators):
                generators.append(generator)
    return generators


def _without_arrays(value, arrays):
    """`value` (lists, tuples, dicts, numbers, strings, None and NumPy
    arrays) for JSON: each array moved to `arrays`, named in its place."""
    if isinstance(value, np.ndarray):
        key = f"a{len(arrays)}"
        arrays[key] = value
        return {"array": key}
    if isinstance(value, dict):
        return {"dict": {k: _without_arrays(v, arrays)
                         for k, v in value.items()}}
    if isinstance(value, (list, tuple)):
        return [_without_arrays(v, arrays) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    return value


def _with_arrays(value, arrays):
    """The inverse of `_without_arrays` (`arrays` the saved ones)."""
    if isinstance(value, dict) and "array" in value:
        return np.array(arrays[value["array"]])
    if isinstance(value, dict):
        return {k: _with_arrays(v, arrays) for k, v in value["dict"].items()}
    if isinstance(value, list):
        return [_with_arrays(v, arrays) for v in value]
    return value


def _temporary(directory, suffix):
    handle, name = tempfile.mkstemp(dir=directory, suffix=suffix,
                                    prefix=".tmp-")
    os.close(handle)
    return pathlib.Path(name)


def _sha256(path):
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
