"""Rewriting a stock model's graph with fused layers: the walk behind
`hftatf.fuse`, and the checks of what it can rewrite."""

import collections

import keras
import numpy as np

from hftatf.core.compat import (
    Functional,
    inbound_nodes,
    keras_history,
    nodes_by_depth,
    run_through_graph,
    set_nodes_by_depth,
)
from hftatf.graph import (
    CUSTOM_STEP_ADVICE,
    STEP_METHODS,
    graph_layers,
    input_structure,
    is_graph_model,
    overridden_methods,
    weighted_layers,
)
from hftatf.layers import resolve
from hftatf.layers.fold import copy_layer, has_random_state
from hftatf.layers.model_axis import (
    BroadcastToModels,
    FoldModelAxis,
    SwapModelAxis,
    UnfoldModelAxis,
)
from hftatf.layers.sample_mixing import PER_SAMPLE_ADVICE, sample_mixing


def check_no_custom_steps(model, names=STEP_METHODS):
    """Refuses a functional or Sequential model whose class overrides any
    of the methods `names`: the array is built from the model's graph and
    would silently train without them."""
    base = keras.Sequential if isinstance(model, keras.Sequential) else (
        Functional)
    methods = overridden_methods(model, base, names)
    if methods:
        raise ValueError(
            f"Model '{model.name}' is a {type(model).__name__} with its own "
            f"{methods}. hftatf.fuse builds the array from the model's graph "
            f"and would train it without them. {CUSTOM_STEP_ADVICE}, or fuse "
            "the plain functional model.")



