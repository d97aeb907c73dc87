"""The live Python objects a model's configs name.

hftatf rebuilds layers from their configs: a layer's fused form from the
stock layer's config, a layer run once per model from copies of it, and
the stock models of an array (`unfuse`, export, callbacks) from the
stock model's config. A config names a custom activation function, a
`Lambda`'s function, or an initializer, regularizer, constraint or layer
class of a script's own; Keras finds such a name only where it is
registered (`keras.saving.register_keras_serializable`) or passed as a
custom object. Within a process the objects themselves are at hand, in the
layers that hold them: `scope(layers)` lets every config round trip in
hftatf find them, as it finds Keras's own.
"""

import types

import keras

from hftatf.core import compat

__all__ = ["all_layers", "live_lambdas", "live_objects", "scope"]

# How deep `live_objects` looks into the objects a layer holds (a layer's
# initializer holding another initializer is two levels).
_DEPTH = 4


def _is_custom(obj):
    """Whether `obj` (a function or class) is neither Keras's nor
    hftatf's."""
    module = (getattr(obj, "__module__", None) or "").split(".")[0]
    return module not in ("keras", "hftatf")


def _is_method(function):
    """Whether `function` is a class's (`Layer.build`, which Keras keeps
    wrapped on each layer), not a module's or a function's own."""
    scopes = function.__qualname__.split(".")
    return len(scopes) > 1 and scopes[-2] != "<locals>"


def _names_keras_object(name):
    """Whether Keras resolves the plain name `name` itself (`"relu"`): a
    function of that name must not stand in for it."""
    try:
        return keras.activations.get(name) is not None
    except (ValueError, TypeError):
        return False


def _is_config_object(value):
    """Whether `value` is an object Keras serializes by class and config
    (an initializer, regularizer, constraint, layer, ...)."""
    return (callable(getattr(value, "get_config", None))
            and not isinstance(value, type)
            and not keras.ops.is_tensor(value)
            and not isinstance(value, keras.Variable))


def live_objects(layers):
    """`{name: object}` of the functions and classes of a script's own that
    `layers` (and the layers inside them) hold, by the names their configs
    give them: a function by its `__name__` (Python lambdas, serialized by
    their code, excluded), a class by its `__name__`. A name two objects
    share, or a function named like a Keras activation, is left out: Keras
    then says it cannot find it rather than rebuild the wrong one."""
    layers = list(all_layers(layers))
    found = {}
    clashes = set()
    # The layers are visited at the top level, each once.
    seen = {id(layer) for layer in layers}

    def add(name, obj):
        if found.setdefault(name, obj) is not obj:
            clashes.add(name)

    def visit(value, depth):
        if id(value) in seen or depth > _DEPTH:
            return
        seen.add(id(value))
        if isinstance(value, types.FunctionType):
            if (value.__name__ != "<lambda>" and _is_custom(value)
                    and not _is_method(value)
                    and not _names_keras_object(value.__name__)):
                add(value.__name__, value)
        elif isinstance(value, (list, tuple)):
            for item in value:
                visit(item, depth + 1)
        elif isinstance(value, dict):
            for item in value.values():
                visit(item, depth + 1)
        elif _is_config_object(value):
            visit_attributes(value, depth)

    def visit_attributes(value, depth):
        if _is_custom(type(value)):
            add(type(value).__name__, type(value))
        for item in vars(value).values():
            visit(item, depth + 1)

    for layer in layers:
        visit_attributes(layer, 0)
    return {name: obj for name, obj in found.items() if name not in clashes}


def scope(layers):
    """A `keras.saving.CustomObjectScope` of `live_objects(layers)`."""
    return keras.saving.CustomObjectScope(live_objects(layers))


def all_layers(layers):
    """`layers` and every layer inside them, wrapped layers included."""
    seen = set()
    stack = list(layers)
    while stack:
        layer = stack.pop()
        if id(layer) in seen:
            continue
        seen.add(id(layer))
        yield layer
        wrapped = getattr(layer, "layer", None)
        if isinstance(wrapped, keras.layers.Layer):
            stack.append(wrapped)
        stack.extend(compat.inner_layers(layer, include_self=False))


def live_lambdas(config, layers):
    """Rewrites `config` (a serialized model, in place) so that each Python
    lambda of a `Lambda` layer among `layers` is named by a key instead of
    its code, and returns `{key: lambda}`, the custom objects that rebuild
    them. Rebuilt from its code, a lambda loses its module's globals
    (`lambda x: keras.ops.sin(x)` then fails to find `keras`); the live
    lambda keeps them."""
    lambdas = {layer.name: layer for layer in all_layers(layers)
               if isinstance(layer, keras.layers.Lambda)}
    found = {}

    def visit(node):
        if isinstance(node, list):
            for item in node:
                visit(item)
            return
        if not isinstance(node, dict):
            return
        inner = node.get("config")
        layer = (lambdas.get(inner.get("name"))
                 if node.get("class_name") == "Lambda"
                 and isinstance(inner, dict) else None)
        if layer is not None:
            output_shape = compat.lambda_output_shape(layer)
            for key, function in (("function", layer.function),
                                  ("output_shape", output_shape)):
                entry = inner.get(key)
                if (isinstance(entry, dict) and callable(function)
                        and entry.get("class_name") == "__lambda__"):
                    name = f"hftatf>{layer.name}>{key}"
                    inner[key] = {"module": None, "class_name": "function",
                                  "config": name, "registered_name": name}
                    found[name] = function
        for item in node.values():
            visit(item)

    visit(config)
    return found
