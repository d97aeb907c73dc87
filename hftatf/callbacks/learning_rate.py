"""Per-model learning rates from callbacks: `ReduceLROnPlateau` and
`LearningRateScheduler`."""

import keras
import numpy as np

from hftatf.callbacks.base import PerModelMonitorCallback, checked_array
from hftatf.core.compat import print_msg
from hftatf.core.logs import model_log_name, per_model_mean


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
            logs[model_log_name("learning_rate", b)] = rate
        logs["learning_rate"] = float(per_model_mean(
            rates, array.diverged_models))
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
                        print_msg(
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
        return checked_array(self)

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
            print_msg(
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


