"""Export and import: between an array and files that need no hftatf.

* `export_models` writes each model of an array as an ordinary Keras model
  (a `.keras` file, a TensorFlow SavedModel, a TF checkpoint) with its
  hyper-parameters and metrics; `load_models` and `from_exported` read such
  an export back as B plain models or as the array again.
* `export_serving` (from `hftatf.serving`) writes the whole array as one
  SavedModel that serves all B models at once, and each of them alone.
* `load_exported_model` turns a path (a `.keras` file, or a model directory
  written by `export_models`) into a plain Keras model with its weights;
  `hftatf.fuse_models` accepts such paths.
"""

import functools
import json
import os
import pathlib
import platform
import re
import shutil
import tempfile

import keras
import numpy as np

from hftatf.core import hooks
from hftatf.core.logs import as_given, split_logs, weights_epoch
from hftatf.core.optional import (
    imported_tensorflow,
    tensorflow,
    tensorflow_backend,
    tensorflow_installed,
)
from hftatf.core.version import __version__
from hftatf.core.zoo_imports import import_zoo_modules, keras_file_config
from hftatf.fuse import (
    check_array,
    compile_stock_model,
    compiles_stock_models,
    fuse_models,
)
from hftatf.graph import architecture_difference, finalize_derived_state
from hftatf.serving import export_serving, move_into_place

__all__ = [
    "export_models",
    "export_serving",
    "from_exported",
    "load_exported_model",
    "load_models",
]

# How to turn plain models into what export takes.
_FUSE_ADVICE = "Fuse plain models first with hftatf.fuse_models."

# What `export_models` can write for each model.
FORMATS = ("keras", "saved_model", "checkpoint")

# What each format needs beyond Keras: a SavedModel is written by
# TensorFlow (from any backend), a TF checkpoint holds TensorFlow variables
# (the TensorFlow backend's).
_SAVED_MODEL_FEATURE = "A TensorFlow SavedModel (format='saved_model')"
_CHECKPOINT_FEATURE = "A TF checkpoint (format='checkpoint')"

# File names inside a model directory `model_{b}/`.
KERAS_FILE = "model.keras"
SAVED_MODEL_DIR = "saved_model"
CHECKPOINT_PREFIX = "checkpoint/model"
CONFIG_FILE = "config.json"
METADATA_FILE = "metadata.json"
INDEX_FILE = "index.json"
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
            values[name] = as_given(per_model[index])
    config = optimizer.get_config()
    for key, value in config.items():
        if key not in names and key not in ("name", "num_models") and (
                isinstance(value, (bool, int, float, str)) or value is None):
            values[key] = value
    return values


def model_metrics(history, index, num_models, epochs_before_end=0):
    """Model `index`'s logged values (`loss`, `val_accuracy`, ...) of the
    epoch `epochs_before_end` epochs before the last one logged (the last
    by default): the entries logged for each of the `num_models` models
    (`split_logs`), so that the mean of a metric whose own name ends in
    `_1` is not read as model 1's."""
    if history is None:
        return {}
    logs = getattr(history, "history", history) or {}
    per_model, _ = split_logs(
        {key: values for key, values in logs.items() if len(values)},
        num_models)
    position = -1 - epochs_before_end
    # A quantity without a single value (the validation columns of a run
    # that did not validate, as a CSV history holds them) is left out; a
    # model's NaN (it diverged) is kept.
    return {name: float(histories[index][position])
            for name, histories in per_model.items()
            if len(histories[index]) >= -position
            and not all(np.isnan(float(v)) for h in histories for v in h)}


def model_epoch(array, history, index):
    """`(epoch, epochs_before_end)`: the epoch, counted from 1 as `fit`
    prints it, whose weights model `index` holds (its best, where
    `hftatf.callbacks.EarlyStopping` restored it; else the last), and how
    many epochs before the last one logged it is. The epochs are read from
    `history` where it is a `keras.callbacks.History`, else from the
    array's last `fit`; `(None, 0)` where neither tells."""
    source = history if isinstance(history, keras.callbacks.History) else (
        getattr(array, "history", None))
    epoch = (weights_epoch(source, index)
             if isinstance(source, keras.callbacks.History) else None)
    if epoch is None:
        return None, 0
    return epoch + 1, int(source.epoch[-1]) - epoch


def model_diverged(array, index):
    """Whether model `index` diverged, from the array's `diverged_models`
    (one bool per model, kept by the trainer); None when not tracked."""
    diverged = getattr(array, "diverged_models", None)
    if diverged is None:
        return None
    return bool(np.asarray(keras.ops.convert_to_numpy(diverged))[index])


