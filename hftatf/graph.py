"""Walking the graph of a functional or Sequential model, a stock model and
its array alike: the paths that name the same layer in both."""

import keras

from hftatf.core.compat import inner_layers, is_functional_graph
from hftatf.layers.layer_state import derives_state, saved_state_digest


def config_layers(model):
    """The layers of the graph `model` in the order its config lists
    them."""
    if isinstance(model, keras.Sequential):
        # With the input layer, as `Sequential.get_config` lists them.
        return super(keras.Sequential, model).layers
    return model.operations  # as `Functional.get_config` lists them


def is_graph_model(layer):
    """Whether `layer` is a functional or Sequential model, whose graph
    `hftatf.fuse` rebuilds with fused layers; a subclassed model used as a
    layer runs once per model instead (`hftatf.layers.FusedPerModel`)."""
    return isinstance(layer, keras.Model) and (
        isinstance(layer, keras.Sequential) or is_functional_graph(layer))


def weighted_layers(model):
    """`(path, layer)` for every layer with weights, nested functional and
    Sequential models entered: the same paths name a stock model's layers
    and its array's."""
    return [(path, layer) for path, layer in graph_layers(model)
            if not is_graph_model(layer) and layer.weights]


def graph_layers(model, prefix=""):
    """Yields `(path, layer)` for every layer of the graph `model`, each
    nested functional or Sequential model before the layers inside it
    (paths `outer/inner`)."""
    for layer in model.layers:
        path = prefix + layer.name
        yield path, layer
        if is_graph_model(layer):
            yield from graph_layers(layer, path + "/")


def set_layer_weights(layer, weights):
    """`layer.set_weights(weights)`, then `finalize_derived_state`."""
    layer.set_weights(weights)
    finalize_derived_state(layer)


def finalize_derived_state(layer):
    """Derives again the state that layers inside `layer` compute from
    their weights (an adapted `Normalization` keeps its mean and variance
    as tensors read from its weights), as loading a saved model does:
    `set_weights` and checkpoint reads leave it as it was."""
    for inner in inner_layers(layer):
        if derives_state(inner):
            inner.finalize_state()


def input_structure(model):
    if isinstance(model, keras.Sequential):
        return model.inputs[0]
    return model.input



def check_graph_model(model):
    """Refuses a subclassed model, whose inputs Keras does not record."""
    if not isinstance(model, keras.Sequential) and not is_functional_graph(
            model):
        raise ValueError(
            f"hftatf.fuse needs a functional or Sequential model; model "
            f"'{model.name}' is a subclassed {type(model).__name__}, whose "
            "inputs (shapes and dtypes) Keras does not record. Call it in a "
            "functional model, whose inputs say them: `inputs = "
            "keras.Input(shape, dtype=...)`, then `hftatf.fuse(keras.Model("
            "inputs, model(inputs)), num_models)`; the array runs it once "
            "per model (hftatf.layers.FusedPerModel), from copies made from "
            "its config (the model needs a `call` and a `get_config` for "
            "that). Or rebuild it with the functional API, so that each of "
            f"its layers fuses.{_custom_step_advice(model)}")


# What a Model subclass may override that an array built from the model's
# graph would not run, and where such a step goes instead.
STEP_METHODS = ("call", "train_step", "test_step", "predict_step",
                "compute_loss", "compute_metrics")
CUSTOM_STEP_ADVICE = (
    "Write the custom step in a hftatf.FusedModel subclass and pass it as "
    "`model_class=` (see FusedGAN in hftatf.models.dcgan)")


def overridden_methods(model, base, names=STEP_METHODS):
    """Those of the methods `names` that `model`'s class overrides from
    `base`, as "`name`, `name`" (empty where none)."""
    return ", ".join(f"`{name}`" for name in names
                     if getattr(type(model), name, None)
                     is not getattr(base, name, None))


def _custom_step_advice(model):
    """For a model subclass with its own training step, what becomes of
    it in an array."""
    methods = overridden_methods(model, keras.Model, STEP_METHODS[1:])
    if not methods:
        return ""
    return (f" Either way, its own {methods} would not run in the array. "
            f"{CUSTOM_STEP_ADVICE}.")



# -- comparing architectures ------------------------------------------------


# Config keys that do not change what a trained layer computes.
_IGNORED_KEYS = ("name", "seed")


def architecture(model):
    """A comparable description of `model`: one entry per layer with its
    class, its config (layer names replaced by positions, seeds and
    initializers dropped), its weight shapes and a digest of what Keras
    saves of it as assets (`layer_state.saved_state_digest`)."""
    if not isinstance(model, keras.Model):
        raise TypeError(
            f"hftatf.fuse_models expects keras.Model objects. Received: "
            f"{model!r} of type {type(model).__name__}.")
    # Before its config: a subclassed model may have none.
    check_graph_model(model)
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
                            "config": architecture(layer)}
        described.append({
            "position": i,
            "class": type(layer).__name__,
            "config": normalize(layer_config),
            "weights": [tuple(w.shape)
                        for w in getattr(layer, "weights", ())],
            # What its config leaves out: a vocabulary learned in `adapt`.
            "assets": (None if is_graph_model(layer)
                       else saved_state_digest(layer)),
        })
    if not isinstance(model, keras.Sequential):
        # Which layers are the inputs and outputs, in order: graphs alike
        # but for the order of their inputs compute different functions.
        described.append({
            "position": "of the inputs and outputs", "class": "Model",
            "config": normalize({key: config.get(key) for key in (
                "input_layers", "output_layers")}),
            "weights": [], "assets": None})
    return described


def architecture_difference(models):
    """`(index, difference)` for the first of `models` whose architecture
    differs from `models[0]`'s, the difference in words
    (`first_difference`); None where they all have one architecture."""
    reference = architecture(models[0])
    for index, model in enumerate(models[1:], start=1):
        difference = first_difference(reference, architecture(model))
        if difference:
            return index, difference
    return None


def first_difference(reference, other):
    """The first way `other` differs from `reference` (as `architecture`
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
        if ours["assets"] != theirs["assets"]:
            # One such layer serves all models of an array.
            return (f"{where} ({ours['class']}) differs in what it keeps "
                    "beside its config and weights (a vocabulary learned "
                    "in `adapt`)")
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

