"""Per-model callbacks for `FusedModel` arrays.

A fused array logs every loss and metric twice: `name`, the mean over the
models that have not diverged (read by stock Keras callbacks, which keep
working unchanged), and `name_0` ... `name_{B-1}`, one value per model. The
callbacks here read the per-model values and act on each model on its own:

- `EarlyStopping` stops (freezes) each model when its own monitored value
  stops improving, restoring that model's best weights if asked;
- `ReduceLROnPlateau` lowers each model's own learning rate;
- `LearningRateScheduler` sets each model's learning rate every epoch from
  its own current rate;
- `CSVLogger` writes one row per epoch and model (a tidy table);
- `TensorBoard` writes one run per model, so TensorBoard overlays them;
- `ModelCheckpoint` saves each model's best weights as a plain Keras model.

Each callback takes the arguments of its stock Keras namesake; `monitor` is
the name of the quantity without the model suffix (`"val_loss"`, read as
`val_loss_b` for model `b`).
"""

import collections
import csv
import os
import re
import string
import uuid
import warnings

import keras
import numpy as np
import tensorflow as tf
from keras import ops
from keras.src.utils import io_utils
from tensorflow.core.framework import summary_pb2

from hftatf.fuse import compile_stock_model, compiles_stock_models
from hftatf.graph import set_layer_weights, weighted_layers

__all__ = [
    "CSVLogger",
    "EarlyStopping",
    "LearningRateScheduler",
    "ModelCheckpoint",
    "PerModelMonitorCallback",
    "ReduceLROnPlateau",
    "TensorBoard",
    "monitor_direction",
    "split_logs",
]

_MODEL_SUFFIX = re.compile(r"^(.+)_(0|[1-9][0-9]*)$")


def split_logs(logs, num_models):
    """Splits an array's logs into per-model and shared values.

    Args:
        logs: a dict of logs as a `FusedModel` writes them: `name_b` for
            each model `b` of every per-model quantity, and `name` for their
            mean.
        num_models: the number of models `B` of the array.

    Returns:
        `(per_model, shared)`: `per_model` maps every name that has a value
        for each of the `B` models (`name_0` ... `name_{B-1}`) to the list of
        those `B` values; `shared` holds every other log entry, leaving out
        the means (`name`) of the per-model quantities.
    """
    logs = logs or {}
    found = collections.defaultdict(dict)
    for key in logs:
        match = _MODEL_SUFFIX.match(key)
        if match and int(match.group(2)) < num_models:
            found[match.group(1)][int(match.group(2))] = key
    per_model, used = {}, set()
    for name, keys in found.items():
        if len(keys) == num_models:
            per_model[name] = [logs[keys[b]] for b in range(num_models)]
            used.update(keys.values())
    shared = {key: value for key, value in logs.items()
              if key not in used and key not in per_model}
    return per_model, shared


def _check_array(callback, model):
    """Returns `model` if it is a fused array; raises a TypeError if not."""
    if not all(hasattr(model, name) for name in (
            "num_models", "freeze_models", "get_model_weights")):
        name = type(callback).__name__
        raise TypeError(
            f"hftatf.callbacks.{name} acts on each model of a FusedModel "
            f"array (hftatf.fuse); it was given {model!r}. For a single "
            f"Keras model use keras.callbacks.{name}.")
    return model


def _per_model_arg(name, value, num_models):
    """A float or a length-B sequence (None stays None) as B values."""
    if value is None or np.ndim(value) == 0:
        return [value] * num_models
    values = list(value)
    if len(values) != num_models:
        raise ValueError(
            f"`{name}` must be a float or one value per model ({num_models} "
            f"values). Received: {name}={value!r}.")
    return values


def _metric_objects(model):
    """Every metric object of `model`, containers (CompileMetrics,
    MetricsList, CompileLoss) opened."""
    pending = list(getattr(model, "metrics", None) or [])
    while pending:
        metric = pending.pop(0)
        inner = getattr(metric, "metrics", None)
        if isinstance(inner, (list, tuple)) and inner:
            pending.extend(inner)
        yield metric