def check_no_weights_shared_into_per_model_layers(model):
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
        if len(layers) > 1 and any(resolve.runs_per_model(layer)
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



class _Graphs:
    """What the walkers of a model and of the models nested in it share:
    the fused form of each stock layer (one, where the layer is called in
    several of those graphs) and the layers called in several."""

    def __init__(self):
        self.fused = {}  # id(stock layer) -> (stock layer, fused layer)
        self.several = None  # ids of layers called in several graphs


class Walker:
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

    def __init__(self, num_models, models_first=False, check_model=None,
                 graphs=None):
        self.num_models = num_models
        # What this walker shares with the walkers of the models nested in
        # its model (and of the model around it).
        self._graphs = _Graphs() if graphs is None else graphs
        self.models_first = models_first
        # Refuses a nested model that cannot be fused (`hftatf.fuse`'s
        # check of a whole model).
        self.check_model = check_model
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
        # id(node) -> (node, rank): the nodes of the rebuilt graph in the
        # order they were made, which follows the stock model's calls.
        self._made = {}

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
                and resolve.takes_models_first(operation))

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
        for nodes in nodes_by_depth(model).values():
            for node in nodes:
                takes = self._takes_models_first(node.operation)
                for tensor in node.input_tensors:
                    producer = keras_history(tensor).operation
                    feeds[id(producer)] = feeds.get(id(producer),
                                                    True) and takes
        for tensor in keras.tree.flatten(model.outputs):
            feeds[id(keras_history(tensor).operation)] = False
        # From the outputs to the inputs: a node's readers are at smaller
        # depths, so whether they want the models first is known.
        for depth in sorted(nodes_by_depth(model)):
            for node in nodes_by_depth(model)[depth]:
                wants = self._wants_models_first(node.operation)
                for tensor in node.input_tensors:
                    producer = id(keras_history(tensor).operation)
                    leads[producer] = leads.get(producer, False) or wants

    def _wants_models_first(self, layer):
        """Whether `layer` computes with the models first even where its
        inputs do not have them first (see the class docstring)."""
        return (self._takes_models_first(layer)
                and self._feeds_models_first.get(id(layer), False)
                and (resolve.prefers_models_first(layer)
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
                     for nodes in nodes_by_depth(model).values()
                     for node in nodes]
        self._calls = collections.Counter(calls)
        if self._graphs.several is None:
            counts = collections.Counter(
                id(layer) for _, layer in graph_layers(model))
            self._graphs.several = {key for key, count in counts.items()
                                    if count > 1}
        if self.models_first:
            self._find_consumers(model)
        if isinstance(model, keras.Sequential):
            outputs = inputs[0]
            for layer in model.layers:
                outputs = self(layer, outputs)
        else:
            outputs = run_through_graph(model, inputs, call_fn=self)
        return keras.tree.map_structure(self.per_model, outputs)

    def _record(self, outputs):
        """Ranks the nodes that made `outputs` and are not ranked yet,
        each after the nodes it reads."""
        stack = []
        for tensor in keras.tree.flatten(outputs):
            if isinstance(tensor, keras.KerasTensor):
                operation, index, _ = keras_history(tensor)
                stack.append((inbound_nodes(operation)[index], False))
        while stack:
            node, parents_ranked = stack.pop()
            if id(node) in self._made:
                continue
            if parents_ranked:
                self._made[id(node)] = (node, len(self._made))
                continue
            stack.append((node, True))
            stack.extend((parent, False) for parent in reversed(
                node.parent_nodes) if id(parent) not in self._made)

    def run_in_stock_order(self, model):
        """Has `model` (built on this walker's outputs) run its layers in
        the order the stock model calls them where that matters: a layer
        called more than once (a shared `BatchNormalization`, whose calls
        each move its statistics) runs its calls in the stock order. Keras
        runs a graph by depth, which the model-axis layers between the
        fused layers change."""
        # An input no layer reads is no output's ancestor: ranked first.
        self._record(model.inputs)
        self._record(model.outputs)  # with the nodes the model made itself
        by_depth = nodes_by_depth(model)
        ranks = [self._made[id(node)]
                 for depth in sorted(by_depth, reverse=True)
                 for node in by_depth[depth]]
        last = {}
        in_order = True
        for node, rank in ranks:
            if rank < last.get(id(node.operation), -1):
                in_order = False
            last[id(node.operation)] = rank
        if not in_order:
            ranks.sort(key=lambda pair: pair[1])
            set_nodes_by_depth(model, {len(ranks) - 1 - i: [node] for i, (
                node, _) in enumerate(ranks)})

    def __call__(self, layer, *args, **kwargs):
        outputs = self._call(layer, *args, **kwargs)
        self._record(outputs)
        return outputs

    def _call(self, layer, *args, **kwargs):
        if is_graph_model(layer):
            return self._call_nested(layer, *args, **kwargs)
        if not isinstance(layer, keras.layers.Layer):
            return self._call_operation(layer, *args, **kwargs)
        tensors = [t for t in keras.tree.flatten((args, kwargs))
                   if isinstance(t, keras.KerasTensor)]
        if (tensors and all(self._is_shared(t) for t in tensors)
                and resolve.is_foldable(layer)
                and not has_random_state(layer)
                # Each model is penalised on its own (FusedFold).
                and layer.activity_regularizer is None):
            # Deterministic, per sample, weightless: once for all models.
            if id(layer) not in self._stock_copies:
                self._stock_copies[id(layer)] = (layer, copy_layer(layer))
            outputs = self._stock_copies[id(layer)][1](*args, **kwargs)
            self._mark(outputs, True)
            return outputs
        fused_elsewhere = self._graphs.fused.get(id(layer))
        if id(layer) not in self._fused and fused_elsewhere is not None:
            # Called in another model of the graph too (a nested model, or
            # the one around it): one fused layer for both, whose weights
            # they share, as the stock layer's.
            self._fused[id(layer)] = fused_elsewhere
            self._layouts[id(layer)] = getattr(fused_elsewhere[1],
                                               "models_first", False)
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
            self._fused[id(layer)] = (layer, resolve.fuse_layer(
                layer, self.num_models, shared_input=shared,
                models_first=first))
            self._graphs.fused[id(layer)] = self._fused[id(layer)]
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
                and id(layer) not in self._graphs.several
                and resolve.takes_shared_input(layer))

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
            if self.check_model is not None:
                self.check_model(model)
            check_no_custom_steps(model, ("call",))
            walker = Walker(self.num_models, self.models_first,
                            self.check_model, self._graphs)
            inputs = [walker.input_like(x, shared=False)
                      for x in keras.tree.flatten(input_structure(model))]
            nested = keras.Model(
                keras.tree.pack_sequence_as(input_structure(model), inputs),
                walker.run(model, inputs), name=model.name)
            walker.run_in_stock_order(nested)
            if not model.trainable:
                nested.trainable = False
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


