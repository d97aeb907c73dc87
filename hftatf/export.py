"""Export and import: between an array and files that need no hftatf.

* `export_models` writes each model of an array as an ordinary Keras model
  (a `.keras` file, a TensorFlow SavedModel, a TF checkpoint) with its
  hyper-parameters and metrics; `load_models` and `from_exported` read such
  an export back as B plain models or as the array again.
* `export_serving` writes the whole array as one SavedModel that serves all
  B models at once, and each of them alone.
* `load_exported_model` turns a path (a `.keras` file, or a model directory
  written by `export_models`) into a plain Keras model with its weights;
  `hftatf.fuse_models` accepts such paths.
"""

import functools
import importlib
import json
import os
import pathlib
import platform
import re
import shutil
import tempfile
import zipfile

import keras
import numpy as np
import tensorflow as tf

import hftatf
from hftatf.core import hooks
from hftatf.core.compat import flatten_layers
from hftatf.core.logs import split_logs
from hftatf.fuse import (
    check_array,
    compile_stock_model,
    compiles_stock_models,
    fuse,
    fuse_models,
)
from hftatf.graph import (
    finalize_derived_state,
    input_structure,
    weighted_layers,
)
from hftatf.layers.per_model import (
    derives_state,
    derives_state_by_ops,
    state_derived_in_calls,
)

# How to turn plain models into what export takes.
_FUSE_ADVICE = "Fuse plain models first with hftatf.fuse_models."

# What `export_models` can write for each model.
FORMATS = ("keras", "saved_model", "checkpoint")

# File names inside a model directory `model_{b}/`.
KERAS_FILE = "model.keras"
SAVED_MODEL_DIR = "saved_model"
CHECKPOINT_PREFIX = "checkpoint/model"
CONFIG_FILE = "config.json"
METADATA_FILE = "metadata.json"
INDEX_FILE = "index.json"
# What a TensorFlow SavedModel directory holds: export_serving replaces a
# directory of these entries only.
SAVED_MODEL_ENTRIES = frozenset(
    {"saved_model.pb", "saved_model.pbtxt", "variables", "assets",
     "assets.extra", "fingerprint.pb", "keras_metadata.pb"})


def model_hyperparameters(optimizer, index):
    """Model `index`'s optimizer hyper-parameters as a JSON-ready dict
    (those of the optimizer a `LossScaleOptimizer` wraps, with
    `loss_scale: true`)."""
    if optimizer is None:
        return {}
    inner = getattr(optimizer, "inner_optimizer", None)
    if inner is not None:
        return {**model_hyperparameters(inner, index), "loss_scale": True}
    values = {"optimizer": type(optimizer).__name__}
    names = getattr(optimizer, "hyperparameter_names", ())
    for name in names:
        per_model = optimizer.get_hyperparameter(name)
        if per_model is not None:
            values[name] = float(per_model[index])
    config = optimizer.get_config()
    for key, value in config.items():
        if key not in names and key not in ("name", "num_models") and (
                isinstance(value, (bool, int, float, str)) or value is None):
            values[key] = value
    return values


def model_metrics(history, index, num_models):
    """Model `index`'s final logged values (`loss`, `val_accuracy`, ...):
    the entries logged for each of the `num_models` models
    (`callbacks.split_logs`), so that the mean of a metric whose own name
    ends in `_1` is not read as model 1's."""
    if history is None:
        return {}
    logs = getattr(history, "history", history) or {}
    per_model, _ = split_logs(
        {key: values for key, values in logs.items() if len(values)},
        num_models)
    # A quantity without a single value (the validation columns of a run
    # that did not validate, as a CSV history holds them) is left out; a
    # model's final NaN (it diverged) is kept.
    return {name: float(histories[index][-1])
            for name, histories in per_model.items()
            if not all(np.isnan(float(v)) for h in histories for v in h)}


def model_diverged(array, index):
    """Whether model `index` diverged, from the array's `diverged_models`
    (one bool per model, kept by the trainer); None when not tracked."""
    diverged = getattr(array, "diverged_models", None)
    if diverged is None:
        return None
    return bool(np.asarray(keras.ops.convert_to_numpy(diverged))[index])


def library_versions():
    """The versions an export was written with."""
    return {"hftatf": hftatf.__version__,
            "keras": keras.__version__,
            "tensorflow": tf.__version__,
            "numpy": np.__version__,
            "python": platform.python_version()}


