"""The names of an array's logs.

A `FusedModel` logs every loss and metric as `name_0` ... `name_{B-1}`
(one value per model) and `name` (their mean over the models that have not
diverged). What reads logs (callbacks, the progress bar, the results
table) splits and orders them with these functions.
"""

import collections
import re

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
        those `B` values, in model order; `shared` holds every other log
        entry, leaving out the means (`name`) of the per-model quantities.
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
