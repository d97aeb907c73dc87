"""fuse, unfuse and fuse_models: between B plain Keras models and an array.

The three are exact inverses: `unfuse(fuse_models(ms))` returns the weights
of `ms`, and `fuse_models(unfuse(a))` the weights of `a`.
"""

import collections
import os
import warnings

import keras
import numpy as np
from keras.src.models.functional import Functional

from hftatf.core import hooks
from hftatf.graph import (
    config_layers,
    is_graph_model,
    set_layer_weights,
    weighted_layers,
)
from hftatf.layers import registry
from hftatf.layers.base import runs_on_accelerator
from hftatf.layers.fold import (
    PER_SAMPLE_ADVICE,
    BroadcastToModels,
    FoldModelAxis,
    SwapModelAxis,
    UnfoldModelAxis,
    copy_layer,
    has_random_state,
    sample_mixing,
)
from hftatf.model import FusedModel, clone_metrics
from hftatf.optimizers.stock import copy_state, stock_optimizer
from hftatf.validation import check_num_models

LAYOUTS = ("auto", "batch_first", "models_first")


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
    if model_class is FusedModel:
        _check_no_custom_steps(model)
    structure = _input_structure(model)
    inputs = keras.tree.flatten(structure)
    shared_inputs = _shared_inputs(shared_inputs, inputs, model)
    walker = _Walker(num_models, models_first=layout == "models_first")
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


# What a Model subclass may override that an array built from the model's
# graph would not run.
_STEP_METHODS = ("call", "train_step", "test_step", "predict_step",
                 "compute_loss", "compute_metrics")


def _check_no_custom_steps(model, names=_STEP_METHODS):
    """Refuses a functional or Sequential model whose class overrides any
    of the methods `names`: the array is built from the model's graph and
    would silently train without them."""
    base = keras.Sequential if isinstance(model, keras.Sequential) else (
        Functional)
    custom = [name for name in names
              if getattr(type(model), name, None) is not getattr(base, name)]
    if custom:
        methods = ", ".join(f"`{name}`" for name in custom)
        raise ValueError(
            f"Model '{model.name}' is a {type(model).__name__} with its own "
            f"{methods}. hftatf.fuse builds the array from the model's graph "
            "and would train it without them. Write the custom step in a "
            "hftatf.FusedModel subclass and pass it as `model_class=` (see "
            "FusedGAN in hftatf.models.dcgan), or fuse the plain functional "
            "model.")


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
    _check_graph_model(model)
    try:
        _input_structure(model)
    except (AttributeError, ValueError, IndexError, TypeError):
        raise ValueError(
            f"Model '{model.name}' has no defined input yet. Give it an "
            "input shape (keras.Input, or call model.build(shape)) before "
            "fusing it.") from None
    _check_no_weights_shared_into_per_model_layers(model)


def _check_graph_model(model):
    """Refuses a subclassed model, whose inputs Keras does not record."""
    if not isinstance(model, keras.Sequential) and not hasattr(
            model, "_nodes_by_depth"):
        raise ValueError(
            f"hftatf.fuse needs a functional or Sequential model; model "
            f"'{model.name}' is a subclassed {type(model).__name__}, whose "
            "inputs (shapes and dtypes) Keras does not record. Call it in a "
            "functional model, whose inputs say them: `inputs = "
            "keras.Input(shape, dtype=...)`, then `hftatf.fuse(keras.Model("
            "inputs, model(inputs)), num_models)`; the array runs it once "
            "per model (hftatf.layers.FusedPerModel), from copies made from "
            "its config. Or rebuild it with the functional API, so that "
            "each of its layers fuses.")


