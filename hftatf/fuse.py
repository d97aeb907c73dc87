"""fuse, unfuse and fuse_models: between B plain Keras models and an array.

The three are exact inverses: `unfuse(fuse_models(ms))` returns the weights
of `ms`, and `fuse_models(unfuse(a))` the weights of `a`.
"""

import os
import warnings

import keras
import numpy as np

from hftatf.core import hooks
from hftatf.core.compat import compile_config
from hftatf.core.devices import available_memory, runs_on_accelerator
from hftatf.core.validation import check_backend, check_num_models
from hftatf.graph import (
    architecture_difference,
    check_graph_model,
    config_layers,
    input_structure,
    is_graph_model,
    set_layer_weights,
    weighted_layers,
)
from hftatf.model import FusedModel
from hftatf.optimizers.stock import copy_state, stock_optimizer
from hftatf.rewrite import (
    Walker,
    check_no_custom_steps,
    check_no_weights_shared_into_per_model_layers,
)
from hftatf.training.model_metrics import clone_metrics
from hftatf.training.surgery import set_weight_states, weight_states

LAYOUTS = ("auto", "batch_first", "models_first")


@hooks.provides("fuse")
def fuse(model, num_models, shared_inputs=True, name=None,
         model_class=FusedModel, layout="auto"):
    """Turns a functional or Sequential Keras model into an array of B.

    Every layer is mapped to its fused form (`hftatf.layers.registry`); a
    layer called several times stays one fused layer. The B models start from
    independent initialisations (each slice as its stock layer would draw
    it); use `fuse_models` to start from given weights.

    Layers without weights that only see shared inputs (e.g. a `Rescaling`
    or `Flatten` right after a shared input) run once on the shared batch;
    the batch is broadcast to the models where a layer first needs
    per-model activations (a layer with weights, or a random one).

    Args:
        model: a functional or Sequential `keras.Model` (built, i.e. with
            known input shapes) made of layers that hftatf fuses.
        num_models: the number of models `B`.
        shared_inputs: whether the models share each input batch
            (`[batch, ...]`, the usual tuning case) or take one batch each
            (`[batch, B, ...]`); a bool for all inputs, one per input, or
            a dict of them by input name.
        name: the array's name; defaults to `"fused_" + model.name`.
        model_class: the `FusedModel` subclass to build.
        layout: how activations between the array's layers are laid out:
            `"batch_first"`, `[batch, B, ...]` everywhere; `"models_first"`,
            `[B, batch, ...]` from each convolution (or from the first of
            the layers in front of it that compute in that layout too)
            through the layers that compute in that layout too (batch
            normalization, activations, dropout, merges, reshapes,
            padding, pooling, dense layers), back to `[batch, B, ...]`
            before any other layer; `"auto"` (the
            default), models first on a CPU, where convolutions run per
            model and their per-model slices of `[B, batch, ...]` are
            views, not copies, and batch first on a GPU or TPU and for
            one model. The array's inputs and outputs are the same in
            every layout, and so is what each model computes (and draws:
            a dropout's masks).

    Returns:
        A `FusedModel` whose outputs are `[batch, B, ...]`.
    """
    check_backend()
    num_models = check_num_models(num_models)
    if layout not in LAYOUTS:
        raise ValueError(
            f"`layout` must be one of {LAYOUTS}. Received: layout={layout!r}.")
    requested = layout
    if layout == "auto":
        # One model's activations are laid out alike either way.
        layout = ("batch_first" if num_models == 1 or runs_on_accelerator()
                  else "models_first")
    _check_fusable(model)
    check_memory(model, num_models)
    if model_class is FusedModel:
        check_no_custom_steps(model)
    structure = input_structure(model)
    inputs = keras.tree.flatten(structure)
    shared_inputs = _shared_inputs(shared_inputs, inputs, model)
    walker = Walker(num_models, models_first=layout == "models_first",
                    check_model=_check_fusable)
    new_inputs = [walker.input_like(x, shared)
                  for x, shared in zip(inputs, shared_inputs)]
    outputs = walker.run(model, new_inputs)
    array = model_class(
        keras.tree.pack_sequence_as(structure, new_inputs),
        outputs,
        num_models=num_models,
        shared_inputs=shared_inputs,
        source=_source(model),
        name=name or f"fused_{model.name}",
    )
    walker.run_in_stock_order(array)
    # What the stock layers' configs leave out: LoRA on an attention
    # layer's projections, weights frozen apart from their layer.
    set_weight_states(array, weight_states(model))
    # Saved with the array's config, so that a reloaded (or selected)
    # array is laid out as asked; "auto" decides again where it loads.
    array._layout = requested
    # The model's dtype policy, not the global one where they differ:
    # `compile` adds loss scaling to a mixed_float16 array as to its model.
    array.dtype_policy = model.dtype_policy
    # The outputs' names are the stock model's (loss and label dicts, logs),
    # also where an output comes from a layer of the array's own (a move of
    # the model axis back to the batch first).
    names = list(getattr(model, "output_names", None) or ())
    if len(names) == len(array.output_names):
        array.output_names = names
    return array


