"""Fused SGD and Adam against B stock Keras optimizers, one per model.

Model b's slice of every fused `[B, ...]` variable must be updated exactly as
a stock `keras.optimizers` instance with model b's hyper-parameters updates a
stock variable: same values, same slots, at float32 tolerance. Clipping has
its own file, test_clipping.py.
"""

import keras
import numpy as np
import pytest
from backend_steps import compiled
from testing import (
    apply_per_model,
    assert_close,
    assert_slices_match,
    max_slice_difference,
    per_model_arrays,
    stock_variables,
)

from hftatf import optimizers

B = 3
# No dimension but the model axis is B: see
# test_adam_per_model_epsilon_on_a_variable_with_an_axis_of_size_b.
SHAPES = [(5,), (4, 2), (2, 3, 4)]
STEPS = 10
SLOTS = {
    "SGD": ("momentums",),
    "Adam": ("_momentums", "_velocities", "_velocity_hats"),
}

SGD_VALUES = {"learning_rate": [0.01, 0.05, 0.1],
              "momentum": [0.9, 0.5, 0.0]}
ADAM_VALUES = {"learning_rate": [0.01, 0.003, 0.05],
               "beta_1": [0.9, 0.8, 0.5],
               "beta_2": [0.999, 0.99, 0.9],
               "epsilon": [1e-7, 1e-3, 1e-1]}


def model_values(values, model):
    """Model `model`'s value of each per-model hyper-parameter."""
    return {name: value[model] if isinstance(value, list) else value
            for name, value in values.items()}


def make_pair(name, values, shapes=SHAPES, seed=0, **shared):
    """A fused optimizer with per-model `values`, its B stock twins, and
    fused/stock variables that start from the same random values."""
    stock_cls = getattr(keras.optimizers, name)
    fused_cls = getattr(optimizers, name)
    stock = [stock_cls(**model_values(values, b), **shared) for b in range(B)]
    fused = fused_cls(**values, **shared)
    initial = per_model_arrays(np.random.default_rng(seed), shapes, B)
    fused_variables = [keras.Variable(value) for value in initial]
    stock_vars = [stock_variables(initial, b) for b in range(B)]
    return fused, fused_variables, stock, stock_vars


def gradient_steps(shapes=SHAPES, steps=STEPS, seed=1):
    """`[B, ...]` gradients, different for every model, variable and step."""
    rng = np.random.default_rng(seed)
    return [per_model_arrays(rng, shapes, B) for _ in range(steps)]


def assert_state_matches(name, fused, fused_variables, stock, stock_vars,
                         err_msg=""):
    """Variables and every slot the stock optimizers hold match per model."""
    assert_slices_match(fused_variables, stock_vars, err_msg=err_msg)
    for slot in SLOTS[name]:
        stock_slots = [getattr(opt, slot, []) for opt in stock]
        if not all(stock_slots):
            continue
        assert_slices_match(getattr(fused, slot), stock_slots,
                            err_msg=f"{err_msg} slot {slot}")


# -- the update rule, per model, eager and in graphs ------------------------


@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("momentum", [[0.0, 0.0, 0.0], [0.9, 0.5, 0.0]],
                         ids=["no_momentum", "momentum"])
def test_sgd_matches_stock(momentum, nesterov):
    values = dict(SGD_VALUES, momentum=momentum)
    fused, fused_vars, stock, stock_vars = make_pair(
        "SGD", values, nesterov=nesterov)
    for step, grads in enumerate(gradient_steps()):
        apply_per_model(stock, stock_vars, grads)
        fused.apply_gradients(zip(grads, fused_vars))
        assert_state_matches("SGD", fused, fused_vars, stock, stock_vars,
                             err_msg=f"step {step}")
    # As stock SGD: momentum slots only when some model uses momentum.
    assert bool(fused.momentums) == any(momentum)
    assert int(fused.iterations) == STEPS


