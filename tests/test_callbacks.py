"""Per-model callbacks (hftatf.callbacks) against stock Keras callbacks.

Callback-level tests drive a callback with synthetic per-model logs on a real
compiled array (`set_model`, `on_train_begin`, `on_epoch_end`), with real
training steps in between, so that every decision is deterministic; the
oracle is B stock callbacks, each fed its own model's logs.
"""

import csv
import glob
import os

import keras
import numpy as np
import pytest
from testing import STEP_JIT

import hftatf
from hftatf import callbacks

B = 3
LEARNING_RATES = [0.05, 0.1, 0.02]


def mlp():
    return keras.Sequential([
        keras.Input((4,)),
        keras.layers.Dense(8, activation="tanh", name="hidden"),
        keras.layers.Dense(1, name="out"),
    ], name="mlp")


def data(n=24, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 4)).astype("float32")
    y = (x @ rng.normal(size=(4, 1))).astype("float32")
    return x, y


def make_array(learning_rates=LEARNING_RATES, metrics=("mae",),
               jit_compile=STEP_JIT):
    array = hftatf.fuse(mlp(), B)
    # (On TensorFlow, XLA would only add compile time to these tiny steps.)
    array.compile(hftatf.optimizers.SGD(list(learning_rates)), loss="mse",
                  metrics=list(metrics), jit_compile=jit_compile)
    array.optimizer.build(array.trainable_variables)
    return array


def model_logs(values, monitor="val_loss"):
    """The logs an array writes for one epoch: per-model values and mean."""
    logs = {f"{monitor}_{b}": float(v) for b, v in enumerate(values)}
    logs[monitor] = float(np.mean(values))
    return logs


def same_weights(first, second):
    return all(np.array_equal(a, b) for a, b in zip(first, second))


def drive(callback, array, sequence, x=None, y=None, after=None):
    """Runs `callback` over per-model log values `sequence[epoch][b]`, with
    a training step before each epoch end (when data is given). Returns
    each model's weights after each epoch's step (before the callback)."""
    callback.set_model(array)
    callback.on_train_begin()
    trajectory = []
    for epoch, values in enumerate(sequence):
        if x is not None:
            array.train_on_batch(x, y)
        trajectory.append([array.get_model_weights(b) for b in range(B)])
        callback.on_epoch_end(epoch, model_logs(values, callback.monitor))
        if after is not None:
            after(epoch)
    return trajectory


def stock_model(learning_rate=0.01):
    model = mlp()
    model.compile(keras.optimizers.SGD(learning_rate), loss="mse")
    return model


# -- helpers ----------------------------------------------------------------


def test_split_logs_separates_per_model_values_from_shared_ones():
    logs = {"loss": 1.0, "loss_0": 0.5, "loss_1": 1.0, "loss_2": 1.5,
            "top_1": 2.0, "top_1_0": 1.0, "top_1_1": 2.0, "top_1_2": 3.0,
            "lr_0": 0.1, "lr_1": 0.2, "other": 7.0}
    per_model, shared = callbacks.split_logs(logs, B)
    assert per_model == {"loss": [0.5, 1.0, 1.5], "top_1": [1.0, 2.0, 3.0]}
    # `lr` lacks model 2: not a per-model quantity.
    assert shared == {"lr_0": 0.1, "lr_1": 0.2, "other": 7.0}


def test_monitor_direction_matches_stock_auto_mode():
    x, y = data()
    metrics = ["mae", "cosine_similarity"]
    array = make_array(metrics=metrics)
    array.evaluate(x, y, verbose=0)  # builds the compiled metrics
    stock = mlp()
    stock.compile("sgd", loss="mse", metrics=metrics)
    stock.evaluate(x, y, verbose=0)
    for name in ["loss", "val_loss", "mae", "val_cosine_similarity"]:
        oracle = keras.callbacks.EarlyStopping(monitor=name)
        oracle.set_model(stock)
        oracle._set_monitor_op()
        expected = "up" if oracle.monitor_op is keras.ops.greater else "down"
        assert callbacks.monitor_direction(array, name, B) == expected
        # Per-model names resolve too (stock Keras cannot resolve them).
        assert callbacks.monitor_direction(array, f"{name}_2", B) == expected
    # Before metrics are built, accuracy-like names still resolve.
    assert callbacks.monitor_direction(make_array(), "val_acc_1", B) == "up"
    with pytest.raises(ValueError, match="mode='max'"):
        callbacks.monitor_direction(array, "val_something", B)


