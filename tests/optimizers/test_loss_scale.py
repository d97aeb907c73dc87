"""The fused LossScaleOptimizer against B stock loss-scale optimizers.

Each model has its own dynamic loss scale: model b's scale, growth counter,
skipped steps, variables and slots must follow exactly those of a stock
`keras.optimizers.LossScaleOptimizer` fed model b's slice of the (already
loss-scaled) gradients, and one model's overflow must never touch another.
"""

import os
import subprocess
import sys

import keras
import numpy as np
import pytest
from backend_steps import apply_stock, apply_stock_per_model, compiled
from keras import ops
from testing import (
    STEP_JIT,
    assert_close,
    assert_slices_match,
    per_model_arrays,
    stock_variables,
    value_and_gradients,
)

import hftatf
from hftatf import optimizers

B = 3
SHAPES = [(5,), (2, 3)]
INNER = {
    "SGD": ({"learning_rate": [0.1, 0.05, 0.2], "momentum": [0.9, 0.5, 0.7]},
            ("momentums",)),
    "Adam": ({"learning_rate": [0.01, 0.003, 0.05],
              "beta_1": [0.9, 0.8, 0.5]}, ("_momentums", "_velocities")),
}
INITIAL_SCALE = 16.0
GROWTH_STEPS = 2
# (step, model, value): non-finite gradients. Model 1 overflows twice in a
# row, model 0 once, and at step 6 every model overflows.
NON_FINITE = [(2, 1, np.inf), (3, 1, np.nan), (5, 0, -np.inf), (6, 0, np.nan),
              (6, 1, np.inf), (6, 2, np.inf)]
STEPS = 9


def for_model(values, model):
    return {name: value[model] if isinstance(value, list) else value
            for name, value in values.items()}


def make_pair(inner, seed=0, **scaling):
    """A fused LossScaleOptimizer, its B stock twins, and their variables."""
    values, _ = INNER[inner]
    scaling = dict(dict(initial_scale=INITIAL_SCALE,
                        dynamic_growth_steps=GROWTH_STEPS), **scaling)
    stock = [keras.optimizers.LossScaleOptimizer(
        getattr(keras.optimizers, inner)(**for_model(values, b)), **scaling)
        for b in range(B)]
    fused = optimizers.LossScaleOptimizer(
        getattr(optimizers, inner)(**values), **scaling)
    initial = per_model_arrays(np.random.default_rng(seed), SHAPES, B)
    fused_vars = [keras.Variable(value) for value in initial]
    stock_vars = [stock_variables(initial, b) for b in range(B)]
    return fused, fused_vars, stock, stock_vars


def scaled_gradients(steps=STEPS, non_finite=NON_FINITE, seed=1):
    """Gradients of the scaled losses (a few times the scale), with the
    non-finite values of `non_finite`."""
    rng = np.random.default_rng(seed)
    grads = [per_model_arrays(rng, SHAPES, B, scale=INITIAL_SCALE)
             for _ in range(steps)]
    for step, model, value in non_finite:
        if step < steps:
            grads[step][step % len(SHAPES)][model].flat[step % 5] = value
    return grads


def assert_state_matches(name, fused, fused_vars, stock, stock_vars,
                         err_msg=""):
    np.testing.assert_array_equal(
        fused.dynamic_scale.numpy(),
        [opt.dynamic_scale.numpy() for opt in stock], err_msg=err_msg)
    np.testing.assert_array_equal(
        fused.step_counter.numpy(),
        [opt.step_counter.numpy() for opt in stock], err_msg=err_msg)
    np.testing.assert_array_equal(
        np.asarray(fused.model_iterations),
        [int(opt.iterations) for opt in stock], err_msg=err_msg)
    assert_slices_match(fused_vars, stock_vars, err_msg=err_msg)
    for slot in INNER[name][1]:
        assert_slices_match(
            getattr(fused.inner_optimizer, slot),
            [getattr(opt.inner_optimizer, slot) for opt in stock],
            err_msg=f"{err_msg} slot {slot}")