def monitor_direction(model, monitor, num_models=None):
    """Whether `monitor` improves `"up"` or `"down"`, as stock Keras infers
    it in `mode="auto"`, for the base names of per-model logs too.

    The `val_` prefix and a model suffix (`_b`, for `b < num_models`) are
    ignored. `loss` (and any `*_loss`) goes down; a metric compiled into
    `model` goes the way its `_direction` says (as in stock Keras); names
    ending in `acc`, `accuracy` or `auc` go up (for metrics not built yet).

    Raises:
        ValueError: if the direction cannot be inferred.
    """
    names = [monitor.removeprefix("val_")]
    match = _MODEL_SUFFIX.match(names[0])
    if match and (num_models is None or int(match.group(2)) < num_models):
        names.append(match.group(1))
    for name in names:
        if name == "loss" or name.endswith("_loss"):
            return "down"
        for metric in _metric_objects(model):
            if metric.name == name and hasattr(metric, "_direction"):
                return "up" if metric._direction == "up" else "down"
        if name.endswith(("acc", "accuracy", "auc")):
            return "up"
    raise ValueError(
        f"Cannot infer whether monitor={monitor!r} should be maximized or "
        "minimized. Pass mode='max' to monitor the highest value, or "
        "mode='min' to monitor the lowest.")


class PerModelMonitorCallback(keras.callbacks.Callback):
    """Base class of callbacks that watch one quantity of every model.

    Model `b`'s value of `monitor` is read from `logs[f"{monitor}_{b}"]`;
    improvements are judged per model exactly as stock Keras'
    `MonitorCallback` judges them for one model.

    Args:
        monitor: the quantity to watch, without the model suffix.
        mode: `"auto"`, `"min"` or `"max"`; `"auto"` infers the direction
            from the name (`monitor_direction`).
        min_delta: the smallest change that counts as an improvement.
    """

    def __init__(self, monitor="val_loss", mode="auto", min_delta=0):
        super().__init__()
        if mode not in ("auto", "min", "max"):
            warnings.warn(
                f"{type(self).__name__} mode '{mode}' is unknown, fallback "
                "to auto mode.", stacklevel=2)
            mode = "auto"
        self.monitor = monitor
        self.mode = mode
        self.min_delta = abs(min_delta)
        self.monitor_op = None

    @property
    def array(self):
        """The fused array this callback watches."""
        return _check_array(self, self.model)

    def _set_monitor_op(self):
        direction = self.mode if self.mode != "auto" else {
            "up": "max", "down": "min"}[monitor_direction(
                self.model, self.monitor, self.array.num_models)]
        self.monitor_op = ops.greater if direction == "max" else ops.less
        if self.monitor_op is ops.less:
            self.min_delta *= -1

    def _is_improvement(self, value, reference):
        # Compared with keras.ops, as stock callbacks compare: the same
        # float32 rounding decides ties.
        if reference is None:
            return True
        return bool(self.monitor_op(value - self.min_delta, reference))

    def _model_values(self, logs, action):
        """Model `b`'s value of `monitor` for each `b` (None if absent)."""
        logs = logs or {}
        num_models = self.array.num_models
        values = [logs.get(f"{self.monitor}_{b}") for b in range(num_models)]
        if any(value is None for value in values):
            per_model, _ = split_logs(logs, num_models)
            warnings.warn(
                f"{action} is conditioned on the per-model metric "
                f"`{self.monitor}` (`{self.monitor}_0` ... "
                f"`{self.monitor}_{num_models - 1}` in the logs), which is "
                "not available. Available per-model metrics are: "
                f"{','.join(per_model)}.", stacklevel=3)
        return [None if v is None else float(v) for v in values]


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
        self._baselines = _per_model_arg("baseline", self.baseline,
                                         num_models)
        self._watched = [bool(a) for a in array.active_models]
        self._restored = [False] * num_models

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
        if stopping:
            array.freeze_models(stopping)
            for b in stopping:
                if self.verbose > 0:
                    io_utils.print_msg(
                        f"Epoch {epoch + 1}: early stopping model {b}")
                self._restore(b)
        if self.stop_training_when_all_stopped and not np.any(
                array.active_models):
            self.model.stop_training = True

    def on_train_end(self, logs=None):
        for b in range(len(self.best_weights)):
            # Models restored when they stopped are restored again: a frozen
            # model's moving statistics (BatchNormalization) are updated by
            # the forward pass of training steps, which freezing leaves on.
            self._restored[b] = False
            self._restore(b)

    def _restore(self, b):
        if not self.restore_best_weights or self._restored[b] or (
                self.best_weights[b] is None):
            return
        if self.verbose > 0:
            io_utils.print_msg(
                f"Restoring model {b}'s weights from the end of its best "
                f"epoch: {self.best_epoch[b] + 1}.")
        self.array.set_model_weights(b, self.best_weights[b])
        self._restored[b] = True


