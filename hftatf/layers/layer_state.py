"""What a stock layer holds besides its weights: state derived from them,
state outside Keras variables (a lookup's vocabulary, which Keras saves
as assets), the `trainable` flags of the layers inside it and of its
weights, and LoRA enabled inside it (which its config does not
carry)."""

import contextlib
import hashlib
import os
import tempfile

import keras
import numpy as np

from hftatf.core import compat
from hftatf.layers.backends import holds_outside_state
from hftatf.layers.lora import lora_settings, match_lora


def derives_state(layer):
    """Whether `layer` itself keeps state derived from its weights
    (`finalize_state`: an adapted `Normalization`'s mean and variance),
    which setting its weights leaves as it was."""
    return bool(layer.weights) and hasattr(layer, "finalize_state")


# `finalize_state` methods that derive a layer's state from its weights by
# ops alone: called where the weights read other values (a stateless
# scope), they derive the state of those values.
_OPS_DERIVED_STATE = (keras.layers.Normalization.finalize_state,)


def derives_state_by_ops(layer):
    """Whether `layer`'s derived state (`derives_state`) is derived by ops
    alone, so that a call on other values of its weights can derive it
    from them (`state_derived_in_calls`)."""
    return type(layer).finalize_state in _OPS_DERIVED_STATE


@contextlib.contextmanager
def state_derived_in_calls(layers):
    """A block in which the derived state of `layers` (each deriving it by
    ops) may be derived again from other values of their weights, by
    calling `finalize_state` where the weights read those values; after
    the block each layer has its own state back."""
    kept = [dict(vars(layer)) for layer in layers]
    try:
        yield
    finally:
        for layer, attributes in zip(layers, kept):
            vars(layer).update(attributes)


def outside_state(layer):
    """A TensorFlow variable or resource that `layer` (or a layer inside
    it) holds outside Keras variables, or None."""
    for inner in compat.inner_layers(layer, include_self=True):
        for name, value in vars(inner).items():
            if holds_outside_state(value):
                return f"'{inner.name}.{name}' ({type(value).__name__})"
    return None


def is_stock_convolution(layer):
    """Whether `layer` is a stock Keras convolution of any family."""
    return isinstance(layer, compat.STOCK_CONVOLUTIONS)


def set_trainable(layer, value):
    """Sets `layer.trainable` and hands it down to the layers inside, even
    where the flag is already `value` (where `layer.trainable = value`
    does nothing)."""
    keras.layers.Layer.trainable.fset(layer, value)


def trainable_flags(layer):
    """The `trainable` flags of `layer` and of the layers inside it, outer
    layers first: what its config does not carry (only its own)."""
    return [inner.trainable for inner in compat.inner_layers(layer)]


def set_trainable_flags(layer, flags, strict=True):
    """Gives the built `layer` the `trainable_flags` of a copy of it (or of
    a layer of its architecture). Where their numbers of inner layers
    differ (a fused layer's own against a stock layer's), raises with
    `strict`, else sets the layer's own flag, `flags[0]`, only."""
    inner = compat.inner_layers(layer)
    if len(inner) != len(flags) and not strict:
        set_trainable(layer, flags[0])
        return
    if len(inner) != len(flags):
        raise ValueError(
            f"Layer '{layer.name}' ({type(layer).__name__}) holds "
            f"{len(inner)} layers once built, where the layer it was made "
            f"from held {len(flags)}, so their `trainable` flags cannot be "
            "carried over. Fuse the stock model once it is built.")
    # Outer layers come first, so that each flag set on a layer (and
    # handed down to the layers inside it) is then corrected by theirs.
    for inner_layer, flag in zip(inner, flags):
        set_trainable(inner_layer, flag)


def inner_trainable_flags(layer):
    """The `trainable` flags of the layers inside `layer` (outer layers
    first), or None where all are the layer's own flag (which its config
    holds)."""
    flags = trainable_flags(layer)[1:]
    return None if all(f == layer.trainable for f in flags) else flags


def weight_state(layer):
    """What the config of `layer` leaves out about its weights: LoRA
    enabled on layers inside it (`lora.lora_settings`: an attention
    layer's projections, or LoRA enabled after the layer was made) and
    the `trainable` flag of each weight (a LoRA layer's frozen weight, a
    frozen projection inside a trainable attention layer). None where
    there is no LoRA and every weight's flag is its layer's own."""
    settings = lora_settings(layer)
    flags = [weight.trainable for weight in layer.weights]
    if not settings and all(flag == layer.trainable for flag in flags):
        return None
    return {"lora": {name: list(setting)
                     for name, setting in settings.items()},
            "trainable": flags}


def set_weight_state(layer, state):
    """Gives the built `layer` the `weight_state` of a layer of its
    architecture (stock or fused): LoRA on the layers inside it that had
    it there, then each weight's `trainable` flag (where the two hold as
    many weights)."""
    match_lora(state["lora"], layer)
    flags = state["trainable"]
    if len(flags) == len(layer.weights):
        for weight, flag in zip(layer.weights, flags):
            weight.trainable = flag


def keeps_assets(layer):
    """Whether `layer` keeps state that its config leaves out and Keras
    saves as assets beside its weights (`save_assets`): the vocabulary a
    `StringLookup`, `IntegerLookup` or `TextVectorization` learned in
    `adapt`."""
    return hasattr(layer, "save_assets") and hasattr(layer, "load_assets")


def saved_state(layer):
    """What Keras saves of the `keeps_assets` layer beside its config:
    `(variables, files)`, the entries of its `save_own_variables` (a
    TF-IDF lookup's weights) and the files of its `save_assets` by name
    (its vocabulary); None where it holds no such state yet (a TF-IDF
    lookup before `adapt` has no weights to save)."""
    variables = {}
    try:
        layer.save_own_variables(variables)
    except AttributeError:
        # Keras's TF-IDF lookup reads weights that `adapt` makes.
        return None
    files = {}
    with tempfile.TemporaryDirectory() as directory:
        layer.save_assets(directory)
        for root, _, names in os.walk(directory):
            for name in names:
                path = os.path.join(root, name)
                with open(path, "rb") as file:
                    files[os.path.relpath(path, directory)] = file.read()
    return variables, files


def load_saved_state(layer, state):
    """Gives `layer` the `saved_state` of a layer of its class and config,
    as loading a saved model does: its variables, then its assets. Where
    it holds that state already (a vocabulary in its config, or none
    learned yet, which a lookup cannot load), it is left as it is."""
    if state is None or _digest(saved_state(layer)) == _digest(state):
        return
    variables, files = state
    if variables:
        layer.load_own_variables(dict(variables))
    with tempfile.TemporaryDirectory() as directory:
        for name, content in files.items():
            path = os.path.join(directory, name)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as file:
                file.write(content)
        layer.load_assets(directory)


def saved_state_digest(layer):
    """A digest of `layer`'s `saved_state` (None for a layer that does not
    `keep_assets`): equal for layers that hold the same vocabulary."""
    return _digest(saved_state(layer)) if keeps_assets(layer) else None


def _digest(state):
    if state is None:
        return "none yet"
    variables, files = state
    digest = hashlib.sha256()
    for name in sorted(files):
        digest.update(name.encode() + b"\0" + files[name])
    for key in sorted(variables):
        digest.update(str(key).encode() + b"\0" + np.asarray(
            variables[key]).tobytes())
    return digest.hexdigest()