def test_callbacks_refuse_a_plain_keras_model():
    for callback in [callbacks.EarlyStopping(),
                     callbacks.ReduceLROnPlateau(),
                     callbacks.LearningRateScheduler(lambda epoch, lr: lr),
                     callbacks.CSVLogger("unused.csv")]:
        callback.set_model(stock_model())
        with pytest.raises(TypeError, match="keras.callbacks"):
            callback.on_train_begin()


@pytest.mark.parametrize("stock, alternative", [
    (lambda: keras.callbacks.ReduceLROnPlateau(monitor="loss"),
     "hftatf.callbacks.ReduceLROnPlateau"),
    (lambda: keras.callbacks.LearningRateScheduler(lambda epoch, lr: lr),
     "hftatf.callbacks.LearningRateScheduler"),
    (lambda: keras.callbacks.TensorBoard("unused"),
     "hftatf.callbacks.TensorBoard"),
    (lambda: type("Mine", (keras.callbacks.ReduceLROnPlateau,), {})(),
     "hftatf.callbacks.ReduceLROnPlateau"),
])
def test_fit_refuses_stock_callbacks_that_read_one_learning_rate(
        stock, alternative):
    # They read the `[B]` rates as one float: without the check, fit fails
    # at the end of its first epoch with a numpy conversion error (a
    # subclass too).
    array = make_array()
    x, y = data()
    before = array.get_weights()
    for given in ([stock()], keras.callbacks.CallbackList([stock()])):
        with pytest.raises(ValueError, match=alternative):
            array.fit(x, y, epochs=1, verbose=0, callbacks=given)
    assert same_weights(array.get_weights(), before)


# -- EarlyStopping ----------------------------------------------------------


def test_early_stopping_freezes_one_model_while_others_train():
    x, y = data()
    array = make_array()
    # Model 1 stops improving after epoch 1; models 0 and 2 keep improving.
    sequence = [[1.0, 1.0, 1.0], [0.9, 0.8, 0.9], [0.8, 0.9, 0.8],
                [0.7, 0.9, 0.7], [0.6, 0.95, 0.6]]
    early = callbacks.EarlyStopping(patience=2)
    trajectory = drive(early, array, sequence, x, y)
    assert early.stopped_epoch == [0, 3, 0]
    assert early.best == [0.6, 0.8, 0.6]
    assert early.best_epoch == [4, 1, 4]
    assert list(array.active_models) == [True, False, True]
    assert not array.stop_training
    # Model 1 was frozen at the end of epoch 3: its weights never change
    # again, bit for bit, while the others still train.
    assert same_weights(trajectory[4][1], trajectory[3][1])
    for b in (0, 2):
        assert not same_weights(trajectory[4][b], trajectory[3][b])
    array.train_on_batch(x, y)
    assert same_weights(array.get_model_weights(1), trajectory[3][1])


def test_early_stopping_ends_training_once_every_model_stopped():
    array = make_array()
    sequence = [[1.0, 1.0, 1.0], [1.1, 0.9, 0.9], [1.2, 1.0, 0.8],
                [1.3, 1.1, 0.85]]
    early = callbacks.EarlyStopping(patience=1)
    stopped = []
    drive(early, array, sequence,
          after=lambda epoch: stopped.append(bool(array.stop_training)))
    assert early.stopped_epoch == [1, 2, 3]
    assert stopped == [False, False, False, True]

    array = make_array()
    early = callbacks.EarlyStopping(patience=1,
                                    stop_training_when_all_stopped=False)
    drive(early, array, sequence)
    assert not array.active_models.any() and not array.stop_training


def test_early_stopping_freezes_moving_statistics_too():
    x, y = data()
    array = hftatf.fuse(keras.Sequential([
        keras.Input((4,)), keras.layers.Dense(8),
        keras.layers.BatchNormalization(), keras.layers.Dense(1)]), B)
    array.compile(hftatf.optimizers.SGD(LEARNING_RATES), loss="mse",
                  jit_compile=STEP_JIT)
    early = callbacks.EarlyStopping(patience=0)
    trajectory = drive(early, array, [[1.0, 1.0, 1.0], [0.9, 1.1, 0.9],
                                      [0.8, 1.2, 0.8]], x, y)
    assert early.stopped_epoch == [0, 1, 0]
    assert same_weights(trajectory[2][1], trajectory[1][1])