def _check_no_weights_shared_into_per_model_layers(model):
    """Refuses a layer run once per model that shares a weight with
    another layer of the model (a head tied to the model's embedding): its
    copies, made from its config, would each hold weights of their own,
    and the models would train them untied."""
    owners = {}
    for _, layer in weighted_layers(model):
        for weight in layer.weights:
            owners.setdefault(id(weight), {})[id(layer)] = layer
    for found in owners.values():
        layers = list(found.values())
        if len(layers) > 1 and any(registry.runs_per_model(layer)
                                   for layer in layers):
            names = " and ".join(
                f"'{layer.name}' ({type(layer).__name__})"
                for layer in layers)
            raise ValueError(
                f"Layers {names} of model '{model.name}' share a weight, "
                "and hftatf runs at least one of them once per model, from "
                "copies made from its config, which would not share it: "
                "the models would train it untied. Tie the weights inside "
                "one layer of your own (it then runs per model as a "
                "whole), or give the layers that share it fused forms.")


def _input_structure(model):
    if isinstance(model, keras.Sequential):
        return model.inputs[0]
    return model.input


class _Walker:
    """Rebuilds a model's graph with fused layers, tracking which tensors
    are still shared by all models (`[batch, ...]`) and, with
    `models_first`, which have the models first (`[B, batch, ...]`).

    With `models_first`, a layer that can computes with the models first
    when one of its inputs has them first, or when every layer that reads
    its output can take them so and it prefers them (a convolution) or
    leads to a layer that computes so by this rule (a `Dense`, normalization
    and reshape in front of a generator's first convolution: the models go
    first once, at the `Dense`'s input, instead of out of and back into
    the `Dense`'s products). Every other layer, and the array's outputs, get
    `[batch, B, ...]` (one `SwapModelAxis` per tensor)."""

    def __init__(self, num_models, models_first=False):
        self.num_models = num_models
        self.models_first = models_first
        # id(tensor) -> (tensor, is shared, has the models first); the
        # tensor is kept so that its id is not reused.
        self._layout_of = {}
        self._swapped = {}  # id(tensor) -> (tensor, axes 0 and 1 swapped)
        self._layouts = {}  # id(stock layer) -> models first
        self._feeds_models_first = {}  # id(stock layer) -> bool
        self._leads_models_first = {}  # id(stock layer) -> bool
        self._fused = {}  # id(stock layer) -> (stock layer, fused layer)
        self._nested_walkers = {}  # id(stock nested model) -> its walker
        self._stock_copies = {}  # id(stock layer) -> copy for shared inputs
        # (id(shared tensor), models first) -> (tensor, broadcast)
        self._broadcasts = {}
        self._folded = {}  # id([batch, B, ...] tensor) -> [batch * B, ...]
        self._calls = collections.Counter()  # id(stock layer) -> calls

    def input_like(self, reference, shared):
        shape = tuple(reference.shape)
        if not shared:
            shape = (shape[0], self.num_models, *shape[1:])
        # Keep the stock input layer's name, so data keyed by input name
        # (dicts, tf.data) feeds the array as it feeds the stock model.
        history = getattr(reference, "_keras_history", None)
        name = history[0].name if history else reference.name
        tensor = keras.Input(batch_shape=shape, dtype=reference.dtype,
                             name=name)
        self._mark(tensor, shared)
        return tensor

    def _mark(self, outputs, shared, first=False):
        for tensor in keras.tree.flatten(outputs):
            if isinstance(tensor, keras.KerasTensor):
                self._layout_of[id(tensor)] = (tensor, shared, first)

    def _is_shared(self, tensor):
        return self._layout_of.get(id(tensor), (None, False, False))[1]

    def _has_models_first(self, tensor):
        return self._layout_of.get(id(tensor), (None, False, False))[2]

    def _swap(self, tensor):
        """`tensor` with its batch and model axes swapped, once per
        tensor; swapping back returns `tensor` itself."""
        if id(tensor) not in self._swapped:
            first = not self._has_models_first(tensor)
            swapped = SwapModelAxis(models_first=first)(tensor)
            self._mark(swapped, False, first)
            self._swapped[id(tensor)] = (tensor, swapped)
            self._swapped[id(swapped)] = (swapped, tensor)
        return self._swapped[id(tensor)][1]

    def _broadcast(self, tensor, first):
        """The shared `tensor` given to every model, once per layout."""
        key = (id(tensor), first)
        if key not in self._broadcasts:
            broadcast = BroadcastToModels(
                self.num_models, models_first=first)(tensor)
            self._mark(broadcast, False, first)
            self._broadcasts[key] = (tensor, broadcast)
        return self._broadcasts[key][1]

    def per_model(self, tensor):
        """Returns `tensor` as `[batch, B, ...]`, broadcasting if shared."""
        if not isinstance(tensor, keras.KerasTensor):
            return tensor
        if self._has_models_first(tensor):
            return self._swap(tensor)
        if self._is_shared(tensor):
            return self._broadcast(tensor, False)
        return tensor

    def with_models_first(self, tensor):
        """Returns `tensor` as `[B, batch, ...]`, broadcasting if shared."""
        if not isinstance(tensor, keras.KerasTensor) or (
                self._has_models_first(tensor)):
            return tensor
        if self._is_shared(tensor):
            return self._broadcast(tensor, True)
        return self._swap(tensor)

    def _takes_models_first(self, operation):
        return (self.models_first
                and isinstance(operation, keras.layers.Layer)
                and not is_graph_model(operation)
                and registry.takes_models_first(operation))

    def _find_consumers(self, model):
        """For every layer of `model`, whether every layer that reads its
        outputs can take them with the models first (not so for the
        model's outputs), and whether one of them wants them so."""
        feeds = self._feeds_models_first
        leads = self._leads_models_first
        if isinstance(model, keras.Sequential):
            pairs = list(zip(model.layers, model.layers[1:] + [None]))
            for layer, consumer in pairs:
                feeds[id(layer)] = feeds.get(id(layer), True) and (
                    consumer is not None and self._takes_models_first(
                        consumer))
            for layer, consumer in reversed(pairs):
                leads[id(layer)] = leads.get(id(layer), False) or (
                    consumer is not None
                    and self._wants_models_first(consumer))
            return
        for nodes in model._nodes_by_depth.values():
            for node in nodes:
                takes = self._takes_models_first(node.operation)
                for tensor in node.input_tensors:
                    producer = tensor._keras_history.operation
                    feeds[id(producer)] = feeds.get(id(producer),
                                                    True) and takes
        for tensor in keras.tree.flatten(model.outputs):
            feeds[id(tensor._keras_history.operation)] = False
        # From the outputs to the inputs: a node's readers are at smaller
        # depths, so whether they want the models first is known.
        for depth in sorted(model._nodes_by_depth):
            for node in model._nodes_by_depth[depth]:
                wants = self._wants_models_first(node.operation)
                for tensor in node.input_tensors:
                    producer = id(tensor._keras_history.operation)
                    leads[producer] = leads.get(producer, False) or wants

    def _wants_models_first(self, layer):
        """Whether `layer` computes with the models first even where its
        inputs do not have them first (see the class docstring)."""
        return (self._takes_models_first(layer)
                and self._feeds_models_first.get(id(layer), False)
                and (registry.prefers_models_first(layer)
                     or self._leads_models_first.get(id(layer), False)))

    def _runs_models_first(self, layer, tensors):
        """Whether the fused form of `layer`, called on `tensors`,
        computes with the models first (decided at its first call)."""
        if id(layer) not in self._layouts:
            first = self._takes_models_first(layer) and (
                any(self._has_models_first(t) for t in tensors)
                or self._wants_models_first(layer))
            self._layouts[id(layer)] = first
        return self._layouts[id(layer)]

    def run(self, model, inputs):
        """Rebuilds `model`'s graph on `inputs`; returns per-model outputs."""
        # How many times the graph calls each layer.
        if isinstance(model, keras.Sequential):
            calls = [id(layer) for layer in model.layers]
        else:
            calls = [id(node.operation)
                     for nodes in model._nodes_by_depth.values()
                     for node in nodes]
        self._calls = collections.Counter(calls)
        if self.models_first:
            self._find_consumers(model)
        if isinstance(model, keras.Sequential):
            outputs = inputs[0]
            for layer in model.layers:
                outputs = self(layer, outputs)
        else:
            outputs = model._run_through_graph(
                inputs, operation_fn=lambda op: op, call_fn=self)
        return keras.tree.map_structure(self.per_model, outputs)

    def __call__(self, layer, *args, **kwargs):
        if is_graph_model(layer):
            return self._call_nested(layer, *args, **kwargs)
        if not isinstance(layer, keras.layers.Layer):
            return self._call_operation(layer, *args, **kwargs)
        tensors = [t for t in keras.tree.flatten((args, kwargs))
                   if isinstance(t, keras.KerasTensor)]
        if (tensors and all(self._is_shared(t) for t in tensors)
                and registry.is_foldable(layer)
                and not has_random_state(layer)
                # Each model is penalised on its own (FusedFold).
                and layer.activity_regularizer is None):
            # Deterministic, per sample, weightless: once for all models.
            if id(layer) not in self._stock_copies:
                self._stock_copies[id(layer)] = (layer, copy_layer(layer))
            outputs = self._stock_copies[id(layer)][1](*args, **kwargs)
            self._mark(outputs, True)
            return outputs
        # A Dense or convolution on a shared tensor takes it as it is: no
        # per-model copies of the shared input.
        shared = self._takes_shared_input(layer, args, tensors)
        first = self._runs_models_first(layer, tensors)
        if first and not shared:
            args, kwargs = keras.tree.map_structure(
                self.with_models_first, (args, kwargs))
        elif not shared:
            args, kwargs = keras.tree.map_structure(
                self.per_model, (args, kwargs))
        if id(layer) not in self._fused:
            self._fused[id(layer)] = (layer, registry.fuse_layer(
                layer, self.num_models, shared_input=shared,
                models_first=first))
        outputs = self._fused[id(layer)][1](*args, **kwargs)
        self._mark(outputs, False, first)
        return outputs

    def _takes_shared_input(self, layer, args, tensors):
        """Whether `layer` is called once, on one shared tensor (`args` is
        that tensor alone; `tensors` all tensors of the call), and has a
        fused form that takes it as it is (a Dense or convolution)."""
        return (len(args) == 1 and tensors == [args[0]]
                and self._is_shared(args[0])
                # Called once in the stock graph: a layer applied to shared
                # and per-model tensors needs one layout for its weights.
                and self._calls[id(layer)] == 1
                and registry.takes_shared_input(layer))

    def _stock_shape(self, tensor):
        """The stock model's shape of the array's `tensor` (the first of a
        list), or None for no tensor of the graph."""
        if isinstance(tensor, (list, tuple)) and tensor:
            tensor = tensor[0]
        if not isinstance(tensor, keras.KerasTensor):
            return None
        shape = list(tensor.shape)
        if not self._is_shared(tensor):
            del shape[0 if self._has_models_first(tensor) else 1]
        return tuple(shape)

    def _stock_arguments(self, args, kwargs):
        """`(args, kwargs)` of a call in the array, with a
        `keras.KerasTensor` of the stock model's shape for each tensor."""
        def stock(x):
            if not isinstance(x, keras.KerasTensor):
                return x
            return keras.KerasTensor(self._stock_shape(x), dtype=x.dtype,
                                     sparse=x.sparse)

        return keras.tree.map_structure(stock, (args, kwargs))

    def _call_operation(self, operation, *args, **kwargs):
        """A raw `keras.ops` node: once on shared tensors (it is
        deterministic), folded over the models otherwise. Folded, it must
        treat every sample on its own: one that reaches across the batch
        axis is refused, by its arguments where they say so
        (`_batch_axis_refusal`, the more precise message), else where the
        probes of `sample_mixing` find it."""
        tensors = [t for t in keras.tree.flatten((args, kwargs))
                   if isinstance(t, keras.KerasTensor)]
        if all(self._is_shared(t) for t in tensors):
            outputs = operation(*args, **kwargs)
            self._mark(outputs, True)
            return outputs
        refusal = _batch_axis_refusal(
            operation, self._stock_shape(args[0] if args else None)
        ) or sample_mixing(operation, operation.compute_output_spec,
                           self._stock_arguments(args, kwargs))
        if refusal:
            raise ValueError(
                f"hftatf cannot fuse the raw operation '{operation.name}' "
                f"({type(operation).__name__}): it {refusal}. "
                f"{PER_SAMPLE_ADVICE}")

        def fold(x):
            if not isinstance(x, keras.KerasTensor):
                return x
            if id(x) not in self._folded:
                self._folded[id(x)] = (
                    x, FoldModelAxis(self.num_models)(self.per_model(x)))
            return self._folded[id(x)][1]

        def unfold(y):
            if not isinstance(y, keras.KerasTensor):
                return y
            unfolded = UnfoldModelAxis(self.num_models)(y)
            # A following operation reuses the folded tensor.
            self._folded[id(unfolded)] = (unfolded, y)
            return unfolded

        args, kwargs = keras.tree.map_structure(fold, (args, kwargs))
        outputs = keras.tree.map_structure(unfold, operation(*args, **kwargs))
        self._mark(outputs, False)
        return outputs

    def pairs(self):
        """`(stock layer, fused layer)` of every layer fused so far, those
        inside a nested model after the nested model itself."""
        for key, pair in self._fused.items():
            yield pair
            if key in self._nested_walkers:
                yield from self._nested_walkers[key].pairs()

    def _call_nested(self, model, *args, **kwargs):
        """A functional or Sequential model used as a layer becomes a nested
        model of fused layers, with its name, taking per-model inputs."""
        if id(model) not in self._fused:
            _check_fusable(model)
            _check_no_custom_steps(model, ("call",))
            walker = _Walker(self.num_models, self.models_first)
            inputs = [walker.input_like(x, shared=False)
                      for x in keras.tree.flatten(_input_structure(model))]
            nested = keras.Model(
                keras.tree.pack_sequence_as(_input_structure(model), inputs),
                walker.run(model, inputs), name=model.name)
            nested.trainable = model.trainable
            if not model.trainable:
                # The flag spread to every layer inside; some of the stock
                # model's were set back (`model.trainable = False`, then
                # `model.get_layer(...).trainable = True`).
                for stock, fused in walker.pairs():
                    if fused.trainable != stock.trainable:
                        fused.trainable = stock.trainable
            self._fused[id(model)] = (model, nested)
            self._nested_walkers[id(model)] = walker
        args, kwargs = keras.tree.map_structure(self.per_model, (args, kwargs))
        outputs = self._fused[id(model)][1](*args, **kwargs)
        self._mark(outputs, False)
        return outputs


