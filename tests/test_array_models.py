"""The models of an array as independent jobs: divergence isolation,
freezing, per-model weights, and select() to keep only some models."""

import logging

import keras
import numpy as np
import pytest
from testing import assert_close

import hftatf
from hftatf.training.divergence import finite_per_model as _finite_per_model

B = 3


def regressor():
    x = keras.Input((4,), name="x")
    h = keras.layers.Dense(8, activation="tanh", name="h")(x)
    return keras.Model(x, keras.layers.Dense(2, name="out")(h))


def data(seed=0, n=32):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(n, 4)).astype("float32"),
            rng.normal(size=(n, 2)).astype("float32"))


def array_with(optimizer, seed=0, jit_compile="auto"):
    keras.utils.set_random_seed(seed)
    array = hftatf.fuse(regressor(), B)
    array.compile(optimizer=optimizer, loss="mse", jit_compile=jit_compile)
    return array


# Isolation with XLA's kernels and with TensorFlow's own (the per-model
# selection of updates compiles differently).
JIT_COMPILE = pytest.mark.parametrize("jit_compile", [True, False],
                                      ids=["xla", "no_xla"])


def fit(array, epochs=3, **kwargs):
    x, y = data()
    return array.fit(x, y, batch_size=8, epochs=epochs, shuffle=False,
                     verbose=0, **kwargs)


@pytest.mark.parametrize("make_optimizer", [
    lambda rates: hftatf.optimizers.SGD(rates, momentum=0.9),
    lambda rates: hftatf.optimizers.Adam(rates),
], ids=["sgd_momentum", "adam"])
@JIT_COMPILE
def test_a_diverging_model_does_not_touch_the_others(make_optimizer,
                                                     jit_compile, caplog):
    healthy = array_with(make_optimizer([0.01, 0.02, 0.03]),
                         jit_compile=jit_compile)
    poisoned = array_with(make_optimizer([1e30, 0.02, 0.03]),
                          jit_compile=jit_compile)
    initial = poisoned.get_model_weights(0)
    fit(healthy)
    with caplog.at_level(logging.WARNING):
        history = fit(poisoned).history
    # Bit for bit: the other models never see model 0's failure.
    for index in (1, 2):
        for ours, theirs in zip(poisoned.get_model_weights(index),
                                healthy.get_model_weights(index)):
            np.testing.assert_array_equal(ours, theirs)
    assert list(poisoned.diverged_models) == [True, False, False]
    assert list(poisoned.active_models) == [False, True, True]
    # Frozen with its last finite weights; its loss is reported as NaN.
    frozen = poisoned.get_model_weights(0)
    assert all(np.all(np.isfinite(w)) for w in frozen)
    assert any(not np.array_equal(a, b) for a, b in zip(frozen, initial)) or (
        history["loss_0"][0] != history["loss_0"][0])
    assert np.isnan(history["loss_0"][-1])
    assert np.all(np.isfinite(history["loss"]))
    assert_close(history["loss"][-1],
                 np.mean([history["loss_1"][-1], history["loss_2"][-1]]))
    messages = [r.getMessage() for r in caplog.records
                if "diverged" in r.getMessage()]
    assert len(messages) == 1 and "Model 0" in messages[0]


# (An infinite rate is refused when the optimizer is made.)
@pytest.mark.parametrize("bad_rate", [3e38, 1e38],
                         ids=["largest", "overflowing"])
@JIT_COMPILE
def test_an_update_that_makes_weights_non_finite_is_undone(
        bad_rate, jit_compile, caplog):
    # Model 1's gradients are finite, its update (a rate whose product
    # with them overflows) is not: it must keep the
    # weights it had before that update, bit for bit, and the others must
    # train as in an array where model 1 is healthy.
    x, y = data()
    y = y * 1e3  # gradients large enough for 1e38 times them to overflow

    def trained(rates):
        array = array_with(hftatf.optimizers.SGD(rates),
                           jit_compile=jit_compile)
        initial = array.get_model_weights(1)
        with caplog.at_level(logging.WARNING):
            array.fit(x, y, batch_size=8, epochs=2, shuffle=False,
                      verbose=0)
        return array, initial

    healthy, _ = trained([0.01, 0.02, 0.03])
    caplog.clear()
    poisoned, initial = trained([0.01, bad_rate, 0.03])
    assert list(poisoned.diverged_models) == [False, True, False]
    assert int(keras.ops.convert_to_numpy(
        poisoned._status.diverged_at)[1]) == 1
    for ours, theirs in zip(poisoned.get_model_weights(1), initial):
        np.testing.assert_array_equal(ours, theirs)
    for index in (0, 2):
        for ours, theirs in zip(poisoned.get_model_weights(index),
                                healthy.get_model_weights(index)):
            np.testing.assert_array_equal(ours, theirs)
    messages = [r.getMessage() for r in caplog.records
                if "diverged" in r.getMessage()]
    assert len(messages) == 1 and "Model 1" in messages[0]
    assert "update made its weights non-finite" in messages[0]
    assert "weights it had before that update" in messages[0]