@pytest.mark.parametrize("mode", ["eager", "graph", "xla"])
@pytest.mark.parametrize("name", ["SGD", "Adam"])
def test_matches_stock_loss_scale_optimizers_per_model(name, mode):
    fused, fused_vars, stock, stock_vars = make_pair(name)

    def apply(grads):
        fused.apply_gradients(zip(grads, fused_vars))

    if mode != "eager":
        apply = compiled(apply, fused, fused_vars,
                         jit_compile=mode == "xla")
    for step, grads in enumerate(scaled_gradients()):
        apply_stock_per_model(stock, stock_vars, grads)
        apply(grads)
        assert_state_matches(name, fused, fused_vars, stock, stock_vars,
                             err_msg=f"step {step}")
    # The scenario did skip steps, grow and shrink scales, per model.
    assert len(set(fused.dynamic_scale.numpy())) == B
    # Steps applied to at least one model (step 6 skipped every model).
    assert int(fused.iterations) == STEPS - 1


def test_one_models_overflow_leaves_the_others_bit_for_bit():
    runs = {}
    for overflow in (False, True):
        # Model 1 gets a huge finite gradient, then inf and NaN.
        non_finite = [(1, 1, 3e38), (2, 1, np.inf), (4, 1, np.nan)]
        fused, fused_vars, _, _ = make_pair("Adam")
        for grads in scaled_gradients(6, non_finite if overflow else []):
            fused.apply_gradients(zip(grads, fused_vars))
        runs[overflow] = (
            [v.numpy() for v in fused_vars + fused.variables
             if len(v.shape) and v.shape[0] == B],
            fused.dynamic_scale.numpy())
    for clean, overflowed in zip(runs[False][0], runs[True][0]):
        np.testing.assert_array_equal(overflowed[[0, 2]], clean[[0, 2]])
    assert runs[True][1][1] < runs[False][1][1]
    assert np.all(np.isfinite(runs[True][0][0]))


def test_a_mask_restricts_the_step_and_the_scale_update():
    fused, fused_vars, stock, stock_vars = make_pair("SGD")
    masks = [[1, 1, 1], [1, 0, 1], [0, 1, 1], [1, 1, 0], [1, 1, 1]]
    for step, (grads, mask) in enumerate(zip(scaled_gradients(5), masks)):
        for b in np.flatnonzero(mask):
            apply_stock(stock[b], [g[b] for g in grads], stock_vars[b])
        fused.apply_gradients(zip(grads, fused_vars),
                              model_mask=np.array(mask, bool))
        assert_state_matches("SGD", fused, fused_vars, stock, stock_vars,
                             err_msg=f"step {step}")


# -- scaling the losses ------------------------------------------------------


def test_scale_model_losses_scales_each_models_gradient_by_its_scale():
    fused, fused_vars, stock, stock_vars = make_pair("SGD")
    weights = np.array([1.0, -2.0, 0.5], "float32")

    def fused_gradient():
        def loss():
            losses = ops_sum_of_squares(fused_vars[1]) * weights
            return None, fused.scale_model_losses(losses)

        return value_and_gradients(loss, [], [fused_vars[1]],
                                   state=fused.variables)[2][0]

    def stock_gradient(b):
        def loss():
            return None, stock[b].scale_loss(
                ops.sum(ops.square(stock_vars[b][1])) * weights[b])

        return value_and_gradients(loss, [], [stock_vars[b][1]],
                                   state=stock[b].variables)[2][0]

    # Before the first step: the initial scale.
    assert_close(fused_gradient(), [stock_gradient(b) for b in range(B)])
    for grads in scaled_gradients(4):
        apply_stock_per_model(stock, stock_vars, grads)
        fused.apply_gradients(zip(grads, fused_vars))
    # By now the scales differ per model.
    assert len(set(fused.dynamic_scale.numpy())) > 1
    assert_close(fused_gradient(), [stock_gradient(b) for b in range(B)])


def ops_sum_of_squares(variable):
    return ops.sum(ops.square(variable), axis=[1, 2])