def check_array(value, user, fix):
    """Returns `value` if it is a `FusedModel`; else a TypeError saying
    that `user` (e.g. `"hftatf.export_models"`) takes one, and `fix`."""
    if not isinstance(value, FusedModel):
        raise TypeError(
            f"{user} expects a FusedModel array (made by hftatf.fuse or "
            f"hftatf.fuse_models). Received: {value!r} of type "
            f"{type(value).__name__}. {fix}")
    return value


def _shared_inputs(shared_inputs, inputs, model):
    """`shared_inputs` as one bool per input of `model` (`inputs`, in
    order), from a bool, a sequence of bools, or a dict of bools by input
    name."""
    names = [x.name for x in inputs]
    if isinstance(shared_inputs, (bool, np.bool_)):
        values = [bool(shared_inputs)] * len(inputs)
    elif isinstance(shared_inputs, dict):
        unknown = sorted(set(shared_inputs) - set(names))
        missing = [n for n in names if n not in shared_inputs]
        if unknown or missing:
            raise ValueError(
                f"`shared_inputs` as a dict needs one bool per input name of "
                f"model '{model.name}': {names}. Received: "
                f"shared_inputs={shared_inputs!r}.")
        values = [shared_inputs[n] for n in names]
    else:
        values = list(shared_inputs)
        if len(values) != len(inputs):
            raise ValueError(
                f"`shared_inputs` needs one bool per input of model "
                f"'{model.name}' ({len(inputs)} inputs: {names}). Received: "
                f"shared_inputs={shared_inputs!r}.")
    if not all(isinstance(v, (bool, np.bool_)) for v in values):
        raise TypeError(
            f"`shared_inputs` takes bools (True: the models share the input; "
            f"False: one batch per model). Received: "
            f"shared_inputs={shared_inputs!r}.")
    return [bool(v) for v in values]


# Copies of a trainable weight that training holds: the weight, its
# gradient and the two slots of Adam (the optimizers' most common state).
_TRAINING_COPIES = 4


def array_memory(model, num_models):
    """The bytes an array of `num_models` copies of `model` holds while it
    trains, at least: each weight, and for each trainable one its gradient
    and two optimizer slots (activations, which depend on the batch, come
    on top)."""
    total = 0
    for weight in model.weights:
        copies = _TRAINING_COPIES if weight.trainable else 1
        total += (copies * int(np.prod(weight.shape))
                  * np.dtype(keras.backend.standardize_dtype(
                      weight.dtype)).itemsize)
    return total * num_models


