"""`EarlyStopping`: stops each model of an array on its own."""

import numpy as np
from keras import ops

from hftatf.callbacks.base import PerModelMonitorCallback, per_model_arg
from hftatf.core.compat import print_msg
from hftatf.core.logs import listed, set_weights_epoch


class EarlyStopping(PerModelMonitorCallback):
    """Stops each model of an array when its monitored metric stops
    improving.

    Model `b` is judged on `logs[f"{monitor}_{b}"]` exactly as stock
    `keras.callbacks.EarlyStopping` judges a single model on
    `logs[monitor]`. When its patience runs out the model is frozen
    (`array.freeze_models([b])`: from the next step on its weights,
    optimizer slots and step count stay as they are) while the other models
    train on; with `restore_best_weights`, its slice of the weights is set
    back to its best epoch's at once. When no model of the array trains any
    more, training stops (`model.stop_training = True`).

    Models that are frozen when training begins are not watched. Models
    this callback stopped stay frozen after `fit`, so a later `fit` trains
    only the others; `array.unfreeze_models` resumes them.

    Args:
        monitor: the quantity to watch, without the model suffix. Defaults
            to `"val_loss"`.
        min_delta: minimum change of the monitored quantity that counts as
            an improvement. Defaults to 0.
        patience: number of epochs without improvement after which a model
            is stopped. Defaults to 0.
        verbose: 0 (silent) or 1 (a message when a model is stopped or
            restored).
        mode: `"auto"`, `"min"` or `"max"`; `"auto"` infers the direction
            from the name, per-model names included (`monitor_direction`).
        baseline: a float, or one float per model: a model that does not
            improve on its baseline is stopped after `patience` epochs.
        restore_best_weights: whether to restore each model's weights from
            its best epoch: when it is stopped, or at the end of training for
            models that were not.
        start_from_epoch: number of warm-up epochs before monitoring starts.
        stop_training_when_all_stopped: whether to end training once no
            model of the array trains any more. Defaults to True.

    Attributes:
        stopped_epoch: per model, the epoch at which it was stopped (0 if it
            was not), as in stock Keras.
        best: per model, the best monitored value (None before the first).
        best_epoch: per model, the epoch of its best value.
        wait: per model, the number of epochs without improvement.
    """

    def __init__(self, monitor="val_loss", min_delta=0, patience=0, verbose=0,
                 mode="auto", baseline=None, restore_best_weights=False,
                 start_from_epoch=0, stop_training_when_all_stopped=True):
        super().__init__(monitor, mode, min_delta=min_delta)
        self.patience = patience
        self.baseline = baseline
        self.restore_best_weights = restore_best_weights
        self.start_from_epoch = start_from_epoch
        self.stop_training_when_all_stopped = stop_training_when_all_stopped
        self.verbose = verbose
        self.stopped_epoch = []
        self.best = []
        self.best_epoch = []
        self.best_weights = []
        self.wait = []

    # What `hftatf.backup.BackupAndRestore` saves and restores.
    backup_state = ("wait", "stopped_epoch", "best", "best_epoch",
                    "best_weights", "_watched", "_restored")

    def on_train_begin(self, logs=None):
        array = self.array
        num_models = array.num_models
        # Allow instances to be re-used across `fit()` calls, as in Keras.
        self.wait = [0] * num_models
        self.stopped_epoch = [0] * num_models
        self.best = [None] * num_models
        self.best_epoch = [0] * num_models
        self.best_weights = [None] * num_models
        self._baselines = per_model_arg("baseline", self.baseline,
                                         num_models)
        self._watched = [bool(a) for a in array.active_models]
        self._restored = [False] * num_models
        self._last_epoch = None

    def on_epoch_end(self, epoch, logs=None):
        if self.monitor_op is None:
            # Delay setup until the model's metrics are all built.
            self._set_monitor_op()
        array = self.array
        values = self._model_values(logs, "Early stopping")
        if epoch < self.start_from_epoch:
            return
        watched = [b for b in range(array.num_models) if self._watched[b]
                   and not self.stopped_epoch[b] and values[b] is not None]
        # If best weights were never set, the current ones are the best.
        unset = [b for b in watched if self.best_weights[b] is None] if (
            self.restore_best_weights) else []
        for b in unset:
            self.best_epoch[b] = epoch
        improved, stopping = [], []
        for b in watched:
            current = values[b]
            self.wait[b] += 1
            if self._is_improvement(current, self.best[b]):
                self.best[b] = current
                self.best_epoch[b] = epoch
                improved.append(b)
                # Only restart wait if we beat both the baseline and our
                # previous best.
                if self._baselines[b] is None or self._is_improvement(
                        current, self._baselines[b]):
                    self.wait[b] = 0
            elif self.wait[b] >= self.patience and epoch > 0:
                self.stopped_epoch[b] = epoch
                stopping.append(b)
        if self.restore_best_weights:
            # Read once for all the models whose best weights change.
            changed = sorted(set(unset) | set(improved))
            for b, weights in zip(changed, _model_weights(array, changed)):
                self.best_weights[b] = weights
        self._last_epoch = epoch
        if stopping:
            array.freeze_models(stopping)
            restored = [b for b in stopping if self._restore(b)]
            if self.verbose > 0:
                print_msg(f"Epoch {epoch + 1}: early stopping "
                          f"{_models(stopping)}"
                          f"{self._restored_text(restored)}.")
        if self.stop_training_when_all_stopped and not np.any(
                array.active_models):
            self.model.stop_training = True

    def on_train_end(self, logs=None):
        history = getattr(self.model, "history", None)
        announce = []
        for b in range(len(self.best_weights)):
            # Models restored when they stopped are restored again (and
            # said so once): a frozen model's moving statistics
            # (BatchNormalization) are updated by the forward pass of
            # training steps, which freezing leaves on.
            announced = self._restored[b]
            self._restored[b] = False
            if not self._restore(b):
                continue
            if not announced and self.best_epoch[b] != self._last_epoch:
                announce.append(b)
            if history is not None:
                # What export_models reads: the metrics of this epoch are
                # those of the weights the model holds.
                set_weights_epoch(history, b, self.best_epoch[b])
        if self.verbose > 0 and announce:
            print_msg(f"Restoring the weights of {_models(announce)} from "
                      f"the end of {self._epochs_text(announce)}.")

    def _restore(self, b):
        """Gives model `b` its best weights where it is to; returns
        whether it did."""
        if not self.restore_best_weights or self._restored[b] or (
                self.best_weights[b] is None):
            return False
        self.array.set_model_weights(b, self.best_weights[b])
        self._restored[b] = True
        return True

    def _epochs_text(self, models):
        """Which best epochs `models` were restored to, in words."""
        if len(models) == 1:
            return f"its best epoch: {self.best_epoch[models[0]] + 1}"
        return "their best epochs: " + listed(
            [str(self.best_epoch[b] + 1) for b in models])

    def _restored_text(self, models):
        """What restoring `models`, which stopped, is, in words."""
        if not models:
            return ""
        owner = "its" if len(models) == 1 else "their"
        return (f"; restoring {owner} weights from the end of "
                f"{self._epochs_text(models)}")


def _models(models):
    """`models` (indices) in words: "model 3", "3 models (0, 4, 7)"."""
    if len(models) == 1:
        return f"model {models[0]}"
    return f"{len(models)} models ({listed([str(b) for b in models])})"


def _model_weights(array, indices):
    """`array.get_model_weights(b)` for each of `indices`, reading every
    weight of the array once rather than once per model."""
    if not indices:
        return []
    stacked = [ops.convert_to_numpy(w) for w in array.weights]
    return [[np.array(w[b]) for w in stacked] for b in indices]