@pytest.mark.parametrize("amsgrad", [False, True])
def test_adam_matches_stock(amsgrad):
    fused, fused_vars, stock, stock_vars = make_pair(
        "Adam", ADAM_VALUES, amsgrad=amsgrad)
    for step, grads in enumerate(gradient_steps()):
        apply_per_model(stock, stock_vars, grads)
        fused.apply_gradients(zip(grads, fused_vars))
        assert_state_matches("Adam", fused, fused_vars, stock, stock_vars,
                             err_msg=f"step {step}")
    assert len(getattr(fused, "_velocity_hats", [])) == (
        len(SHAPES) if amsgrad else 0)


@pytest.mark.parametrize("jit_compile", [False, True])
@pytest.mark.parametrize("name, values, flags", [
    ("SGD", SGD_VALUES, {"nesterov": True}),
    ("Adam", ADAM_VALUES, {"amsgrad": True}),
])
def test_matches_stock_inside_a_compiled_step(name, values, flags,
                                             jit_compile):
    fused, fused_vars, stock, stock_vars = make_pair(name, values, **flags)

    # On TensorFlow built on the first trace, as when a train step is the
    # first call.
    def train_step(grads):
        fused.apply_gradients(zip(grads, fused_vars))

    train_step = compiled(train_step, fused, fused_vars, jit_compile)
    for step, grads in enumerate(gradient_steps(steps=4)):
        apply_per_model(stock, stock_vars, grads)
        train_step(grads)
        assert_state_matches(name, fused, fused_vars, stock, stock_vars,
                             err_msg=f"step {step}")


# Regression: ops.add with a [B, 1, ..., 1] epsilon took TensorFlow's
# bias_add path along the last axis when an axis had size B.
@pytest.mark.parametrize("amsgrad", [False, True])
def test_adam_per_model_epsilon_on_a_variable_with_an_axis_of_size_b(
        amsgrad):
    # A Dense kernel [B, in, out] with out == B or in == B, say.
    shapes = [(4, B), (B, 4)]
    fused, fused_vars, stock, stock_vars = make_pair(
        "Adam", ADAM_VALUES, shapes=shapes, amsgrad=amsgrad)
    for step, grads in enumerate(gradient_steps(shapes=shapes, steps=3)):
        apply_per_model(stock, stock_vars, grads)
        fused.apply_gradients(zip(grads, fused_vars))
        assert_state_matches("Adam", fused, fused_vars, stock, stock_vars,
                             err_msg=f"step {step}")


@pytest.mark.parametrize("options", [
    {"gradient_accumulation_steps": 2},
    {"use_ema": True, "ema_momentum": 0.9, "ema_overwrite_frequency": 3},
    {"loss_scale_factor": 4.0},
], ids=["accumulation", "ema", "loss_scale"])
def test_elementwise_base_options_match_stock(options):
    fused, fused_vars, stock, stock_vars = make_pair(
        "Adam", ADAM_VALUES, **options)
    for step, grads in enumerate(gradient_steps(steps=6)):
        apply_per_model(stock, stock_vars, grads)
        fused.apply_gradients(zip(grads, fused_vars))
        assert_state_matches("Adam", fused, fused_vars, stock, stock_vars,
                             err_msg=f"step {step}")


def test_values_set_before_build_are_used():
    fused, fused_vars, stock, stock_vars = make_pair("SGD", SGD_VALUES)
    fused.learning_rate = [0.3, 0.2, 0.1]
    fused.set_hyperparameter("momentum", 0.7)
    for b, opt in enumerate(stock):
        opt.learning_rate = [0.3, 0.2, 0.1][b]
        opt.momentum = 0.7
    for step, grads in enumerate(gradient_steps(steps=3)):
        apply_per_model(stock, stock_vars, grads)
        fused.apply_gradients(zip(grads, fused_vars))
        assert_state_matches("SGD", fused, fused_vars, stock, stock_vars,
                             err_msg=f"step {step}")


# -- weight decay ------------------------------------------------------------


