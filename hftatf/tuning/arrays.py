"""Trials as arrays: which built models can share an array, the array's
per-model optimizer, and carrying trained models into a new array.

A tuner builds one plain Keras model per trial with the user's `build(hp)`.
Trials whose models have the same architecture (as `hftatf.fuse_models`
compares them), the same compiled loss and metrics and optimizers of the
same class and structure can train as one array; only the optimizers'
float hyper-parameters (learning rate, momentum, ...) may differ, since a
fused optimizer holds one value per model. The array's model `b` starts from
trial `b`'s built weights, so it trains exactly what the trial would train
alone.
"""

import json

import keras
import numpy as np

import hftatf
from hftatf import optimizers as fused_optimizers
from hftatf.core import compat
from hftatf.core.compat import exclude_from_weight_decay_like
from hftatf.graph import (
    architecture,
    set_layer_weights,
    weighted_layers,
)
from hftatf.training.model_metrics import custom_objects

# Compile arguments that the array decides for itself: the optimizer is
# built per model, and a stock model's `jit_compile` is already resolved
# ("auto" reads as False on a CPU), while the array's is the tuner's.
_NOT_COMPILE_KEYS = ("optimizer", "jit_compile")


def compile_config(model):
    """The serialized compile arguments of a built trial model, optimizer
    and `jit_compile` left out.

    Raises:
        ValueError: if the model is not compiled.
    """
    config = model.get_compile_config() if model.compiled else None
    if not config or not config.get("loss"):
        raise ValueError(
            f"The model built for a trial ('{model.name}') is not compiled "
            "with a loss, so its array cannot train. Compile it in "
            "`build(hp)` (model.compile(optimizer=..., loss=..., "
            "metrics=...)), or pass `optimizer`, `loss` and `metrics` to the "
            "tuner.")
    return {key: value for key, value in config.items()
            if key not in _NOT_COMPILE_KEYS}


def trial_optimizer(model):
    """The fused optimizer (hyper-parameters shared, `num_models` unset)
    that does for an array what `model`'s compiled optimizer does for it.

    A stock `LossScaleOptimizer` is unwrapped: `FusedModel.compile` adds
    per-model loss scaling under a mixed-precision policy.
    """
    compile_config(model)  # A clear error for an uncompiled model.
    optimizer = model.optimizer
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        optimizer = optimizer.inner_optimizer
    if isinstance(optimizer, fused_optimizers.FusedOptimizer):
        config = optimizer.get_config()
        config["num_models"] = None
        return type(optimizer).from_config(config)
    return fused_optimizers.get(optimizer)


def optimizer_structure(optimizer):
    """What two trials' fused optimizers must share to be one optimizer:
    class and every setting but the float hyper-parameters, plus which of
    those are unset (None) or schedules."""
    config = optimizer.get_config()
    names = set(optimizer.hyperparameter_names)
    structure = {key: value for key, value in config.items()
                 if key not in names and key not in ("name", "num_models")}
    for name in names:
        value = config[name]
        structure[name] = ("unset" if value is None else "schedule"
                           if isinstance(value, dict) else "float")
    pattern = getattr(optimizer, "_exclude_from_weight_decay_pattern", None)
    structure["exclude_from_weight_decay"] = pattern
    return {"class": type(optimizer).__name__, "config": structure}


def combine_optimizers(optimizers):
    """One fused optimizer for an array whose model `b` had
    `optimizers[b]` (fused optimizers of one structure, shared values)."""
    first = optimizers[0]
    configs = [optimizer.get_config() for optimizer in optimizers]
    config = dict(configs[0])
    for name in first.hyperparameter_names:
        values = [c[name] for c in configs]
        # One value for all models when they agree: schedules stay one
        # schedule, and a float stays a float.
        config[name] = values[0] if all(
            v == values[0] for v in values) else values
    config["num_models"] = len(optimizers)
    combined = type(first).from_config(config)
    exclude_from_weight_decay_like(combined, first)
    return combined


