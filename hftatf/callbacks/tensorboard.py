"""`TensorBoard`: each model of an array as a TensorBoard run."""

import functools
import os

import keras
import numpy as np

from hftatf.callbacks.base import (
    check_hyperparameter_names,
    checked_array,
    hyperparameter_values,
)
from hftatf.core.logs import as_given, split_logs
from hftatf.core.optional import tensorflow
from hftatf.core.tensorflow_compat import scalar_summary_metadata

# Written with each scalar: TensorBoard's scalars plugin shows them.
scalar_metadata = functools.cache(scalar_summary_metadata)

# What TensorFlow is imported for here: its summary writer, on any backend.
_FEATURE = "hftatf.callbacks.TensorBoard (TensorFlow's summary writer)"


# Abbreviations in run names, as users write these hyper-parameters.
_SHORT_NAMES = {"learning_rate": "lr"}


def varying_hyperparameters(optimizer):
    """`{name: [B] values}` of the optimizer's per-model hyper-parameters
    whose values are not the same for every model."""
    found = hyperparameter_values(
        optimizer, getattr(optimizer, "hyperparameter_names", ()),
        as_float=False)
    return {name: values for name, values in found.items()
            if len({str(v) for v in values}) > 1}


def describe_models(optimizer, num_models):
    """A name per model after what varies between the models: their
    hyper-parameters, written as the user gave them (`lr=0.03`, not the
    float32 variable's `0.029999999329447746`), joined by commas. Where
    that does not tell the models apart, each name starts with the
    model's own (`model_{b}`)."""
    varying = varying_hyperparameters(optimizer)
    names = [",".join(f"{_SHORT_NAMES.get(name, name)}="
                      f"{as_given(values[b])!r}"
                      for name, values in varying.items())
             for b in range(num_models)]
    if len(set(names)) == num_models:
        return names
    return [f"model_{b}" + (f",{name}" if name else "")
            for b, name in enumerate(names)]


class TensorBoard(keras.callbacks.Callback):
    """Writes each model's epoch results as a TensorBoard run of its own.

    Model `b`'s run is the directory `log_dir/<its run name>`, named by
    default after what varies between the models (`lr=0.03`, or
    `lr=0.03,beta_1=0.9`; see `describe_models`), so TensorBoard shows the
    B models as B runs overlaid on every chart and names them by what was
    tuned. Inside each run, as stock `keras.callbacks.TensorBoard` writes
    one model's, training results go to `train/` and validation results to
    `validation/`, both under the tag `epoch_{name}` at step `epoch`
    (`val_loss` is written as `epoch_loss` in `validation/`), so the train
    and validation curves of a model overlay too. Each hyper-parameter
    named in `hyperparameters` is written with the training results
    (`epoch_learning_rate`). The event files are plain `tf.summary`
    scalars: TensorFlow writes them, on any Keras backend (an ImportError
    where it is not installed); the tensorboard package is needed to view
    them, not to write them.

    Args:
        log_dir: the directory under which the runs are written.
        hyperparameters: names of the optimizer's per-model hyper-parameters
            to write too; those the optimizer does not have are left out.
            Defaults to `("learning_rate",)`.
        update_freq: `"epoch"`, the only frequency supported: per-model
            values are epoch results.
        run_names: the run of each model, a directory under `log_dir`
            (one name per model; None for a model not to write); defaults
            to the names `describe_models` gives, decided when training
            begins.
    """

    def __init__(self, log_dir="logs", hyperparameters=("learning_rate",),
                 update_freq="epoch", run_names=None):
        super().__init__()
        tensorflow(_FEATURE)
        if update_freq != "epoch":
            raise ValueError(
                "hftatf.callbacks.TensorBoard writes epoch results only: "
                f"pass update_freq='epoch'. Received: update_freq="
                f"{update_freq!r}.")
        self.log_dir = os.fspath(log_dir)
        self.hyperparameters = check_hyperparameter_names(hyperparameters)
        self.update_freq = update_freq
        self.run_names = (None if run_names is None else [
            None if name is None else os.fspath(name) for name in run_names])
        self._default_names = None
        self._writers = []

    def run_dir(self, index):
        """The run directory of model `index` (None if it writes none)."""
        names = self.run_names
        if names is None:
            if self._default_names is None:
                array = checked_array(self)
                self._default_names = describe_models(array.optimizer,
                                                      array.num_models)
            names = self._default_names
        name = names[index]
        return None if name is None else os.path.join(self.log_dir, name)

    def on_train_begin(self, logs=None):
        array = checked_array(self)
        if self.run_names is not None and (
                len(self.run_names) != array.num_models):
            raise ValueError(
                f"TensorBoard was given {len(self.run_names)} run names for "
                f"an array of {array.num_models} models; give one per "
                "model.")
        self._close()
        self._default_names = None
        self._writers = [self._run_writers(self.run_dir(b))
                         for b in range(array.num_models)]

    @staticmethod
    def _run_writers(run):
        """`{"train": writer, "validation": writer}` of the run directory
        `run` (None for none), as stock TensorBoard lays out a run."""
        if run is None:
            return None
        tf = tensorflow(_FEATURE)
        return {kind: tf.summary.create_file_writer(os.path.join(run, kind))
                for kind in ("train", "validation")}

    def on_epoch_end(self, epoch, logs=None):
        if not self._writers:
            self.on_train_begin()
        per_model, _ = split_logs(logs, len(self._writers))
        hypers = hyperparameter_values(
            self.model.optimizer,
            [n for n in self.hyperparameters if n not in per_model])
        tf = tensorflow(_FEATURE)
        for b, writers in enumerate(self._writers):
            if writers is None:
                continue
            for name, values in {**per_model, **hypers}.items():
                kind = "validation" if name.startswith("val_") else "train"
                value = np.asarray(values[b])
                if value.ndim == 0 and value.dtype.kind in "fiub":
                    with writers[kind].as_default():
                        tf.summary.write(
                            f"epoch_{name.removeprefix('val_')}",
                            tf.constant(value, "float32"), step=epoch,
                            metadata=scalar_metadata())
            for writer in writers.values():
                writer.flush()

    def on_train_end(self, logs=None):
        self._close()

    def _close(self):
        for writers in self._writers:
            for writer in (writers or {}).values():
                writer.close()
        self._writers = []