@pytest.mark.parametrize("exclude", [None, "var_names", "var_list"])
@pytest.mark.parametrize("name, values", [
    ("SGD", SGD_VALUES), ("Adam", ADAM_VALUES)])
def test_per_model_weight_decay_matches_stock(name, values, exclude):
    values = dict(values, weight_decay=[0.5, 0.0, 2.0])
    shapes = [(4, 2), (2,)]
    names = ["kernel", "bias"]
    stock = [getattr(keras.optimizers, name)(**model_values(values, b))
             for b in range(B)]
    fused = getattr(optimizers, name)(**values)
    initial = per_model_arrays(np.random.default_rng(0), shapes, B)
    fused_vars = [keras.Variable(v, name=n) for v, n in zip(initial, names)]
    stock_vars = [stock_variables(initial, b, names) for b in range(B)]
    if exclude == "var_names":
        for opt in [fused, *stock]:
            opt.exclude_from_weight_decay(var_names=["bias"])
    elif exclude == "var_list":
        fused.exclude_from_weight_decay(var_list=[fused_vars[1]])
        for opt, variables in zip(stock, stock_vars):
            opt.exclude_from_weight_decay(var_list=[variables[1]])
    for step, grads in enumerate(gradient_steps(shapes=shapes, steps=5)):
        apply_per_model(stock, stock_vars, grads)
        fused.apply_gradients(zip(grads, fused_vars))
        assert_state_matches(name, fused, fused_vars, stock, stock_vars,
                             err_msg=f"step {step}")


def test_weight_decay_exclusion_changes_only_the_excluded_variable():
    # Guards the test above against an exclusion that does nothing.
    shapes = [(4, 2), (2,)]
    initial = per_model_arrays(np.random.default_rng(0), shapes, B)
    grads = gradient_steps(shapes=shapes, steps=1)[0]
    results = []
    for exclude in (False, True):
        opt = optimizers.SGD(learning_rate=0.1, weight_decay=[0.5, 0.1, 1.0])
        variables = [keras.Variable(v, name=n)
                     for v, n in zip(initial, ["kernel", "bias"])]
        if exclude:
            opt.exclude_from_weight_decay(var_names=["bias"])
        opt.apply_gradients(zip(grads, variables))
        results.append([v.numpy() for v in variables])
    np.testing.assert_array_equal(results[0][0], results[1][0])
    assert_close(results[1][1], initial[1] - 0.1 * grads[1])
    assert not np.allclose(results[0][1], results[1][1])


# -- learning-rate schedules -------------------------------------------------


def schedules():
    """Three different schedules, one per model."""
    return [
        keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=3,
                                                    decay_rate=0.5),
        keras.optimizers.schedules.CosineDecay(0.05, decay_steps=8),
        keras.optimizers.schedules.PiecewiseConstantDecay(
            boundaries=[2, 5], values=[0.2, 0.05, 0.01]),
    ]


@pytest.mark.parametrize("in_graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("per_model", [False, True],
                         ids=["shared", "per_model"])
@pytest.mark.parametrize("name, values", [
    ("SGD", SGD_VALUES), ("Adam", ADAM_VALUES)])
def test_schedules_match_stock(name, values, per_model, in_graph):
    stock_schedules = schedules() if per_model else [schedules()[0]] * B
    rate = schedules() if per_model else schedules()[0]
    stock = [getattr(keras.optimizers, name)(
        **dict(model_values(values, b), learning_rate=stock_schedules[b]))
        for b in range(B)]
    fused = getattr(optimizers, name)(**dict(values, learning_rate=rate))
    initial = per_model_arrays(np.random.default_rng(0), SHAPES, B)
    fused_vars = [keras.Variable(value) for value in initial]
    stock_vars = [stock_variables(initial, b) for b in range(B)]

    def apply(grads):
        fused.apply_gradients(zip(grads, fused_vars))

    if in_graph:
        apply = compiled(apply, fused, fused_vars)
    for step, grads in enumerate(gradient_steps(steps=7)):
        expected = [float(opt.learning_rate) for opt in stock]
        assert_close(fused.learning_rate, expected, err_msg=f"step {step}")
        assert_close(fused.get_hyperparameter("learning_rate"), expected)
        apply_per_model(stock, stock_vars, grads)
        apply(grads)
        assert_state_matches(name, fused, fused_vars, stock, stock_vars,
                             err_msg=f"step {step}")
    if per_model:
        # The schedules did give the models different rates.
        assert len(set(expected)) == B