def group_key(model, optimizer, extra=None):
    """A string equal for two trials exactly when their models can train in
    one array: same architecture, compile arguments and optimizer
    structure, and the same `extra` (e.g. `fit` arguments)."""
    description = {
        "architecture": architecture(model),
        "compile": compile_config(model),
        "optimizer": optimizer_structure(optimizer),
        "extra": extra,
    }
    return json.dumps(description, sort_keys=True, default=repr)


def compile_arguments(model):
    """`compile_config(model)` as arguments for `compile`: new losses and
    metrics made from their configs. Functions and classes of the user's
    own that are not registered with Keras are found among the objects
    `model` was compiled with, as stock compile takes them."""
    with keras.saving.custom_object_scope(custom_objects(
            compat.compile_config(model))):
        return keras.saving.deserialize_keras_object(compile_config(model))


def fuse_trials(models, optimizers, jit_compile="auto"):
    """A compiled array whose model `b` is `models[b]` (its weights) with
    the optimizer `optimizers[b]`.

    Args:
        models: built, compiled plain Keras models of one group.
        optimizers: their fused optimizers (`trial_optimizer`).
        jit_compile: the array's `jit_compile` (see `FusedModel.compile`).
    """
    array = hftatf.fuse_models(models)
    config = compile_arguments(models[0])
    config["jit_compile"] = jit_compile
    array.compile(optimizer=combine_optimizers(optimizers), **config)
    return array


def continue_models(sources, models, optimizers, jit_compile="auto"):
    """An array that continues trained models: model `b` is model
    `sources[b][1]` of the array `sources[b][0]`, with its weights and its
    optimizer state (slots, step counts), or, where `sources[b]` is None,
    `models[b]` as it is with a new optimizer state.

    When every model comes from one array this is `array.select(...)`:
    successive halving by compaction, the losers dropped and the winners
    carried on. Models from several arrays are gathered into a new array.
    Models that a callback froze (early stopping) train again, as they
    would in a new `fit` of a stock model; diverged ones stay frozen.
    """
    arrays = {id(source[0]) for source in sources if source is not None}
    if None not in sources and len(arrays) == 1:
        array = sources[0][0].select([index for _, index in sources])
    else:
        array = fuse_trials(models, optimizers, jit_compile=jit_compile)
        array.optimizer.build(array.trainable_variables)
        for slot, source in enumerate(sources):
            if source is not None:
                copy_model(source[0], source[1], array, slot)
    stopped = [b for b in range(array.num_models)
               if not array.active_models[b] and not
               array.diverged_models[b]]
    if stopped:
        array.unfreeze_models(stopped)
    return array


def reusable(array, optimizers=None):
    """Whether `reload` can give `array` new models with `optimizers`
    (their trial optimizers, one per model of the array).

    The array's optimizer must be a plain fused optimizer (no loss-scaling
    wrapper) without learning-rate schedules, which are traced into its
    step, and build the same variables as the new models' optimizer would:
    an SGD whose models all had momentum 0, for one, has no momentum slots
    for new models with momentum. With `optimizers=None`, whether the array
    can take new models at all.
    """
    if optimizers is None:
        return _takes_new_models(array)
    return reload_optimizer(array, optimizers) is not None


def reload_optimizer(array, optimizers):
    """The fused optimizer, built, that `reload(array, ..., optimizers)`
    loads into `array`; None where `reusable(array, optimizers)` is False.
    Hand it to `reload` in place of `optimizers` to build it once."""
    optimizer = array.optimizer
    if not (_takes_new_models(array)
            and len(optimizers) == array.num_models
            and type(optimizer) is type(optimizers[0])
            and all(optimizer_structure(o)["config"]["learning_rate"]
                    == "float" for o in optimizers)):
        return None
    fresh = combine_optimizers(optimizers)
    fresh.build(array.trainable_variables)
    return fresh if _variables(fresh) == _variables(optimizer) else None


def _takes_new_models(array):
    optimizer = array.optimizer
    return (isinstance(optimizer, fused_optimizers.FusedOptimizer)
            and not optimizer._learning_rate_schedules()
            and not array.diverged_models.any())


def _variables(optimizer):
    """What `reload` needs two optimizers to share: their variables'
    names, shapes and dtypes, in order."""
    return [(v.name, tuple(v.shape), v.dtype) for v in optimizer.variables]