def check_memory(model, num_models):
    """Refuses an array whose weights, gradients and optimizer slots
    (`array_memory`) exceed the memory still available where it trains
    (`available_memory`), before anything of it is built."""
    available = available_memory()
    needed = array_memory(model, num_models)
    if available is None or needed <= available:
        return
    per_model = needed / num_models
    raise ValueError(
        f"An array of num_models={num_models} copies of model "
        f"'{model.name}' ({model.count_params()} parameters each) needs "
        f"about {needed / 2**30:.1f} GiB for its weights, gradients and "
        f"optimizer slots, but {available / 2**30:.1f} GiB are available. "
        f"Use at most num_models={max(int(available // per_model), 1)}, "
        "or split the sweep into several arrays trained one after "
        "another, or use a device with more memory.")


def _check_fusable(model):
    if isinstance(model, FusedModel):
        raise ValueError(
            f"Model '{model.name}' is already an array of "
            f"{model.num_models} models. Unfuse it first, or use "
            "hftatf.fuse_models to stack trained models.")
    if not isinstance(model, keras.Model):
        raise TypeError(
            "hftatf.fuse expects a keras.Model (functional or Sequential). "
            f"Received: {model!r} of type {type(model).__name__}.")
    check_graph_model(model)
    try:
        input_structure(model)
    except (AttributeError, ValueError, IndexError, TypeError):
        raise ValueError(
            f"Model '{model.name}' has no defined input yet. Give it an "
            "input shape (keras.Input, or call model.build(shape)) before "
            "fusing it.") from None
    check_no_weights_shared_into_per_model_layers(model)



def _source(model):
    """`model` serialized, for `FusedModel.stock_model`, with the name of
    each layer of a Sequential model written next to its config (as a
    functional model's config has it): where a layer's own config leaves it
    out, the stock model gives the layer its name back from there."""
    config = keras.saving.serialize_keras_object(model)
    _name_entries(model, config)
    return config


def _name_entries(model, config):
    entries = config["config"].get("layers")
    if entries is None:
        # A functional model of a class of its own that writes its
        # constructor's arguments (keras-hub's models) builds its layers,
        # named, from them.
        return
    for layer, entry in zip(config_layers(model), entries):
        entry.setdefault("name", layer.name)
        if is_graph_model(layer):
            _name_entries(layer, entry)


@hooks.provides("unfuse")
def unfuse(array, compile=True):
    """Returns the array's B models as plain Keras models with their weights.

    The models have the architecture of the stock model the array was fused
    from and need no hftatf to run, save or load.

    With `compile=True` (the default) and an array compiled with a loss,
    model `b` is compiled as it trains in the array: the array's loss,
    loss weights and metrics (fresh ones), and the stock optimizer of the
    fused one's class with model `b`'s hyper-parameters as they are now
    and its state (step count, slots, EMA averages, loss scale;
    `hftatf.optimizers.stock_optimizer`). `fit` on it goes on exactly as
    model `b` would in the array, and `model.save` keeps the optimizer, as
    stock Keras does. An optimizer with no stock form (`Lars`, a schedule
    without one) leaves the models uncompiled, with a warning.
    """
    if array.source_config is None:
        raise ValueError(
            f"Array '{array.name}' was not made by hftatf.fuse or "
            "hftatf.fuse_models, so it has no stock architecture to unfuse "
            "into.")
    stacked = {path: layer.get_weights()
               for path, layer in weighted_layers(array)}
    # The config is the array's own, whose layers (a Lambda's function
    # included) are already loaded: safe mode would only refuse them.
    models = array._stock_models(array.num_models, safe_mode=False)
    for index, model in enumerate(models):
        for path, layer in weighted_layers(model):
            set_layer_weights(layer, [w[index] for w in stacked[path]])
    if compile and compiles_stock_models(array):
        for index, model in enumerate(models):
            compile_stock_model(array, index, model)
    return models


