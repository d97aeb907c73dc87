"""Walking the graph of a functional or Sequential model, a stock model and
its array alike: the paths that name the same layer in both."""

import keras

from hftatf.layers.per_model import derives_state


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
        isinstance(layer, keras.Sequential) or hasattr(layer,
                                                       "_nodes_by_depth"))


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
    for inner in layer._flatten_layers():
        if derives_state(inner):
            inner.finalize_state()
