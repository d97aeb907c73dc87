"""What every per-model callback shares: the array check, per-model
arguments, and judging one quantity of every model."""

import warnings

import keras
import numpy as np
from keras import ops

from hftatf.core.logs import (
    as_given,
    model_log_name,
    monitor_direction,
    split_logs,
)
from hftatf.fuse import check_array


def checked_array(callback):
    """The `FusedModel` that `callback` is set on; a TypeError if it is
    set on anything else."""
    name = type(callback).__name__
    return check_array(
        callback.model, f"hftatf.callbacks.{name}",
        f"For a single Keras model use keras.callbacks.{name}.")


def per_model_arg(name, value, num_models):
    """A float or a length-B sequence (None stays None) as B values."""
    if value is None or np.ndim(value) == 0:
        return [value] * num_models
    values = list(value)
    if len(values) != num_models:
        raise ValueError(
            f"`{name}` must be a float or one value per model ({num_models} "
            f"values). Received: {name}={value!r}.")
    return values


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
        return checked_array(self)

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
        values = [logs.get(model_log_name(self.monitor, b))
                  for b in range(num_models)]
        if any(value is None for value in values):
            per_model, _ = split_logs(logs, num_models)
            warnings.warn(
                f"{action} is conditioned on the per-model metric "
                f"`{self.monitor}` (`{self.monitor}_0` ... "
                f"`{self.monitor}_{num_models - 1}` in the logs), which is "
                "not available. Available per-model metrics are: "
                f"{','.join(per_model)}.", stacklevel=3)
        return [None if v is None else float(v) for v in values]



def hyperparameter_values(optimizer, names, as_float=True):
    """`{name: [B] values}` for the optimizer's hyper-parameters `names`
    that exist and are set: Python floats as given (`core.logs.as_given`:
    `0.03` for a float32 0.03), or with `as_float=False` numpy
    scalars of the variables' dtype (whose `str` is the shortest that
    reads back as the same value: `0.03` for a float32 0.03)."""
    found = {}
    available = getattr(optimizer, "hyperparameter_names", ())
    for name in names:
        if name in available:
            values = optimizer.get_hyperparameter(name)
            if values is not None:
                found[name] = [as_given(v) if as_float else v
                               for v in np.asarray(values)]
    return found


def check_hyperparameter_names(value):
    if isinstance(value, str):
        return (value,)
    names = tuple(value or ())
    if not all(isinstance(n, str) for n in names):
        raise TypeError(
            "`hyperparameters` must be a sequence of hyper-parameter names "
            f"(e.g. ('learning_rate',)). Received: hyperparameters={value!r}")
    return names


