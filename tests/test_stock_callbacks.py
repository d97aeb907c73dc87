"""Stock Keras callbacks that would act on the mean over an array's models
are refused with the hftatf callback that acts on each model, unless their
user says they mean the mean; per-model callbacks say each thing once."""

import keras
import numpy as np
import pytest

import hftatf
from hftatf import callbacks
from hftatf.core import logs

B = 3


def make_array():
    x = keras.Input((4,))
    array = hftatf.fuse(keras.Model(x, keras.layers.Dense(1)(x)), B)
    array.compile(hftatf.optimizers.SGD([0.05, 0.1, 0.02]), loss="mse",
                  metrics=["mae"], jit_compile=False)
    return array


def data(n=16):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 4)).astype("float32")
    return x, (x @ rng.normal(size=(4, 1))).astype("float32")


class MyStopping(keras.callbacks.EarlyStopping):
    pass


# Each builds its callback writing (where it writes) under a directory.
MONITORING = [
    (lambda d: keras.callbacks.EarlyStopping("val_accuracy"),
     "hftatf.callbacks.EarlyStopping", "val_accuracy"),
    (lambda d: keras.callbacks.ModelCheckpoint(d / "m.keras",
                                               save_best_only=True),
     "hftatf.callbacks.ModelCheckpoint", "val_loss"),
    (lambda d: MyStopping(monitor="loss"), "hftatf.callbacks.EarlyStopping",
     "loss"),
]


@pytest.mark.parametrize("stock, alternative, monitor", MONITORING)
def test_stock_callbacks_that_monitor_the_mean_are_refused(
        stock, alternative, monitor, tmp_path):
    with pytest.raises(ValueError, match=alternative) as error:
        logs.check_stock_callbacks([stock(tmp_path)])
    assert f"`{monitor}`, the mean over its models" in str(error.value)
    assert "monitors_array_mean = True" in str(error.value)
    with pytest.raises(ValueError, match=alternative):
        logs.check_stock_callbacks(
            keras.callbacks.CallbackList([stock(tmp_path)]))


def test_stock_reduce_lr_on_plateau_is_refused_for_its_learning_rate():
    with pytest.raises(ValueError, match="hftatf.callbacks.ReduceLROnPlateau"):
        logs.check_stock_callbacks([keras.callbacks.ReduceLROnPlateau()])


def test_callbacks_that_mean_the_mean_or_each_model_are_accepted(tmp_path):
    on_mean = keras.callbacks.EarlyStopping("val_loss")
    on_mean.monitors_array_mean = True
    logs.check_stock_callbacks([
        on_mean,
        keras.callbacks.CSVLogger(tmp_path / "unused.csv"),
        # Saves the whole array every epoch: its monitor is not read.
        keras.callbacks.ModelCheckpoint(tmp_path / "array.keras"),
        keras.callbacks.LambdaCallback(),
        callbacks.EarlyStopping("val_loss"),
        callbacks.ModelCheckpoint(tmp_path / "m_{model}.keras"),
        callbacks.ReduceLROnPlateau(),
    ])


def test_a_stock_callback_on_the_mean_trains_as_stock_keras_says():
    # Declared to mean the mean, stock EarlyStopping stops the whole array
    # on the mean loss.
    on_mean = keras.callbacks.EarlyStopping("loss", min_delta=1e9)
    on_mean.monitors_array_mean = True
    x, y = data()
    history = make_array().fit(x, y, epochs=5, verbose=0,
                               callbacks=[on_mean])
    assert len(history.epoch) == 2


@pytest.mark.parametrize("stock, alternative, monitor", MONITORING)
def test_fit_refuses_stock_callbacks_that_monitor_the_mean(
        stock, alternative, monitor, tmp_path):
    x, y = data()
    array = make_array()
    with pytest.raises(ValueError, match=alternative):
        array.fit(x, y, epochs=1, verbose=0, validation_data=(x, y),
                  callbacks=[stock(tmp_path)])


def test_early_stopping_says_each_restore_once(capsys):
    x, y = data()
    array = make_array()
    early = callbacks.EarlyStopping(patience=2, verbose=1,
                                    restore_best_weights=True)
    early.set_model(array)
    early.on_train_begin()
    # Model 1 stops (and is restored) at epoch 3; the others at the end.
    for epoch, values in enumerate([[1.0, 1.0, 1.0], [0.9, 1.1, 0.9],
                                    [0.95, 1.2, 0.95]]):
        array.train_on_batch(x, y)
        early.on_epoch_end(epoch, {f"val_loss_{b}": v
                                   for b, v in enumerate(values)})
    early.on_train_end()
    out = capsys.readouterr().out.splitlines()
    # Model 1 when it stopped; the others, whose best epoch was not the
    # last, at the end; each once, in one line.
    assert out == [
        "Epoch 3: early stopping model 1; restoring its weights from the "
        "end of its best epoch: 1.",
        "Restoring the weights of 2 models (0, 2) from the end of their "
        "best epochs: 2, 2."], out