def compiles_stock_models(array):
    """Whether `compile_stock_model` can compile the array's models: the
    array is compiled with a loss and its optimizer has a stock form (a
    warning says so where it has none)."""
    config = compile_config(array)
    if config.get("loss") is None or array.optimizer is None:
        return False
    try:
        stock_optimizer(array.optimizer, 0)
    except TypeError as error:
        warnings.warn(
            f"The models of array '{array.name}' are left uncompiled: "
            f"{error}", stacklevel=3)
        return False
    return True


def compile_stock_model(array, index, model):
    """Compiles the plain `model` (the array's architecture) as model
    `index` trains in the array, with its optimizer's state."""
    config = compile_config(array)
    optimizer = stock_optimizer(array.optimizer, index)
    model.compile(
        optimizer=optimizer, loss=config["loss"],
        loss_weights=config.get("loss_weights"),
        metrics=clone_metrics(config.get("metrics")),
        weighted_metrics=clone_metrics(config.get("weighted_metrics")),
        run_eagerly=config.get("run_eagerly", False),
        steps_per_execution=config.get("steps_per_execution", 1),
        jit_compile=config.get("jit_compile", "auto"),
        auto_scale_loss=config.get("auto_scale_loss", True))
    # By path: the array may list its layers in another order than the
    # stock model (which Keras orders by depth, raw operations counted).
    stock_layers = dict(weighted_layers(model))
    fused = {id(stock): variable
             for path, layer in weighted_layers(array)
             if path in stock_layers
             for variable, stock in zip(layer.weights,
                                        stock_layers[path].weights)}
    missing = [v.path for v in model.trainable_variables
               if id(v) not in fused]
    if missing:
        raise ValueError(
            f"Cannot give model {index} of array '{array.name}' its "
            f"optimizer state: its variables {missing} have no counterpart "
            "in the array.")
    copy_state(
        array.optimizer, index, model.optimizer,
        [(fused[id(v)], v) for v in model.trainable_variables])


def fuse_models(models, shared_inputs=True, name=None,
                model_class=FusedModel, layout="auto"):
    """Stacks B trained plain Keras models of one architecture into an array.

    Model `b` of the array holds `models[b]`'s weights (trainable and not,
    e.g. BatchNormalization statistics).

    Args:
        models: a sequence of functional or Sequential Keras models with the
            same architecture (layer names may differ), or of paths to them:
            `.keras` files, or model directories written by
            `hftatf.export_models` (or the SavedModel inside one, whose
            weights are read from the `.keras` file or checkpoint next to
            it).
        shared_inputs, name, model_class, layout: as for `hftatf.fuse`.

    Raises:
        ValueError: for models whose architectures differ, naming the first
            difference (layer count, order, class, configuration or weight
            shapes).
    """
    if isinstance(models, (str, os.PathLike, keras.Model)):
        raise TypeError(
            "hftatf.fuse_models expects a sequence of models or paths, one "
            f"per model of the array. Received: models={models!r}. Pass a "
            "list, or use hftatf.from_exported for a directory written by "
            "hftatf.export_models.")
    models = [_as_model(model) for model in models]
    if not models:
        raise ValueError("hftatf.fuse_models needs at least one model.")
    found = architecture_difference(models)
    if found:
        index, difference = found
        raise ValueError(
            f"hftatf.fuse_models needs models of one architecture; "
            f"model {index} ('{models[index].name}') differs from model 0 "
            f"('{models[0].name}'): {difference}.")
    array = fuse(models[0], len(models), shared_inputs=shared_inputs,
                 name=name, model_class=model_class, layout=layout)
    fused = dict(weighted_layers(array))
    layers = [weighted_layers(model) for model in models]
    for position, (path, _) in enumerate(layers[0]):
        per_model = [model_layers[position][1].get_weights()
                     for model_layers in layers]
        fused[path].set_weights(
            [np.stack(weights) for weights in zip(*per_model)])
    return array


def _as_model(model):
    """`model`, or the model stored at the path `model`."""
    if isinstance(model, (str, os.PathLike)):
        # Reading files is hftatf.export's, which builds on this module.
        return hooks.call("load_exported_model", model)
    return model


