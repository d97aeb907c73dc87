"""The array's progress bar: one line of a fixed width at any B, its
values those of the logs, every model's value on request."""

import math
import re

import keras
import numpy as np
import pytest

import hftatf
from hftatf import progress

ANSI = re.compile(r"\x1b\[[0-9;]*m")


def make_array(num_models, rates=None):
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(8, activation="relu")(inputs)
    outputs = keras.layers.Dense(3, activation="softmax")(hidden)
    array = hftatf.fuse(keras.Model(inputs, outputs), num_models=num_models)
    rates = rates or list(np.geomspace(1e-3, 0.5, num_models))
    array.compile(hftatf.optimizers.SGD(rates),
                  loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    return array


def data(size=64):
    rng = np.random.default_rng(0)
    return (rng.standard_normal((size, 4)).astype("float32"),
            rng.integers(0, 3, size))


def shown_lines(text):
    """The lines a terminal shows: split at carriage returns and line
    breaks, colour codes left out."""
    return [line for line in re.split(r"[\r\n]", ANSI.sub("", text))
            if line.strip()]


class Recorder(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.epochs, self.batches = [], []

    def on_train_batch_end(self, batch, logs=None):
        self.batches.append(dict(logs))

    def on_epoch_end(self, epoch, logs=None):
        self.epochs.append(dict(logs))


@pytest.mark.parametrize("num_models", [
    1, 8, 100])
def test_every_line_fits_the_terminal(num_models, monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "80")
    x, y = data()
    array = make_array(num_models)
    recorder = Recorder()
    for verbose in (1, 2):
        array.fit(x, y, batch_size=16, epochs=2, validation_split=0.25,
                  verbose=verbose, callbacks=[recorder])
        array.evaluate(x, y, batch_size=16, verbose=verbose)
    lines = shown_lines(capsys.readouterr().out)
    bars = [line for line in lines if not line.startswith("Epoch")]
    assert bars, lines
    assert max(len(line.rstrip()) for line in lines) <= 80, lines
    for line in bars:
        assert "loss " in line and "_0" not in line, line
    # The logs that callbacks receive keep every model's entry.
    for logs in recorder.epochs + recorder.batches:
        assert {f"loss_{b}" for b in range(num_models)} <= set(logs)
    assert {f"val_accuracy_{b}" for b in range(num_models)} <= set(
        recorder.epochs[-1])


def test_the_line_shows_the_mean_best_and_worst_of_the_logs(monkeypatch,
                                                            capsys):
    monkeypatch.setenv("COLUMNS", "400")
    x, y = data()
    array = make_array(5)
    recorder = Recorder()
    array.fit(x, y, batch_size=16, epochs=1, validation_split=0.25,
              verbose=2, callbacks=[recorder])
    (line,) = [line for line in shown_lines(capsys.readouterr().out)
               if line.startswith("3/3")]
    logs = recorder.epochs[0]
    for name, best in [("loss", np.argmin), ("accuracy", np.argmax),
                       ("val_loss", np.argmin), ("val_accuracy", np.argmax)]:
        values = [float(logs[f"{name}_{b}"]) for b in range(5)]
        worst = np.argmax if best is np.argmin else np.argmin
        b, w = int(best(values)), int(worst(values))
        expected = (f"{name} {float(logs[name]):.3g} [{values[b]:.3g} m{b} "
                    f"… {values[w]:.3g} m{w}]")
        assert f" - {expected}" in line, (expected, line)
    # Training quantities first, loss first; then validation.
    order = [line.index(f" - {name} ") for name in
             ("loss", "accuracy", "val_loss", "val_accuracy")]
    assert order == sorted(order)


def test_diverged_models_are_counted(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "120")
    x, y = data()
    array = make_array(3, rates=[0.01, 0.01, 0.01])
    # Model 1's activations overflow, whatever its initial weights.
    array.set_model_weights(1, [w * 1e37 for w in array.get_model_weights(1)])
    array.fit(x * 1e3, y, batch_size=16, epochs=2, verbose=2)
    assert array.diverged_models.tolist() == [False, True, False]
    last = shown_lines(capsys.readouterr().out)[-1]
    assert " - 1 diverged - loss " in last, last
    assert "m1" not in last  # A diverged model is neither best nor worst.
    array.freeze_models([2])
    array.fit(x, y, batch_size=16, epochs=1, verbose=2)
    last = shown_lines(capsys.readouterr().out)[-1]
    assert " - 1 diverged, 1 frozen - loss " in last, last


def test_per_model_values_are_listed_in_model_order(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "80")
    x, y = data()
    array = make_array(11)
    recorder = Recorder()
    array.fit(x, y, batch_size=16, epochs=1, verbose=2,
              callbacks=[recorder, progress.ProgbarLogger(per_model=True)])
    lines = shown_lines(capsys.readouterr().out)
    assert max(len(line.rstrip()) for line in lines) <= 80, lines
    text = " ".join(lines[1:])
    found = re.findall(r"m(\d+) (\S+)", text.split("accuracy")[0])
    logs = recorder.epochs[0]
    assert [int(b) for b, _ in found] == list(range(11))
    for b, value in found:
        assert value == f"{float(logs[f'loss_{b}']):.3g}"


def test_one_progress_bar_and_none_at_verbose_0():
    callbacks = progress.with_progress_bar(None)
    assert [type(c) for c in callbacks] == [progress.ProgbarLogger]
    given = [keras.callbacks.ProgbarLogger()]
    assert progress.with_progress_bar(given) == given
    assert progress.with_progress_bar(None, verbose=0) is None


def test_compact_text_keeps_the_status_and_says_what_it_left_out():
    items = progress.quantities(
        {"loss": 1.0, "loss_0": 0.5, "loss_1": 1.5, "val_loss": 2.0,
         "val_loss_0": 1.0, "val_loss_1": 3.0, "accuracy": 0.5,
         "accuracy_0": 0.75, "accuracy_1": 0.25}, 2,
        direction=lambda name: "up" if "accuracy" in name else "down")
    assert [item.name for item in items] == ["loss", "accuracy", "val_loss"]
    assert items[1].full_text() == "accuracy 0.5 [0.75 m0 … 0.25 m1]"
    text = progress.compact_text(items, 200, "1 diverged")
    assert text == ("1 diverged - loss 1 [0.5 m0 … 1.5 m1] - accuracy 0.5 "
                    "[0.75 m0 … 0.25 m1] - val_loss 2 [1 m0 … 3 m1]")
    # Validation keeps its best and worst before training does.
    text = progress.compact_text(items, 61, "1 diverged")
    assert text == ("1 diverged - loss 1 - accuracy 0.5 - val_loss 2 "
                    "[1 m0 … 3 m1]")
    text = progress.compact_text(items, 30, "1 diverged")
    assert text == "1 diverged - val_loss 2 - …"
    assert math.isnan(progress.quantities(
        {"loss_0": math.nan}, 1)[0].mean)


def test_a_log_file_keeps_every_quantity(monkeypatch, capsys):
    # Written to a file or pipe (here pytest's capture), with no COLUMNS:
    # the epoch line is not cut to a terminal's 80 columns.
    monkeypatch.delenv("COLUMNS", raising=False)
    x, y = data()
    array = make_array(5)
    array.set_model_weights(1, [w * 1e37 for w in array.get_model_weights(1)])
    array.fit(x * 1e3, y, batch_size=16, epochs=1, verbose=2,
              validation_data=(x, y))
    last = shown_lines(capsys.readouterr().out)[-1]
    assert len(last) > 80, last
    for name in ("loss", "accuracy", "val_loss", "val_accuracy"):
        assert f" - {name} " in last, (name, last)
    assert " - 1 diverged - " in last, last