def default_formats():
    """What `export_models` writes by default: every format of `FORMATS`
    that this installation can write (the `.keras` file everywhere; the
    SavedModel where TensorFlow is installed; the TF checkpoint on the
    TensorFlow backend)."""
    if keras.backend.backend() == "tensorflow":
        return FORMATS
    return ("keras", "saved_model") if tensorflow_installed() else (
        "keras",)


def library_versions():
    """The versions an export was written with (TensorFlow's None where
    the process did not import it) and the Keras backend."""
    tf = imported_tensorflow()
    return {"hftatf": __version__,
            "keras": keras.__version__,
            "backend": keras.backend.backend(),
            "tensorflow": None if tf is None else tf.__version__,
            "numpy": np.__version__,
            "python": platform.python_version()}


@hooks.provides("export_models")
def export_models(array, directory, history=None, format=None,
                  verbose="auto"):
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
      * `checkpoint/model.*` (format `"checkpoint"`, TensorFlow backend
        only): a TF checkpoint of the plain model's variables, restored
        into a stock model `m` of the same architecture by
        `tf.train.Checkpoint(model=m).read(path)`;
      * `config.json`: the stock architecture
        (`keras.saving.deserialize_keras_object` rebuilds it);
      * `metadata.json`: its index, optimizer hyper-parameters, metrics
        (None for a non-finite value) and `epoch`, whether it diverged
        (None if the array does not track it) and the library versions.
        The metrics are those logged for the weights exported: at the end
        of `epoch` (counted from 1, as `fit` prints it), the model's last
        epoch or, where `hftatf.callbacks.EarlyStopping` restored its best
        weights, its best epoch (None where `history` does not tell).
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
        directory: where to write; created if missing (a ValueError if it
            is a file). Model directories of an earlier export there are
            replaced, and those of its models that this export does not
            have are removed, so `index.json` and the `model_{b}`
            directories list this export's models only; nothing else there
            is touched (only `model_{b}` directories the earlier
            `index.json` lists are removed), and a `model_{b}` entry that
            no export wrote is refused before anything is written.
        history: a `keras.callbacks.History` (what `fit` returns) or its
            `history` dict; defaults to the array's last `fit`.
        format: what to write for each model: one of `"keras"`,
            `"saved_model"`, `"checkpoint"` or a sequence of them; by
            default all that this installation writes
            (`default_formats()`: all three on the TensorFlow backend; on
            another, the `.keras` file, and the SavedModel where TensorFlow
            is installed). `load_models` needs `"keras"` or
            `"checkpoint"`.
        verbose: 1 (or `"auto"`) for a progress bar over the models, 0
            for none.

    Raises:
        ImportError: for `"saved_model"` where TensorFlow is not installed.
        ValueError: for `"checkpoint"` on a backend other than TensorFlow,
            or a `model_{b}` entry in `directory` that no export wrote.

    Returns:
        The list of the B model directories.
    """
    check_array(array, "hftatf.export_models", _FUSE_ADVICE)
    formats = _check_formats(format)
    directory = _export_directory(directory)
    earlier = _earlier_model_dirs(directory)
    _check_replaceable(directory, array.num_models, earlier)
    if history is None:
        history = getattr(array, "history", None)
    optimizer = getattr(array, "optimizer", None)
    compiles = "keras" in formats and compiles_stock_models(array)
    staging = pathlib.Path(tempfile.mkdtemp(prefix=".export-", dir=directory))
    bar = (keras.utils.Progbar(array.num_models, unit_name="model")
           if verbose == "auto" or verbose else None)
    try:
        index = []
        for b, model in enumerate(array.unfuse(compile=False)):
            path = staging / f"model_{b}"
            files = _write_model(
                model, path, formats,
                compile=functools.partial(compile_stock_model, array, b)
                if compiles else None)
            epoch, before_end = model_epoch(array, history, b)
            metadata = _finite({
                "index": b,
                "num_models": array.num_models,
                "array": {"name": array.name,
                          "shared_inputs": list(array.shared_inputs)},
                "hyperparameters": model_hyperparameters(optimizer, b),
                "metrics": model_metrics(history, b, array.num_models,
                                         before_end),
                "epoch": epoch,
                "diverged": model_diverged(array, b),
                "files": files,
                "versions": library_versions(),
            })
            _write_json(path / METADATA_FILE, metadata)
            index.append({**metadata, "path": path.name})
            if bar is not None:
                bar.update(b + 1)
        # No index may list a mix of old and new models while they move.
        (directory / INDEX_FILE).unlink(missing_ok=True)
        paths = []
        for entry in index:
            paths.append(move_into_place(staging / entry["path"],
                                          directory / entry["path"], staging))
        # The earlier export's models that this one does not list would
        # sit beside its index as if they belonged to it.
        for name in sorted(earlier - {entry["path"] for entry in index}):
            (directory / name).rename(staging / f".stale-{name}")
        _write_json(directory / INDEX_FILE, index, staging=staging)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return paths


def _export_directory(directory):
    """`directory` as a `pathlib.Path`, created if missing; a ValueError
    where it (or a parent) is a file."""
    directory = pathlib.Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise ValueError(
            f"hftatf.export_models writes a directory, but '{directory}' "
            "is a file or lies under one. Pass the path of a new or empty "
            "directory, or of an earlier export to replace.") from None
    return directory


def _earlier_model_dirs(directory):
    """The `model_{b}` directories that an earlier export in `directory`
    lists in its index: the only ones export_models removes (never any
    other file of its user's); none where there is no readable index."""
    try:
        entries = _read_index(directory)
    except ValueError:
        return set()
    return {entry["path"] for entry in entries
            if re.fullmatch(r"model_(0|[1-9][0-9]*)", entry["path"])
            and (directory / entry["path"]).is_dir()}


def _check_replaceable(directory, num_models, earlier):
    """Refuses, before anything is written, a `model_{b}` entry of
    `directory` that this export would replace and that is not a model
    an export wrote (listed in the `earlier` index, or holding its
    `metadata.json`, as one a killed export moved into place does): a
    user's own files there are never replaced."""
    for b in range(num_models):
        path = directory / f"model_{b}"
        if not path.exists() and not path.is_symlink():
            continue
        if path.name in earlier or (
                path.is_dir() and not path.is_symlink()
                and (path / METADATA_FILE).is_file()):
            continue
        raise ValueError(
            f"hftatf.export_models writes model {b} to '{path}', which "
            "exists and is not a model an earlier export wrote, so it will "
            "not replace it. Move it away, or export into another "
            "directory.")


def _check_formats(format):
    """The formats `format` asks for; the TensorFlow they need is checked
    (and imported) before anything is written."""
    if format is None:
        return default_formats()
    formats = (format,) if isinstance(format, str) else tuple(format)
    unknown = [f for f in formats if f not in FORMATS]
    if unknown or not formats:
        raise ValueError(
            f"`format` must be one of {FORMATS} or a non-empty sequence of "
            f"them. Received: format={format!r}.")
    if "saved_model" in formats:
        tensorflow(_SAVED_MODEL_FEATURE)
    if "checkpoint" in formats:
        tensorflow_backend(_CHECKPOINT_FEATURE)
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
        tensorflow_backend(_CHECKPOINT_FEATURE).train.Checkpoint(
            model=model).write(str(path / CHECKPOINT_PREFIX))
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


# -- reading an export back -------------------------------------------------


def load_models(directory, custom_objects=None, compile=False,
                safe_mode=True):
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
        safe_mode: as for `keras.models.load_model`: False loads a
            `Lambda` layer's function (only from files you trust).

    Returns:
        A list of B `keras.Model`s in the order of the array's models, with
        their weights (trainable and not, e.g. BatchNormalization
        statistics), read from each `model.keras` or, where the export
        wrote none, from the checkpoint and `config.json`.
    """
    directory = pathlib.Path(directory)
    entries = _read_index(directory)
    models = [load_exported_model(_entry_path(directory, entry),
                                  custom_objects, compile, safe_mode)
              for entry in entries]
    found = architecture_difference(models)
    if found:
        index, difference = found
        raise ValueError(
            f"{directory / INDEX_FILE} lists models of different "
            f"architectures, which no array of export_models holds: model "
            f"{index} ('{entries[index]['path']}') differs from model 0 "
            f"('{entries[0]['path']}'): {difference}. Export the array "
            "again, or load single models with "
            "hftatf.export.load_exported_model.")
    return models


@hooks.provides("from_exported")
def from_exported(directory, custom_objects=None, safe_mode=True,
                  **fuse_kwargs):
    """Returns the array written by `export_models`, to resume tuning or to
    serve: `hftatf.fuse_models(load_models(directory))`.

    Args:
        directory: the directory given to `export_models`.
        custom_objects, safe_mode: as for `load_models`.
        **fuse_kwargs: arguments of `hftatf.fuse_models` (`shared_inputs`,
            `name`, `model_class`); `shared_inputs` and `name` default to
            the exported array's.
    """
    entries = _read_index(pathlib.Path(directory))
    array = entries[0].get("array", {})
    defaults = {key: array[key] for key in ("shared_inputs", "name")
                if key in array}
    return fuse_models(
        load_models(directory, custom_objects, safe_mode=safe_mode),
        **{**defaults, **fuse_kwargs})


def _read_index(directory):
    """The entries of `directory`'s index, in model order; a ValueError
    naming the file for an index that export_models did not write."""
    path = directory / INDEX_FILE
    if not path.is_file():
        raise ValueError(
            f"Directory '{directory}' holds no {INDEX_FILE}, so it is not a "
            "complete export of hftatf.export_models (an export that failed "
            "writes none). Pass the directory given to export_models, or "
            "load single models with hftatf.export.load_exported_model.")
    fix = ("Export the array again with hftatf.export_models, or load "
           "single models with hftatf.export.load_exported_model.")
    try:
        entries = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(
            f"{path} is not valid JSON ({error}), so '{directory}' cannot "
            f"be read as an export. {fix}") from None
    if not isinstance(entries, list) or not entries or not all(
            isinstance(e, dict) and isinstance(e.get("index"), int)
            and isinstance(e.get("path"), str) for e in entries):
        raise ValueError(
            f"{path} must hold a non-empty list of model entries, each with "
            f"an integer `index` and a `path`, as export_models writes it. "
            f"{fix}")
    entries = sorted(entries, key=lambda e: e["index"])
    if [entry["index"] for entry in entries] != list(range(len(entries))):
        raise ValueError(
            f"{path} must list models 0 to B-1. Received indices "
            f"{[entry['index'] for entry in entries]}.")
    return entries


def _entry_path(directory, entry):
    """The model directory an index entry names, which must lie inside the
    export `directory`: an index never sends a load elsewhere."""
    path = (directory / entry["path"]).resolve()
    if not path.is_relative_to(directory.resolve()) or (
            path == directory.resolve()):
        raise ValueError(
            f"{directory / INDEX_FILE} lists model {entry['index']} at "
            f"{entry['path']!r}, which leads outside the export directory "
            f"'{directory}'; export_models writes each model into a "
            "directory inside it (`model_{b}`). Export the array again, or "
            "load a model elsewhere with hftatf.export.load_exported_model.")
    return path


def _load_keras_file(path, custom_objects, compile, safe_mode):
    import_zoo_modules(keras_file_config(path))
    return keras.models.load_model(path, custom_objects=custom_objects,
                                   compile=compile, safe_mode=safe_mode)


@hooks.provides("load_exported_model")
def load_exported_model(path, custom_objects=None, compile=False,
                        safe_mode=True):
    """Returns the plain Keras model, with its weights, stored at `path`.

    Args:
        path: a `.keras` file; a model directory `model_{b}/` written by
            `export_models`; or the `saved_model/` directory inside one
            (its weights are read from the `.keras` file or the checkpoint
            next to it).
        custom_objects, compile, safe_mode: as for `load_models`.

    Raises:
        ValueError: for a SavedModel without a Keras model next to it
            (its weights cannot be restored into Keras layers), or a path
            that holds no model.
    """
    path = pathlib.Path(path)
    if path.is_file():
        if path.suffix in (".keras", ".h5", ".hdf5"):
            return _load_keras_file(path, custom_objects, compile, safe_mode)
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
                                    compile, safe_mode)
        checkpoint = candidate / CHECKPOINT_PREFIX
        if (candidate / CONFIG_FILE).is_file() and pathlib.Path(
                f"{checkpoint}.index").is_file():
            return _restore_checkpoint(candidate / CONFIG_FILE, checkpoint,
                                       custom_objects, safe_mode)
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


def _restore_checkpoint(config_path, prefix, custom_objects, safe_mode):
    config = json.loads(config_path.read_text())
    import_zoo_modules(config)
    model = keras.saving.deserialize_keras_object(
        config, custom_objects=custom_objects, safe_mode=safe_mode)
    tf = tensorflow_backend(f"Reading the TF checkpoint at '{prefix}'")
    tf.train.Checkpoint(model=model).read(
        str(prefix)).assert_existing_objects_matched()
    finalize_derived_state(model)
    return model