def test_scale_loss_needs_the_per_model_losses():
    fused, _, _, _ = make_pair("SGD")
    assert_close(fused.scale_loss(np.array([1.0, 2.0, 3.0], "float32")),
                 [16.0, 32.0, 48.0])
    with pytest.raises(ValueError, match="per-model losses"):
        fused.scale_loss(np.float32(1.0))


# -- the wrapper: hyper-parameters, counts, config, checkpoints --------------


def test_delegates_to_the_inner_optimizer():
    inner = optimizers.SGD(learning_rate=0.1, momentum=0.9, use_ema=True,
                           ema_momentum=[0.5, 0.6, 0.7])
    fused = optimizers.LossScaleOptimizer(inner)
    assert fused.num_models == B
    assert fused.hyperparameter_names == inner.hyperparameter_names
    fused.set_hyperparameter("momentum", [0.1, 0.2, 0.3])
    assert_close(inner.get_hyperparameter("momentum"), [0.1, 0.2, 0.3])
    fused.learning_rate = [0.3, 0.2, 0.1]
    assert_close(fused.learning_rate, [0.3, 0.2, 0.1])
    assert_close(fused.get_hyperparameter("learning_rate"), [0.3, 0.2, 0.1])
    variables = [keras.Variable(v) for v in per_model_arrays(
        np.random.default_rng(0), SHAPES, B)]
    for grads in scaled_gradients(2, []):
        fused.apply_gradients(zip(grads, variables))
    assert int(fused.iterations) == 2
    np.testing.assert_array_equal(np.asarray(fused.model_iterations), [2] * B)
    assert all(any(v is w for w in fused.variables) for v in inner.variables)
    fused.finalize_variable_values(variables)
    np.testing.assert_array_equal(
        variables[0].numpy(), inner._model_variables_moving_average[0].numpy())
    assert inner.loss_scale_factor is None


def test_num_models_is_the_inner_optimizers():
    inner = optimizers.Adam()
    fused = optimizers.LossScaleOptimizer(inner)
    fused.num_models = 4
    assert inner.num_models == 4
    with pytest.raises(ValueError, match="3"):
        optimizers.LossScaleOptimizer(optimizers.Adam(num_models=4)).build(
            [keras.Variable(np.zeros((3, 2), "float32"))])


@pytest.mark.parametrize("inner", [
    "sgd", keras.optimizers.Adam(0.01), optimizers.Adam([0.1, 0.2, 0.3])],
    ids=["name", "stock", "fused"])
def test_inner_optimizer_is_converted(inner):
    fused = optimizers.LossScaleOptimizer(inner)
    assert isinstance(fused.inner_optimizer, optimizers.FusedOptimizer)
    assert isinstance(fused, keras.optimizers.LossScaleOptimizer)


@pytest.mark.parametrize("kwargs, match", [
    (dict(dynamic=False), "dynamic"),
    (dict(clipnorm=1.0), "clipnorm"),
    (dict(use_ema=True), "use_ema"),
    (dict(foo=1), "foo"),
])
def test_unsupported_arguments_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        optimizers.LossScaleOptimizer(optimizers.SGD(), **kwargs)


def test_inner_optimizer_that_cannot_be_fused_raises():
    with pytest.raises(TypeError):
        optimizers.LossScaleOptimizer(object())


def test_config_round_trip():
    fused, fused_vars, _, _ = make_pair("Adam", initial_scale=64.0,
                                        dynamic_growth_steps=7, name="ls")
    fused.apply_gradients(zip(scaled_gradients(1)[0], fused_vars))
    fused.set_hyperparameter("beta_1", [0.3, 0.4, 0.5])
    config = fused.get_config()
    for clone in (
            optimizers.LossScaleOptimizer.from_config(dict(config)),
            keras.saving.deserialize_keras_object(
                keras.saving.serialize_keras_object(fused)),
            # Configs of the stock class carry the base defaults.
            optimizers.LossScaleOptimizer.from_config(
                dict(config, use_ema=False, clipnorm=None))):
        assert type(clone) is optimizers.LossScaleOptimizer
        assert type(clone.inner_optimizer) is optimizers.Adam
        assert clone.name == "ls"
        assert clone.initial_scale == 64.0
        assert clone.dynamic_growth_steps == 7
        assert_close(clone.get_hyperparameter("beta_1"), [0.3, 0.4, 0.5])
        assert_close(clone.learning_rate, INNER["Adam"][0]["learning_rate"])
        assert clone.get_config() == config