def _model_weights(array, indices):
    """`array.get_model_weights(b)` for each of `indices`, reading every
    weight of the array once rather than once per model."""
    if not indices:
        return []
    stacked = [ops.convert_to_numpy(w) for w in array.weights]
    return [[np.array(w[b]) for w in stacked] for b in indices]


def _unwrap_optimizer(optimizer):
    while hasattr(optimizer, "inner_optimizer"):
        optimizer = optimizer.inner_optimizer
    return optimizer


def _check_settable_learning_rate(callback, optimizer):
    """Raises a TypeError unless `optimizer` is a fused optimizer whose
    per-model learning rates are floats (which `callback` sets)."""
    inner = _unwrap_optimizer(optimizer)
    schedules = getattr(inner, "_learning_rate_schedules", None)
    if not hasattr(inner, "set_hyperparameter") or (
            schedules is not None and schedules()):
        raise TypeError(
            f"{type(callback).__name__} sets each model's learning rate, so "
            "the array's optimizer must be a fused optimizer built with float "
            "learning rates (e.g. hftatf.optimizers.SGD([0.1, 0.01])). "
            f"Received optimizer {optimizer!r}, whose learning rate is "
            "not settable (a learning-rate schedule?).")


def _log_learning_rates(array, logs):
    """Returns the array's `B` learning rates as floats and, where `logs`
    is given, writes them there as the stock callbacks do, in the array's
    format: `learning_rate_b` for model `b`, and `learning_rate` for their
    mean over the models that have not diverged."""
    rates = [float(r) for r in np.asarray(
        array.optimizer.get_hyperparameter("learning_rate"))]
    if logs is not None:
        for b, rate in enumerate(rates):
            logs[f"learning_rate_{b}"] = rate
        healthy = [r for r, d in zip(rates, array.diverged_models) if not d]
        logs["learning_rate"] = (float(np.mean(healthy)) if healthy
                                 else float("nan"))
    return rates