def test_scheduled_learning_rate_is_not_settable():
    opt = optimizers.SGD(learning_rate=schedules())
    with pytest.raises(TypeError, match="schedule"):
        opt.learning_rate = [0.1, 0.2, 0.3]


# -- hyper-parameters are data: changing one does not retrace ---------------


@pytest.mark.parametrize("name, values, hyper, new", [
    ("SGD", SGD_VALUES, "learning_rate", [0.2, 0.001, 0.03]),
    # Stock SGD has no momentum slots to switch on: every model starts > 0.
    ("SGD", dict(SGD_VALUES, momentum=[0.9, 0.5, 0.2]), "momentum",
     [0.1, 0.95, 0.5]),
    ("Adam", ADAM_VALUES, "learning_rate", 0.02),
    ("Adam", ADAM_VALUES, "beta_1", [0.5, 0.99, 0.9]),
    ("Adam", ADAM_VALUES, "beta_2", [0.9, 0.9999, 0.99]),
    ("Adam", ADAM_VALUES, "epsilon", [1e-1, 1e-7, 1e-3]),
    ("Adam", dict(ADAM_VALUES, weight_decay=[0.1, 0.2, 0.3]),
     "weight_decay", [1.0, 0.0, 3.0]),
    ("SGD", dict(SGD_VALUES, clipnorm=[0.5, 1.0, 2.0]),
     "clipnorm", [2.0, 0.1, 0.5]),
])
def test_changing_a_hyperparameter_takes_effect_without_retracing(
        name, values, hyper, new):
    fused, fused_vars, stock, stock_vars = make_pair(name, values)
    # Twins that keep the old values: the change must make a difference.
    _, _, control, control_vars = make_pair(name, values)
    fused.build(fused_vars)
    traces = []

    def train_step(grads):
        traces.append(None)
        fused.apply_gradients(zip(grads, fused_vars))

    train_step = compiled(train_step, fused, fused_vars)

    for step, grads in enumerate(gradient_steps(steps=6)):
        if step == 3:
            if hyper == "learning_rate":
                fused.learning_rate = new
            else:
                fused.set_hyperparameter(hyper, new)
            for b, opt in enumerate(stock):
                setattr(opt, hyper, new[b] if isinstance(new, list) else new)
        apply_per_model(stock, stock_vars, grads)
        apply_per_model(control, control_vars, grads)
        train_step(grads)
        assert_state_matches(name, fused, fused_vars, stock, stock_vars,
                             err_msg=f"step {step}")
    assert len(traces) == 1
    assert_close(fused.get_hyperparameter(hyper), np.broadcast_to(new, (B,)))
    assert max_slice_difference(fused_vars, control_vars) > 1e-4


# -- configuration, serialization, checkpoints -------------------------------


def test_get_config_round_trip_keeps_per_model_values():
    opt = optimizers.Adam(**ADAM_VALUES, amsgrad=True, clipnorm=[1, 2, 3],
                          weight_decay=0.01)
    clone = optimizers.Adam.from_config(opt.get_config())
    assert clone.amsgrad and clone.num_models == B
    for hyper in ADAM_VALUES:
        assert_close(clone.get_hyperparameter(hyper), ADAM_VALUES[hyper],
                     err_msg=hyper)
    assert_close(clone.get_hyperparameter("clipnorm"), [1, 2, 3])
    assert_close(clone.get_hyperparameter("weight_decay"), [0.01] * B)
    for hyper in ("clipvalue", "global_clipnorm"):
        assert clone.get_hyperparameter(hyper) is None


