"""What export_models writes and load_models accepts: the metrics of the
weights exported, index entries that stay inside the export, clear errors
for paths and files that are not an export, and no stale models."""

import json
import shutil

import keras
import numpy as np
import pytest
from testing import BACKEND

import hftatf
from hftatf import callbacks

# The quickest export that loads back: a TF checkpoint on TensorFlow (whose
# variables it holds), the `.keras` file elsewhere.
QUICK_FORMAT = "checkpoint" if BACKEND == "tensorflow" else "keras"


def linear(units=1):
    x = keras.Input((4,), name="x")
    return keras.Model(x, keras.layers.Dense(units, name="out")(x),
                       name="linear")


# The linear map every sample of `regression` follows, training and
# validation alike: a model that learns it does better on both.
TARGET = np.random.default_rng(99).normal(size=(4, 1))


def regression(n, seed):
    x = np.random.default_rng(seed).normal(size=(n, 4)).astype("float32")
    return x, (x @ TARGET).astype("float32")


def export(directory, num_models=2, units=1):
    array = hftatf.fuse(linear(units), num_models)
    array.compile(hftatf.optimizers.SGD(0.1), loss="mse")
    return array.export_models(directory, format=QUICK_FORMAT)


def rewrite_index(directory, change):
    path = directory / "index.json"
    entries = json.loads(path.read_text())
    change(entries)
    path.write_text(json.dumps(entries))


def test_exported_metrics_are_those_of_the_restored_weights(tmp_path):
    keras.utils.set_random_seed(1)
    x, y = regression(32, 0)
    x_val, y_val = regression(32, 1)
    array = hftatf.fuse(linear(), 2)
    # Model 1's rate overshoots: its validation loss grows every epoch, so
    # early stopping gives it back an early epoch's weights.
    array.compile(hftatf.optimizers.SGD([0.05, 1.2]), loss="mse")
    stopping = callbacks.EarlyStopping(patience=10, restore_best_weights=True)
    history = array.fit(x, y, epochs=4, batch_size=8, verbose=0,
                        validation_data=(x_val, y_val),
                        callbacks=[stopping])
    assert stopping.best_epoch[0] == 3 and stopping.best_epoch[1] < 3
    hftatf.export_models(array, tmp_path, format=("keras", QUICK_FORMAT))
    index = json.loads((tmp_path / "index.json").read_text())
    models = hftatf.load_models(tmp_path)
    for b, (entry, model) in enumerate(zip(index, models)):
        best = stopping.best_epoch[b]
        assert entry["epoch"] == best + 1
        metadata = json.loads((tmp_path / entry["path"] /
                               "metadata.json").read_text())
        assert metadata["epoch"] == best + 1
        for name in ("loss", "val_loss"):
            assert entry["metrics"][name] == metadata["metrics"][name] == (
                history.history[f"{name}_{b}"][best])
        # The metrics describe the model that was exported.
        model.compile(loss="mse")
        np.testing.assert_allclose(
            model.evaluate(x_val, y_val, batch_size=32, verbose=0),
            entry["metrics"]["val_loss"], rtol=1e-5)


def test_exported_epoch_is_the_last_without_early_stopping(tmp_path):
    x, y = regression(16, 0)
    array = hftatf.fuse(linear(), 2)
    array.compile(hftatf.optimizers.SGD(0.05), loss="mse")
    history = array.fit(x, y, epochs=3, batch_size=8, verbose=0)
    array.export_models(tmp_path, format=QUICK_FORMAT)
    index = json.loads((tmp_path / "index.json").read_text())
    assert [entry["epoch"] for entry in index] == [3, 3]
    assert index[1]["metrics"]["loss"] == history.history["loss_1"][-1]


@pytest.mark.parametrize("path", ["../../../etc", "/etc", ".", "model_0/.."])
def test_load_models_refuses_entries_outside_the_export(tmp_path, path):
    directory = tmp_path / "export"
    export(directory)

    def escape(entries):
        entries[1]["path"] = path

    rewrite_index(directory, escape)
    with pytest.raises(ValueError, match="outside the export directory"):
        hftatf.load_models(directory)