class ReduceLROnPlateau(PerModelMonitorCallback):
    """Lowers each model's learning rate when its monitored metric stops
    improving.

    Model `b` is judged on `logs[f"{monitor}_{b}"]` exactly as stock
    `keras.callbacks.ReduceLROnPlateau` judges a single model, with its own
    wait and cooldown counters, and only its own learning rate changes
    (`optimizer.set_hyperparameter("learning_rate", ...)`, which takes effect
    at the next step without retracing). Frozen models (stopped or
    diverged) are left as they are.

    Like the stock callback it adds the learning rates to the logs, in the
    array's format: `learning_rate_b` for model `b` and `learning_rate` for
    their mean over the models that have not diverged.

    The optimizer must be a fused optimizer built with float learning
    rates: a learning-rate schedule is not settable, and training with one
    raises a TypeError when it begins.

    Args:
        monitor: the quantity to watch, without the model suffix. Defaults
            to `"val_loss"`.
        factor: factor by which a learning rate is reduced:
            `new_lr = lr * factor`. Must be below 1.
        patience: number of epochs without improvement after which a model's
            learning rate is reduced.
        verbose: 0 (quiet) or 1 (a message for each reduction).
        mode: `"auto"`, `"min"` or `"max"`.
        min_delta: threshold for measuring a new optimum.
        cooldown: number of epochs to wait before resuming normal operation
            after a model's learning rate was reduced.
        min_lr: lower bound on the learning rates.
    """

    def __init__(self, monitor="val_loss", factor=0.1, patience=10,
                 verbose=0, mode="auto", min_delta=1e-4, cooldown=0,
                 min_lr=0.0):
        super().__init__(monitor, mode, min_delta=min_delta)
        if factor >= 1.0:
            raise ValueError(
                "ReduceLROnPlateau does not support a factor >= 1.0. "
                f"Received factor={factor}")
        self.factor = factor
        self.patience = patience
        self.cooldown = cooldown
        self.min_lr = min_lr
        self.verbose = verbose
        self.best = []
        self.wait = []
        self.cooldown_counter = []

    # What `hftatf.backup.BackupAndRestore` saves and restores.
    backup_state = ("best", "wait", "cooldown_counter")

    def on_train_begin(self, logs=None):
        num_models = self.array.num_models
        _check_settable_learning_rate(self, self.model.optimizer)
        self.best = [None] * num_models
        self.wait = [0] * num_models
        self.cooldown_counter = [0] * num_models

    def in_cooldown(self, index):
        """Whether model `index` is in its cooldown period."""
        return self.cooldown_counter[index] > 0

    def on_epoch_end(self, epoch, logs=None):
        if self.monitor_op is None:
            # Delay setup until the model's metrics are all built.
            self._set_monitor_op()
        array = self.array
        optimizer = self.model.optimizer
        rates = _log_learning_rates(array, logs)
        values = self._model_values(logs, "Learning rate reduction")
        active = array.active_models
        new_rates = list(rates)
        for b, current in enumerate(values):
            if current is None or not active[b]:
                continue
            if self.in_cooldown(b):
                self.cooldown_counter[b] -= 1
                self.wait[b] = 0
            if self._is_improvement(current, self.best[b]):
                self.best[b] = current
                self.wait[b] = 0
            elif not self.in_cooldown(b):
                self.wait[b] += 1
                if self.wait[b] >= self.patience and (
                        rates[b] > np.float32(self.min_lr)):
                    new_rates[b] = max(rates[b] * self.factor, self.min_lr)
                    if self.verbose > 0:
                        io_utils.print_msg(
                            f"\nEpoch {epoch + 1}: ReduceLROnPlateau "
                            f"reducing model {b}'s learning rate to "
                            f"{new_rates[b]}.")
                    self.cooldown_counter[b] = self.cooldown
                    self.wait[b] = 0
        if new_rates != rates:
            optimizer.set_hyperparameter("learning_rate", new_rates)