def test_get_converts_a_stock_loss_scale_optimizer():
    stock = keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(0.1, momentum=0.5), initial_scale=32.0,
        dynamic_growth_steps=3)
    fused = optimizers.get(stock)
    assert type(fused) is optimizers.LossScaleOptimizer
    assert type(fused.inner_optimizer) is optimizers.SGD
    assert (fused.initial_scale, fused.dynamic_growth_steps) == (32.0, 3)
    assert optimizers.get(fused) is fused


@pytest.mark.parametrize("how", [
    pytest.param("checkpoint", marks=pytest.mark.backends(
        "tensorflow", reason="tf.train.Checkpoint saves TensorFlow "
        "variables")),
    "own_variables"])
def test_state_round_trip(how, tmp_path):
    def trained(seed):
        fused, fused_vars, _, _ = make_pair("Adam", seed=seed)
        for grads in scaled_gradients(5, seed=seed):
            fused.apply_gradients(zip(grads, fused_vars))
        return fused, fused_vars

    saved, saved_vars = trained(0)
    restored, restored_vars = trained(3)
    if how == "checkpoint":
        import tensorflow as tf

        path = tf.train.Checkpoint(optimizer=saved).save(tmp_path / "ckpt")
        tf.train.Checkpoint(optimizer=restored).restore(
            path).assert_existing_objects_matched()
    else:
        store = {}
        saved.save_own_variables(store)
        restored.load_own_variables(store)
    assert len(saved.variables) == len(restored.variables)
    for saved_var, restored_var in zip(saved.variables, restored.variables):
        np.testing.assert_array_equal(restored_var.numpy(), saved_var.numpy(),
                                      err_msg=saved_var.path)
    for variable, saved_var in zip(restored_vars, saved_vars):
        variable.assign(saved_var)
    for grads in scaled_gradients(3, seed=5):
        saved.apply_gradients(zip(grads, saved_vars))
        restored.apply_gradients(zip(grads, restored_vars))
    for variable, saved_var in zip(restored_vars, saved_vars):
        np.testing.assert_array_equal(variable.numpy(), saved_var.numpy())


def test_changing_hyperparameters_and_scales_does_not_retrace():
    fused, fused_vars, stock, stock_vars = make_pair("SGD")
    fused.build(fused_vars)
    traces = []

    def train_step(grads):
        traces.append(None)
        fused.apply_gradients(zip(grads, fused_vars))

    train_step = compiled(train_step, fused, fused_vars)

    for step, grads in enumerate(scaled_gradients()):
        if step == 4:
            fused.learning_rate = [0.01, 0.02, 0.03]
            fused.set_hyperparameter("momentum", [0.2, 0.3, 0.4])
            for b, opt in enumerate(stock):
                opt.learning_rate = [0.01, 0.02, 0.03][b]
                opt.inner_optimizer.momentum = [0.2, 0.3, 0.4][b]
        apply_stock_per_model(stock, stock_vars, grads)
        train_step(grads)
        assert_state_matches("SGD", fused, fused_vars, stock, stock_vars,
                             err_msg=f"step {step}")
    assert len(traces) == 1


# -- mixed precision ---------------------------------------------------------


