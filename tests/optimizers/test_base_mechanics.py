"""The fused optimizer base: EMA, gradient accumulation, per-model steps.

The oracle is B stock Keras optimizers, one per model. A partial step
(`apply(..., model_mask=mask)`) must leave the models outside `mask` exactly
as they were, and update the others exactly as their stock twins, which
simply do not take the steps their model skips.
"""

import collections
import contextlib

import keras
import numpy as np
import pytest
from backend_steps import compiled
from keras import ops
from testing import (
    BACKEND,
    apply_per_model,
    assert_close,
    assert_slices_match,
    per_model_arrays,
    stock_variables,
)

from hftatf import optimizers
from hftatf.layers.base import Modelwise

B = 3
SHAPES = [(5,), (2, 3)]
SLOTS = {
    "SGD": ("momentums",),
    "Adam": ("_momentums", "_velocities", "_velocity_hats"),
}
# The base optimizer's own per-variable state.
BASE_SLOTS = ("_model_variables_moving_average", "_accumulated_gradients")
VALUES = {
    "SGD": {"learning_rate": [0.1, 0.05, 0.2], "momentum": [0.9, 0.5, 0.0]},
    "Adam": {"learning_rate": [0.01, 0.003, 0.05], "beta_1": [0.9, 0.8, 0.5],
             "beta_2": [0.999, 0.99, 0.9]},
}
EMA_MOMENTUM = [0.9, 0.5, 0.99]


def for_model(values, model):
    return {name: value[model] if isinstance(value, list) else value
            for name, value in values.items()}


def make_pair(name, values=None, seed=0, **shared):
    """A fused optimizer, its B stock twins (model b's values each), and
    fused/stock variables that start from the same random values."""
    values = dict(VALUES[name] if values is None else values)
    stock = [getattr(keras.optimizers, name)(**for_model(values, b),
                                             **shared) for b in range(B)]
    fused = getattr(optimizers, name)(**values, **shared)
    initial = per_model_arrays(np.random.default_rng(seed), SHAPES, B)
    fused_vars = [keras.Variable(value) for value in initial]
    stock_vars = [stock_variables(initial, b) for b in range(B)]
    return fused, fused_vars, stock, stock_vars


def with_ema(name="SGD", momentum=None):
    """`name`'s per-model values plus per-model EMA momenta."""
    momentum = EMA_MOMENTUM if momentum is None else momentum
    return dict(VALUES[name], ema_momentum=momentum)


def gradient_steps(steps, seed=1):
    rng = np.random.default_rng(seed)
    return [per_model_arrays(rng, SHAPES, B) for _ in range(steps)]


def assert_state_matches(name, fused, fused_vars, stock, stock_vars,
                         err_msg=""):
    """Variables, slots, moving averages, accumulators and step counts."""
    assert_slices_match(fused_vars, stock_vars, err_msg=err_msg)
    for slot in SLOTS[name] + BASE_SLOTS:
        stock_slots = [getattr(opt, slot, None) for opt in stock]
        if not any(stock_slots):
            assert not getattr(fused, slot, None), slot
            continue
        # Stock SGD has no momentum slots where the momentum is 0.
        for b in (b for b, slots in enumerate(stock_slots) if slots):
            for fused_slot, stock_slot in zip(getattr(fused, slot),
                                              stock_slots[b]):
                assert_close(fused_slot.numpy()[b], stock_slot,
                             err_msg=f"{err_msg} slot {slot} model {b}")
    np.testing.assert_array_equal(
        np.asarray(fused.model_iterations),
        [int(opt.iterations) for opt in stock], err_msg=err_msg)


def x64():
    """A context where the backend computes in float64 (JAX's x64 mode)."""
    if BACKEND == "jax":
        import jax

        return jax.enable_x64(True)
    return contextlib.nullcontext()


def step_function(fused, fused_vars, mode):
    """`fused` applying gradients (and a mask), eagerly or in a graph."""
    def apply(grads, mask=None):
        fused.apply_gradients(zip(grads, fused_vars), model_mask=mask)

    if mode == "eager":
        return apply
    return compiled(apply, fused, fused_vars, jit_compile=mode == "xla")


# -- EMA, per model ----------------------------------------------------------


@pytest.mark.parametrize("name, overwrite, mode", [
    ("SGD", None, "eager"), ("SGD", 3, "graph"), ("Adam", None, "graph"),
    ("Adam", 3, "eager")])