EARLY_STOPPING_CASES = {
    "patience": dict(patience=2),
    "min_delta_max": dict(min_delta=0.05, mode="max", patience=1),
    "baseline": dict(baseline=0.3, patience=2),
    "warm_up": dict(start_from_epoch=3, patience=1, min_delta=0.01),
}


@pytest.mark.parametrize("case", sorted(EARLY_STOPPING_CASES))
def test_early_stopping_matches_stock_per_model(case):
    kwargs = EARLY_STOPPING_CASES[case]
    rng = np.random.default_rng(sorted(EARLY_STOPPING_CASES).index(case))
    epochs = 10
    sequence = rng.uniform(0.0, 1.0, size=(epochs, B))
    array = make_array()
    ours = callbacks.EarlyStopping(**kwargs)
    drive(ours, array, sequence)

    for b in range(B):
        stock = keras.callbacks.EarlyStopping(**kwargs)
        stock.set_model(stock_model())
        stock.on_train_begin()
        for epoch in range(epochs):
            stock.on_epoch_end(epoch, {"val_loss": float(sequence[epoch, b])})
            if stock.model.stop_training:
                break
        assert ours.stopped_epoch[b] == stock.stopped_epoch, b
        assert ours.best[b] == stock.best, b
        assert ours.best_epoch[b] == stock.best_epoch, b
        assert bool(array.active_models[b]) == (not stock.stopped_epoch)


def test_early_stopping_per_model_baseline():
    array = make_array()
    sequence = [[0.5, 0.5, 0.5], [0.6, 0.6, 0.6], [0.7, 0.7, 0.7]]
    early = callbacks.EarlyStopping(patience=2, baseline=[0.2, 1.0, 0.2])
    drive(early, array, sequence)
    # Models 0 and 2 never beat their baseline of 0.2, so their patience
    # counts from the first epoch; model 1 beat its baseline at epoch 0.
    assert early.stopped_epoch == [1, 2, 1]
    with pytest.raises(ValueError, match="one value per model"):
        drive(callbacks.EarlyStopping(baseline=[0.1, 0.2]), array, sequence)


def test_restore_best_weights_restores_only_that_models_slice():
    x, y = data()
    array = make_array()
    # Model 1's best epoch is 1; it stops at epoch 3 (patience 2). Models
    # 0 and 2 are not stopped; their best epochs are 3 and 2.
    sequence = [[1.0, 1.0, 1.0], [0.9, 0.5, 0.9], [0.8, 0.7, 0.8],
                [0.7, 0.8, 0.85]]
    early = callbacks.EarlyStopping(patience=2, restore_best_weights=True)
    checked = {}

    def after(epoch):
        if epoch == 3:
            checked["weights"] = [array.get_model_weights(b)
                                  for b in range(B)]

    trajectory = drive(early, array, sequence, x, y, after=after)
    assert early.stopped_epoch == [0, 3, 0]
    # At its stop, model 1 went back to its epoch-1 weights; the others
    # were left exactly as they were.
    assert same_weights(checked["weights"][1], trajectory[1][1])
    assert not same_weights(trajectory[3][1], trajectory[1][1])
    for b in (0, 2):
        assert same_weights(checked["weights"][b], trajectory[3][b])
    # It stays there while the others train.
    array.train_on_batch(x, y)
    assert same_weights(array.get_model_weights(1), trajectory[1][1])
    assert not same_weights(array.get_model_weights(0), trajectory[3][0])
    # At the end each remaining model gets its own best epoch back, as stock
    # EarlyStopping restores a single model.
    early.on_train_end()
    assert early.best_epoch == [3, 1, 2]
    for b, best in enumerate(early.best_epoch):
        assert same_weights(array.get_model_weights(b), trajectory[best][b])