@hooks.provides("export_models")
def export_models(array, directory, history=None, format=FORMATS):
    """Writes every model of `array` as a plain Keras model.

    For model `b`, `directory/model_{b}/` receives:
      * `model.keras` (format `"keras"`): the model in the Keras format;
        `keras.models.load_model` loads it without hftatf. Where the array
        is compiled with a loss, the model is saved compiled as it trains
        in the array, with its own stock optimizer and that optimizer's
        state (`hftatf.fuse.unfuse`), so the loaded model trains on as it
        would have in the array;
      * `saved_model/` (format `"saved_model"`): a TensorFlow SavedModel
        for serving, with the stock model's input signature under
        `serving_default` (`tf.saved_model.load(path).serve(x)` runs it);
      * `checkpoint/model.*` (format `"checkpoint"`): a TF checkpoint of
        the plain model's variables, restored into a stock model `m` of the
        same architecture by `tf.train.Checkpoint(model=m).read(path)`;
      * `config.json`: the stock architecture
        (`keras.saving.deserialize_keras_object` rebuilds it);
      * `metadata.json`: its index, optimizer hyper-parameters, final
        metrics (None for a non-finite value), whether it diverged (None
        if the array does not track it) and the library versions.
    `directory/index.json` lists every model's metadata and directory, so
    the best model can be picked without loading them all.

    Writes are atomic: the models are written into a hidden temporary
    directory and renamed into place once all are complete, and
    `index.json` is written last. A failed export leaves no `model_{b}`
    directory that is incomplete and no `index.json` (an earlier export in
    the same directory stays whole); a directory without `index.json` is
    not a complete export. A killed process may leave its hidden
    `.export-*` directory behind, never a `model_{b}` one.

    Arrays whose variables are distributed (built under a
    `tf.distribute` strategy) export their values, as `get_weights` reads
    them (for statistics that replicas update apart, like stock
    BatchNormalization's moving statistics, the first replica's).

    Args:
        array: a `FusedModel` made by `hftatf.fuse` or `hftatf.fuse_models`.
        directory: where to write; created if missing. Model directories
            of an earlier export there are replaced (`index.json` lists
            this export's models only).
        history: a `keras.callbacks.History` (what `fit` returns) or its
            `history` dict; defaults to the array's last `fit`.
        format: what to write for each model: one of `"keras"`,
            `"saved_model"`, `"checkpoint"` or a sequence of them; all by
            default. `load_models` needs `"keras"` or `"checkpoint"`.

    Returns:
        The list of the B model directories.
    """
    check_array(array, "hftatf.export_models", _FUSE_ADVICE)
    formats = _check_formats(format)
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if history is None:
        history = getattr(array, "history", None)
    optimizer = getattr(array, "optimizer", None)
    compiles = "keras" in formats and compiles_stock_models(array)
    staging = pathlib.Path(tempfile.mkdtemp(prefix=".export-", dir=directory))
    try:
        index = []
        for b, model in enumerate(array.unfuse(compile=False)):
            path = staging / f"model_{b}"
            files = _write_model(
                model, path, formats,
                compile=functools.partial(compile_stock_model, array, b)
                if compiles else None)
            metadata = _finite({
                "index": b,
                "num_models": array.num_models,
                "array": {"name": array.name,
                          "shared_inputs": list(array.shared_inputs)},
                "hyperparameters": model_hyperparameters(optimizer, b),
                "metrics": model_metrics(history, b, array.num_models),
                "diverged": model_diverged(array, b),
                "files": files,
                "versions": library_versions(),
            })
            _write_json(path / METADATA_FILE, metadata)
            index.append({**metadata, "path": path.name})
        # No index may list a mix of old and new models while they move.
        (directory / INDEX_FILE).unlink(missing_ok=True)
        paths = []
        for entry in index:
            paths.append(_move_into_place(staging / entry["path"],
                                          directory / entry["path"], staging))
        _write_json(directory / INDEX_FILE, index, staging=staging)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return paths


def _check_formats(format):
    formats = (format,) if isinstance(format, str) else tuple(format)
    unknown = [f for f in formats if f not in FORMATS]
    if unknown or not formats:
        raise ValueError(
            f"`format` must be one of {FORMATS} or a non-empty sequence of "
            f"them. Received: format={format!r}.")
    return formats