def test_ema_matches_stock_per_model(name, overwrite, mode):
    fused, fused_vars, _, stock_vars = make_pair(name)
    stock = [getattr(keras.optimizers, name)(
        **for_model(VALUES[name], b), use_ema=True,
        ema_momentum=EMA_MOMENTUM[b], ema_overwrite_frequency=overwrite)
        for b in range(B)]
    fused = getattr(optimizers, name)(
        **VALUES[name], use_ema=True, ema_momentum=EMA_MOMENTUM,
        ema_overwrite_frequency=overwrite)
    apply = step_function(fused, fused_vars, mode)
    for step, grads in enumerate(gradient_steps(7)):
        apply_per_model(stock, stock_vars, grads)
        apply(grads)
        assert_state_matches(name, fused, fused_vars, stock, stock_vars,
                             err_msg=f"step {step}")
    assert_close(fused.get_hyperparameter("ema_momentum"), EMA_MOMENTUM)


def test_ema_of_the_first_step_is_the_weights():
    # Stock's formula: momentum 0 on the first step, whatever ema_momentum.
    fused, fused_vars, _, _ = make_pair("SGD", with_ema(), use_ema=True)
    fused.apply_gradients(zip(gradient_steps(1)[0], fused_vars))
    for variable, average in zip(fused_vars,
                                 fused._model_variables_moving_average):
        np.testing.assert_array_equal(average.numpy(), variable.numpy())


def test_ema_momenta_differ_per_model():
    # Guards the stock comparison: one momentum for all would differ.
    averages = []
    for momentum in (EMA_MOMENTUM, EMA_MOMENTUM[0]):
        fused, fused_vars, _, _ = make_pair(
            "SGD", with_ema("SGD", momentum), use_ema=True)
        for grads in gradient_steps(3):
            fused.apply_gradients(zip(grads, fused_vars))
        averages.append(fused._model_variables_moving_average[0].numpy())
    np.testing.assert_array_equal(averages[0][0], averages[1][0])
    assert not np.allclose(averages[0][1:], averages[1][1:])


def test_finalize_variable_values_swaps_in_the_averages():
    fused, fused_vars, _, stock_vars = make_pair("Adam")
    stock = [keras.optimizers.Adam(**for_model(VALUES["Adam"], b),
                                   use_ema=True, ema_momentum=EMA_MOMENTUM[b])
             for b in range(B)]
    fused = optimizers.Adam(**VALUES["Adam"], use_ema=True,
                            ema_momentum=EMA_MOMENTUM)
    for grads in gradient_steps(4):
        apply_per_model(stock, stock_vars, grads)
        fused.apply_gradients(zip(grads, fused_vars))
    averages = [a.numpy() for a in fused._model_variables_moving_average]
    assert not np.allclose(averages[0], fused_vars[0].numpy())
    fused.finalize_variable_values(fused_vars)
    for opt, variables in zip(stock, stock_vars):
        opt.finalize_variable_values(variables)
    for variable, average in zip(fused_vars, averages):
        np.testing.assert_array_equal(variable.numpy(), average)
    assert_slices_match(fused_vars, stock_vars)


@pytest.mark.parametrize("kwargs", [
    dict(use_ema=True, ema_momentum=[0.9, 1.5, 0.5]),
    dict(use_ema=True, ema_momentum=-0.1),
])
def test_ema_momentum_out_of_range_raises(kwargs):
    with pytest.raises(ValueError, match="ema_momentum"):
        optimizers.SGD(**kwargs)


def test_ema_momentum_is_only_checked_with_ema_as_in_keras():
    keras.optimizers.SGD(ema_momentum=1.5)
    optimizers.SGD(ema_momentum=[1.5, 0.5])


def test_setting_ema_momentum():
    fused, fused_vars, _, _ = make_pair("SGD", use_ema=True,
                                        ema_momentum=0.9)
    fused.build(fused_vars)
    with pytest.raises(ValueError, match="ema_momentum"):
        fused.set_hyperparameter("ema_momentum", [0.5, 2.0, 0.5])
    with pytest.raises(ValueError, match="ema_momentum"):
        fused.ema_momentum = [0.5, 0.5]
    fused.ema_momentum = [0.3, 0.2, 0.1]
    assert_close(fused.get_hyperparameter("ema_momentum"), [0.3, 0.2, 0.1])
    assert_close(fused.ema_momentum, [0.3, 0.2, 0.1])