def test_early_stopping_in_fit_stops_models_independently():
    x, y = data(n=32)
    # Model 1 learns too slowly to improve by min_delta: it is stopped after
    # its second epoch, while models 0 and 2 train for all four.
    # Compiled as by default (XLA): the freeze holds in the compiled step.
    array = make_array(learning_rates=[0.05, 1e-7, 0.05], jit_compile="auto")
    early = callbacks.EarlyStopping(monitor="loss", min_delta=1e-3)
    seen = []
    record = keras.callbacks.LambdaCallback(on_epoch_end=lambda e, logs: (
        seen.append([array.get_model_weights(b) for b in range(B)])))
    history = array.fit(x, y, epochs=4, batch_size=8, verbose=0,
                        callbacks=[early, record])
    assert len(history.history["loss"]) == 4
    assert early.stopped_epoch == [0, 1, 0]
    assert same_weights(seen[3][1], seen[1][1])
    for b in (0, 2):
        assert not same_weights(seen[3][b], seen[2][b])


# -- ReduceLROnPlateau ------------------------------------------------------


REDUCE_CASES = {
    "default": dict(patience=2),
    "cooldown_min_lr": dict(patience=1, cooldown=2, factor=0.5, min_lr=0.02),
    "max_min_delta": dict(patience=1, mode="max", min_delta=0.05,
                          factor=0.3),
}


@pytest.mark.parametrize("case", sorted(REDUCE_CASES))
def test_reduce_lr_on_plateau_matches_stock_per_model(case):
    kwargs = REDUCE_CASES[case]
    rng = np.random.default_rng(sorted(REDUCE_CASES).index(case))
    epochs = 12
    sequence = rng.uniform(0.0, 1.0, size=(epochs, B))
    array = make_array()
    ours = callbacks.ReduceLROnPlateau(**kwargs)
    ours.set_model(array)
    ours.on_train_begin()
    stock = []
    for b in range(B):
        callback = keras.callbacks.ReduceLROnPlateau(**kwargs)
        callback.set_model(stock_model(LEARNING_RATES[b]))
        callback.on_train_begin()
        stock.append(callback)
    reductions = 0
    for epoch in range(epochs):
        logs = model_logs(sequence[epoch])
        ours.on_epoch_end(epoch, logs)
        for b, callback in enumerate(stock):
            stock_logs = {"val_loss": float(sequence[epoch, b])}
            callback.on_epoch_end(epoch, stock_logs)
            # The learning rate used in the epoch, logged before reducing.
            assert logs[f"learning_rate_{b}"] == stock_logs["learning_rate"]
        rates = array.optimizer.get_hyperparameter("learning_rate")
        expected = [keras.ops.convert_to_numpy(c.model.optimizer.learning_rate)
                    for c in stock]
        np.testing.assert_array_equal(rates, np.array(expected))
        reductions += int(np.any(rates != np.float32(LEARNING_RATES)))
    assert reductions > 0  # the sequence exercises the reductions


def test_reduce_lr_on_plateau_leaves_frozen_models_alone():
    array = make_array()
    array.freeze_models([1])
    reduce = callbacks.ReduceLROnPlateau(patience=0, min_delta=1.0)
    drive(reduce, array, [[1.0] * B] * 3)
    rates = array.optimizer.get_hyperparameter("learning_rate")
    assert rates[1] == np.float32(LEARNING_RATES[1])
    assert rates[0] < np.float32(LEARNING_RATES[0])


def test_reduce_lr_on_plateau_changes_training_of_that_model_only():
    x, y = data()
    array = make_array()
    reference = make_array()
    reference.set_weights(array.get_weights())
    reduce = callbacks.ReduceLROnPlateau(patience=0, min_delta=1.0)
    drive(reduce, array, [[1.0, 1.0, 1.0], [1.0, -1.0, 1.0]])
    # Same steps on both arrays; only model 1's rate was left unchanged
    # (it improved by more than min_delta at epoch 1).
    rates = array.optimizer.get_hyperparameter("learning_rate")
    assert rates[1] == np.float32(LEARNING_RATES[1])
    array.train_on_batch(x, y)
    reference.train_on_batch(x, y)
    assert same_weights(array.get_model_weights(1),
                        reference.get_model_weights(1))
    assert not same_weights(array.get_model_weights(0),
                            reference.get_model_weights(0))


def test_reduce_lr_on_plateau_refuses_schedules_and_large_factors():
    array = hftatf.fuse(mlp(), B)
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.9)
    array.compile(hftatf.optimizers.SGD(schedule), loss="mse")
    reduce = callbacks.ReduceLROnPlateau()
    reduce.set_model(array)
    with pytest.raises(TypeError, match="float learning rates"):
        reduce.on_train_begin()
    with pytest.raises(ValueError, match="factor"):
        callbacks.ReduceLROnPlateau(factor=1.0)