def _write_model(model, path, formats, compile=None):
    """Writes `model` into the new directory `path`; returns the files.
    `compile` (where given) compiles `model` before its `.keras` file is
    written: the checkpoint holds the model's variables alone."""
    path.mkdir()
    files = {"config": CONFIG_FILE}
    _write_json(path / CONFIG_FILE,
                keras.saving.serialize_keras_object(model))
    if "saved_model" in formats:
        model.export(str(path / SAVED_MODEL_DIR), verbose=False)
        files["saved_model"] = SAVED_MODEL_DIR
    if "checkpoint" in formats:
        tf.train.Checkpoint(model=model).write(str(path / CHECKPOINT_PREFIX))
        files["checkpoint"] = CHECKPOINT_PREFIX
    if "keras" in formats:
        if compile is not None:
            compile(model)
        model.save(path / KERAS_FILE)
        files["keras"] = KERAS_FILE
    return files


def _write_json(path, value, staging=None):
    """Writes `value` to `path` through a rename, so that the file is either
    absent or complete."""
    handle, temporary = tempfile.mkstemp(
        prefix=f".{path.name}.", dir=staging or path.parent)
    with os.fdopen(handle, "w") as file:
        json.dump(value, file, indent=2)
    os.replace(temporary, path)


def _finite(value):
    """`value` with non-finite floats (a diverged model's loss) as None:
    JSON has no NaN, and other readers than Python's refuse it."""
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    if isinstance(value, float) and not np.isfinite(value):
        return None
    return value


def _move_into_place(source, target, staging):
    """Renames the complete directory `source` to `target`, replacing an
    earlier one (moved into `staging`, deleted with it)."""
    if target.exists():
        target.rename(staging / f".replaced-{target.name}")
    source.rename(target)
    return target


# -- reading an export back -------------------------------------------------


def load_models(directory, custom_objects=None, compile=False):
    """Returns the plain Keras models written by `export_models`.

    Args:
        directory: the directory given to `export_models`.
        custom_objects: as for `keras.models.load_model`: the functions and
            classes of your own that the models use and that are not
            registered with Keras (`{"name": object}`).
        compile: as for `keras.models.load_model`: True gives each model
            compiled as it was saved (with its own optimizer and that
            optimizer's state, where the array was compiled), ready to
            train on. A model exported without a `.keras` file (read from
            its checkpoint) is uncompiled either way.

    Returns:
        A list of B `keras.Model`s in the order of the array's models, with
        their weights (trainable and not, e.g. BatchNormalization
        statistics), read from each `model.keras` or, where the export
        wrote none, from the checkpoint and `config.json`.
    """
    directory = pathlib.Path(directory)
    return [load_exported_model(directory / entry["path"], custom_objects,
                                compile=compile)
            for entry in _read_index(directory)]


@hooks.provides("from_exported")
def from_exported(directory, custom_objects=None, **fuse_kwargs):
    """Returns the array written by `export_models`, to resume tuning or to
    serve: `hftatf.fuse_models(load_models(directory))`.

    Args:
        directory: the directory given to `export_models`.
        custom_objects: as for `load_models`.
        **fuse_kwargs: arguments of `hftatf.fuse_models` (`shared_inputs`,
            `name`, `model_class`); `shared_inputs` and `name` default to
            the exported array's.
    """
    entries = _read_index(pathlib.Path(directory))
    array = entries[0].get("array", {})
    defaults = {key: array[key] for key in ("shared_inputs", "name")
                if key in array}
    return fuse_models(load_models(directory, custom_objects),
                       **{**defaults, **fuse_kwargs})


def _read_index(directory):
    path = directory / INDEX_FILE
    if not path.is_file():
        raise ValueError(
            f"Directory '{directory}' holds no {INDEX_FILE}, so it is not a "
            "complete export of hftatf.export_models (an export that failed "
            "writes none). Pass the directory given to export_models, or "
            "load single models with hftatf.export.load_exported_model.")
    entries = sorted(json.loads(path.read_text()), key=lambda e: e["index"])
    if [entry["index"] for entry in entries] != list(range(len(entries))):
        raise ValueError(
            f"{path} must list models 0 to B-1. Received indices "
            f"{[entry['index'] for entry in entries]}.")
    return entries


# The package of hftatf's model zoo, whose Keras objects (PointNet's
# `OrthogonalityRegularizer`) its modules register when imported.
ZOO_PACKAGE = "hftatf.models"
_ZOO_MODULE = re.compile(re.escape(ZOO_PACKAGE) + r"(\.[A-Za-z_]\w*)+")


def zoo_modules(config):
    """The modules of hftatf's model zoo that the serialized model `config`
    names (as the `module` of a registered object): loading the model needs
    them imported. Only modules under `hftatf.models` are listed, so that
    loading a file never imports any other module it names."""
    found = set()
    pending = [config]
    while pending:
        value = pending.pop()
        if isinstance(value, dict):
            module = value.get("module")
            if isinstance(module, str) and _ZOO_MODULE.fullmatch(module):
                found.add(module)
            pending.extend(value.values())
        elif isinstance(value, list):
            pending.extend(value)
    return sorted(found)


