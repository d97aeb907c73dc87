"""The callbacks of a fused trial's `fit`: the tuner's recorder of each
trial's history and best weights, and the per-model forms of the stock
callbacks a search is given."""

import collections

import keras

from hftatf import callbacks as fused_callbacks
from hftatf.core.logs import split_logs
from hftatf.tuning import arrays


class TrialRecorder(keras.callbacks.Callback):
    """Splits an array's logs into each trial's history, and saves each
    trial's weights at its best epoch (keras-tuner's `SaveBestEpoch`, per
    model)."""

    def __init__(self, tuner, members):
        super().__init__()
        self.tuner = tuner
        self.members = members
        self.objective = tuner.oracle.objective
        self.logs = [[] for _ in members]
        worst = float("-inf") if self.objective.direction == "max" else (
            float("inf"))
        self.best = {m.trial.trial_id: worst for m in members}
        self._training = None

    def on_epoch_begin(self, epoch, logs=None):
        # Models stopped by a callback leave the history, as a stock trial
        # ends when its fit stops.
        self._training = self.model.active_models.copy()
        for index, member in enumerate(self.members):
            if self._training[index]:
                self.tuner.on_epoch_begin(member.trial, self.model, epoch,
                                          logs=logs)

    def on_epoch_end(self, epoch, logs=None):
        per_model, _ = split_logs(logs, self.model.num_models)
        diverged = self.model.diverged_models
        stacked = None
        for index, member in enumerate(self.members):
            if not self._training[index]:
                continue
            # A diverged model is frozen at its last finite weights, which
            # its metrics would score: the trial records what diverged
            # training is worth instead, NaN (its stock twin's weights are
            # NaN; keras-tuner fails a trial whose score is NaN).
            model_logs = {name: float("nan") if diverged[index]
                          else float(values[index])
                          for name, values in per_model.items()}
            self.logs[index].append(model_logs)
            if self._improved(member, model_logs):
                if stacked is None:
                    stacked = arrays.stacked_weights(self.model)
                self.tuner._save_trial_model(member, stacked, index)
            self.tuner.on_epoch_end(member.trial, self.model, epoch,
                                    logs=model_logs)

    def _improved(self, member, logs):
        if not self.objective.has_value(logs):
            # The objective comes after fit: save every epoch, as stock.
            return True
        value = self.objective.get_value(logs)
        trial_id = member.trial.trial_id
        if self.objective.better_than(value, self.best[trial_id]):
            self.best[trial_id] = value
            return True
        return False

    def histories(self):
        """One `keras.callbacks.History` per model, as its stock fit would
        have returned."""
        histories = []
        for epochs in self.logs:
            history = keras.callbacks.History()
            history.history = collections.defaultdict(list)
            for logs in epochs:
                for name, value in logs.items():
                    history.history[name].append(value)
            history.history = dict(history.history)
            history.epoch = list(range(len(epochs)))
            histories.append(history)
        return histories


def for_array(callback, runs):
    """`callback`, or its per-model form where a stock callback would judge
    the array's mean instead of each model (or read one learning rate).
    `runs` names each model's TensorBoard run as keras-tuner names a
    trial's."""
    if type(callback) is keras.callbacks.TensorBoard:
        return fused_callbacks.TensorBoard(callback.log_dir, run_names=runs)
    if type(callback) is keras.callbacks.EarlyStopping:
        return fused_callbacks.EarlyStopping(
            monitor=callback.monitor, min_delta=callback.min_delta,
            patience=callback.patience, verbose=callback.verbose,
            mode=callback.mode, baseline=callback.baseline,
            restore_best_weights=callback.restore_best_weights,
            start_from_epoch=callback.start_from_epoch)
    if type(callback) is keras.callbacks.ReduceLROnPlateau:
        return fused_callbacks.ReduceLROnPlateau(
            monitor=callback.monitor, factor=callback.factor,
            patience=callback.patience, verbose=callback.verbose,
            mode=callback.mode, min_delta=callback.min_delta,
            cooldown=callback.cooldown, min_lr=callback.min_lr)
    if type(callback) is keras.callbacks.LearningRateScheduler:
        return fused_callbacks.LearningRateScheduler(
            callback.schedule, verbose=callback.verbose)
    return callback
