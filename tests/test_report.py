"""The per-model table of an array (every N epochs and at the end), and
ranking its models: their values are those of the logs."""

import math

import keras
import numpy as np
import pytest
from testing import assert_close

import hftatf
from hftatf import report
from hftatf.core import logs

RATES = [0.3, 0.1, 0.03]


def data():
    rng = np.random.default_rng(0)
    return (rng.standard_normal((64, 4)).astype("float32"),
            rng.integers(0, 3, 64))


def trained_array(epochs, callbacks=()):
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(8, activation="relu")(inputs)
    outputs = keras.layers.Dense(3, activation="softmax")(hidden)
    array = hftatf.fuse(keras.Model(inputs, outputs), num_models=3)
    array.compile(hftatf.optimizers.SGD(RATES),
                  loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    x, y = data()
    history = array.fit(x, y, batch_size=16, epochs=epochs,
                        validation_split=0.25, verbose=0,
                        callbacks=list(callbacks))
    return array, history.history


def table_rows(text):
    """The cells of each model's row of a printed table."""
    lines = text.splitlines()
    header = lines[1].split()
    rows = []
    for line in lines[2:]:
        cells = line.replace(" (", "(").split()
        rows.append(dict(zip(header, cells)))
    return rows


def test_the_table_every_n_epochs_shows_the_logs_change_and_best():
    printed = []
    logger = report.TableLogger(
        every_n_epochs=2, monitor="val_loss",
        hyperparameters={"learning_rate": RATES}, print_fn=printed.append)
    _, history = trained_array(4, [logger])
    assert [text.splitlines()[0] for text in printed] == ["Epoch 2:",
                                                          "Epoch 4:"]
    for text, epoch, before in [(printed[0], 1, None), (printed[1], 3, 1)]:
        rows = table_rows(text)
        val_losses = [history[f"val_loss_{b}"][epoch] for b in range(3)]
        best = int(np.argmin(val_losses))
        for b, row in enumerate(rows):
            assert row["model"] == f"{b}*" if b == best else str(b)
            assert row["learning_rate"] == str(RATES[b])
            for name in ("loss", "accuracy", "val_loss", "val_accuracy"):
                value = history[f"{name}_{b}"][epoch]
                expected = f"{value:.4g}"
                if before is not None:
                    change = value - history[f"{name}_{b}"][before]
                    expected += f"({change:+.2g})"
                assert row[name] == expected, (name, b, row)
            assert row["status"] == "ok"


def test_ranking_follows_the_last_fits_history_as_the_table_does():
    array, history = trained_array(2)
    ranking = array.rank_models("val_accuracy")
    last = [history[f"val_accuracy_{b}"][-1] for b in range(3)]
    assert sorted(last, reverse=True) == [value for _, value in ranking]
    assert [b for b, _ in ranking] == sorted(
        range(3), key=lambda b: (-last[b], b))
    rows = report.model_results(history, {"learning_rate": RATES},
                                diverged=array.diverged_models)
    best = report.best_model(rows, "val_accuracy", "max")
    assert best["model"] == ranking[0][0]
    assert [b for b, _ in array.rank_models()] == sorted(
        range(3), key=lambda b: history[f"val_loss_{b}"][-1])


def test_ranking_reads_the_epochs_whose_weights_the_models_hold():
    early = hftatf.callbacks.EarlyStopping(
        monitor="val_loss", patience=10, restore_best_weights=True)
    array, history = trained_array(6, callbacks=[early])
    x, y = data()
    held = array.evaluate(x[48:], y[48:], verbose=0, return_dict=True)
    ranking = dict(array.rank_models("val_loss"))
    for b in range(3):
        assert_close(ranking[b], held[f"loss_{b}"], err_msg=f"model {b}")
    # Not all of them hold their last epoch's weights.
    assert any(abs(history[f"val_loss_{b}"][-1] - ranking[b]) > 1e-4
               for b in range(3))


def test_diverged_models_rank_last():
    nan = math.nan
    history = {"loss_0": [1.0, nan], "loss_1": [2.0, 1.5],
               "loss_2": [0.5, 0.4]}

    class Array:
        name, num_models = "array", 3
        diverged_models = np.array([True, False, False])

    assert report.rank_models(Array(), "loss", history=history) == [
        (2, 0.4), (1, 1.5), (0, 1.0)]
    with pytest.raises(ValueError, match="call `fit` first"):
        report.rank_models(Array(), "loss")


def test_hyperparameters_are_shown_as_given():
    assert report.format_hyperparameter(float(np.float32(0.03))) == "0.03"
    assert report.format_hyperparameter(1e-4) == "0.0001"
    assert report.format_hyperparameter(0.1234567) == "0.1234567"
    # A float64 keeps its digits: two models' values never read the same.
    assert report.format_hyperparameter(0.12345671) == "0.12345671"
    assert report.format_hyperparameter(np.float64(1 / 3)) == str(1 / 3)
    assert report.format_hyperparameter(np.float32(1e-5)) == "1e-05"
    assert report.format_hyperparameter(3) == "3"
    assert report.format_hyperparameter("adam") == "adam"
    # The value itself, for JSON: as given, beyond float32's range too.
    assert logs.as_given(float(np.float32(0.03))) == 0.03
    assert logs.as_given(1e300) == 1e300
    rows = [{"model": 0, "learning_rate": float(np.float32(0.03)),
             "loss": 0.5}]
    assert "0.03 " in report.format_table(rows, ["learning_rate"]) + " "


def test_results_keep_validation_where_every_model_diverged():
    nan = math.nan
    diverged = {"loss_0": [nan, nan], "loss_1": [nan, nan],
                "val_loss_0": [2.0, 2.0], "val_loss_1": [3.0, 3.0]}
    rows = report.model_results(diverged, {"learning_rate": [1e6, 1e9]},
                                diverged=[True, True])
    # No model has a finite epoch to report, but the run validated.
    assert all(math.isnan(row["val_loss"]) for row in rows)
    assert [row["status"] for row in rows] == ["diverged", "diverged"]
    unvalidated = {"loss_0": [1.0], "loss_1": [2.0],
                   "val_loss_0": [nan], "val_loss_1": [nan]}
    rows = report.model_results(unvalidated, num_models=2)
    assert "val_loss" not in rows[0]