# Raw operations whose `axis` counts the axes of their output.
_OUTPUT_AXIS_OPERATIONS = ("ExpandDims", "Stack", "OneHot")


def _batch_axis_refusal(operation, shape):
    """How the raw `operation`, whose first argument has the stock `shape`,
    reaches across the batch axis, in words; None where it treats every
    sample on its own, as an operation folded over the models must (or
    where its first argument is no tensor of the graph, `shape` None,
    whose axes it may not mean)."""
    if shape is None:
        return None
    kind = type(operation).__name__
    ndim = len(shape) + (kind in _OUTPUT_AXIS_OPERATIONS)
    if hasattr(operation, "axis"):
        axis = operation.axis
        if axis is None:
            # All axes (a reduction), or the flattened tensor; Squeeze's
            # None squeezes axes of size one only.
            return (None if kind == "Squeeze"
                    else "acts on all axes, the batch axis included "
                         "(axis=None)")
        axes = axis if isinstance(axis, (list, tuple)) else [axis]
        if any(isinstance(a, int) and a % max(ndim, 1) == 0 for a in axes):
            return f"acts along the batch axis (axis={axis!r})"
    axes = getattr(operation, "axes", None)
    if kind == "Transpose" and axes and axes[0] != 0:
        return f"moves the batch axis (axes={tuple(axes)!r})"
    if kind == "BroadcastTo":
        # Its target names every axis, the batch axis included.
        return (f"broadcasts to a fixed batch size (shape="
                f"{tuple(operation.shape)!r}, from {tuple(shape)!r})")
    if kind == "Tile":
        repeats = operation.repeats
        repeats = [repeats] if isinstance(repeats, int) else list(repeats)
        if len(repeats) > ndim:
            return f"moves the batch axis (repeats={tuple(repeats)!r})"
        if len(repeats) == ndim and repeats[0] != 1:
            return f"repeats the batch (repeats={tuple(repeats)!r})"
    new_shape = getattr(operation, "newshape", None)
    if kind == "Reshape" and new_shape is not None:
        given = list(shape[1:])
        wanted = list(new_shape[1:])
        if None not in given and all(isinstance(d, int) and d >= 0
                                     for d in wanted) and (
                int(np.prod(given)) != int(np.prod(wanted))):
            return (f"reshapes samples into the batch axis (to "
                    f"{tuple(new_shape)!r} from {tuple(shape)!r})")
    return None