def test_mismatched_ema_momentum_length_raises():
    with pytest.raises(ValueError, match="ema_momentum"):
        optimizers.SGD(learning_rate=[0.1, 0.2, 0.3], use_ema=True,
                       ema_momentum=[0.9, 0.8])


@pytest.mark.parametrize("name, flag", [
    ("SGD", "nesterov"), ("Lars", "nesterov"), ("Adam", "amsgrad"),
    ("RMSprop", "centered"), ("Adafactor", "relative_step"),
    ("Muon", "nesterov"), ("Muon", "ns_steps"), ("SGD", "use_ema"),
    ("SGD", "loss_scale_factor"), ("Adam", "gradient_accumulation_steps"),
    ("SGD", "ema_overwrite_frequency")])
def test_a_list_for_an_argument_all_models_share_is_refused(name, flag):
    # A list means one value per model elsewhere; these take one for all
    # (bool([True, False, True]) would switch the flag on for every model).
    value = [True, False, True] if flag in ("nesterov", "amsgrad",
                                            "centered", "relative_step",
                                            "use_ema") else [1, 2, 4]
    with pytest.raises(ValueError, match=f"`{flag}` is shared by all models"):
        getattr(optimizers, name)(**{flag: value})
    with pytest.raises(ValueError, match="`staircase` is shared"):
        optimizers.schedules.ExponentialDecay(0.1, 10, 0.5,
                                              staircase=[True, False])


def test_float64_hyperparameters_are_not_rounded_to_float32():
    # As a stock optimizer's learning-rate variable holds 0.01 exactly.
    previous = keras.config.floatx()
    keras.config.set_floatx("float64")
    # JAX holds float64 only with x64 enabled (stock variables too).
    try:
        with x64():
            optimizer = optimizers.SGD(learning_rate=[0.01, 0.1],
                                       momentum=0.9)
            optimizer.build([keras.Variable(np.zeros((2, 3)))])
            assert optimizer.get_hyperparameter(
                "learning_rate").tolist() == [0.01, 0.1]
            assert optimizer.get_hyperparameter("momentum").tolist() == [
                0.9, 0.9]
    finally:
        keras.config.set_floatx(previous)


def test_a_schedule_for_other_models_than_the_array_is_refused():
    schedule = optimizers.schedules.ExponentialDecay([0.1, 0.2], 2, 0.5)
    optimizer = optimizers.SGD(schedule)
    assert optimizer.num_models == 2
    with pytest.raises(ValueError, match="schedule 'ExponentialDecay' is "
                       "configured for 2 models.*num_models=3"):
        optimizer.num_models = 3


# -- gradient accumulation ---------------------------------------------------


@pytest.mark.parametrize("name, steps, mode", [
    ("SGD", 2, "eager"), ("SGD", 3, "graph"), ("Adam", 2, "graph"),
    ("Adam", 3, "eager")])
def test_gradient_accumulation_matches_stock(name, steps, mode):
    fused, fused_vars, stock, stock_vars = make_pair(
        name, gradient_accumulation_steps=steps)
    apply = step_function(fused, fused_vars, mode)
    for step, grads in enumerate(gradient_steps(7)):
        apply_per_model(stock, stock_vars, grads)
        apply(grads)
        assert_state_matches(name, fused, fused_vars, stock, stock_vars,
                             err_msg=f"step {step}")
        assert int(fused.iterations) == int(stock[0].iterations)
        assert int(fused._iterations) == int(stock[0]._iterations)
    # 7 micro-steps: 7 // steps updates, and the accumulators hold the rest.
    assert int(fused.iterations) == 7 // steps
    assert np.any(fused._accumulated_gradients[0].numpy() != 0)


def test_gradient_accumulation_with_ema_and_weight_decay_matches_stock():
    # Stock EMA reads the accumulated step count on every micro-step.
    shared = dict(gradient_accumulation_steps=2, weight_decay=0.1,
                  ema_overwrite_frequency=2)
    fused, fused_vars, _, stock_vars = make_pair("Adam")
    stock = [keras.optimizers.Adam(**for_model(VALUES["Adam"], b), **shared,
                                   use_ema=True, ema_momentum=EMA_MOMENTUM[b])
             for b in range(B)]
    fused = optimizers.Adam(**VALUES["Adam"], **shared, use_ema=True,
                            ema_momentum=EMA_MOMENTUM)
    for step, grads in enumerate(gradient_steps(7)):
        apply_per_model(stock, stock_vars, grads)
        fused.apply_gradients(zip(grads, fused_vars))
        assert_state_matches("Adam", fused, fused_vars, stock, stock_vars,
                             err_msg=f"step {step}")