@pytest.mark.parametrize("name, values, flag, hyper, new", [
    ("SGD", SGD_VALUES, "nesterov", "momentum", [0.3, 0.2, 0.1]),
    ("Adam", ADAM_VALUES, "amsgrad", "beta_2", [0.9, 0.95, 0.99]),
])
def test_config_of_a_built_optimizer_has_the_changed_values(
        name, values, flag, hyper, new):
    fused, fused_vars, _, _ = make_pair(name, values, **{flag: True})
    fused.apply_gradients(zip(gradient_steps(steps=1)[0], fused_vars))
    fused.set_hyperparameter(hyper, new)
    fused.learning_rate = [0.5, 0.25, 0.125]
    config = fused.get_config()
    assert config[flag] is True and config["num_models"] == B
    assert_close(config[hyper], new)
    assert_close(config["learning_rate"], [0.5, 0.25, 0.125])
    for clone in (
            type(fused).from_config(config),
            keras.saving.deserialize_keras_object(
                keras.saving.serialize_keras_object(fused))):
        assert type(clone) is type(fused)
        assert getattr(clone, flag) is True
        for other in fused.hyperparameter_names:
            expected = fused.get_hyperparameter(other)
            if expected is None:
                assert clone.get_hyperparameter(other) is None
            else:
                assert_close(clone.get_hyperparameter(other), expected,
                             err_msg=other)


def test_config_with_per_model_schedules_round_trips():
    opt = optimizers.Adam(learning_rate=schedules(), beta_1=[0.9, 0.8, 0.7])
    for clone in (
            optimizers.Adam.from_config(opt.get_config()),
            keras.saving.deserialize_keras_object(
                keras.saving.serialize_keras_object(opt))):
        rates = clone._hyper_values["learning_rate"]
        assert [type(r) for r in rates] == [type(r) for r in schedules()]
        assert [r.get_config() for r in rates] == [
            r.get_config() for r in schedules()]
        assert_close(clone.learning_rate, opt.learning_rate)


def _trained(name, values, flags, seed):
    """An optimizer after 3 steps and a hyper-parameter change."""
    fused, fused_vars, _, _ = make_pair(name, values, seed=seed, **flags)
    for grads in gradient_steps(steps=3, seed=seed):
        fused.apply_gradients(zip(grads, fused_vars))
    fused.learning_rate = [0.3, 0.2, 0.1]
    return fused, fused_vars


@pytest.mark.parametrize("how", [
    pytest.param("checkpoint", marks=pytest.mark.backends(
        "tensorflow", reason="tf.train.Checkpoint saves TensorFlow "
        "variables")),
    "own_variables"])
@pytest.mark.parametrize("name, values, flags", [
    ("SGD", SGD_VALUES, {"nesterov": True}),
    ("Adam", ADAM_VALUES, {"amsgrad": True}),
])
def test_optimizer_state_round_trip(name, values, flags, how, tmp_path):
    saved, saved_vars = _trained(name, values, flags, seed=0)
    # Another optimizer, other values, other state, on variables of the
    # same shapes.
    restored, restored_vars = _trained(name, values, flags, seed=5)
    restored.set_hyperparameter(
        "momentum" if name == "SGD" else "beta_1", [0.11, 0.22, 0.33])
    if how == "checkpoint":
        import tensorflow as tf

        path = tf.train.Checkpoint(optimizer=saved).save(tmp_path / "ckpt")
        tf.train.Checkpoint(optimizer=restored).restore(
            path).assert_existing_objects_matched()
    else:
        store = {}
        saved.save_own_variables(store)
        restored.load_own_variables(store)
    assert len(restored.variables) == len(saved.variables)
    for saved_var, restored_var in zip(saved.variables, restored.variables):
        np.testing.assert_array_equal(restored_var.numpy(), saved_var.numpy(),
                                      err_msg=saved_var.path)
    for hyper in saved.hyperparameter_names:
        expected = saved.get_hyperparameter(hyper)
        if expected is not None:
            np.testing.assert_array_equal(
                restored.get_hyperparameter(hyper), expected, err_msg=hyper)
    for slot in SLOTS[name]:
        for saved_slot, restored_slot in zip(getattr(saved, slot, []),
                                             getattr(restored, slot, [])):
            np.testing.assert_array_equal(restored_slot.numpy(),
                                          saved_slot.numpy())
    # The restored optimizer continues exactly as the saved one.
    for variable, saved_var in zip(restored_vars, saved_vars):
        variable.assign(saved_var)
    grads = gradient_steps(steps=1, seed=9)[0]
    saved.apply_gradients(zip(grads, saved_vars))
    restored.apply_gradients(zip(grads, restored_vars))
    for variable, saved_var in zip(restored_vars, saved_vars):
        np.testing.assert_array_equal(variable.numpy(), saved_var.numpy())