@pytest.mark.parametrize("compute_dtype", ["float16", "bfloat16"])
def test_low_precision_steps_without_fit_match_stock(compute_dtype):
    # The optimizer's part of a mixed-precision train step, on whichever
    # backend runs: each model's loss computed in `compute_dtype` from its
    # float32 weights and scaled by its own scale. Model 1's large inputs
    # overflow its float16 gradients until its scale is small enough;
    # bfloat16 has float32's range and does not overflow.
    fused, fused_vars, stock, stock_vars = make_pair("SGD")
    inputs = np.ones((B, 5), "float32")
    inputs[1] = 100.0

    def loss(variables, x):
        """`[B]` per-model losses of `[B, ...]` variables, or one model's
        loss of its own."""
        kernel, other = (ops.cast(v, compute_dtype) for v in variables)
        return ops.cast(
            ops.sum(ops.square(kernel * ops.cast(x, compute_dtype)), -1)
            + ops.sum(ops.square(other), (-2, -1)), "float32")

    for step in range(5):
        _, _, grads = value_and_gradients(
            lambda: (None, fused.scale_model_losses(
                loss(fused_vars, inputs))), [], fused_vars,
            state=fused.variables)
        fused.apply(grads, fused_vars)
        for b in range(B):
            _, _, model_grads = value_and_gradients(
                lambda b=b: (None, stock[b].scale_loss(
                    loss(stock_vars[b], inputs[b]))), [], stock_vars[b],
                state=stock[b].variables)
            apply_stock(stock[b], model_grads, stock_vars[b])
        assert_state_matches("SGD", fused, fused_vars, stock, stock_vars,
                             err_msg=f"step {step}")
    steps = np.asarray(fused.model_iterations)
    assert list(steps[[0, 2]]) == [5, 5]
    assert (steps[1] < 5) == (compute_dtype == "float16"), steps


@pytest.fixture
def mixed_float16():
    keras.mixed_precision.set_global_policy("mixed_float16")
    yield
    keras.mixed_precision.set_global_policy("float32")


def mlp():
    x = keras.Input((6,))
    h = keras.layers.Dense(8, activation="relu")(x)
    # Logits: stock crossentropy of a softmax output reads the logits the
    # softmax saw, which the array's per-model output slices do not carry.
    y = keras.layers.Dense(3, dtype="float32")(h)
    return keras.Model(x, y)


@pytest.mark.parametrize("jit_compile", [False, True], ids=["tf", "xla"])
@pytest.mark.parametrize("models_per_pass", [None, 1])
def test_mixed_float16_array_trains_like_stock_models(mixed_float16,
                                                      models_per_pass,
                                                      jit_compile):
    rates = [0.05, 0.1, 0.2]
    array = hftatf.fuse(mlp(), B)
    # Model 1's large output kernel overflows its float16 gradients on every
    # step (its scale halves each time); the others never overflow.
    output = array.layers[-1]
    kernel, bias = output.get_weights()
    kernel[1] *= 1e3
    output.set_weights([kernel, bias])
    stock = array.unfuse()
    initial = [model.get_weights() for model in stock]
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    # In passes, each model's loss still carries its own scale.
    array.compile(optimizers.LossScaleOptimizer(optimizers.SGD(rates)),
                  loss=loss, models_per_pass=models_per_pass,
                  jit_compile=jit_compile)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 6)).astype("float32")
    y = rng.integers(0, 3, size=32)
    array.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    for b, model in enumerate(stock):
        model.compile(keras.optimizers.SGD(rates[b]), loss=loss)
        assert isinstance(model.optimizer,
                          keras.optimizers.LossScaleOptimizer)
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    scales = [float(m.optimizer.dynamic_scale.numpy()) for m in stock]
    np.testing.assert_array_equal(array.optimizer.dynamic_scale.numpy(),
                                  scales)
    assert scales == [2.0**15, 2.0**11, 2.0**15]
    np.testing.assert_array_equal(np.asarray(array.optimizer.model_iterations),
                                  [int(m.optimizer.iterations) for m in stock])
    # XLA's float16 products round differently from TensorFlow's (oneDNN's
    # on CPUs with float16 arithmetic); without XLA, the stock models'
    # kernels: exact.
    assert_updates_agree(array, stock, initial,
                         float16_units=1 if jit_compile else None)


def assert_updates_agree(array, stock, initial, float16_units=None):
    """Each model of `array` moved from `initial` as its `stock` model did:
    exactly, or to `float16_units` float16 units in the last place of the
    largest move."""
    for b, model in enumerate(array.unfuse()):
        for ours, theirs, before in zip(model.get_weights(),
                                        stock[b].get_weights(), initial[b]):
            if float16_units is None:
                assert_close(ours, theirs)
                continue
            change = theirs - before
            assert_close(ours - before, change, rtol=0,
                         atol=float16_units * 2.0**-10 * np.abs(change).max())


