"""One TensorFlow SavedModel that serves every model of an array.

`export_serving` writes it, from any Keras backend where TensorFlow is
installed (Keras converts a JAX array with `jax2tf`); `move_into_place`
is how it, and `hftatf.export_models`, put a complete directory where an
earlier one was.
"""

import pathlib
import shutil
import tempfile

import keras

from hftatf.core.compat import inner_layers
from hftatf.core.optional import tensorflow
from hftatf.fuse import check_array, fuse
from hftatf.graph import input_structure, weighted_layers
from hftatf.layers.layer_state import (
    derives_state,
    derives_state_by_ops,
    state_derived_in_calls,
)

# What a TensorFlow SavedModel directory holds: export_serving replaces a
# directory of these entries only.
SAVED_MODEL_ENTRIES = frozenset(
    {"saved_model.pb", "saved_model.pbtxt", "variables", "assets",
     "assets.extra", "fingerprint.pb", "keras_metadata.pb"})


# What TensorFlow is imported for here.
SERVING_FEATURE = "hftatf.export_serving (a TensorFlow SavedModel)"


def move_into_place(source, target, staging):
    """Renames the complete directory `source` to `target`, replacing an
    earlier one (moved into `staging`, deleted with it)."""
    if target.exists():
        target.rename(staging / f".replaced-{target.name}")
    source.rename(target)
    return target


def export_serving(array, directory):
    """Writes `array` as one TensorFlow SavedModel that serves its B models.

    The SavedModel loads with `tf.saved_model.load` (no hftatf or Keras
    needed) and follows TensorFlow Serving's conventions. It holds the
    array's `[B, ...]` variables once, and these signatures (each also a
    callable attribute of the loaded object):
      * `shared`: the stock model's inputs, `[batch, ...]`, shared by all
        models -> outputs `[batch, B, ...]`;
      * `per_model`: one batch per model, `[batch, B, ...]` ->
        `[batch, B, ...]`;
      * `model_{b}` for each `b`: the stock model's inputs `[batch, ...]`
        -> model `b`'s outputs `[batch, ...]`, computed by a plain graph of
        the stock architecture on model `b`'s slice of the variables (the
        other models are not computed);
      * `serving_default`: the array's own input layout (`shared` or
        `per_model`; for an array that shares some inputs and not others,
        also the endpoint `serve`).
    Signature inputs are named after the stock model's inputs; outputs are
    named as in Keras' `model.export` (`output_0`, ...).

    For an array not made by `hftatf.fuse` (built from `hftatf.layers`
    directly) there is no stock architecture: `model_{b}` then runs the
    fused graph on the shared input and slices model `b`'s outputs, and
    `per_model` is left out when the array shares its inputs. So it does
    for a stock model with a layer that derives state from its weights
    other than an adapted `Normalization` (which `model_{b}` derives from
    model `b`'s slice).

    Like `export_models`, it writes into a temporary directory renamed
    into place when complete, replacing an earlier SavedModel there. It
    never replaces anything else: a `directory` that is a file, or that
    holds entries a SavedModel does not have, is refused before anything
    is written.

    Args:
        array: a `FusedModel`.
        directory: where to write the SavedModel.

    Returns:
        `directory` as a `pathlib.Path`.

    Raises:
        ImportError: where TensorFlow is not installed.
    """
    check_array(array, "hftatf.export_serving",
                "Fuse plain models first with hftatf.fuse_models.")
    tensorflow(SERVING_FEATURE)
    directory = pathlib.Path(directory)
    _check_replaceable(directory)
    stock = None if array.source_config is None else array.stock_model()
    num_models = array.num_models
    archive = keras.export.ExportArchive()
    archive.track(array)
    endpoints = {}
    layout = set(array.shared_inputs)
    if len(layout) > 1:
        endpoints["serve"] = (
            lambda inputs: array(inputs, training=False),
            _input_specs(array, shared=None))
    for shared, name in ((True, "shared"), (False, "per_model")):
        call = _layout_call(array, stock, shared)
        if call is not None:
            endpoints[name] = (call, _input_specs(array, shared))
    if layout == {False}:
        # The array's own layout is the default endpoint.
        endpoints = {"per_model": endpoints.pop("per_model"), **endpoints}
    for b in range(num_models):
        endpoints[f"model_{b}"] = (
            _model_call(array, stock, b),
            _input_specs(array, shared=True))
    for name, (call, specs) in endpoints.items():
        archive.add_endpoint(name, call, input_signature=[specs])
    directory.parent.mkdir(parents=True, exist_ok=True)
    # Written aside and renamed, as the models of export_models are.
    staging = pathlib.Path(tempfile.mkdtemp(
        prefix=f".{directory.name}-", dir=directory.parent))
    try:
        archive.write_out(str(staging / directory.name), verbose=False)
        move_into_place(staging / directory.name, directory, staging)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return directory


