"""Bad data is refused as bad data, not taken for bad hyper-parameters:
labels and sample weights that do not fit the array's B, class ids outside
the classes, and batches on which every model turns non-finite at once."""

import re

import keras
import numpy as np
import pytest
from testing import BACKEND

import hftatf
from hftatf.training import divergence

BATCH = 8


def classifier(classes=3):
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(8, activation="relu")(inputs)
    return keras.Model(inputs, keras.layers.Dense(
        classes, activation="softmax")(hidden))


def regressor():
    inputs = keras.Input((6,))
    return keras.Model(inputs, keras.layers.Dense(1)(inputs))


def inputs(n=16, seed=0):
    return np.random.default_rng(seed).normal(size=(n, 6)).astype("float32")


def class_ids(shape, classes=3, seed=1):
    return np.random.default_rng(seed).integers(0, classes, shape)


def array_of(build, num_models, loss, jit_compile="auto", rates=0.05):
    keras.utils.set_random_seed(0)
    array = hftatf.fuse(build(), num_models)
    array.compile(hftatf.optimizers.SGD(rates), loss=loss,
                  jit_compile=jit_compile)
    return array


def weights_of(array):
    return [keras.ops.convert_to_numpy(w).copy() for w in array.weights]


def assert_untrained(array, before):
    for ours, theirs in zip(weights_of(array), before):
        np.testing.assert_array_equal(ours, theirs)
    assert not array.diverged_models.any()
    assert array.active_models.all()


# What a TensorFlow kernel raises on bad class ids (outside XLA); JAX's
# kernels raise nothing.
if BACKEND == "tensorflow":
    import tensorflow as tf

    KERNEL_ERRORS = (tf.errors.InvalidArgumentError,)
else:
    KERNEL_ERRORS = ()

JIT_COMPILE = pytest.mark.parametrize("jit_compile", [True, False],
                                      ids=["xla", "no_xla"])

# (model, B, loss, labels, sample weights, the received shape and the
# shapes the error must name as fitting).
SHAPE_CASES = {
    "mse_labels_of_3_models_for_4": (
        regressor, 4, "mse", np.zeros((16, 3, 1), "float32"), None,
        "3, 1)", ["(batch, 1)", "(batch, 4, 1)"]),
    "sample_weights_of_5_models_for_4": (
        regressor, 4, "mse", np.zeros((16, 1), "float32"),
        np.ones((16, 5), "float32"), "5)", ["(batch)", "(batch, 4)"]),
    # A weight per class: Keras's losses weigh one value per sample.
    "sample_weights_along_the_classes": (
        classifier, 2, "sparse_categorical_crossentropy", class_ids((16,)),
        np.ones((16, 2, 3), "float32"), "2, 3)", ["(batch)", "(batch, 2)"]),
    "class_ids_of_3_models_for_4": (
        classifier, 4, "sparse_categorical_crossentropy",
        class_ids((16, 3)), None, "3)", ["(batch)", "(batch, 4)"]),
    "one_hot_labels_of_5_classes_for_3": (
        classifier, 3, "categorical_crossentropy",
        np.eye(5, dtype="float32")[class_ids((16, 3), classes=5)], None,
        "3, 5)", ["(batch, 3)", "(batch, 3, 3)"]),
}


@pytest.mark.parametrize("case", sorted(SHAPE_CASES))
def test_labels_and_weights_that_fit_no_reading_are_refused_first(case):
    build, num_models, loss, y, weights, received, fitting = SHAPE_CASES[case]
    array = array_of(build, num_models, loss)
    before = weights_of(array)
    with pytest.raises(ValueError, match=re.escape(received)) as error:
        array.fit(inputs(), y, sample_weight=weights, batch_size=BATCH,
                  verbose=0)
    for shape in fitting:
        assert shape in str(error.value), (shape, str(error.value))
    assert f"num_models={num_models}" in str(error.value)
    assert_untrained(array, before)