def reload(array, models, optimizers):
    """Turns a trained array into a new array of `models` (their weights)
    with `optimizers` (new optimizer state, their hyper-parameters), as
    `fuse_trials(models, optimizers)` would build it, keeping the array's
    traced (and compiled) steps: no tracing or XLA compilation again.

    Only for arrays that `reusable(array, optimizers)` accepts, with
    `models` of the group the array was built for (`group_key`).
    `optimizers` may also be the fused optimizer that
    `reload_optimizer(array, optimizers)` returned.
    """
    if len(models) != array.num_models:
        raise ValueError(
            f"Array '{array.name}' holds {array.num_models} models; received "
            f"{len(models)} to load.")
    fresh = (optimizers
             if isinstance(optimizers, fused_optimizers.FusedOptimizer)
             else reload_optimizer(array, optimizers))
    if fresh is None or _variables(fresh) != _variables(array.optimizer):
        raise ValueError(
            f"Cannot reload array '{array.name}' with these optimizers: the "
            "array's optimizer is wrapped, has learning-rate schedules or a "
            "diverged model, or is of another type, or would build other "
            "variables (names or shapes) than theirs. Check "
            "`reusable(array, optimizers)` first.")
    # The trial models' layers (named as each model was) in their stock
    # order, which may differ from the array's.
    fused = dict(weighted_layers(array))
    per_model = [weighted_layers(model) for model in models]
    for position, path in enumerate(array.stock_layer_paths()):
        weights = [layers[position][1].get_weights() for layers in per_model]
        fused[path].set_weights([np.stack(w) for w in zip(*weights)])
    # Step counts, slots and hyper-parameter variables start anew.
    for old, new in zip(array.optimizer.variables, fresh.variables):
        old.assign(new)
    for name in fresh.hyperparameter_names:
        value = fresh.get_config()[name]
        if value is not None:
            # Keeps the optimizer's config (and exported metadata) true.
            array.optimizer.set_hyperparameter(name, value)
    frozen = [b for b in range(array.num_models)
              if not array.active_models[b]]
    if frozen:
        array.unfreeze_models(frozen)
    return array


def copy_model(source, index, target, slot):
    """Copies model `index` of array `source` (weights, optimizer slots,
    per-model hyper-parameters and step counts) into model `slot` of
    array `target`, an array of the same architecture and optimizer."""
    pairs = list(zip(source.weights, target.weights))
    if source.optimizer is not None and source.optimizer.built:
        pairs += list(zip(source.optimizer.variables,
                          target.optimizer.variables))
    for old, new in pairs:
        old_value = keras.ops.convert_to_numpy(old)
        if old_value.ndim == 0 or old_value.shape[0] != source.num_models:
            continue  # Shared by all models (a step counter): kept.
        new_value = keras.ops.convert_to_numpy(new).copy()
        if new_value.shape[1:] != old_value.shape[1:]:
            raise ValueError(
                f"Cannot carry model {index} of array '{source.name}' into "
                f"array '{target.name}': '{old.path}' has per-model shape "
                f"{old_value.shape[1:]} where '{new.path}' has "
                f"{new_value.shape[1:]}.")
        new_value[slot] = old_value[index]
        new.assign(new_value)
    if source.diverged_models[index] or not source.active_models[index]:
        target.freeze_models([slot])


def stacked_weights(array):
    """Every weighted layer's stacked weights, read once, in the order a
    stock model of the array's architecture lists its layers
    (`stock_layer_paths`): sliced for each model by `set_model`."""
    fused = dict(weighted_layers(array))
    return [fused[path].get_weights() for path in array.stock_layer_paths()]


def set_model(model, stacked, index):
    """Sets the plain model `model` (the architecture of the array that
    `stacked` was read from) to that array's model `index`."""
    layers = weighted_layers(model)
    if len(layers) != len(stacked):
        raise ValueError(
            f"Model '{model.name}' has {len(layers)} layers with weights; "
            f"the array has {len(stacked)}.")
    for (_, layer), weights in zip(layers, stacked):
        set_layer_weights(layer, [np.asarray(w[index]) for w in weights])