# -- bad input ---------------------------------------------------------------


def _lengths_in(message, name, *lengths):
    return name in message and all(
        f" {length} " in message or f"({length}" in message
        or f" {length})" in message for length in lengths)


@pytest.mark.parametrize("kwargs, name, lengths", [
    (dict(learning_rate=[0.1, 0.2, 0.3], beta_1=[0.9, 0.8]), "beta_1", (3, 2)),
    (dict(beta_2=[0.9, 0.8], epsilon=[1e-7] * 4), "epsilon", (2, 4)),
    (dict(learning_rate=[0.1, 0.2, 0.3], num_models=4), "learning_rate",
     (3, 4)),
    (dict(num_models=2, clipnorm=[1.0, 2.0, 3.0]), "clipnorm", (2, 3)),
])
def test_mismatched_lengths_raise(kwargs, name, lengths):
    with pytest.raises(ValueError) as info:
        optimizers.Adam(**kwargs)
    assert _lengths_in(str(info.value), name, *lengths), str(info.value)


@pytest.mark.parametrize("via", ["build", "apply_gradients"])
def test_lengths_that_differ_from_the_model_axis_raise(via):
    opt = optimizers.SGD(learning_rate=0.1, momentum=[0.9, 0.8, 0.7])
    variable = keras.Variable(np.zeros((4, 2), "float32"))
    with pytest.raises(ValueError) as info:
        if via == "build":
            opt.build([variable])
        else:
            opt.apply_gradients([(np.ones((4, 2), "float32"), variable)])
    assert _lengths_in(str(info.value), "momentum", 3, 4), str(info.value)


def test_variables_with_different_model_axes_raise():
    opt = optimizers.Adam()
    variables = [keras.Variable(np.zeros((3, 2), "float32")),
                 keras.Variable(np.zeros((4, 2), "float32"))]
    with pytest.raises(ValueError, match="4"):
        opt.build(variables)


def test_setting_a_list_of_another_length_raises():
    fused, fused_vars, _, _ = make_pair("Adam", ADAM_VALUES)
    fused.build(fused_vars)
    with pytest.raises(ValueError) as info:
        fused.set_hyperparameter("beta_1", [0.9, 0.8])
    assert _lengths_in(str(info.value), "beta_1", 3, 2), str(info.value)
    with pytest.raises(ValueError, match="nesterov"):
        fused.set_hyperparameter("nesterov", 0.5)


@pytest.mark.parametrize("learning_rate", [
    None, "abc", [], (), np.array([]), [0.1, "a"], True])
def test_bad_learning_rate_raises(learning_rate):
    with pytest.raises((TypeError, ValueError), match="learning_rate"):
        optimizers.SGD(learning_rate=learning_rate)


@pytest.mark.parametrize("momentum", [1.5, -0.1, [0.5, -0.1], [0.2, 1.01]])
def test_momentum_out_of_range_raises(momentum):
    with pytest.raises(ValueError, match="momentum"):
        optimizers.SGD(momentum=momentum)


def test_only_one_kind_of_clipping():
    with pytest.raises(ValueError, match="clip"):
        optimizers.SGD(clipnorm=[1.0, 2.0], clipvalue=1.0)