def _source(model):
    """`model` serialized, for `FusedModel.stock_model`, with the name of
    each layer of a Sequential model written next to its config (as a
    functional model's config has it): where a layer's own config leaves it
    out, the stock model gives the layer its name back from there."""
    config = keras.saving.serialize_keras_object(model)
    _name_entries(model, config)
    return config


def _name_entries(model, config):
    for layer, entry in zip(config_layers(model),
                            config["config"]["layers"]):
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
    config = array._compile_config.config if array.compiled else {}
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
    config = array._compile_config.config
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
    fused = {id(stock): variable
             for (_, layer), (_, stock_layer) in zip(
                 weighted_layers(array), weighted_layers(model))
             for variable, stock in zip(layer.weights, stock_layer.weights)}
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
    reference = _architecture(models[0])
    for index, model in enumerate(models[1:], start=1):
        difference = _first_difference(reference, _architecture(model))
        if difference:
            raise ValueError(
                f"hftatf.fuse_models needs models of one architecture; "
                f"model {index} ('{model.name}') differs from model 0 "
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


# Config keys that do not change what a trained layer computes.
_IGNORED_KEYS = ("name", "seed")


def _architecture(model):
    """A comparable description of `model`: one entry per layer with its
    class, its config (layer names replaced by positions, seeds and
    initializers dropped) and its weight shapes."""
    if not isinstance(model, keras.Model):
        raise TypeError(
            f"hftatf.fuse_models expects keras.Model objects. Received: "
            f"{model!r} of type {type(model).__name__}.")
    # Before its config: a subclassed model may have none.
    _check_graph_model(model)
    # Names are the models' own (Keras numbers auto-named layers and raw
    # operations, such as the comparisons behind masks, per session): compare
    # positions in the graph instead.
    positions = {operation.name: f"<operation {i}>"
                 for i, operation in enumerate(getattr(model, "operations",
                                                       ()))}
    positions.update({layer.name: f"<layer {i}>"
                      for i, layer in enumerate(model.layers)})
    positions[model.name] = "<model>"

    def normalize(value):
        if isinstance(value, dict) and str(
                value.get("class_name", "")).endswith("DTypePolicy"):
            # A dtype policy's `name` is the policy itself.
            return value
        if isinstance(value, dict):
            return {k: normalize(v) for k, v in value.items()
                    if k not in _IGNORED_KEYS and not k.endswith(
                        "_initializer")}
        if isinstance(value, (list, tuple)):
            return [normalize(v) for v in value]
        if isinstance(value, str):
            return positions.get(value, value)
        return value

    config = model.get_config()
    layer_configs = config.get("layers", [])
    if isinstance(model, keras.Sequential):
        layer_configs = layer_configs[1:] if layer_configs and (
            layer_configs[0].get("class_name") == "InputLayer") else (
            layer_configs)
    # A functional config lists the graph's operations, raw `keras.ops`
    # calls included, in `model.operations` order; `model.layers` leaves
    # the raw operations out.
    operations = (model.layers if isinstance(model, keras.Sequential)
                  else getattr(model, "operations", model.layers))
    described = []
    for i, layer in enumerate(operations):
        layer_config = layer_configs[i] if i < len(layer_configs) else {}
        if is_graph_model(layer):
            # Inner layer names are the nested model's own: compare its
            # architecture, not its names.
            layer_config = {**layer_config,
                            "config": _architecture(layer)}
        described.append({
            "position": i,
            "class": type(layer).__name__,
            "config": normalize(layer_config),
            "weights": [tuple(w.shape)
                        for w in getattr(layer, "weights", ())],
        })
    if not isinstance(model, keras.Sequential):
        # Which layers are the inputs and outputs, in order: graphs alike
        # but for the order of their inputs compute different functions.
        described.append({
            "position": "of the inputs and outputs", "class": "Model",
            "config": normalize({key: config.get(key) for key in (
                "input_layers", "output_layers")}),
            "weights": []})
    return described


def _first_difference(reference, other):
    """The first way `other` differs from `reference` (as `_architecture`
    describes them), in words; None if they are the same. The layers are
    compared first, then the order of the inputs and outputs."""
    def split(described):
        return ([e for e in described if isinstance(e["position"], int)],
                [e for e in described if not isinstance(e["position"], int)])

    (ours_layers, ours_io), (their_layers, their_io) = (
        split(reference), split(other))
    found = _first_entry_difference(ours_layers, their_layers)
    if found is None and len(ours_layers) != len(their_layers):
        extra = (their_layers if len(their_layers) > len(ours_layers)
                 else ours_layers)[min(len(ours_layers), len(their_layers))]
        found = (f"it has {len(their_layers)} layers instead of "
                 f"{len(ours_layers)}, from layer {extra['position']} "
                 f"({extra['class']}) on")
    return found or _first_entry_difference(ours_io, their_io)


def _first_entry_difference(reference, other):
    for ours, theirs in zip(reference, other):
        where = (f"layer {ours['position']}"
                 if isinstance(ours["position"], int)
                 else f"the order {ours['position']}")
        if ours["class"] != theirs["class"]:
            # Usually the same layers in another order.
            return (f"{where} is a {theirs['class']} where model 0 has a "
                    f"{ours['class']} (layer order or layer types differ)")
        if ours["config"] != theirs["config"]:
            # e.g. "layer 1 (Dense) differs in configuration: units is ..."
            return (f"{where} ({ours['class']}) differs in configuration: "
                    + _config_difference(ours["config"], theirs["config"]))
        if ours["weights"] != theirs["weights"]:
            return (f"{where} ({ours['class']}) differs in weight shapes: "
                    f"{theirs['weights']} instead of {ours['weights']}")
    return None


def _config_difference(ours, theirs, path=""):
    if isinstance(ours, dict) and isinstance(theirs, dict):
        for key in sorted(set(ours) | set(theirs), key=str):
            if ours.get(key) != theirs.get(key):
                return _config_difference(ours.get(key), theirs.get(key),
                                          f"{path}.{key}" if path else key)
    if (isinstance(ours, list) and isinstance(theirs, list)
            and len(ours) == len(theirs)
            and any(isinstance(v, dict) for v in ours)):
        # A nested model's layers: the first that differs.
        for index, (mine, other) in enumerate(zip(ours, theirs)):
            if mine != other:
                return _config_difference(mine, other,
                                          f"{path or 'config'}[{index}]")
    return f"{path or 'config'} is {theirs!r} instead of {ours!r}"