class LearningRateScheduler(keras.callbacks.Callback):
    """Sets each model's learning rate at the beginning of every epoch.

    The array's counterpart of `keras.callbacks.LearningRateScheduler`:
    model `b` follows `schedule(epoch, lr_b)` from its own current rate
    `lr_b`, exactly as the stock callback drives a single model, so models
    started at different rates keep their own trajectories (a decay of 0.9
    per epoch from 0.1 and from 0.01). Give a list of `B` functions to
    schedule each model differently. As with the stock callback, a
    function of the epoch alone (`schedule(epoch)`) is accepted too.
    Frozen models (stopped or diverged) keep their rates.

    The rates are set with `optimizer.set_hyperparameter("learning_rate",
    ...)`, which takes effect at the next step without retracing, and are
    logged at the end of each epoch as `learning_rate_b` for model `b` and
    `learning_rate` for their mean over the models that have not diverged.
    The optimizer must be a fused optimizer built with float learning rates
    (a schedule inside the optimizer is not settable; training with one
    raises a TypeError when it begins).

    Args:
        schedule: a function `(epoch, lr) -> new lr` (the epoch counted from
            0, the rate a float), used for every model, or a sequence of `B`
            such functions, one per model.
        verbose: 0 (quiet) or 1 (a message for each epoch).

    Example:

    ```python
    def decay(epoch, lr):
        return lr if epoch < 10 else lr * 0.9

    array.compile(hftatf.optimizers.SGD([0.1, 0.03, 0.01]), loss="mse")
    array.fit(x, y, epochs=30,
              callbacks=[hftatf.callbacks.LearningRateScheduler(decay)])
    ```
    """

    def __init__(self, schedule, verbose=0):
        super().__init__()
        if callable(schedule):
            self._schedules = None
        else:
            schedules = list(schedule) if isinstance(
                schedule, (list, tuple)) else None
            if not schedules or not all(callable(s) for s in schedules):
                raise TypeError(
                    "`schedule` must be a function (epoch, lr) -> lr or a "
                    "list of such functions, one per model. Received: "
                    f"schedule={schedule!r}")
            self._schedules = schedules
        self.schedule = schedule
        self.verbose = verbose

    @property
    def array(self):
        return _check_array(self, self.model)

    def on_train_begin(self, logs=None):
        num_models = self.array.num_models
        if self._schedules is not None and len(self._schedules) != num_models:
            raise ValueError(
                f"LearningRateScheduler got {len(self._schedules)} schedules "
                f"for an array of {num_models} models; give one function "
                "for all models or one per model.")
        _check_settable_learning_rate(self, self.model.optimizer)

    def schedule_of(self, index):
        """The schedule function of model `index`."""
        if self._schedules is None:
            return self.schedule
        return self._schedules[index]

    def on_epoch_begin(self, epoch, logs=None):
        array = self.array
        rates = _log_learning_rates(array, None)
        new_rates = list(rates)
        for b, active in enumerate(array.active_models):
            if active:
                new_rates[b] = _scheduled_rate(self.schedule_of(b), epoch,
                                               rates[b])
        array.optimizer.set_hyperparameter("learning_rate", new_rates)
        if self.verbose > 0:
            shown = ", ".join(f"{rate:g}" for rate in new_rates)
            io_utils.print_msg(
                f"\nEpoch {epoch + 1}: LearningRateScheduler setting the "
                f"models' learning rates to [{shown}].")

    def on_epoch_end(self, epoch, logs=None):
        _log_learning_rates(self.array, logs)


def _scheduled_rate(schedule, epoch, rate):
    """`schedule(epoch, rate)` (or `schedule(epoch)`, the older form the
    stock callback accepts) as a float, or a ValueError."""
    try:
        value = schedule(epoch, rate)
    except TypeError:
        value = schedule(epoch)
    array = np.asarray(value) if not isinstance(value, (str, bytes)) else None
    if (array is None or array.shape != () or
            not np.issubdtype(array.dtype, np.floating)):
        raise ValueError(
            "The output of the `schedule` function should be a float. "
            f"Got: {value!r}")
    return float(array)


def _hyperparameter_values(optimizer, names):
    """`{name: [B] values}` for the optimizer's hyper-parameters `names`
    that exist and are set."""
    found = {}
    available = getattr(optimizer, "hyperparameter_names", ())
    for name in names:
        if name in available:
            values = optimizer.get_hyperparameter(name)
            if values is not None:
                found[name] = [float(v) for v in np.asarray(values)]
    return found


def _check_hyperparameter_names(value):
    if isinstance(value, str):
        return (value,)
    names = tuple(value or ())
    if not all(isinstance(n, str) for n in names):
        raise TypeError(
            "`hyperparameters` must be a sequence of hyper-parameter names "
            f"(e.g. ('learning_rate',)). Received: hyperparameters={value!r}")
    return names