# -- partial steps: a [B] mask of the models to update -----------------------


def schedules():
    return [
        keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=2,
                                                    decay_rate=0.5),
        keras.optimizers.schedules.CosineDecay(0.05, decay_steps=6),
        keras.optimizers.schedules.PiecewiseConstantDecay(
            boundaries=[1, 3], values=[0.2, 0.05, 0.01]),
    ]


PARTIAL = {
    "sgd_nesterov": ("SGD", {}, dict(nesterov=True)),
    "adam_amsgrad_decay_clip": (
        "Adam", dict(weight_decay=[0.1, 0.0, 0.3],
                     global_clipnorm=[1.0, 0.5, 0.0]),
        dict(amsgrad=True)),
    "adam_ema": ("Adam", {}, dict(use_ema=True, ema_overwrite_frequency=2)),
    "sgd_accumulation": ("SGD", {}, dict(gradient_accumulation_steps=2)),
    "adam_accumulation_ema": ("Adam", {}, dict(
        gradient_accumulation_steps=3, use_ema=True)),
    "adam_schedules": ("Adam", dict(learning_rate="schedules"), {}),
    "sgd_shared_schedule": ("SGD", dict(learning_rate="shared_schedule"), {}),
}
# Every model skips some steps, at different times; one step skips all.
MASKS = [[1, 1, 1], [0, 1, 1], [1, 0, 1], [0, 0, 0], [1, 1, 0], [1, 0, 0],
         [1, 1, 1], [0, 1, 1], [1, 1, 1]]


def partial_pair(config):
    name, values, flags = PARTIAL[config]
    values = dict(VALUES[name], **values)
    if values["learning_rate"] == "schedules":
        values["learning_rate"] = schedules()
    elif values["learning_rate"] == "shared_schedule":
        values["learning_rate"] = schedules()[0]
    if flags.get("use_ema"):
        values["ema_momentum"] = EMA_MOMENTUM
    return (name, *make_pair(name, values, **flags))


def masked_gradients(grads, mask):
    """Non-finite values in the models a step skips: they must not leak."""
    grads = [g.copy() for g in grads]
    for b in np.flatnonzero(~mask):
        grads[0][b] = np.nan
        grads[-1][b].flat[0] = np.inf
    return grads


@pytest.mark.parametrize("config, mode", [
    *((config, "eager") for config in sorted(PARTIAL)),
    *((config, "graph") for config in (
        "adam_amsgrad_decay_clip", "adam_ema", "sgd_accumulation",
        "adam_schedules"))])
def test_partial_steps_match_stock_optimizers_that_skip_them(config, mode):
    name, fused, fused_vars, stock, stock_vars = partial_pair(config)
    apply = step_function(fused, fused_vars, mode)
    for step, (grads, mask) in enumerate(zip(
            gradient_steps(len(MASKS)), np.asarray(MASKS, bool))):
        rates = [float(opt.learning_rate) for opt in stock]
        assert_close(fused.learning_rate, rates, err_msg=f"step {step}")
        for b in np.flatnonzero(mask):
            stock[b].apply_gradients(zip([g[b] for g in grads],
                                         stock_vars[b]))
        apply(masked_gradients(grads, mask), mask)
        assert_state_matches(name, fused, fused_vars, stock, stock_vars,
                             err_msg=f"step {step}")
    # Steps applied to at least one model.
    assert int(fused._iterations) == sum(map(any, MASKS))


def test_partial_steps_under_xla_match_stock():
    name, fused, fused_vars, stock, stock_vars = partial_pair(
        "adam_accumulation_ema")
    apply = step_function(fused, fused_vars, "xla")
    for step, (grads, mask) in enumerate(zip(
            gradient_steps(len(MASKS)), np.asarray(MASKS, bool))):
        for b in np.flatnonzero(mask):
            stock[b].apply_gradients(zip([g[b] for g in grads],
                                         stock_vars[b]))
        apply(masked_gradients(grads, mask), mask)
        assert_state_matches(name, fused, fused_vars, stock, stock_vars,
                             err_msg=f"step {step}")


