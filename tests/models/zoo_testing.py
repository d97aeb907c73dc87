"""Checks shared by the vision and point-cloud zoo tests: an array trained
with `fit` against B stock models trained alike, and export round trips."""

import keras
import numpy as np
from testing import ATOL, RTOL, assert_close

import hftatf

LOSS = "sparse_categorical_crossentropy"


def assert_fit_matches_stock(model, x, y, learning_rates, batch_size=8,
                             atol=ATOL, rtol=RTOL):
    """Fuses `model` into an array of `len(learning_rates)` models, trains it
    for one epoch of `x` with fused SGD, trains B stock copies of its start
    with stock SGD on the same batches, and asserts that every weight
    (BatchNormalization statistics included) and every loss agree. Returns
    the trained array.

    SGD without momentum keeps each step's update proportional to that
    step's gradient, so a wrong gradient cannot hide in optimizer state.
    Every model's trainable weights must move by at least 10x the tolerance,
    so that the comparison can tell training from no training, and a
    learning rate from its neighbour's.
    """
    num_models = len(learning_rates)
    array = hftatf.fuse(model, num_models)
    stock = array.unfuse()
    start = [[np.asarray(w).copy() for w in m.trainable_weights]
             for m in stock]
    # Eagerly: tracing these deep graphs would take most of the test, and
    # two steps need no graph.
    array.compile(hftatf.optimizers.SGD(learning_rates), loss=LOSS,
                  run_eagerly=True)
    history = array.fit(x, y, batch_size=batch_size, epochs=1,
                        shuffle=False, verbose=0)
    trained = array.unfuse()
    for b, reference in enumerate(stock):
        reference.compile(keras.optimizers.SGD(learning_rates[b]), loss=LOSS,
                          run_eagerly=True)
        stock_history = reference.fit(x, y, batch_size=batch_size, epochs=1,
                                      shuffle=False, verbose=0)
        for ours, theirs in zip(trained[b].weights, reference.weights):
            assert_close(ours, theirs, atol=atol, rtol=rtol,
                         err_msg=f"model {b} {theirs.path}")
        assert_close(history.history[f"loss_{b}"],
                     stock_history.history["loss"], atol=atol, rtol=rtol)
        moved = max(float(np.max(np.abs(np.asarray(w) - w0)))
                    for w, w0 in zip(reference.trainable_weights, start[b]))
        assert moved > 10 * atol, (b, moved)
    return array


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