# -- LearningRateScheduler --------------------------------------------------


def step_decay(epoch, lr):
    return lr if epoch < 1 else lr * 0.5


def epoch_only(epoch):
    return 0.1 / (1 + epoch)


def restart(epoch, lr):
    return 0.08 if epoch % 2 == 0 else lr * 0.25


@pytest.mark.parametrize("schedule", [
    step_decay, epoch_only, [step_decay, restart, epoch_only]],
    ids=["shared", "epoch_only", "per_model"])
def test_learning_rate_scheduler_trains_like_stock_per_model(schedule):
    # The oracle: B stock models, each fit with the stock callback and its
    # model's schedule, from the same weights and on the same batches.
    x, y = data(n=16)
    stock = []
    for b in range(B):
        model = mlp()
        model.compile(keras.optimizers.SGD(LEARNING_RATES[b]), loss="mse")
        stock.append(model)
    array = hftatf.fuse_models(stock)
    array.compile(hftatf.optimizers.SGD(list(LEARNING_RATES)), loss="mse",
                  jit_compile=STEP_JIT)
    per_model = schedule if isinstance(schedule, list) else [schedule] * B
    epochs = 4
    history = array.fit(
        x, y, batch_size=8, epochs=epochs, shuffle=False, verbose=0,
        callbacks=[callbacks.LearningRateScheduler(schedule)]).history
    for b, model in enumerate(stock):
        expected = model.fit(
            x, y, batch_size=8, epochs=epochs, shuffle=False, verbose=0,
            callbacks=[keras.callbacks.LearningRateScheduler(
                per_model[b])]).history
        np.testing.assert_allclose(history[f"learning_rate_{b}"],
                                   expected["learning_rate"], rtol=0)
        np.testing.assert_allclose(history[f"loss_{b}"], expected["loss"],
                                   rtol=1e-5)
        for ours, theirs in zip(array.get_model_weights(b),
                                model.get_weights()):
            np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)
    # The rates did change (by each model's own rate, unless the schedule
    # reads the epoch alone).
    final = array.optimizer.get_hyperparameter("learning_rate")
    assert not np.allclose(final, np.float32(LEARNING_RATES))
    assert len(set(final.tolist())) == (1 if schedule is epoch_only else B)
    np.testing.assert_allclose(
        history["learning_rate"],
        np.mean([history[f"learning_rate_{b}"] for b in range(B)], axis=0),
        rtol=1e-6)


def test_learning_rate_scheduler_leaves_frozen_models_alone(capsys):
    array = make_array()
    array.freeze_models([1])
    scheduler = callbacks.LearningRateScheduler(
        lambda epoch, lr: lr * 0.5, verbose=1)
    scheduler.set_model(array)
    scheduler.on_train_begin()
    for epoch in range(2):
        scheduler.on_epoch_begin(epoch)
    rates = array.optimizer.get_hyperparameter("learning_rate")
    expected = np.float32(LEARNING_RATES) * np.float32([0.25, 1.0, 0.25])
    np.testing.assert_allclose(rates, expected, rtol=1e-6)
    assert "Epoch 2: LearningRateScheduler" in capsys.readouterr().out


def test_learning_rate_scheduler_argument_errors():
    with pytest.raises(TypeError, match="schedule"):
        callbacks.LearningRateScheduler(0.1)
    with pytest.raises(TypeError, match="schedule"):
        callbacks.LearningRateScheduler([step_decay, 0.1, step_decay])
    array = make_array()
    too_few = callbacks.LearningRateScheduler([step_decay, step_decay])
    too_few.set_model(array)
    with pytest.raises(ValueError, match="2 schedules for an array of 3"):
        too_few.on_train_begin()
    for output in [1, "0.1", [0.1, 0.2], None]:
        bad = callbacks.LearningRateScheduler(
            lambda epoch, lr, output=output: output)
        bad.set_model(array)
        bad.on_train_begin()
        with pytest.raises(ValueError, match="should be a float"):
            bad.on_epoch_begin(0)
    np.testing.assert_array_equal(
        array.optimizer.get_hyperparameter("learning_rate"),
        np.float32(LEARNING_RATES))
    scheduled = hftatf.fuse(mlp(), B)
    scheduled.compile(hftatf.optimizers.SGD(
        keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.9)),
        loss="mse")
    scheduler = callbacks.LearningRateScheduler(step_decay)
    scheduler.set_model(scheduled)
    with pytest.raises(TypeError, match="float learning rates"):
        scheduler.on_train_begin()