def test_masked_out_models_keep_every_bit_of_state():
    fused = optimizers.Adam(
        **VALUES["Adam"], amsgrad=True, weight_decay=0.1, clipnorm=1.0,
        use_ema=True, ema_momentum=EMA_MOMENTUM, ema_overwrite_frequency=1,
        gradient_accumulation_steps=2)
    initial = per_model_arrays(np.random.default_rng(0), SHAPES, B)
    fused_vars = [keras.Variable(value) for value in initial]
    # Constraints are applied after the update: also per model only.
    fused_vars[0].constraint = Modelwise(keras.constraints.UnitNorm(), B)
    fused.build(fused_vars)
    mask = np.array([True, False, True])
    for step, grads in enumerate(gradient_steps(4)):
        before = [v.numpy() for v in fused.variables + fused_vars
                  if len(v.shape) and v.shape[0] == B]
        fused.apply_gradients(zip(masked_gradients(grads, mask), fused_vars),
                              model_mask=mask)
        after = [v.numpy() for v in fused.variables + fused_vars
                 if len(v.shape) and v.shape[0] == B]
        changed = set()
        for old, new in zip(before, after):
            np.testing.assert_array_equal(new[1], old[1])
            changed.update(b for b in (0, 2) if not np.array_equal(
                new[b], old[b]))
        assert changed == {0, 2}, f"step {step}"
        assert np.all(np.isfinite(np.concatenate([a.ravel() for a in after])))
    np.testing.assert_array_equal(np.asarray(fused.model_iterations),
                                  [2, 0, 2])


def test_model_iterations_and_local_step():
    fused, fused_vars, _, _ = make_pair("SGD")
    fused.build(fused_vars)
    np.testing.assert_array_equal(np.asarray(fused.model_iterations), [0] * 3)
    masks = [[1, 0, 1], [0, 0, 0], [1, 1, 0]]
    for grads, mask in zip(gradient_steps(3), masks):
        fused.apply_gradients(zip(grads, fused_vars),
                              model_mask=np.array(mask, bool))
    np.testing.assert_array_equal(np.asarray(fused.model_iterations),
                                  [2, 1, 1])
    assert int(fused.iterations) == 2
    local = fused._local_step(fused_vars[1])
    assert tuple(local.shape) == (B, 1, 1)
    assert local.dtype == fused_vars[1].dtype
    np.testing.assert_array_equal(np.asarray(local).ravel(), [3, 2, 2])


def test_unmasked_step_counts_every_model():
    fused, fused_vars, _, _ = make_pair("Adam")
    for grads in gradient_steps(2):
        fused.apply_gradients(zip(grads, fused_vars))
    np.testing.assert_array_equal(np.asarray(fused.model_iterations),
                                  [2] * B)
    assert int(fused.iterations) == 2


@pytest.mark.parametrize("mask", [[True, False], [[True] * 3]],
                         ids=["short", "rank2"])
def test_mask_of_the_wrong_shape_raises(mask):
    fused, fused_vars, _, _ = make_pair("SGD")
    with pytest.raises(ValueError, match="model_mask"):
        fused.apply_gradients(zip(gradient_steps(1)[0], fused_vars),
                              model_mask=mask)


@pytest.mark.parametrize("loss_scale", [False, True],
                         ids=["plain", "loss_scale"])
def test_stateless_apply_refuses_values_that_are_not_the_variables(
        loss_scale):
    fused, fused_vars, _, _ = make_pair("SGD")
    if loss_scale:
        fused = optimizers.LossScaleOptimizer(fused)
    grads = gradient_steps(1)[0]
    values = [v.value for v in fused_vars]
    with pytest.raises(ValueError, match="not built.*build"):
        fused.stateless_apply([], grads, values)
    fused.build(fused_vars)
    state = [v.value for v in fused.variables]
    with pytest.raises(ValueError, match=(
            f"`optimizer_variables`, {len(state)} in all; received "
            f"{len(state) - 1}")):
        fused.stateless_apply(state[1:], grads, values)
    with pytest.raises(ValueError, match=(
            f"`trainable_variables`, {len(values)} in all; received 1")):
        fused.stateless_apply(state, grads, values[:1])


class ScalarStateSGD(optimizers.SGD):
    """Keeps a scalar, model-less variable: it cannot be updated per model."""

    def build(self, variables):
        super().build(variables)
        self.total = self.add_variable((), name="total")

    def update_step(self, gradient, variable, learning_rate):
        super().update_step(gradient, variable, learning_rate)
        self.assign_add(self.total, 1.0)