def test_a_forward_overflow_is_skipped_as_stock_keras_skips_it(
        mixed_float16):
    # Model 1's own inputs hold one huge sample in the second batch: its
    # float16 forward pass overflows there once. Stock Keras skips that
    # step and halves the scale; the array must not freeze the model.
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, B, 6)).astype("float32")
    y = rng.integers(0, 3, size=32)
    x[9, 1] = 1e6
    array = hftatf.fuse(mlp(), B, shared_inputs=False)
    stock = array.unfuse()
    initial = [model.get_weights() for model in stock]
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    array.compile(optimizers.SGD(0.1), loss=loss, jit_compile=STEP_JIT)
    array.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    assert not array.diverged_models.any()
    for b, model in enumerate(stock):
        model.compile(keras.optimizers.SGD(0.1), loss=loss)
        model.fit(x[:, b], y, batch_size=8, epochs=2, shuffle=False,
                  verbose=0)
    np.testing.assert_array_equal(
        array.optimizer.dynamic_scale.numpy(),
        [float(m.optimizer.dynamic_scale.numpy()) for m in stock])
    # The outlier's batch is skipped in each epoch.
    iterations = [int(m.optimizer.iterations) for m in stock]
    assert iterations == [8, 6, 8]
    np.testing.assert_array_equal(np.asarray(array.optimizer.model_iterations),
                                  iterations)
    # The models' own inputs go through a batched float16 product, stock's
    # through a plain one, which round differently.
    assert_updates_agree(array, stock, initial, float16_units=2)


def test_a_model_still_overflowing_below_a_scale_of_one_is_frozen(
        mixed_float16):
    # Model 1's inputs overflow float16 at every step: its scale halves,
    # 2 -> 1 -> 0.5, and at the next overflow it counts as diverged.
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, B, 6)).astype("float32")
    y = rng.integers(0, 3, size=40)
    x[:, 1] = 1e6
    array = hftatf.fuse(mlp(), B, shared_inputs=False)
    before = array.get_model_weights(1)
    array.compile(optimizers.LossScaleOptimizer(optimizers.SGD(0.1),
                                                initial_scale=2.0),
                  loss="mse", jit_compile=STEP_JIT)
    array.fit(x, keras.ops.one_hot(y, 3), batch_size=8, epochs=1,
              shuffle=False, verbose=0)
    np.testing.assert_array_equal(array.diverged_models, [False, True, False])
    np.testing.assert_array_equal(array.optimizer.dynamic_scale.numpy(),
                                  [2.0, 0.5, 2.0])
    np.testing.assert_array_equal(np.asarray(array.optimizer.model_iterations),
                                  [5, 0, 5])
    for ours, theirs in zip(array.get_model_weights(1), before):
        np.testing.assert_array_equal(ours, theirs)


def test_with_several_loss_scaling_optimizers_any_scale_below_one_freezes():
    # A step of two networks (a GAN's), each with a loss-scaling optimizer
    # of its own; models 0 and 1 overflowed. Model 0 is still rescaled by
    # both, which skip its step and halve its scales; model 1's first scale
    # is below 1, so it diverged, though the second optimizer would still
    # rescale it. Model 2 is finite, whatever its scales.
    array = hftatf.fuse(mlp(), B)
    array.compile(optimizers.SGD(0.1), loss="mse")
    first, second = array.layers[-2].trainable_weights, \
        array.layers[-1].trainable_weights
    scaling = [optimizers.LossScaleOptimizer(optimizers.SGD(0.1))
               for _ in range(2)]
    for optimizer, variables in zip(scaling, (first, second)):
        optimizer.build(variables)
    scaling[0].dynamic_scale.assign([2.0, 0.5, 4.0])
    scaling[1].dynamic_scale.assign([2.0, 2.0, 0.5])
    before = [v.numpy() for v in array.trainable_weights]
    nan = float("nan")

    def gradients(variables):
        return [np.stack([np.full(v.shape[1:], value, "float32")
                          for value in (nan, nan, 1.0)]) for v in variables]

    took = array.apply_model_gradients(
        [(scaling[0], gradients(first), first),
         (scaling[1], gradients(second), second)],
        keras.ops.convert_to_tensor([nan, nan, 1.0]))
    np.testing.assert_array_equal(took, [True, False, True])
    np.testing.assert_array_equal(array.diverged_models, [False, True, False])
    np.testing.assert_array_equal(scaling[0].dynamic_scale.numpy(),
                                  [1.0, 0.5, 4.0])
    np.testing.assert_array_equal(scaling[1].dynamic_scale.numpy(),
                                  [1.0, 2.0, 0.5])
    for variable, old in zip(array.trainable_weights, before):
        np.testing.assert_array_equal(variable.numpy()[:2], old[:2])
        assert not np.array_equal(variable.numpy()[2], old[2])


