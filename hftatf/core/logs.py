"""How an array names its logs, and the stock callbacks that cannot read
them.

A `FusedModel` logs every loss and metric twice: `name_b`, model `b`'s
value, for each model, and `name`, their mean over the models that have not
diverged. Stock Keras callbacks read `name` only.
"""

import collections
import re

import keras
import numpy as np
from keras import ops

from hftatf.core.compat import metric_direction

MODEL_SUFFIX = re.compile(r"^(.+)_(0|[1-9][0-9]*)$")


def model_log_name(name, index):
    """The log entry of model `index`'s value of `name`: `name_{index}`."""
    return f"{name}_{index}"


# What marks the entry of a traced step's logs that holds a per-model
# quantity's values of all models (`[B, ...]`).
_MODELS_SUFFIX = "/models"


def models_log_name(name):
    """The entry of a traced step's logs holding the `[B, ...]` values of
    per-model quantity `name`, which `expand_model_logs` splits into the
    `name_b` entries."""
    return f"{name}{_MODELS_SUFFIX}"


def expand_model_logs(logs, model_values):
    """`logs` of a step (a dict) with each `models_log_name(name)` entry
    replaced by the `name_b` entries, from `model_values(values)` (the `B`
    entries of the entry's values), where it was; other logs as they are."""
    def marked(key):
        return isinstance(key, str) and key.endswith(_MODELS_SUFFIX)

    if not isinstance(logs, dict) or not any(marked(key) for key in logs):
        return logs
    expanded = {}
    for key, value in logs.items():
        if not marked(key):
            expanded[key] = value
            continue
        name = key[:-len(_MODELS_SUFFIX)]
        for index, model_value in enumerate(model_values(value)):
            expanded[model_log_name(name, index)] = model_value
    return expanded


def host_values(vector):
    """The `B` entries of a step's `[B]` log `vector`, read on the host at
    once: B eager slices would each be an operation of their own (on JAX,
    a program compiled for it), and the callbacks read every log after
    each batch anyway."""
    return list(np.asarray(vector))


def base_log_name(key, num_models=None):
    """`(name, index)` for a per-model entry `name_{index}` (with `index <
    num_models` where given); `(key, None)` for any other entry."""
    match = MODEL_SUFFIX.match(key)
    if match and (num_models is None or int(match.group(2)) < num_models):
        return match.group(1), int(match.group(2))
    return key, None


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
        name, index = base_log_name(key, num_models)
        if index is not None:
            found[name][index] = key
    per_model, used = {}, set()
    for name, keys in found.items():
        if len(keys) == num_models:
            per_model[name] = [logs[keys[b]] for b in range(num_models)]
            used.update(keys.values())
    shared = {key: value for key, value in logs.items()
              if key not in used and key not in per_model}
    return per_model, shared


def per_model_mean(values, diverged):
    """The array's log of a per-model quantity: the mean of `values`
    (`[B, ...]`) over the models that have not diverged (`diverged`, `[B]`
    booleans or counts), NaN when all have. A diverged model's NaN does not
    turn every scalar log (and the stock callbacks reading it) into NaN."""
    stacked = ops.cast(ops.convert_to_tensor(values), "float32")
    healthy = ops.cast(ops.cast(diverged, "float32") <= 0, "float32")
    count = ops.sum(healthy)
    kept = ops.reshape(healthy, (-1, *[1] * (len(stacked.shape) - 1)))
    return ops.where(
        count > 0,
        ops.sum(ops.where(kept > 0, stacked, 0.0), axis=0)
        / ops.maximum(count, 1.0),
        float("nan"))


def check_log_names(per_model, num_models):
    """Refuses logs whose per-model names (`name_b`) would overwrite
    another log: Keras names a second `AUC()` `auc_1`, model 1's `auc`."""
    clashes = sorted(model_log_name(name, b) for name in per_model
                     for b in range(num_models)
                     if model_log_name(name, b) in per_model)
    if clashes:
        name = base_log_name(clashes[0])[0]
        raise ValueError(
            f"The array logs model b's `{name}` as `{name}_b`, which would "
            f"overwrite the log named `{clashes[0]}`. Give that metric a "
            "name of its own, e.g. "
            "`keras.metrics.AUC(curve='PR', name='pr_auc')`.")


