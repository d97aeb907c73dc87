"""Checks shared by the vision and point-cloud zoo tests: an array trained
with `fit` against B stock models trained alike, and export round trips."""

import keras
import numpy as np
from testing import ATOL, BACKEND, RTOL, assert_close

import hftatf

LOSS = "sparse_categorical_crossentropy"

# Whether the zoo tests' few steps run eagerly: on TensorFlow, where
# tracing these deep graphs would take most of a test and two steps need
# no graph; not on JAX, where an eager step compiles each operation's
# program on its own, which takes longer than compiling the step.
EAGER = BACKEND != "jax"

# The validation share of scikit-learn's 1,797 digits that leaves 1,408 for
# training: 11 full batches of 128, so that a compiled step compiles once
# (a last batch of another size compiles it again: 17 s for a MobileNet
# array on JAX).
DIGITS_VALIDATION = 389 / 1797


def assert_fit_matches_stock(model, x, y, learning_rates, batch_size=8,
                             update_rtol=None, loss_rtol=RTOL, eager=EAGER):
    """Fuses `model` into an array of `len(learning_rates)` models, trains it
    for one epoch of `x` with fused SGD, trains B stock copies of its start
    with stock SGD on the same batches, and asserts that every weight
    (BatchNormalization statistics included) and every loss agree. Returns
    the trained array.

    SGD without momentum keeps each step's update proportional to that
    step's gradient, so a wrong gradient cannot hide in optimizer state.
    Every model's trainable weights must move by at least 100x the float32
    tolerance, so that the comparison tells training from no training.

    Args:
        update_rtol: None to compare the trained weights at the float32
            tolerance of `testing`. For networks whose training step
            amplifies float32 rounding (see test_mobilenet.py), a fraction:
            each weight's change must equal its stock twin's to that
            fraction of the model's largest change (of a trainable weight,
            or of a statistic for statistics).
        loss_rtol: the relative tolerance of the logged losses.
        eager: whether the array and the stock models run their steps
            eagerly.
    """
    num_models = len(learning_rates)
    array = hftatf.fuse(model, num_models)
    stock = array.unfuse()
    start = [[np.asarray(w).copy() for w in m.weights] for m in stock]
    array.compile(hftatf.optimizers.SGD(learning_rates), loss=LOSS,
                  run_eagerly=eager)
    history = array.fit(x, y, batch_size=batch_size, epochs=1,
                        shuffle=False, verbose=0)
    trained = array.unfuse()
    for b, reference in enumerate(stock):
        reference.compile(keras.optimizers.SGD(learning_rates[b]), loss=LOSS,
                          run_eagerly=eager)
        stock_history = reference.fit(x, y, batch_size=batch_size, epochs=1,
                                      shuffle=False, verbose=0)
        changes = [np.asarray(w) - w0
                   for w, w0 in zip(reference.weights, start[b])]
        largest = {trainable: _largest(changes, reference.weights, trainable)
                   for trainable in (True, False)}
        for ours, theirs, before, change in zip(
                trained[b].weights, reference.weights, start[b], changes):
            message = f"model {b} {theirs.path}"
            if update_rtol is None:
                assert_close(ours, theirs, err_msg=message)
            else:
                assert_close(np.asarray(ours) - before, change, rtol=0.0,
                             atol=update_rtol * largest[theirs.trainable]
                             + ATOL, err_msg=message)
        assert_close(history.history[f"loss_{b}"],
                     stock_history.history["loss"], rtol=loss_rtol,
                     err_msg=f"model {b} loss")
        assert largest[True] > 100 * ATOL, (b, largest)
    return array


def _largest(changes, weights, trainable):
    """The largest change of the trainable weights, or of the others."""
    return max([float(np.max(np.abs(change)))
                for change, weight in zip(changes, weights)
                if weight.trainable == trainable], default=0.0)


def assert_export_round_trip(array, x, directory, format="keras"):
    """Exports every model of `array` and checks that each loads with stock
    Keras and predicts what its slice of the array predicts."""
    hftatf.export_models(array, directory, format=format)
    outputs = array.predict(x, verbose=0)
    assert not np.allclose(outputs[:, 0], outputs[:, 1])
    for b in range(array.num_models):
        model = keras.models.load_model(
            directory / f"model_{b}" / "model.keras")
        assert_close(model.predict(x, verbose=0), outputs[:, b])