# -- loggers ----------------------------------------------------------------


def read_csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_csv_logger_writes_one_row_per_epoch_and_model(tmp_path):
    x, y = data()
    array = make_array()
    path = tmp_path / "log.csv"
    history = array.fit(x, y, epochs=2, batch_size=8, verbose=0,
                        validation_data=(x, y),
                        callbacks=[callbacks.CSVLogger(path)])
    rows = read_csv(path)
    assert list(rows[0]) == ["epoch", "model", "loss", "mae", "val_loss",
                             "val_mae", "learning_rate"]
    assert [(int(r["epoch"]), int(r["model"])) for r in rows] == [
        (e, b) for e in range(2) for b in range(B)]
    for row in rows:
        epoch, b = int(row["epoch"]), int(row["model"])
        for name in ["loss", "mae", "val_loss", "val_mae"]:
            assert float(row[name]) == history.history[f"{name}_{b}"][epoch]
        assert np.float32(float(row["learning_rate"])) == np.float32(
            LEARNING_RATES[b])

    # Appending keeps the header and adds rows.
    array.fit(x, y, epochs=1, batch_size=8, verbose=0,
              callbacks=[callbacks.CSVLogger(path, append=True)])
    rows = read_csv(path)
    assert len(rows) == 3 * B
    # No validation in the appended epoch: its val_ columns are NA.
    assert rows[-1]["val_loss"] == "NA" and rows[-1]["loss"] != "NA"


def test_csv_logger_records_reduced_learning_rates(tmp_path):
    array = make_array()
    path = tmp_path / "log.csv"
    logger = callbacks.CSVLogger(path, separator=";")
    logger.set_model(array)
    logger.on_train_begin()
    for epoch in range(2):
        array.optimizer.set_hyperparameter(
            "learning_rate", [lr / (epoch + 1) for lr in LEARNING_RATES])
        logger.on_epoch_end(epoch, model_logs([0.1, 0.2, 0.3], "loss"))
    logger.on_train_end()
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f, delimiter=";"))
    assert list(rows[0]) == ["epoch", "model", "loss", "val_loss",
                             "learning_rate"]
    assert [float(r["loss"]) for r in rows] == [0.1, 0.2, 0.3] * 2
    assert [r["val_loss"] for r in rows] == ["NA"] * 6
    rates = [np.float32(float(r["learning_rate"])) for r in rows]
    assert rates == [np.float32(lr / (e + 1))
                     for e in range(2) for lr in LEARNING_RATES]


def test_loggers_record_learning_rates_reduced_during_fit(tmp_path):
    x, y = data()
    array = make_array()
    # min_delta=10: no epoch improves on the first, so every model's rate is
    # cut at the end of epoch 1 (patience 0).
    reduce = callbacks.ReduceLROnPlateau(monitor="loss", patience=0,
                                         min_delta=10.0)
    path = tmp_path / "log.csv"
    array.fit(x, y, epochs=3, batch_size=8, verbose=0, callbacks=[
        reduce, callbacks.CSVLogger(path),
        callbacks.TensorBoard(tmp_path / "tb")])
    rows = read_csv(path)
    assert list(rows[0]) == ["epoch", "model", "learning_rate", "loss",
                             "mae", "val_loss", "val_mae"]
    for b in range(B):
        # The rate each epoch was trained with.
        expected = [np.float32(LEARNING_RATES[b])] * 2 + [
            np.float32(float(np.float32(LEARNING_RATES[b])) * 0.1)]
        logged = [np.float32(float(r["learning_rate"])) for r in rows
                  if int(r["model"]) == b]
        assert logged == expected
        # Named after the rates given, as training began.
        scalars = read_events(
            tmp_path / "tb" / f"lr={LEARNING_RATES[b]}" / "train")
        assert [np.float32(scalars["epoch_learning_rate"][e])
                for e in range(3)] == expected