def ordered_names(names):
    """`names` of logged quantities in the order people read them: the
    training ones first (`loss` first, then the others by name), then the
    validation ones in the same order."""
    def order(name):
        base = name[4:] if name.startswith("val_") else name
        return (name.startswith("val_"), base != "loss", base)

    return sorted(names, key=order)


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
    base, index = base_log_name(names[0], num_models)
    if index is not None:
        names.append(base)
    for name in names:
        if name == "loss" or name.endswith("_loss"):
            return "down"
        for metric in _metric_objects(model):
            direction = metric_direction(metric)
            if metric.name == name and direction is not None:
                return "up" if direction == "up" else "down"
        if name.endswith(("acc", "accuracy", "auc")):
            return "up"
    raise ValueError(
        f"Cannot infer whether monitor={monitor!r} should be maximized or "
        "minimized. Pass mode='max' to monitor the highest value, or "
        "mode='min' to monitor the lowest.")


def as_given(value):
    """A hyper-parameter's value as its user wrote it, as a Python float:
    the shortest decimal that reads back as the same value of its dtype (a
    float32 `0.03`, not `0.029999999329447746`). A NumPy float has its
    dtype; a Python float that holds a float32 exactly (one read out of an
    array's float32 variable, e.g. with `tolist()`) reads as that float32,
    any other keeps all its digits. Values other than floats unchanged.
    `str(as_given(value))` shows it."""
    if isinstance(value, np.floating):
        return float(str(value))
    if isinstance(value, float):
        with np.errstate(over="ignore"):
            single = np.float32(value)
        if float(single) == value:
            return float(str(single))
    return value


# -- the epoch of a model's weights -----------------------------------------

# The attribute of a `keras.callbacks.History` that says, per model, the
# epoch whose weights it was given back (by early stopping's
# `restore_best_weights`); a model not listed holds its last epoch's.
_WEIGHTS_EPOCHS = "hftatf_weights_epochs"


# Models a message names one by one; the rest it counts.
NAMED_MODELS = 8


def listed(texts, more=""):
    """`texts` joined for a message, the first `NAMED_MODELS` named and
    the rest counted ("0, 4, 7 and 12 more"), `more` after the count."""
    named = ", ".join(texts[:NAMED_MODELS])
    if len(texts) > NAMED_MODELS:
        named += f" and {len(texts) - NAMED_MODELS} more{more}"
    return named


def set_weights_epoch(history, index, epoch):
    """Records in `history` (what `fit` returns) that model `index` holds
    the weights it had at the end of `epoch` (counted from 0)."""
    epochs = dict(getattr(history, _WEIGHTS_EPOCHS, None) or {})
    epochs[int(index)] = int(epoch)
    setattr(history, _WEIGHTS_EPOCHS, epochs)


def weights_epoch(history, index):
    """The epoch (counted from 0) whose weights model `index` holds after
    the `fit` that returned `history`: the one early stopping restored, or
    the last epoch logged (None where `history` says neither)."""
    restored = (getattr(history, _WEIGHTS_EPOCHS, None) or {}).get(index)
    if restored is not None:
        return restored
    epochs = getattr(history, "epoch", None)
    return int(epochs[-1]) if epochs else None


def restored_positions(history):
    """`{index: position}` for each model whose weights early stopping
    restored after the `fit` that returned `history`: the position, in
    the lists of `history.history`, of the epoch whose weights it holds."""
    epochs = [int(e) for e in getattr(history, "epoch", ())]
    restored = getattr(history, _WEIGHTS_EPOCHS, None) or {}
    return {index: epochs.index(epoch) for index, epoch in restored.items()
            if epoch in epochs}


# -- stock callbacks and an array's logs ------------------------------------