def test_a_scalar_variable_in_a_partial_step_raises():
    opt = ScalarStateSGD()
    variables = [keras.Variable(np.zeros((B, 2), "float32"))]
    grads = [np.ones((B, 2), "float32")]
    opt.apply_gradients(zip(grads, variables))
    with pytest.raises(ValueError, match="scalar variable"):
        opt.apply_gradients(zip(grads, variables),
                            model_mask=np.array([1, 0, 1], bool))


def test_hyperparameters_and_masks_change_without_retracing():
    fused, fused_vars, stock, stock_vars = make_pair("SGD", with_ema(),
                                                     use_ema=True)
    fused.build(fused_vars)
    traces = []

    def train_step(grads, mask):
        traces.append(None)
        fused.apply_gradients(zip(grads, fused_vars), model_mask=mask)

    train_step = compiled(train_step, fused, fused_vars)

    new_momentum = [0.2, 0.95, 0.6]
    for step, grads in enumerate(gradient_steps(5)):
        if step == 2:
            fused.set_hyperparameter("ema_momentum", new_momentum)
            fused.learning_rate = [0.3, 0.2, 0.1]
            for b, opt in enumerate(stock):
                opt.ema_momentum = new_momentum[b]
                opt.learning_rate = [0.3, 0.2, 0.1][b]
        mask = np.array(MASKS[step], bool)
        for b in np.flatnonzero(mask):
            stock[b].apply_gradients(zip([g[b] for g in grads],
                                         stock_vars[b]))
        train_step(grads, mask)
        assert_state_matches("SGD", fused, fused_vars, stock, stock_vars,
                             err_msg=f"step {step}")
    assert len(traces) == 1


# -- configuration and checkpoints -------------------------------------------


def test_config_round_trip_of_base_options():
    fused, fused_vars, _, _ = make_pair(
        "Adam", with_ema("Adam"), use_ema=True, ema_overwrite_frequency=4,
        gradient_accumulation_steps=3, loss_scale_factor=8.0)
    fused.apply_gradients(zip(gradient_steps(1)[0], fused_vars))
    fused.ema_momentum = [0.7, 0.8, 0.9]
    config = fused.get_config()
    assert_close(config["ema_momentum"], [0.7, 0.8, 0.9])
    for clone in (
            optimizers.Adam.from_config(config),
            keras.saving.deserialize_keras_object(
                keras.saving.serialize_keras_object(fused))):
        assert type(clone) is optimizers.Adam
        assert clone.use_ema is True
        assert clone.ema_overwrite_frequency == 4
        assert clone.gradient_accumulation_steps == 3
        assert clone.loss_scale_factor == 8.0
        assert_close(clone.get_hyperparameter("ema_momentum"),
                     [0.7, 0.8, 0.9])
        assert clone.get_config() == config


@pytest.mark.parametrize("how", [
    pytest.param("checkpoint", marks=pytest.mark.backends(
        "tensorflow", reason="tf.train.Checkpoint saves TensorFlow "
        "variables")),
    "own_variables"])
def test_model_step_counts_are_checkpointed(how, tmp_path):
    def trained(seed):
        fused, fused_vars, _, _ = make_pair(
            "Adam", seed=seed, use_ema=True, gradient_accumulation_steps=2)
        for grads, mask in zip(gradient_steps(5, seed=seed), MASKS):
            fused.apply_gradients(zip(grads, fused_vars),
                                  model_mask=np.array(mask, bool))
        return fused, fused_vars

    saved, saved_vars = trained(0)
    restored, restored_vars = trained(7)
    restored.apply_gradients(zip(gradient_steps(1)[0], restored_vars))
    if how == "checkpoint":
        import tensorflow as tf

        path = tf.train.Checkpoint(optimizer=saved).save(tmp_path / "ckpt")
        tf.train.Checkpoint(optimizer=restored).restore(
            path).assert_existing_objects_matched()
    else:
        store = {}
        saved.save_own_variables(store)
        restored.load_own_variables(store)
    np.testing.assert_array_equal(np.asarray(restored.model_iterations),
                                  np.asarray(saved.model_iterations))
    assert any(v is restored._model_iterations for v in restored.variables)
    for variable, saved_var in zip(restored_vars, saved_vars):
        variable.assign(saved_var)
    grads = gradient_steps(1, seed=9)[0]
    mask = np.array([0, 1, 1], bool)
    saved.apply_gradients(zip(grads, saved_vars), model_mask=mask)
    restored.apply_gradients(zip(grads, restored_vars), model_mask=mask)
    for variable, saved_var in zip(restored_vars, saved_vars):
        np.testing.assert_array_equal(variable.numpy(), saved_var.numpy())


