"""Per-model export: each model of an array as an ordinary Keras model."""

import json
import pathlib

import keras
import numpy as np
import tensorflow as tf

import hftatf


def model_hyperparameters(optimizer, index):
    """Model `index`'s optimizer hyper-parameters as a JSON-ready dict."""
    if optimizer is None:
        return {}
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


def model_metrics(history, index):
    """Model `index`'s final logged values (`loss`, `val_accuracy`, ...)."""
    if history is None:
        return {}
    logs = getattr(history, "history", history) or {}
    suffix = f"_{index}"
    return {key[:-len(suffix)]: float(values[-1])
            for key, values in logs.items()
            if key.endswith(suffix) and values}


def export_models(array, directory, history=None):
    """Writes every model of `array` as a plain Keras model.

    For model `b`, `directory/model_{b}/` receives:
      * `model.keras`: the model in the Keras format
        (`keras.models.load_model` loads it without hftatf);
      * `saved_model/`: a TensorFlow SavedModel for serving (`model.export`;
        `tf.saved_model.load(path).serve(x)` runs it);
      * `metadata.json`: its index, optimizer hyper-parameters and final
        metrics.
    `directory/index.json` lists every model's metadata, so the best one can
    be picked without loading them all.

    Args:
        array: a `FusedModel` made by `hftatf.fuse` or `hftatf.fuse_models`.
        directory: where to write; created if missing.
        history: a `keras.callbacks.History` (what `fit` returns) or its
            `history` dict; defaults to the array's last `fit`.

    Returns:
        The list of the B model directories.
    """
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if history is None:
        history = getattr(array, "history", None)
    optimizer = getattr(array, "optimizer", None)
    index = []
    paths = []
    for b, model in enumerate(array.unfuse()):
        path = directory / f"model_{b}"
        path.mkdir(exist_ok=True)
        model.save(path / "model.keras")
        model.export(str(path / "saved_model"), verbose=False)
        metadata = {
            "index": b,
            "num_models": array.num_models,
            "hyperparameters": model_hyperparameters(optimizer, b),
            "metrics": model_metrics(history, b),
            "versions": {"hftatf": hftatf.__version__,
                         "keras": keras.__version__,
                         "tensorflow": tf.__version__,
                         "numpy": np.__version__},
        }
        (path / "metadata.json").write_text(json.dumps(metadata, indent=2))
        index.append({**metadata, "path": path.name})
        paths.append(path)
    (directory / "index.json").write_text(json.dumps(index, indent=2))
    return paths