@JIT_COMPILE
def test_a_frozen_model_keeps_its_weights_and_optimizer_state(jit_compile):
    array = array_with(hftatf.optimizers.Adam([0.01, 0.02, 0.03]),
                       jit_compile=jit_compile)
    fit(array, epochs=1)
    array.freeze_models([1])
    weights = array.get_model_weights(1)
    slots = [np.asarray(v)[1].copy() for v in array.optimizer.variables
             if len(v.shape) and v.shape[0] == B]
    others = array.get_model_weights(0)
    fit(array, epochs=2)
    for ours, theirs in zip(array.get_model_weights(1), weights):
        np.testing.assert_array_equal(ours, theirs)
    after = [np.asarray(v)[1] for v in array.optimizer.variables
             if len(v.shape) and v.shape[0] == B]
    for ours, theirs in zip(after, slots):
        np.testing.assert_array_equal(ours, theirs)
    assert not np.array_equal(array.get_model_weights(0)[0], others[0])
    array.unfreeze_models([1])
    fit(array, epochs=1)
    assert not np.array_equal(array.get_model_weights(1)[0], weights[0])


def test_freezing_a_model_of_two_leaves_the_others_random_stream():
    # A seed generator's state has shape [2], an array of two's model
    # axis: it is no per-model state for a frozen model to keep.
    x, y = data(seed=3, n=16)

    def trained(freeze):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((x.shape[1],))
        hidden = keras.layers.Dropout(0.5)(keras.layers.Dense(8)(inputs))
        array = hftatf.fuse(keras.Model(inputs, keras.layers.Dense(2)(
            hidden)), 2)
        array.compile(hftatf.optimizers.SGD(0.1), loss="mse")
        if freeze:
            array.freeze_models([1])
        array.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
        return array.get_model_weights(0)

    for ours, theirs in zip(trained(True), trained(False)):
        np.testing.assert_array_equal(ours, theirs)


def test_model_indices_are_checked():
    array = array_with("sgd")
    for bad in ([3], [-1], [1.5], [True]):
        with pytest.raises(ValueError, match="indices"):
            array.freeze_models(bad)
    with pytest.raises(ValueError, match="per-model shape"):
        array.set_model_weights(0, [np.zeros((1,))] * len(array.weights))
    # A NumPy index, as `np.argmin` of the models' losses gives one.
    for index in (np.int64(2), np.array(2)):
        for ours, theirs in zip(array.get_model_weights(index),
                                array.get_model_weights(2)):
            np.testing.assert_array_equal(ours, theirs)
    array.freeze_models(np.array([0, 2]))
    assert list(array.active_models) == [False, True, False]


def test_set_model_weights_changes_one_model_only():
    array = array_with("sgd")
    other = array.get_model_weights(2)
    new = [np.full(w.shape, 0.5, w.dtype) for w in array.get_model_weights(0)]
    array.set_model_weights(0, new)
    for ours, theirs in zip(array.get_model_weights(0), new):
        np.testing.assert_array_equal(ours, theirs)
    for ours, theirs in zip(array.get_model_weights(2), other):
        np.testing.assert_array_equal(ours, theirs)


@pytest.mark.parametrize("make_optimizer", [
    lambda: hftatf.optimizers.Adam([0.01, 0.02, 0.03], beta_1=[0.9, 0.8, 0.7]),
    lambda: hftatf.optimizers.SGD(
        [keras.optimizers.schedules.ExponentialDecay(r, 4, 0.5)
         for r in (0.1, 0.05, 0.02)], momentum=0.9),
    lambda: hftatf.optimizers.SGD(hftatf.optimizers.schedules.CosineDecay(
        [0.1, 0.05, 0.02], decay_steps=20)),
    lambda: hftatf.optimizers.LossScaleOptimizer(
        hftatf.optimizers.Adam([0.01, 0.02, 0.03]), initial_scale=8.0,
        dynamic_growth_steps=3),
], ids=["adam", "stock_schedules", "fused_schedule", "loss_scale"])
def test_select_continues_the_kept_models_exactly(make_optimizer):
    array = array_with(make_optimizer())
    fit(array, epochs=2)
    kept = array.select([2, 0])
    assert kept.num_models == 2
    for new, old in ((0, 2), (1, 0)):
        for ours, theirs in zip(kept.get_model_weights(new),
                                array.get_model_weights(old)):
            np.testing.assert_array_equal(ours, theirs)
    assert int(kept.optimizer.iterations) == int(array.optimizer.iterations)
    fit(array, epochs=2)
    history = fit(kept, epochs=2).history
    assert "loss_1" in history and "loss_2" not in history
    for new, old in ((0, 2), (1, 0)):
        for ours, theirs in zip(kept.get_model_weights(new),
                                array.get_model_weights(old)):
            # Another array size, another float32 summation order.
            assert_close(ours, theirs, atol=1e-6, rtol=1e-6)