def _branch_op_counts(num_variables):
    """The op types of each branch of a traced masked Adam step over
    `num_variables` variables of one shape: `{branch: Counter}`."""
    variables = [keras.Variable(np.ones((3, 4, 5), "float32"))
                 for _ in range(num_variables)]
    optimizer = optimizers.Adam([0.1, 0.2, 0.3])
    optimizer.build(variables)
    import tensorflow as tf

    grads = [tf.ones((3, 4, 5))] * num_variables
    step = tf.function(lambda mask: optimizer.apply(grads, variables, mask))
    graph = step.get_concrete_function(
        tf.TensorSpec((3,), tf.bool)).graph
    (cond,) = [op for op in graph.get_operations() if "If" in op.type]
    return {branch: collections.Counter(
        node.op for node in graph._get_function(
            cond.get_attr(branch).name).definition.node_def)
        for branch in ("then_branch", "else_branch")}


@pytest.mark.backends(
    "tensorflow", reason="it reads the branches of the TensorFlow cond "
    "between the unmasked and the masked update; on JAX every masked step "
    "selects, in the XLA computation of the step")
def test_steps_of_every_model_select_nothing_and_broadcast_once():
    # A masked step where every model trains takes the unmasked update
    # (no select per variable and slot); each hyper-parameter and the step
    # count are broadcast once per variable rank, not once per variable.
    two, four = _branch_op_counts(2), _branch_op_counts(4)
    assert two["then_branch"]["SelectV2"] == 0
    assert four["then_branch"]["Reshape"] == two["then_branch"]["Reshape"]


@pytest.mark.backends(
    "tensorflow", reason="it reads the masked branch of the TensorFlow "
    "cond; on JAX a masked step's selects are fused by XLA into the update")
def test_partial_steps_select_whole_models():
    # A step that leaves models out (frozen ones) selects, per variable and
    # slot, each model's whole slice (a select with the [B] condition),
    # not element by element with the condition broadcast to the
    # variable's shape, which cost more than the update itself: the steps
    # of an array with frozen models were slower than all models' steps.
    two, four = _branch_op_counts(2), _branch_op_counts(4)
    masked, unmasked = four["else_branch"], four["then_branch"]
    assert masked["SelectV2"] == 0
    # Adam assigns both slots and the variable.
    assert masked["Select"] == 3 * 4 == 2 * two["else_branch"]["Select"]
    assert unmasked["Select"] == 0


# -- complements and attributes, as the stock optimizers have them ----------

COMPLEMENTED = {
    "Adam": {"beta_1": [0.9999, 0.9, 0.99], "beta_2": [0.9999, 0.999, 0.99]},
    "AdamW": {"beta_1": [0.9999, 0.9, 0.99], "beta_2": [0.9999, 0.999, 0.99]},
    "Adamax": {"beta_1": [0.9999, 0.999, 0.99]},
    "RMSprop": {"rho": [0.9999, 0.999, 0.99]},
    "Adadelta": {"rho": [0.9999, 0.999, 0.99]},
}


@pytest.mark.parametrize("name", sorted(COMPLEMENTED))
def test_complements_are_rounded_once_as_in_stock(name):
    # Stock optimizers compute `1 - self.beta_2` from the Python float: from
    # float32 values near 1 it would be off by up to 2e-4 of itself, and
    # these steps (a learning rate of 1) would drift past the tolerance.
    # (Lamb, which complements too, rescales its updates by the trust
    # ratio, which cancels most of the error: no test of it here.)
    values = {"learning_rate": 1.0, **COMPLEMENTED[name]}
    fused = getattr(optimizers, name)(**values)
    stock = [getattr(keras.optimizers, name)(
        learning_rate=1.0, **{k: v[b] for k, v in COMPLEMENTED[name].items()})
        for b in range(B)]
    rng = np.random.default_rng(7)
    initial = per_model_arrays(rng, SHAPES, B)
    fused_variables = [keras.Variable(value) for value in initial]
    stock_vars = [stock_variables(initial, b) for b in range(B)]
    for _ in range(4):
        grads = per_model_arrays(rng, SHAPES, B)
        fused.apply(grads, fused_variables)
        apply_per_model(stock, stock_vars, grads)
    assert_slices_match(fused_variables, stock_vars, atol=1e-6, rtol=1e-6)