def stock_refuses(x, y, jit_compile):
    keras.utils.set_random_seed(0)
    model = classifier()
    model.compile("sgd", "sparse_categorical_crossentropy",
                  jit_compile=jit_compile)
    try:
        history = model.fit(x, y, batch_size=BATCH, verbose=0).history
    except KERNEL_ERRORS as error:
        assert "outside the valid range" in str(error)
        return True
    # No error: TensorFlow's XLA kernel gives NaN; JAX's, a finite loss
    # (the id taken in range).
    assert np.isnan(history["loss"][-1]) == (BACKEND == "tensorflow")
    return False


@pytest.mark.parametrize("bad", [7, -1])
@pytest.mark.parametrize("per_model", [False, True],
                         ids=["shared", "per_model"])
@JIT_COMPILE
def test_class_ids_outside_the_classes_are_refused(bad, per_model,
                                                   jit_compile):
    x = inputs()
    y = class_ids((16, 3) if per_model else (16,))
    if per_model:
        y[11, 2] = bad  # model 2's label in the second batch
    else:
        y[11] = bad
    # Stock Keras refuses them where TensorFlow's kernel runs.
    assert stock_refuses(x, y[:, 2] if per_model else y, jit_compile) == (
        BACKEND == "tensorflow" and not jit_compile)
    def after_a_clean_batch():
        array = array_of(classifier, 3, "sparse_categorical_crossentropy",
                         jit_compile=jit_compile)
        array.fit(x[:8], y[:8], batch_size=BATCH, shuffle=False,
                  verbose=0)
        return array

    array, reference = after_a_clean_batch(), after_a_clean_batch()
    with pytest.raises((ValueError, *KERNEL_ERRORS),
                       match="outside"):
        array.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    # The first batch trained every model; the second, none.
    reference.fit(x[:8], y[:8], batch_size=BATCH, shuffle=False,
                  verbose=0)
    assert_untrained(array, weights_of(reference))


def test_the_class_ids_a_loss_ignores_are_no_error():
    y = class_ids((16,))
    y[3] = -1
    array = array_of(classifier, 3, keras.losses.SparseCategoricalCrossentropy(
        ignore_class=-1))
    array.fit(inputs(), y, batch_size=BATCH, verbose=0)
    assert not array.diverged_models.any()


def test_the_error_names_the_batch_and_what_is_wrong_with_it():
    x, y = inputs(), class_ids((16,))
    x[12, 4] = np.nan  # the second batch
    array = array_of(classifier, 3, "sparse_categorical_crossentropy")
    with pytest.raises(ValueError, match="batch 1 of epoch 0") as error:
        array.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    message = str(error.value)
    assert "inputs hold NaN or infinite values" in message
    assert "every model" in message
    assert "labels" not in message and "sample weights" not in message
    assert not array.diverged_models.any() and array.active_models.all()
    # Nothing of the refused batch stays: clean data trains every model.
    x[12, 4] = 0.0
    history = array.fit(x, y, batch_size=BATCH, verbose=0).history
    assert all(np.isfinite(history[f"loss_{b}"][-1]) for b in range(3))
    assert not array.diverged_models.any()


def test_all_nan_sample_weights_are_named():
    x, y = inputs(), class_ids((16,))
    weights = np.full((16,), np.nan, "float32")
    array = array_of(classifier, 3, "sparse_categorical_crossentropy")
    before = weights_of(array)
    with pytest.raises(ValueError, match="sample weights hold NaN"):
        array.fit(x, y, sample_weight=weights, batch_size=BATCH, verbose=0)
    assert_untrained(array, before)


def test_train_on_batch_refuses_a_bad_batch_too():
    x, y = inputs(8), class_ids((8,))
    x[0, 0] = np.inf
    array = array_of(classifier, 3, "sparse_categorical_crossentropy")
    before = weights_of(array)
    with pytest.raises(ValueError, match="inputs hold NaN or infinite"):
        array.train_on_batch(x, y)
    assert_untrained(array, before)