def test_select_below_the_models_per_pass_keeps_training():
    # Passes of 2 models; one model kept: its array runs passes of 1.
    array = array_with(hftatf.optimizers.SGD([0.01, 0.02, 0.03]))
    array.compile(array.optimizer, loss="mse", models_per_pass=2)
    fit(array, epochs=1)
    kept = array.select([1])
    assert kept.num_models == 1
    fit(array, epochs=1)
    fit(kept, epochs=1)
    for ours, theirs in zip(kept.get_model_weights(0),
                            array.get_model_weights(1)):
        assert_close(ours, theirs, atol=1e-6, rtol=1e-6)


def test_select_keeps_frozen_and_diverged_status():
    array = array_with(hftatf.optimizers.SGD([1e30, 0.02, 0.03]))
    fit(array, epochs=1)
    array.freeze_models([1])
    kept = array.select([0, 1])
    assert list(kept.diverged_models) == [True, False]
    assert list(kept.active_models) == [False, False]


@pytest.mark.parametrize("how", ["keras_file", "weights_file"])
def test_frozen_and_diverged_status_is_saved_and_loaded(tmp_path, how):
    array = array_with(hftatf.optimizers.SGD([1e30, 0.02, 0.03]))
    fit(array, epochs=1)
    array.freeze_models([1])
    steps = keras.ops.convert_to_numpy(array._status.diverged_at)
    if how == "keras_file":
        array.save(tmp_path / "array.keras")
        loaded = keras.models.load_model(tmp_path / "array.keras")
    else:
        array.save_weights(tmp_path / "array.weights.h5")
        loaded = array_with(hftatf.optimizers.SGD([1e30, 0.02, 0.03]))
        loaded.load_weights(tmp_path / "array.weights.h5")
    assert list(loaded.diverged_models) == [True, False, False]
    assert list(loaded.active_models) == [False, False, True]
    np.testing.assert_array_equal(
        keras.ops.convert_to_numpy(loaded._status.diverged_at), steps)
    # The frozen models stay as they were when training goes on.
    before = [loaded.get_model_weights(b) for b in range(B)]
    fit(loaded, epochs=1)
    for b in range(B):
        same = all(np.array_equal(w, v) for w, v in zip(
            loaded.get_model_weights(b), before[b]))
        assert same == (b < 2), b


def test_select_of_an_uncompiled_array_and_bad_indices():
    array = hftatf.fuse(regressor(), B)
    kept = array.select([1])
    assert kept.num_models == 1 and not kept.compiled
    for ours, theirs in zip(kept.get_model_weights(0),
                            array.get_model_weights(1)):
        np.testing.assert_array_equal(ours, theirs)
    with pytest.raises(ValueError, match="at least one"):
        array.select([])
    with pytest.raises(ValueError, match="indices"):
        array.select([5])


@pytest.mark.backends("tensorflow", reason="sparse gradients "
                      "(tf.IndexedSlices) and tf.function's modes")
@pytest.mark.parametrize("mode", ["eager", "graph", "xla"])
def test_finite_per_model_is_exact(mode):
    import tensorflow as tf

    big = np.float32(3e38)  # finite; two of them sum to inf
    dense = np.array([[big, big], [1.0, 2.0], [0.0, 0.0]], "float32")
    nan = dense.copy()
    nan[1, 0] = np.nan
    infs = dense.copy()
    infs[2] = [np.inf, -np.inf]  # their sum is NaN
    sparse = (np.array([[1.0, big], [2.0, np.nan], [big, 1.0]], "float32"),
              np.array([0, 2, 0], "int64"))

    def check(*tensors):
        return _finite_per_model(list(tensors), B)

    def run(*tensors):
        tensors = [tf.IndexedSlices(tf.constant(v), tf.constant(i),
                                    tf.constant([B, 2], "int64"))
                   if i is not None
                   else tf.constant(v) for v, i in tensors]
        if mode == "eager":
            return np.asarray(check(*tensors))
        return np.asarray(tf.function(check, jit_compile=mode == "xla")(
            *tensors))

    assert list(run((dense, None))) == [True, True, True]
    assert list(run((dense, None), (nan, None))) == [True, False, True]
    assert list(run((infs, None), (dense, None))) == [True, True, False]
    # Rows of models 0 (overflowing sum, finite) and 2 (NaN); none of 1.
    assert list(run((dense, None), sparse)) == [True, True, False]
    assert list(run((np.zeros((B,), "float32"), None))) == [True] * B


def test_models_diverging_in_one_epoch_are_reported_in_one_warning(caplog):
    num_models = 12
    keras.utils.set_random_seed(0)
    array = hftatf.fuse(regressor(), num_models)
    # Ten of them overflow at once.
    array.compile(optimizer=hftatf.optimizers.SGD(
        [1e30] * 10 + [0.01, 0.01]), loss="mse")
    with caplog.at_level(logging.WARNING):
        fit(array, epochs=2)
    assert array.diverged_models.tolist() == [True] * 10 + [False] * 2
    warnings = [r.getMessage() for r in caplog.records
                if "diverged" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith(
        f"10 models of array '{array.name}' diverged in epoch 1: 0 (step ")
    assert "and 2 more (`diverged_models` lists them all)" in warnings[0]
    assert "the other models train on" in warnings[0]