def test_hyperparameters_read_and_set_as_attributes():
    optimizer = optimizers.Adam(learning_rate=0.1, beta_1=[0.9, 0.8, 0.5])
    assert optimizer.beta_1 == [0.9, 0.8, 0.5]
    assert optimizer.beta_2 == 0.999
    optimizer.beta_2 = [0.99, 0.9, 0.5]  # checked and kept, as the setter
    np.testing.assert_allclose(optimizer.get_hyperparameter("beta_2"),
                               [0.99, 0.9, 0.5])
    variables = [keras.Variable(np.ones((B, 2), "float32"))]
    optimizer.build(variables)
    optimizer.beta_1 = 0.0  # read by the next step
    np.testing.assert_array_equal(optimizer.get_hyperparameter("beta_1"),
                                  [0.0] * B)
    np.testing.assert_allclose(
        optimizer._complement_variables["beta_1"], [1.0] * B)
    assert optimizer.get_config()["beta_1"] == 0.0
    with pytest.raises(ValueError, match="beta_1"):
        optimizer.beta_1 = [0.9, 0.9]
    with pytest.raises(AttributeError, match="beta_3"):
        optimizer.beta_3  # noqa: B018


def _complemented_adam(wrap):
    optimizer = optimizers.Adam(learning_rate=[0.1, 0.2, 0.3],
                                beta_1=[0.9, 0.8, 0.5],
                                beta_2=[0.9999, 0.999, 0.99])
    return optimizers.LossScaleOptimizer(optimizer) if wrap else optimizer


@pytest.mark.parametrize("wrap", [False, True], ids=["plain", "loss_scale"])
def test_state_saved_without_complements_loads(wrap):
    # A file written before complements were variables of their own holds
    # every other variable, in the same order: it must load all of them,
    # and set the complements from the betas, not skip the whole state as
    # the stock base does when the counts differ.
    saved = _complemented_adam(wrap)
    variables = [keras.Variable(v) for v in per_model_arrays(
        np.random.default_rng(3), SHAPES, B)]
    for seed in range(2):
        saved.apply(per_model_arrays(np.random.default_rng(seed), SHAPES, B),
                    variables)
    complements = {id(v) for _, _, v in saved._complements()}
    assert len(complements) == 2
    old_layout = [v for v in saved.variables if id(v) not in complements]
    store = {str(i): ops.convert_to_numpy(v) for i, v in enumerate(old_layout)}

    loaded = _complemented_adam(wrap)
    loaded.build([keras.Variable(np.zeros(v.shape, v.dtype))
                  for v in variables])
    loaded.load_own_variables(store)
    assert len(loaded.variables) == len(saved.variables)
    for mine, theirs in zip(loaded.variables, saved.variables):
        np.testing.assert_array_equal(ops.convert_to_numpy(mine),
                                      ops.convert_to_numpy(theirs))

    # Another count is still skipped, with the stock warning.
    del store[str(len(store) - 1)]
    with pytest.warns(UserWarning, match="Skipping variable loading"):
        _complemented_adam(wrap).load_own_variables(store)


def test_complements_follow_loaded_betas():
    # Loaded betas that differ from the config's floats (set on the
    # variables) give complements computed from the values loaded.
    optimizer = _complemented_adam(False)
    optimizer.build([keras.Variable(np.ones((B, 2), "float32"))])
    complements = {id(c) for _, _, c in optimizer._complements()}
    old_layout = [v for v in optimizer.variables if id(v) not in complements]
    store = {str(i): ops.convert_to_numpy(v) for i, v in enumerate(old_layout)}
    index = next(i for i, v in enumerate(old_layout)
                 if v is optimizer._hyper_variables["beta_2"])
    store[str(index)] = np.array([0.5, 0.25, 0.75], "float32")
    optimizer.load_own_variables(store)
    np.testing.assert_array_equal(
        ops.convert_to_numpy(optimizer._complement_variables["beta_2"]),
        np.array([0.5, 0.75, 0.25], "float32"))
    np.testing.assert_array_equal(
        ops.convert_to_numpy(optimizer._complement_variables["beta_1"]),
        (1.0 - np.array([0.9, 0.8, 0.5])).astype("float32"))