def test_load_models_refuses_models_of_different_architectures(tmp_path):
    export(tmp_path / "a", units=1)
    export(tmp_path / "b", units=2)
    shutil.rmtree(tmp_path / "a" / "model_1")
    shutil.copytree(tmp_path / "b" / "model_1", tmp_path / "a" / "model_1")
    message = "lists models of different architectures.*model 1"
    with pytest.raises(ValueError, match=message):
        hftatf.load_models(tmp_path / "a")
    with pytest.raises(ValueError, match=message):
        hftatf.from_exported(tmp_path / "a")


def test_export_to_a_file_is_refused(tmp_path):
    target = tmp_path / "notes.txt"
    target.write_text("mine")
    for path in (target, target / "export"):
        with pytest.raises(ValueError, match="is a file or lies under one"):
            export(path)
    assert target.read_text() == "mine"


@pytest.mark.parametrize("text, message", [
    ("{not json", "index.json is not valid JSON"),
    ('{"index": 0}', "must hold a non-empty list of model entries"),
    ("[]", "must hold a non-empty list of model entries"),
    ('[{"index": 0}]', "must hold a non-empty list of model entries"),
])
def test_malformed_index_is_named(tmp_path, text, message):
    export(tmp_path)
    (tmp_path / "index.json").write_text(text)
    with pytest.raises(ValueError, match=message) as error:
        hftatf.load_models(tmp_path)
    assert str(tmp_path / "index.json") in str(error.value)
    assert "Export the array again" in str(error.value)


def test_export_of_fewer_models_removes_the_earlier_ones(tmp_path):
    export(tmp_path, num_models=3)
    # The user's own files, and a model directory no index listed.
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "model_7").mkdir()
    (tmp_path / "model_extra").mkdir()
    export(tmp_path, num_models=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "index.json", "model_0", "model_1", "model_7", "model_extra",
        "notes.txt"]
    assert len(hftatf.load_models(tmp_path)) == 2


def test_a_model_directory_no_export_wrote_is_refused(tmp_path):
    mine = tmp_path / "model_1"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=(
            r"model 1 to '.*model_1', which exists and is not a model an "
            r"earlier export wrote")):
        export(tmp_path)
    assert (mine / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model_1"]


def test_models_a_killed_export_moved_into_place_are_replaced(tmp_path):
    export(tmp_path, num_models=2)
    # Killed after moving its models, before writing its index.
    (tmp_path / "index.json").unlink()
    export(tmp_path, num_models=2)
    assert len(hftatf.load_models(tmp_path)) == 2


def test_export_over_a_malformed_index_removes_nothing(tmp_path):
    export(tmp_path, num_models=3)
    (tmp_path / "index.json").write_text("{not json")
    export(tmp_path, num_models=2)
    assert (tmp_path / "model_2").is_dir()
    assert len(hftatf.load_models(tmp_path)) == 2


def test_models_holding_a_lambda_load_outside_safe_mode(tmp_path):
    # Keras's safe mode refuses a `Lambda`'s function: as for
    # `keras.models.load_model`, `safe_mode=False` loads it.
    x = keras.Input((4,))
    doubled = keras.layers.Lambda(lambda t: 2.0 * t, output_shape=(4,))(x)
    array = hftatf.fuse(keras.Model(x, keras.layers.Dense(1)(doubled)), 2)
    array.export_models(tmp_path, format="keras")
    with pytest.raises(ValueError, match="safe_mode"):
        hftatf.load_models(tmp_path)
    inputs = np.ones((3, 4), "float32")
    expected = array.predict(inputs, verbose=0)
    models = hftatf.load_models(tmp_path, safe_mode=False)
    for b, model in enumerate(models):
        np.testing.assert_array_equal(model.predict(inputs, verbose=0),
                                      expected[:, b])
    again = hftatf.export.from_exported(tmp_path, safe_mode=False)
    np.testing.assert_array_equal(again.predict(inputs, verbose=0), expected)


def test_export_shows_its_progress_over_the_models(tmp_path, capsys):
    array = hftatf.fuse(linear(), 3)
    array.export_models(tmp_path / "shown", format=QUICK_FORMAT)
    assert "3/3" in capsys.readouterr().out
    array.export_models(tmp_path / "quiet", format=QUICK_FORMAT, verbose=0)
    assert "3/3" not in capsys.readouterr().out