# Stock callbacks that read (or set) one learning rate, where an array's
# optimizer holds one per model, and what does their work for an array.
_SINGLE_RATE = {
    keras.callbacks.ReduceLROnPlateau: (
        "hftatf.callbacks.ReduceLROnPlateau, which lowers each model's rate "
        "when that model's own metric stops improving"),
    keras.callbacks.LearningRateScheduler: (
        "hftatf.callbacks.LearningRateScheduler, which applies the schedule "
        "to each model's own rate every epoch, or a schedule per model in "
        "the optimizer, e.g. hftatf.optimizers.Adam(learning_rate="
        "[schedule_0, schedule_1, ...]) with keras.optimizers.schedules, "
        "which each model follows by its own step count"),
    # (It writes the rate with each epoch's logs.)
    keras.callbacks.TensorBoard: (
        "hftatf.callbacks.TensorBoard, which writes each model's results "
        "and hyper-parameters as a TensorBoard run of its own"),
}

# Stock callbacks that act on the value of their `monitor`, which for an
# array is the mean over its models, and what acts on each model's own.
_MONITORING = {
    keras.callbacks.EarlyStopping: (
        "hftatf.callbacks.EarlyStopping, which stops each model when its "
        "own metric stops improving"),
    keras.callbacks.ModelCheckpoint: (
        "hftatf.callbacks.ModelCheckpoint, which saves each model at its "
        "own best"),
}

# How a user says that a stock callback with a `monitor` means the mean.
MEAN_ADVICE = (
    "To act on the mean over the models instead (as the log `{monitor}` "
    "is), set `callback.monitors_array_mean = True` before `fit`.")


def check_stock_callbacks(callbacks):
    """Refuses the stock callbacks that would drive an array wrongly.

    Those that read one learning rate fail mid-training on the array's
    `[B]` rates. Those that act on a `monitor` (`keras.callbacks`'
    EarlyStopping, ModelCheckpoint with `save_best_only=True` and any
    other with a `monitor`, and their subclasses) would act on the array's
    log `name`, the mean over its models, not on each model: each is
    refused with the hftatf callback that acts per model, unless the user
    sets `callback.monitors_array_mean = True` to act on the mean, or
    monitors one model's entry (`name_b`) by name.
    """
    if isinstance(callbacks, keras.callbacks.CallbackList):
        callbacks = callbacks.callbacks
    for callback in callbacks or ():
        for stock, alternative in _SINGLE_RATE.items():
            if isinstance(callback, stock):
                raise ValueError(
                    f"keras.callbacks.{stock.__name__} reads one learning "
                    "rate; an array's optimizer holds one per model. Use "
                    f"{alternative}.")
        monitor = getattr(callback, "monitor", None)
        # A monitor naming one model's entry (`loss_2`) is the user's
        # explicit choice of what drives the whole array.
        if (isinstance(monitor, str) and _is_stock(callback)
                and _acts_on_monitor(callback)
                and base_log_name(monitor.removeprefix("val_"))[1] is None
                and not getattr(callback, "monitors_array_mean", False)):
            raise ValueError(_monitor_refusal(callback, monitor))


def _acts_on_monitor(callback):
    """Whether `callback` acts on its `monitor`: a ModelCheckpoint that
    saves every epoch (the whole array) does not read it."""
    if isinstance(callback, keras.callbacks.ModelCheckpoint):
        return bool(callback.save_best_only)
    return True


def _is_stock(callback):
    """Whether `callback` is a Keras callback or a subclass of one (other
    than the base `keras.callbacks.Callback`)."""
    return any(kind.__module__.startswith("keras.")
               and kind is not keras.callbacks.Callback
               for kind in type(callback).__mro__)


def _monitor_refusal(callback, monitor):
    stock = next((s for s in _MONITORING if isinstance(callback, s)), None)
    what = (f"keras.callbacks.{stock.__name__}" if stock
            else type(callback).__name__)
    alternative = _MONITORING.get(
        stock, "the hftatf.callbacks counterpart, which reads each model's "
        "`name_b` logs (or a callback built on "
        "hftatf.callbacks.PerModelMonitorCallback)")
    return (
        f"{what}(monitor={monitor!r}) would act on the array's log "
        f"`{monitor}`, the mean over its models, not on each model "
        f"(`{monitor}_0`, `{monitor}_1`, ...). Use {alternative}. "
        + MEAN_ADVICE.format(monitor=monitor))
