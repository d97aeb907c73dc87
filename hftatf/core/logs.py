"""How an array names its logs.

A `FusedModel` logs every loss and metric twice: `name_b`, model `b`'s
value, for each model, and `name`, their mean over the models that have not
diverged. Stock Keras callbacks read `name` only.
"""

import collections
import re

from keras import ops

MODEL_SUFFIX = re.compile(r"^(.+)_(0|[1-9][0-9]*)$")


def model_log_name(name, index):
    """The log entry of model `index`'s value of `name`: `name_{index}`."""
    return f"{name}_{index}"


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