def read_events(directory):
    """`{tag: {step: value}}` of every scalar in a run directory (read by
    TensorFlow, which writes them on either backend)."""
    tf = pytest.importorskip("tensorflow")
    scalars = {}
    for path in glob.glob(os.path.join(directory, "events.out.tfevents.*")):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                assert value.metadata.plugin_data.plugin_name == "scalars"
                scalars.setdefault(value.tag, {})[event.step] = float(
                    tf.make_ndarray(value.tensor))
    return scalars


def test_tensorboard_writes_one_run_per_model(tmp_path):
    x, y = data()
    array = make_array()
    history = array.fit(x, y, epochs=2, batch_size=8, verbose=0,
                        validation_data=(x, y),
                        callbacks=[callbacks.TensorBoard(tmp_path)])
    # Each run is named after what varies between the models, written as
    # it was given; inside it, train/ and validation/ as stock Keras lays
    # out one model's run.
    runs = [f"lr={rate}" for rate in LEARNING_RATES]
    assert sorted(os.listdir(tmp_path)) == sorted(runs)
    for b, run in enumerate(runs):
        assert sorted(os.listdir(tmp_path / run)) == ["train", "validation"]
        train = read_events(tmp_path / run / "train")
        validation = read_events(tmp_path / run / "validation")
        assert sorted(train) == ["epoch_learning_rate", "epoch_loss",
                                 "epoch_mae"]
        assert sorted(validation) == ["epoch_loss", "epoch_mae"]
        for name in ["loss", "mae"]:
            for scalars, key in [(train, name), (validation, f"val_{name}")]:
                logged = history.history[f"{key}_{b}"]
                assert scalars[f"epoch_{name}"] == {
                    e: float(np.float32(v)) for e, v in enumerate(logged)}
        assert train["epoch_learning_rate"] == {
            e: float(np.float32(LEARNING_RATES[b])) for e in range(2)}
    with pytest.raises(ValueError, match="update_freq='epoch'"):
        callbacks.TensorBoard(tmp_path, update_freq="batch")


def test_tensorboard_run_names_tell_the_models_apart(tmp_path):
    optimizer = hftatf.optimizers.Adam([0.03, 0.03, 1e-4],
                                       beta_1=[0.9, 0.95, 0.9])
    assert callbacks.tensorboard.describe_models(optimizer, 3) == [
        "lr=0.03,beta_1=0.9", "lr=0.03,beta_1=0.95", "lr=0.0001,beta_1=0.9"]
    # Models that differ in nothing the optimizer holds (seeds) keep their
    # index; models alike in what varies get it first.
    assert callbacks.tensorboard.describe_models(
        hftatf.optimizers.SGD(0.1), 2) == ["model_0", "model_1"]
    assert callbacks.tensorboard.describe_models(
        hftatf.optimizers.SGD([0.1, 0.1, 0.2]), 3) == [
        "model_0,lr=0.1", "model_1,lr=0.1", "model_2,lr=0.2"]
    x, y = data()
    array = make_array([0.1, 0.1, 0.2])
    array.fit(x, y, epochs=1, batch_size=8, verbose=0,
              callbacks=[callbacks.TensorBoard(tmp_path,
                                               run_names=["a", None, "c"])])
    assert sorted(os.listdir(tmp_path)) == ["a", "c"]


# -- ModelCheckpoint --------------------------------------------------------


def stock_slices(array):
    """Each model's weights in stock `get_weights` order."""
    return [model.get_weights() for model in array.unfuse()]


def test_model_checkpoint_saves_each_models_best_weights(tmp_path):
    x, y = data()
    array = make_array()
    sequence = [[1.0, 1.0, 1.0], [0.9, 1.1, 0.8], [0.95, 0.9, 0.7],
                [0.8, 1.2, 0.9]]
    checkpoint = callbacks.ModelCheckpoint(
        str(tmp_path / "ckpt" / "model_{model}.keras"))
    checkpoint.set_model(array)
    checkpoint.on_train_begin()
    saved = []
    for epoch, values in enumerate(sequence):
        array.train_on_batch(x, y)
        saved.append(stock_slices(array))
        checkpoint.on_epoch_end(epoch, model_logs(values))
    assert checkpoint.best == [0.8, 0.9, 0.7]
    best_epochs = [3, 2, 2]
    assert sorted(os.listdir(tmp_path / "ckpt")) == [
        f"model_{b}.keras" for b in range(B)]  # no temporary files left
    for b in range(B):
        model = keras.models.load_model(tmp_path / "ckpt" / f"model_{b}.keras")
        assert type(model) is keras.Sequential
        assert same_weights(model.get_weights(), saved[best_epochs[b]][b])
        # The file holds model b exactly: it predicts as model b does.
        np.testing.assert_array_equal(
            model.predict(x, verbose=0),
            stock_model_with(saved[best_epochs[b]][b]).predict(x, verbose=0))