def test_every_model_diverging_at_once_on_clean_data_stops_training():
    # Rates that make every model's loss overflow on the second step: the
    # data is clean, and the error says so.
    array = array_of(regressor, 3, "mse", rates=1e30)
    x = inputs()
    y = np.ones((16, 1), "float32")
    with pytest.raises(ValueError, match="learning rates too large"):
        array.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False,
                  verbose=0)
    assert not array.diverged_models.any()


def test_one_model_diverging_alone_still_trains_the_others():
    array = array_of(regressor, 3, "mse", rates=[0.01, 1e30, 0.01])
    x, y = inputs(), np.ones((16, 1), "float32")
    array.fit(x, y, batch_size=BATCH, epochs=2, verbose=0)
    assert list(array.diverged_models) == [False, True, False]


@pytest.mark.parametrize("seconds", [0.0, 1e9], ids=["every", "epoch"])
def test_no_model_trains_past_a_refused_batch(monkeypatch, seconds):
    # The refused batch is checked once later steps are under way (at the
    # epoch's end where checks are rare; on JAX, where batch ends run
    # beside the next steps, always): they must not train any model
    # either, and the count of refused steps names the batch.
    monkeypatch.setattr(divergence, "_CHECK_SECONDS", seconds)
    x, y = inputs(48), class_ids((48,))
    x[10, 2] = np.nan  # the second of six batches
    array = array_of(classifier, 3, "sparse_categorical_crossentropy")
    clean = array_of(classifier, 3, "sparse_categorical_crossentropy")
    clean.fit(x[:BATCH], y[:BATCH], batch_size=BATCH, verbose=0)
    with pytest.raises(ValueError, match="batch 1 of epoch 0"):
        array.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    # One step at this rate moves weights by 1e-4 and more; XLA on the CPU
    # may round the two arrays' programs an ulp apart.
    for ours, theirs in zip(weights_of(array), weights_of(clean)):
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-7)
    assert not array.diverged_models.any() and array.active_models.all()
    # The flags the interrupted fit left refuse no later batch.
    array.train_on_batch(x[:BATCH], y[:BATCH])


def test_refused_calls_leave_the_array_as_it_was():
    # A refused call between others (a predict, an evaluate, a fit, each
    # given data that does not fit) neither brings back weights set
    # before it nor leaves the array unable to go on.
    x, y = inputs(), class_ids((16,))
    array = array_of(classifier, 2, "sparse_categorical_crossentropy")
    array.fit(x, y, batch_size=BATCH, verbose=0)
    with pytest.raises(ValueError):
        array.predict(x[:, :5], verbose=0)
    weights = [np.full_like(w, 0.25) for w in weights_of(array)]
    array.set_weights(weights)
    wrong_labels = class_ids((16, 3))
    with pytest.raises(ValueError, match="Cannot match labels"):
        array.evaluate(x, wrong_labels, verbose=0)
    with pytest.raises(ValueError, match="Cannot match labels"):
        array.fit(x, wrong_labels, batch_size=BATCH, verbose=0)
    for ours, theirs in zip(weights_of(array), weights):
        np.testing.assert_array_equal(ours, theirs)
    array.evaluate(x, y, verbose=0)
    array.fit(x, y, batch_size=BATCH, verbose=0)
    assert all(np.isfinite(w).all() for w in weights_of(array))


def test_labels_without_a_model_axis_under_per_model_labels_are_refused():
    x, y = inputs(), class_ids((16,))
    array = hftatf.fuse(classifier(), 2)
    array.compile(hftatf.optimizers.SGD(0.05),
                  loss="sparse_categorical_crossentropy",
                  per_model_labels=True)
    before = weights_of(array)
    with pytest.raises(ValueError, match=re.escape(
            "per_model_labels=True, so its labels need a model axis of 2 "
            "(`[batch, 2, ...]`")):
        array.fit(x, y, batch_size=BATCH, verbose=0)
    assert_untrained(array, before)