def _check_replaceable(directory):
    """Refuses a `directory` that holds anything but an earlier SavedModel:
    export_serving replaces what is there, and must never replace a user's
    own files."""
    if not directory.exists():
        return
    if not directory.is_dir():
        raise ValueError(
            f"hftatf.export_serving writes a SavedModel directory, but "
            f"{str(directory)!r} is a file. Pass the path of a new or empty "
            "directory, or of an earlier SavedModel to replace.")
    foreign = sorted(entry.name for entry in directory.iterdir()
                     if entry.name not in SAVED_MODEL_ENTRIES)
    if foreign:
        raise ValueError(
            f"hftatf.export_serving replaces the directory it writes, and "
            f"{str(directory)!r} holds files that are not part of a "
            f"SavedModel: {foreign}. Expected a new or empty directory, or "
            "an earlier SavedModel (only "
            f"{sorted(SAVED_MODEL_ENTRIES)}). Pass another path, or move "
            "those files away first.")


def _input_specs(array, shared):
    """The input signature (as the model's input structure): `[batch, ...]`
    if `shared`, `[batch, B, ...]` if not, the array's own layout if None."""
    structure = input_structure(array)
    flat = keras.tree.flatten(structure)
    tf = tensorflow(SERVING_FEATURE)
    specs = []
    for tensor, own in zip(flat, array.shared_inputs):
        shape = list(tensor.shape)
        if shared is not None and shared != own:
            if shared:
                del shape[1]
            else:
                shape.insert(1, array.num_models)
        shape[0] = None
        specs.append(tf.TensorSpec(shape, tensor.dtype, name=tensor.name))
    return keras.tree.pack_sequence_as(structure, specs)


def _layout_call(array, stock, shared):
    """A function computing the array on inputs that are all shared
    (`shared=True`) or all per model; None where that cannot be done."""
    if all(own == shared for own in array.shared_inputs):
        return lambda inputs: array(inputs, training=False)
    if stock is not None:
        # The same stock graph fused for this layout, run on the array's
        # variables: shared preprocessing still runs once.
        twin = fuse(stock, array.num_models, shared_inputs=shared)
        return _bound_call(twin, _variable_map(array, twin, index=None))
    if not shared:
        return None
    num_models = array.num_models

    def broadcast(inputs):
        flat = [x if own else keras.ops.repeat(
            keras.ops.expand_dims(x, 1), num_models, axis=1)
            for x, own in zip(keras.tree.flatten(inputs),
                              array.shared_inputs)]
        return array(keras.tree.pack_sequence_as(inputs, flat),
                     training=False)

    return broadcast


def _model_call(array, stock, index):
    """A function computing model `index` alone on shared inputs."""
    if stock is not None and _derives_state_from_values(stock):
        # One stock model serves every index.
        return _bound_call(stock, _variable_map(array, stock, index))
    shared_call = _layout_call(array, None, shared=True)
    return lambda inputs: keras.tree.map_structure(
        lambda y: y[:, index], shared_call(inputs))


def _derives_state_from_values(model):
    """Whether every layer of `model` that computes with state derived from
    its weights derives it by ops (`derives_state_by_ops`), so that a
    stateless call derives it from the values it is given (`_bound_call`).
    Models with other such layers are served from the array's outputs."""
    return all(derives_state_by_ops(layer)
               for layer in inner_layers(model) if derives_state(layer))


def _variable_map(array, model, index):
    """`id(variable of model)` -> the array variable holding its value
    (slice `index` of it, or all of it for `index=None`)."""
    arrays = dict(weighted_layers(array))
    mapping = {}
    for path, layer in weighted_layers(model):
        for ours, theirs in zip(layer.weights, arrays[path].weights):
            mapping[id(ours)] = (theirs, index)
    return mapping


def _bound_call(model, mapping):
    """Runs `model` with the variable values given by `mapping`, reading
    the array's variables (so the SavedModel holds them once)."""
    # State without weights (seed generators) is fixed at inference: read
    # now, while eager, and kept as constants.
    fixed = {id(v): keras.ops.convert_to_numpy(v)
             for v in model.variables if id(v) not in mapping}
    derived = [layer for layer in inner_layers(model)
               if derives_state(layer)]

    def value(variable):
        if id(variable) in fixed:
            return keras.ops.convert_to_tensor(fixed[id(variable)])
        source, index = mapping[id(variable)]
        return source.value if index is None else source.value[index]

    def call(inputs):
        with state_derived_in_calls(derived):
            for layer in derived:
                # The state derived from the values given, not from the
                # model's own weights (`_derives_state_from_values`).
                with keras.StatelessScope(state_mapping=[
                        (w, value(w)) for w in layer.weights]):
                    layer.finalize_state()
            outputs, _ = model.stateless_call(
                [value(v) for v in model.trainable_variables],
                [value(v) for v in model.non_trainable_variables],
                inputs, training=False)
        return outputs

    return call