def stock_model_with(weights):
    model = mlp()
    model.set_weights(weights)
    return model


def test_model_checkpoint_formats_paths_with_model_logs(tmp_path):
    array = make_array()
    checkpoint = callbacks.ModelCheckpoint(
        str(tmp_path / "m{model}-{epoch:02d}-{val_loss:.2f}.weights.h5"),
        save_best_only=False, save_weights_only=True)
    drive(checkpoint, array, [[0.25, 0.5, 0.75]])
    assert sorted(os.listdir(tmp_path)) == [
        "m0-01-0.25.weights.h5", "m1-01-0.50.weights.h5",
        "m2-01-0.75.weights.h5"]
    expected = stock_slices(array)
    for b, value in enumerate(["0.25", "0.50", "0.75"]):
        model = mlp()
        model.load_weights(tmp_path / f"m{b}-01-{value}.weights.h5")
        assert same_weights(model.get_weights(), expected[b])


def test_model_checkpoint_never_leaves_a_partial_file(tmp_path, monkeypatch):
    array = make_array()
    path = tmp_path / "model_{model}.keras"
    checkpoint = callbacks.ModelCheckpoint(str(path), save_best_only=False)
    drive(checkpoint, array, [[1.0] * B])
    before = {b: (tmp_path / f"model_{b}.keras").read_bytes()
              for b in range(B)}

    def failing_save(self, filepath, **kwargs):
        with open(filepath, "wb") as f:
            f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(keras.Model, "save", failing_save)
    array.train_on_batch(*data())
    with pytest.raises(OSError, match="disk full"):
        checkpoint.on_epoch_end(1, model_logs([0.5] * B))
    # The previous checkpoints are intact and no temporary file remains.
    assert sorted(os.listdir(tmp_path)) == [
        f"model_{b}.keras" for b in range(B)]
    for b in range(B):
        assert (tmp_path / f"model_{b}.keras").read_bytes() == before[b]


def test_model_checkpoint_argument_errors():
    with pytest.raises(ValueError, match=r"\.keras"):
        callbacks.ModelCheckpoint("model_{model}.h6")
    with pytest.raises(ValueError, match=r"\.weights\.h5"):
        callbacks.ModelCheckpoint("m.keras", save_weights_only=True)
    with pytest.raises(ValueError, match="save_freq='epoch'"):
        callbacks.ModelCheckpoint("m.keras", save_freq=10)


def test_model_checkpoint_needs_a_file_per_model(tmp_path):
    # Without `{model}`, the B models would overwrite one file.
    checkpoint = callbacks.ModelCheckpoint(str(tmp_path / "best.keras"))
    checkpoint.set_model(make_array())
    with pytest.raises(ValueError, match="`{model}` field"):
        checkpoint.on_train_begin()
    checkpoint = callbacks.ModelCheckpoint(
        str(tmp_path / "m{model:02d}.keras"))
    checkpoint.set_model(make_array())
    checkpoint.on_train_begin()


# -- stock callbacks --------------------------------------------------------


def test_stock_callbacks_keep_working_on_scalar_logs():
    x, y = data()
    array = make_array()
    history = keras.callbacks.History()
    # min_delta=10: no epoch improves on the first, so training stops after
    # the second.
    early = keras.callbacks.EarlyStopping(monitor="loss", min_delta=10.0)
    # The user says it means the mean over the models.
    early.monitors_array_mean = True
    array.fit(x, y, epochs=5, batch_size=8, verbose=0,
              callbacks=[early, history])
    assert early.stopped_epoch == 1
    assert len(history.history["loss"]) == 2
    for epoch in range(2):
        np.testing.assert_allclose(
            history.history["loss"][epoch],
            np.mean([history.history[f"loss_{b}"][epoch] for b in range(B)]),
            rtol=1e-6)