def _import_zoo_modules(config):
    """Imports the zoo modules `config` names, which registers their Keras
    objects, so that a zoo model loads without its user importing the
    zoo."""
    for module in zoo_modules(config):
        importlib.import_module(module)


def _keras_file_config(path):
    """The model config stored in the `.keras` file `path` ({} for a
    legacy `.h5` file or one that is not a zip archive)."""
    try:
        with zipfile.ZipFile(path) as archive:
            return json.loads(archive.read("config.json"))
    except (zipfile.BadZipFile, KeyError, json.JSONDecodeError):
        return {}


def _load_keras_file(path, custom_objects, compile):
    _import_zoo_modules(_keras_file_config(path))
    return keras.models.load_model(path, custom_objects=custom_objects,
                                   compile=compile)


@hooks.provides("load_exported_model")
def load_exported_model(path, custom_objects=None, compile=False):
    """Returns the plain Keras model, with its weights, stored at `path`.

    Args:
        path: a `.keras` file; a model directory `model_{b}/` written by
            `export_models`; or the `saved_model/` directory inside one
            (its weights are read from the `.keras` file or the checkpoint
            next to it).
        custom_objects, compile: as for `load_models`.

    Raises:
        ValueError: for a SavedModel without a Keras model next to it
            (its weights cannot be restored into Keras layers), or a path
            that holds no model.
    """
    path = pathlib.Path(path)
    if path.is_file():
        if path.suffix in (".keras", ".h5", ".hdf5"):
            return _load_keras_file(path, custom_objects, compile)
        raise ValueError(
            f"Cannot load a Keras model from file '{path}': expected a "
            "`.keras` file (or a legacy `.h5` one) or a model directory "
            "written by hftatf.export_models.")
    if not path.is_dir():
        raise ValueError(f"No such file or directory: '{path}'.")
    is_saved_model = any((path / name).is_file()
                         for name in ("saved_model.pb", "saved_model.pbtxt"))
    candidates = [path]
    if is_saved_model and (path.parent / METADATA_FILE).is_file():
        # The SavedModel of a model directory written by export_models.
        candidates.append(path.parent)
    for candidate in candidates:
        if (candidate / KERAS_FILE).is_file():
            return _load_keras_file(candidate / KERAS_FILE, custom_objects,
                                    compile)
        checkpoint = candidate / CHECKPOINT_PREFIX
        if (candidate / CONFIG_FILE).is_file() and pathlib.Path(
                f"{checkpoint}.index").is_file():
            return _restore_checkpoint(candidate / CONFIG_FILE, checkpoint,
                                       custom_objects)
    if is_saved_model:
        raise ValueError(
            f"'{path}' is a SavedModel without a Keras model next to it: a "
            "SavedModel keeps a graph, not Keras layers, so its weights "
            "cannot be restored into a Keras model (keras.layers.TFSMLayer "
            "only wraps it for inference). Pass the `.keras` file of the "
            "model, or a model directory written by hftatf.export_models.")
    if (path / INDEX_FILE).is_file():
        raise ValueError(
            f"'{path}' is a whole export of hftatf.export_models, not one "
            "model. Use hftatf.load_models or hftatf.from_exported for it, "
            "or pass one of its model directories.")
    raise ValueError(
        f"Directory '{path}' holds no Keras model: expected a model "
        f"directory written by hftatf.export_models (with {KERAS_FILE}, or "
        f"{CONFIG_FILE} and a checkpoint) or a SavedModel inside one.")


def _restore_checkpoint(config_path, prefix, custom_objects=None):
    config = json.loads(config_path.read_text())
    _import_zoo_modules(config)
    model = keras.saving.deserialize_keras_object(
        config, custom_objects=custom_objects)
    tf.train.Checkpoint(model=model).read(
        str(prefix)).assert_existing_objects_matched()
    finalize_derived_state(model)
    return model


# -- one SavedModel for the whole array -------------------------------------


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
    """
    check_array(array, "hftatf.export_serving", _FUSE_ADVICE)
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
        _move_into_place(staging / directory.name, directory, staging)
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
               for layer in flatten_layers(model) if derives_state(layer))


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
    derived = [layer for layer in flatten_layers(model)
               if derives_state(layer)]

    def value(variable):
        if id(variable) in fixed:
            return tf.constant(fixed[id(variable)])
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