def test_building_on_a_scalar_variable_raises():
    with pytest.raises(ValueError, match="scalar"):
        optimizers.Adam().build([keras.Variable(1.0)])


def test_setting_momentum_out_of_range_raises():
    opt = optimizers.SGD(learning_rate=0.1, momentum=[0.9, 0.8, 0.7])
    with pytest.raises(ValueError, match="momentum"):
        opt.set_hyperparameter("momentum", [0.9, 1.5, 0.7])


def test_switching_momentum_on_after_build_is_not_silently_ignored():
    opt = optimizers.SGD(learning_rate=0.1, momentum=0.0)
    variable = keras.Variable(np.zeros((B, 2), "float32"))
    opt.build([variable])
    with pytest.raises(ValueError, match="momentum"):
        opt.set_hyperparameter("momentum", [0.5, 0.5, 0.5])


# -- optimizers.get ----------------------------------------------------------


@pytest.mark.parametrize("identifier, cls", [
    ("adam", optimizers.Adam), ("Adam", optimizers.Adam),
    ("SGD", optimizers.SGD), ("sgd", optimizers.SGD)])
def test_get_by_name(identifier, cls):
    assert type(optimizers.get(identifier)) is cls


def test_get_returns_a_fused_optimizer_as_it_is():
    opt = optimizers.SGD(learning_rate=[0.1, 0.2])
    assert optimizers.get(opt) is opt
    clone = optimizers.get(keras.saving.serialize_keras_object(opt))
    assert type(clone) is optimizers.SGD
    assert_close(clone.get_hyperparameter("learning_rate"), [0.1, 0.2])


@pytest.mark.parametrize("name, kwargs", [
    ("Adam", dict(learning_rate=0.01, beta_1=0.8)),
    ("Adam", dict(learning_rate=keras.optimizers.schedules.ExponentialDecay(
        0.05, decay_steps=2, decay_rate=0.5), amsgrad=True, weight_decay=0.1)),
    ("SGD", dict(learning_rate=0.05, momentum=0.9, nesterov=True,
                 clipnorm=1.0)),
], ids=["adam", "adam_schedule", "sgd_clipnorm"])
def test_get_converts_a_stock_optimizer(name, kwargs):
    stock_cls = getattr(keras.optimizers, name)
    fused = optimizers.get(stock_cls(**kwargs))
    assert type(fused) is getattr(optimizers, name)
    stock = [stock_cls(**kwargs) for _ in range(B)]
    initial = per_model_arrays(np.random.default_rng(0), SHAPES, B)
    fused_vars = [keras.Variable(value) for value in initial]
    stock_vars = [stock_variables(initial, b) for b in range(B)]
    for step, grads in enumerate(gradient_steps(steps=5)):
        # Large gradients, so that clipping acts.
        grads = [3.0 * g for g in grads]
        apply_per_model(stock, stock_vars, grads)
        fused.apply_gradients(zip(grads, fused_vars))
        assert_state_matches(name, fused, fused_vars, stock, stock_vars,
                             err_msg=f"step {step}")
    config = stock[0].get_config()
    for hyper in fused.hyperparameter_names:
        value = config[hyper]
        if hyper == "learning_rate" or value is None:
            continue
        assert_close(fused.get_hyperparameter(hyper), [value] * B,
                     err_msg=hyper)
    for flag in ("nesterov", "amsgrad"):
        if flag in config:
            assert getattr(fused, flag) == config[flag]


def test_get_rejects_a_built_stock_optimizer():
    stock = keras.optimizers.Adam()
    stock.build([keras.Variable(np.zeros((2,), "float32"))])
    with pytest.raises(ValueError, match="built"):
        optimizers.get(stock)


@pytest.mark.parametrize("identifier, error", [
    ("nope", ValueError), ("multioptimizer", ValueError), (3, TypeError),
    (None, TypeError)])
def test_get_rejects_unknown_identifiers(identifier, error):
    with pytest.raises(error):
        optimizers.get(identifier)