class CSVLogger(keras.callbacks.Callback):
    """Streams each model's epoch results to a CSV file, one row per epoch
    and model.

    Columns: `epoch`, `model`, then every per-model quantity of the logs
    under its name without the model suffix (`loss`, `accuracy`,
    `val_loss`, ...; sorted, as stock Keras sorts them), then the optimizer
    hyper-parameters named in `hyperparameters` (model `b`'s current value),
    then any log entry that is not per model (the same on every row). The
    means over models are left out: the table is tidy, one observation per
    row, and loads directly into pandas (`pd.read_csv`) or a plotting tool;
    missing values (e.g. `val_*` on epochs without validation) are written
    as `NA`.

    Args:
        filename: the CSV file's path.
        separator: the string that separates the columns.
        append: whether to append to an existing file (its header is kept)
            rather than overwrite it.
        hyperparameters: names of the optimizer's per-model hyper-parameters
            to write too; those the optimizer does not have are left out.
            Defaults to `("learning_rate",)`.
    """

    def __init__(self, filename, separator=",", append=False,
                 hyperparameters=("learning_rate",)):
        super().__init__()
        self.sep = separator
        self.filename = os.fspath(filename)
        self.append = append
        self.hyperparameters = _check_hyperparameter_names(hyperparameters)
        self.keys = None
        self.writer = None
        self.append_header = True
        self.csv_file = None

    def on_train_begin(self, logs=None):
        _check_array(self, self.model)
        if self.append:
            if tf.io.gfile.exists(self.filename):
                with tf.io.gfile.GFile(self.filename, "r") as f:
                    self.append_header = not bool(len(f.readline()))
            mode = "a"
        else:
            mode = "w"
        self._close()
        self.csv_file = tf.io.gfile.GFile(self.filename, mode)
        self.writer = None
        self.keys = None

    def on_epoch_end(self, epoch, logs=None):
        array = _check_array(self, self.model)
        per_model, shared = split_logs(logs, array.num_models)
        hypers = _hyperparameter_values(
            self.model.optimizer,
            [n for n in self.hyperparameters if n not in per_model])
        if self.keys is None:
            names = sorted(per_model)
            if not any(n.startswith("val_") for n in names):
                # Epochs with validation will add these later (not for
                # hyper-parameters another callback logged).
                own = getattr(self.model.optimizer, "hyperparameter_names",
                              ())
                names += [f"val_{n}" for n in names if n not in own]
            self.keys = names + [n for n in hypers if n not in names]
            self.keys += sorted(k for k in shared if k not in self.keys)
        if self.writer is None:

            class Dialect(csv.excel):
                delimiter = self.sep

            self.writer = csv.DictWriter(
                self.csv_file, fieldnames=["epoch", "model", *self.keys],
                dialect=Dialect)
            if self.append_header:
                self.writer.writeheader()
        values = {**shared, **hypers, **per_model}
        for b in range(array.num_models):
            row = {"epoch": epoch, "model": b}
            for key in self.keys:
                value = values.get(key, "NA")
                if isinstance(value, list):
                    value = value[b]
                row[key] = _plain(value)
            self.writer.writerow(row)
        self.csv_file.flush()

    def on_train_end(self, logs=None):
        self._close()
        self.writer = None

    def _close(self):
        if self.csv_file is not None:
            self.csv_file.close()
            self.csv_file = None


def _plain(value):
    """A log value as CSV writes it: numbers as Python numbers."""
    if isinstance(value, str):
        return value
    array = np.asarray(value)
    if array.ndim == 0 and array.dtype.kind in "fiub":
        return array.item()
    return f'"[{", ".join(map(str, array.ravel()))}]"'


# Summary metadata of TensorBoard's scalars plugin (what tf.summary.scalar
# writes); writing it directly works without the tensorboard package.
_SCALAR_METADATA = summary_pb2.SummaryMetadata(
    plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="scalars"))


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
        self.hyperparameters = _check_hyperparameter_names(hyperparameters)
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
        array = _check_array(self, self.model)
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
        hypers = _hyperparameter_values(
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
                            step=epoch, metadata=_SCALAR_METADATA)
            writer.flush()

    def on_train_end(self, logs=None):
        self._close()

    def _close(self):
        for writer in self._writers:
            if writer is not None:
                writer.close()
        self._writers = []


