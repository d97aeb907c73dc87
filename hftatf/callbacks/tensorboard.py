"""`TensorBoard`: each model of an array as a TensorBoard run."""

import os

import keras
import numpy as np
import tensorflow as tf

from hftatf.callbacks.base import (
    check_hyperparameter_names,
    checked_array,
    hyperparameter_values,
)
from hftatf.core.compat import scalar_summary_metadata
from hftatf.core.logs import split_logs

# Written with each scalar: TensorBoard's scalars plugin shows them.
SCALAR_METADATA = scalar_summary_metadata()


class TensorBoard(keras.callbacks.Callback):
    """Writes each model's epoch results as a TensorBoard run of its own.

    Model `b`'s scalars go to `log_dir/model_{b}`, so TensorBoard shows the
    B models as B runs overlaid on every chart. Each per-model quantity of
    the logs is written under the tag `epoch_{name}` (`epoch_loss`,
    `epoch_val_loss`, `epoch_accuracy`, ...) at step `epoch`, as stock
    `keras.callbacks.TensorBoard` tags epoch summaries, and so is each
    hyper-parameter named in `hyperparameters` (`epoch_learning_rate`).
    The event files are plain `tf.summary` scalars: the tensorboard package
    is needed to view them, not to write them.

    Args:
        log_dir: the directory under which the runs are written.
        hyperparameters: names of the optimizer's per-model hyper-parameters
            to write too; those the optimizer does not have are left out.
            Defaults to `("learning_rate",)`.
        update_freq: `"epoch"`, the only frequency supported: per-model
            values are epoch results.
        run_names: the run of each model, a directory under `log_dir`
            (one name per model; None for a model not to write); defaults
            to `model_{b}`.
    """

    def __init__(self, log_dir="logs", hyperparameters=("learning_rate",),
                 update_freq="epoch", run_names=None):
        super().__init__()
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
        self._writers = []

    def run_dir(self, index):
        """The run directory of model `index` (None if it writes none)."""
        if self.run_names is None:
            return os.path.join(self.log_dir, f"model_{index}")
        name = self.run_names[index]
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
        self._writers = [
            None if self.run_dir(b) is None
            else tf.summary.create_file_writer(self.run_dir(b))
            for b in range(array.num_models)]

    def on_epoch_end(self, epoch, logs=None):
        if not self._writers:
            self.on_train_begin()
        per_model, _ = split_logs(logs, len(self._writers))
        hypers = hyperparameter_values(
            self.model.optimizer,
            [n for n in self.hyperparameters if n not in per_model])
        for b, writer in enumerate(self._writers):
            if writer is None:
                continue
            with writer.as_default():
                for name, values in {**per_model, **hypers}.items():
                    value = np.asarray(values[b])
                    if value.ndim == 0 and value.dtype.kind in "fiub":
                        tf.summary.write(
                            f"epoch_{name}", tf.constant(value, "float32"),
                            step=epoch, metadata=SCALAR_METADATA)
            writer.flush()

    def on_train_end(self, logs=None):
        self._close()

    def _close(self):
        for writer in self._writers:
            if writer is not None:
                writer.close()
        self._writers = []