def test_compile_wraps_in_the_fused_loss_scale_optimizer(mixed_float16):
    array = hftatf.fuse(mlp(), B)
    array.compile(optimizers.SGD(0.1), loss="mse")
    assert isinstance(array.optimizer, optimizers.LossScaleOptimizer)


# -- tf.distribute -----------------------------------------------------------

# Run in a fresh process: logical CPU devices must be set before TensorFlow
# starts. Two replicas each see half of every gradient (the inner optimizer
# sums them); replica 1 alone sees an inf in model 1 at step 2.
MIRRORED_SCRIPT = """
import tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
import keras, numpy as np
from hftatf import optimizers
B, SHAPES = 3, [(4,), (2, 3)]
rng = np.random.default_rng(0)
initial = [rng.standard_normal((B, *s)).astype("float32") for s in SHAPES]
grads = [[8 * rng.standard_normal((B, *s)).astype("float32")
          for s in SHAPES] for _ in range(5)]

def optimizer():
    return optimizers.LossScaleOptimizer(
        optimizers.Adam([0.01, 0.02, 0.03], use_ema=True,
                        ema_overwrite_frequency=2),
        initial_scale=8.0, dynamic_growth_steps=2)

single = optimizer()
single_vars = [keras.Variable(v) for v in initial]
for step, g in enumerate(grads):
    g = [x.copy() for x in g]
    if step == 2:
        g[1][1, 0, 0] = np.inf
    single.apply_gradients(zip(g, single_vars))

strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
with strategy.scope():
    mirrored = optimizer()
    mirrored_vars = [keras.Variable(v) for v in initial]
    mirrored.build(mirrored_vars)

@tf.function
def train_step(first, second):
    def replica_step(first, second):
        replica = tf.distribute.get_replica_context().replica_id_in_sync_group
        g = [tf.where(tf.equal(replica, 0), a, b)
             for a, b in zip(first, second)]
        mirrored.apply_gradients(zip(g, mirrored_vars))
    strategy.run(replica_step, args=(first, second))

for step, g in enumerate(grads):
    first = [x / 2 for x in g]
    second = [x / 2 for x in g]
    if step == 2:
        second[1][1, 0, 0] = np.inf
    train_step(first, second)

np.testing.assert_array_equal(mirrored.dynamic_scale.numpy(),
                              single.dynamic_scale.numpy())
np.testing.assert_array_equal(np.asarray(mirrored.model_iterations),
                              [5, 4, 5])
for ours, theirs in zip(mirrored_vars, single_vars):
    for copy in strategy.experimental_local_results(ours.value):
        np.testing.assert_allclose(copy.numpy(), theirs.numpy(),
                                   rtol=1e-6, atol=1e-6)
print("MIRRORED OK")
"""


@pytest.mark.backends(
    "tensorflow", reason="tf.distribute replicas; on JAX a step has none "
    "(keras.distribution shards the arrays of one step)")
def test_overflow_on_one_replica_skips_that_model_on_every_replica():
    result = subprocess.run(
        [sys.executable, "-c", MIRRORED_SCRIPT], capture_output=True,
        text=True, timeout=300, env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert "MIRRORED OK" in result.stdout, result.stderr[-3000:]