class ModelCheckpoint(PerModelMonitorCallback):
    """Saves each model of an array as a plain Keras model, at its best.

    Model `b` is judged on `logs[f"{monitor}_{b}"]` as stock
    `keras.callbacks.ModelCheckpoint` judges a single model; when it
    improves (or every epoch, with `save_best_only=False`) its slice of the
    array's weights is saved in the stock architecture the array was fused
    from, so the file loads with `keras.models.load_model` without hftatf.
    As stock Keras saves a model, it is saved compiled (but with
    `save_weights_only`): with the array's loss and metrics and model `b`'s
    own stock optimizer and its state (`hftatf.fuse.unfuse`), so training
    the loaded model goes on as model `b` would have in the array.
    Files are written atomically (to a temporary file in the same directory,
    then renamed), so a crash never leaves a truncated checkpoint behind.

    `filepath` is formatted per model with `model` (its index), `epoch`
    (1-based, as in Keras) and any log entry, model `b`'s own values under
    the names without suffix, e.g. `"ckpt/model_{model}.keras"` or
    `"ckpt/m{model}-{epoch:02d}-{val_loss:.3f}.keras"`.

    Needs an array made by `hftatf.fuse` or `hftatf.fuse_models` (which
    know their stock architecture).

    Args:
        filepath: the path pattern of the files; it must end in `.keras` (or
            `.weights.h5` with `save_weights_only=True`).
        monitor: the quantity to watch, without the model suffix.
        verbose: 0 (silent) or 1 (a message per save).
        save_best_only: whether a model is saved only when its monitored
            value improves. Defaults to True (stock Keras: False): the point
            of checkpointing an array is usually each model's best.
        save_weights_only: whether to save only the weights
            (`model.save_weights`) rather than the whole model.
        mode: `"auto"`, `"min"` or `"max"`.
        save_freq: `"epoch"`, the only frequency supported: per-model values
            are epoch results.
        initial_value_threshold: a float, or one float per model: the value
            a model must beat to be saved at all.

    Attributes:
        best: per model, the best monitored value so far.
    """

    def __init__(self, filepath, monitor="val_loss", verbose=0,
                 save_best_only=True, save_weights_only=False, mode="auto",
                 save_freq="epoch", initial_value_threshold=None):
        super().__init__(monitor, mode)
        self.filepath = os.fspath(filepath)
        self.save_best_only = save_best_only
        self.save_weights_only = save_weights_only
        self.initial_value_threshold = initial_value_threshold
        self.verbose = verbose
        if save_freq != "epoch":
            raise ValueError(
                "hftatf.callbacks.ModelCheckpoint compares each model's "
                "epoch results: pass save_freq='epoch'. Received: save_freq="
                f"{save_freq!r}.")
        self.save_freq = save_freq
        if save_weights_only:
            if not self.filepath.endswith(".weights.h5"):
                raise ValueError(
                    "When using `save_weights_only=True` in `ModelCheckpoint`"
                    ", the filepath provided must end in `.weights.h5` "
                    "(Keras weights format). Received: "
                    f"filepath={self.filepath}")
        elif not self.filepath.endswith((".keras", ".h5")):
            raise ValueError(
                "The filepath provided must end in `.keras` (Keras model "
                f"format). Received: filepath={self.filepath}")
        self.best = []
        self._stock = None

    # What `hftatf.backup.BackupAndRestore` saves and restores.
    backup_state = ("best",)

    def on_train_begin(self, logs=None):
        array = self.array
        if array.source_config is None:
            raise ValueError(
                f"ModelCheckpoint saves each model of array '{array.name}' "
                "in its stock architecture, but the array was not made by "
                "hftatf.fuse or hftatf.fuse_models and has none. Fuse the "
                "stock model with hftatf.fuse to checkpoint its models.")
        if array.num_models > 1 and "model" not in {
                re.split(r"[.\[]", field)[0] for _, field, _, _
                in string.Formatter().parse(self.filepath) if field}:
            raise ValueError(
                f"ModelCheckpoint saves each of the {array.num_models} "
                "models of the array to its own file, so `filepath` must "
                "name the model with a `{model}` field (e.g. "
                "'ckpt/model_{model}.keras'); the models would overwrite "
                f"each other's files. Received: filepath={self.filepath!r}.")
        if len(self.best) != array.num_models:
            self.best = _per_model_arg(
                "initial_value_threshold", self.initial_value_threshold,
                array.num_models)

    def on_epoch_end(self, epoch, logs=None):
        if self.save_best_only and self.monitor_op is None:
            # Delay setup until the model's metrics are all built.
            self._set_monitor_op()
        array = self.array
        if len(self.best) != array.num_models:
            self.on_train_begin()
        logs = logs or {}
        per_model, _ = split_logs(logs, array.num_models)
        values = (self._model_values(logs, "Saving the best models")
                  if self.save_best_only else [None] * array.num_models)
        stacked = None
        for b in range(array.num_models):
            model_logs = {**logs, **{
                name: v[b] for name, v in per_model.items()}}
            try:
                filepath = self.filepath.format(
                    epoch=epoch + 1, model=b, **model_logs)
            except KeyError as e:
                raise KeyError(
                    "Failed to format this callback filepath: "
                    f'"{self.filepath}". Reason: {e}') from e
            if not self._should_save(b, values[b], epoch, filepath):
                continue
            if stacked is None:
                stacked = _stacked_layer_weights(array)
            self._save(b, stacked, filepath)
            if self.verbose > 0:
                io_utils.print_msg(
                    f"\nEpoch {epoch + 1}: finished saving model {b} to "
                    f"{filepath}")

    def _should_save(self, b, current, epoch, filepath):
        if not self.save_best_only:
            if self.verbose > 0:
                io_utils.print_msg(
                    f"\nEpoch {epoch + 1}: saving model {b} to {filepath}")
            return True
        if current is None:
            # Stock Keras saves when it cannot judge (and warns).
            return True
        best_str = "None" if self.best[b] is None else f"{self.best[b]:.5f}"
        if self._is_improvement(current, self.best[b]):
            if self.verbose > 0:
                io_utils.print_msg(
                    f"\nEpoch {epoch + 1}: {self.monitor} of model {b} "
                    f"improved from {best_str} to {current:.5f}, saving it "
                    f"to {filepath}")
            self.best[b] = current
            return True
        if self.verbose > 0:
            io_utils.print_msg(
                f"\nEpoch {epoch + 1}: {self.monitor} of model {b} did not "
                f"improve from {best_str}")
        return False

    def _stock_model(self):
        """One stock model of the array's architecture, built once; each
        save loads a model's slice into it. Also whether the model is saved
        compiled (`hftatf.fuse.compiles_stock_models`)."""
        array = self.array
        if self._stock is None or self._stock[0] is not array or (
                self._stock[1] is not array.optimizer):
            model = array.stock_model()
            compiles = (not self.save_weights_only
                        and compiles_stock_models(array))
            self._stock = (array, array.optimizer, model,
                           weighted_layers(model), compiles)
        return self._stock[2:]

    def _save(self, b, stacked, filepath):
        model, layers, compiles = self._stock_model()
        for path, layer in layers:
            set_layer_weights(layer, [w[b] for w in stacked[path]])
        if compiles:
            # Saved as stock ModelCheckpoint saves a model: compiled, with
            # model b's optimizer and its state.
            compile_stock_model(self.array, b, model)
        directory = os.path.dirname(filepath)
        if directory and not tf.io.gfile.exists(directory):
            tf.io.gfile.makedirs(directory)
        # Same directory and extension, so the rename is atomic and Keras
        # accepts the name.
        temporary = os.path.join(
            directory, f".tmp-{uuid.uuid4().hex}-{os.path.basename(filepath)}")
        try:
            if self.save_weights_only:
                model.save_weights(temporary, overwrite=True)
            else:
                model.save(temporary, overwrite=True)
            tf.io.gfile.rename(temporary, filepath, overwrite=True)
        except IsADirectoryError as e:
            raise OSError(
                "Please specify a non-directory filepath for "
                "ModelCheckpoint. Filepath used is an existing directory: "
                f"{filepath}") from e
        finally:
            if tf.io.gfile.exists(temporary):
                tf.io.gfile.remove(temporary)


def _stacked_layer_weights(array):
    """`{layer path: [B, ...] weights}` for every layer of `array` with
    weights, keyed as the stock model's layers are."""
    return {path: layer.get_weights()
            for path, layer in weighted_layers(array)}
