"""Per-model export: plain Keras models that load without hftatf."""

import json
import subprocess
import sys

import keras
import numpy as np
import tensorflow as tf
from testing import assert_close

import hftatf


def trained_array(tmp_path):
    x = keras.Input((5,), name="x")
    h = keras.layers.Dense(8, activation="relu")(x)
    y = keras.layers.Dense(3, activation="softmax")(h)
    array = hftatf.fuse(keras.Model(x, y), 3)
    array.compile(hftatf.optimizers.SGD([0.1, 0.2, 0.3], momentum=0.5),
                  loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    rng = np.random.default_rng(0)
    inputs = rng.normal(size=(24, 5)).astype("float32")
    labels = rng.integers(0, 3, size=24)
    history = array.fit(inputs, labels, epochs=2, verbose=0)
    return array, history, inputs


def test_exported_models_predict_like_the_array(tmp_path):
    array, history, inputs = trained_array(tmp_path)
    paths = array.export_models(tmp_path / "export")
    assert [p.name for p in paths] == ["model_0", "model_1", "model_2"]
    expected = array.predict(inputs, verbose=0)
    for b, path in enumerate(paths):
        model = keras.models.load_model(path / "model.keras")
        assert not any("hftatf" in type(layer).__module__
                       for layer in model.layers)
        assert_close(model.predict(inputs, verbose=0), expected[:, b])
        served = tf.saved_model.load(str(path / "saved_model"))
        assert_close(served.serve(inputs), expected[:, b])


def test_metadata_records_hyperparameters_and_metrics(tmp_path):
    array, history, _ = trained_array(tmp_path)
    array.export_models(tmp_path / "export")
    index = json.loads((tmp_path / "export" / "index.json").read_text())
    assert [entry["path"] for entry in index] == [
        "model_0", "model_1", "model_2"]
    for b, rate in enumerate([0.1, 0.2, 0.3]):
        metadata = json.loads(
            (tmp_path / "export" / f"model_{b}" / "metadata.json").read_text())
        assert metadata["index"] == b
        hyper = metadata["hyperparameters"]
        assert hyper["optimizer"] == "SGD"
        assert np.isclose(hyper["learning_rate"], rate)
        assert np.isclose(hyper["momentum"], 0.5)
        assert metadata["metrics"]["loss"] == history.history[f"loss_{b}"][-1]
        assert metadata["metrics"]["accuracy"] == (
            history.history[f"accuracy_{b}"][-1])


def test_exported_model_loads_without_hftatf(tmp_path):
    array, _, inputs = trained_array(tmp_path)
    array.export_models(tmp_path / "export")
    np.save(tmp_path / "inputs.npy", inputs)
    model_dir = tmp_path / "export" / "model_1"
    script = "\n".join([
        "import sys, numpy as np, keras, tensorflow as tf",
        f"x = np.load(r'{tmp_path / 'inputs.npy'}')",
        f"m = keras.models.load_model(r'{model_dir / 'model.keras'}')",
        f"s = tf.saved_model.load(r'{model_dir / 'saved_model'}')",
        "y = np.stack([m.predict(x, verbose=0), s.serve(x)])",
        "np.save(sys.argv[1], y)",
        "assert 'hftatf' not in sys.modules",
    ])
    out = tmp_path / "out.npy"
    subprocess.run([sys.executable, "-c", script, str(out)], check=True,
                   capture_output=True)
    keras_out, saved_out = np.load(out)
    expected = array.predict(inputs, verbose=0)[:, 1]
    assert_close(keras_out, expected)
    assert_close(saved_out, expected)
