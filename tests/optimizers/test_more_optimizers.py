"""Fused AdamW, Adamax, Nadam, RMSprop, Adagrad, Adadelta, Ftrl, Lion, Muon
and ScheduleFreeAdamW against B stock Keras optimizers, one per model.

Model b's slice of every fused `[B, ...]` variable and of every slot must be
updated exactly as a stock `keras.optimizers` instance with model b's
hyper-parameters updates its own variable, at float32 tolerance.
"""

import inspect

import keras
import numpy as np
import pytest
from backend_steps import compiled
from keras import ops
from testing import (
    STEP_JIT,
    apply_per_model,
    assert_close,
    assert_slices_match,
    max_slice_difference,
    per_model_arrays,
    stock_variables,
)

import hftatf
from hftatf import optimizers
from hftatf.core.axis import to_model_rank

B = 3
# No dimension but the model axis is B; test_variables_with_an_axis_of_size_b
# covers that case.
SHAPES = [(5,), (4, 2), (2, 3, 4)]
STEPS = 10

# The stock attribute of every slot; the fused optimizers use the same names.
SLOTS = {
    "AdamW": ("_momentums", "_velocities", "_velocity_hats"),
    "Adamax": ("_m", "_u"),
    "Nadam": ("_momentums", "_velocities", "_u_product"),
    "RMSprop": ("_velocities", "_momentums", "_average_gradients"),
    "Adagrad": ("_accumulators",),
    "Adadelta": ("_accumulated_grads", "_accumulated_delta_vars"),
    "Ftrl": ("_accumulators", "_linears"),
    "Lion": ("_momentums",),
    "Muon": ("momentums", "adam_velocities"),
    "ScheduleFreeAdamW": ("_momentums", "_velocities"),
}

# Distinct values per model for every hyper-parameter.
VALUES = {
    "AdamW": {"learning_rate": [0.01, 0.003, 0.05],
              "weight_decay": [0.004, 0.1, 0.5],
              "beta_1": [0.9, 0.8, 0.5],
              "beta_2": [0.999, 0.99, 0.9],
              "epsilon": [1e-7, 1e-3, 1e-1]},
    "Adamax": {"learning_rate": [0.01, 0.003, 0.05],
               "beta_1": [0.9, 0.8, 0.5],
               "beta_2": [0.999, 0.9, 0.5],
               "epsilon": [1e-7, 1e-3, 1e-1]},
    "Nadam": {"learning_rate": [0.01, 0.003, 0.05],
              "beta_1": [0.9, 0.8, 0.5],
              "beta_2": [0.999, 0.99, 0.9],
              "epsilon": [1e-7, 1e-3, 1e-1]},
    "RMSprop": {"learning_rate": [0.01, 0.003, 0.02],
                "rho": [0.9, 0.8, 0.95],
                "momentum": [0.9, 0.5, 0.0],
                "epsilon": [1e-7, 1e-3, 1e-1]},
    "Adagrad": {"learning_rate": [0.01, 0.1, 0.05],
                "initial_accumulator_value": [0.1, 0.0, 1.0],
                "epsilon": [1e-7, 1e-3, 1e-1]},
    "Adadelta": {"learning_rate": [1.0, 0.5, 2.0],
                 "rho": [0.95, 0.9, 0.5],
                 "epsilon": [1e-7, 1e-3, 1e-1]},
    "Ftrl": {"learning_rate": [0.01, 0.05, 0.1],
             "learning_rate_power": [-0.5, -0.2, 0.0],
             "initial_accumulator_value": [0.0, 0.1, 0.5],
             "l1_regularization_strength": [0.0, 0.01, 0.1],
             "l2_regularization_strength": [0.0, 0.1, 0.01],
             "l2_shrinkage_regularization_strength": [0.0, 0.05, 0.1],
             "beta": [0.0, 0.5, 1.0]},
    "Lion": {"learning_rate": [0.001, 0.01, 0.003],
             "beta_1": [0.9, 0.5, 1.0],
             "beta_2": [0.99, 0.9, 0.5]},
    # The (4, 2) variables take Muon steps, the others Adam steps.
    "Muon": {"learning_rate": [0.01, 0.003, 0.05],
             "adam_beta_1": [0.9, 0.8, 0.5],
             "adam_beta_2": [0.999, 0.99, 0.9],
             "epsilon": [1e-7, 1e-3, 1e-1],
             "weight_decay": [0.004, 0.1, 0.0],
             "adam_weight_decay": [0.004, 0.05, 0.2],
             "adam_lr_ratio": [1.0, 0.1, 0.5],
             "momentum": [0.95, 0.9, 0.5]},
    "ScheduleFreeAdamW": {"learning_rate": [0.0025, 0.01, 0.05],
                          "beta_1": [0.9, 0.8, 0.5],
                          "beta_2": [0.999, 0.99, 0.9],
                          "epsilon": [1e-8, 1e-3, 1e-1]},
}
NAMES = sorted(VALUES)
# The structural options switched on: the strongest case of each optimizer.
FLAGS = {"AdamW": {"amsgrad": True}, "RMSprop": {"centered": True}}


def model_values(values, model):
    """Model `model`'s value of each per-model hyper-parameter."""
    return {name: value[model] if isinstance(value, list) else value
            for name, value in values.items()}


def make_pair(name, values=None, shapes=SHAPES, seed=0, **shared):
    """A fused optimizer with per-model `values`, its B stock twins, and
    fused/stock variables that start from the same random values."""
    values = VALUES[name] if values is None else values
    stock = [getattr(keras.optimizers, name)(**model_values(values, b),
                                             **shared) for b in range(B)]
    fused = getattr(optimizers, name)(**values, **shared)
    initial = per_model_arrays(np.random.default_rng(seed), shapes, B)
    fused_vars = [keras.Variable(value) for value in initial]
    stock_vars = [stock_variables(initial, b) for b in range(B)]
    return fused, fused_vars, stock, stock_vars


def gradient_steps(shapes=SHAPES, steps=STEPS, seed=1):
    """`[B, ...]` gradients, different for every model, variable and step."""
    rng = np.random.default_rng(seed)
    return [per_model_arrays(rng, shapes, B) for _ in range(steps)]


def slot_list(optimizer, slot):
    """An optimizer's slot variables as a list (Nadam's `_u_product` is one
    variable: a stock scalar, a fused `[B]` vector)."""
    value = getattr(optimizer, slot, None)
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def assert_state_matches(name, fused, fused_vars, stock, stock_vars,
                         err_msg=""):
    """Variables and every slot a stock optimizer holds match per model; the
    fused optimizer has a slot exactly when some stock optimizer has it."""
    assert_slices_match(fused_vars, stock_vars, err_msg=err_msg)
    for slot in SLOTS[name]:
        fused_slots = slot_list(fused, slot)
        stock_slots = [slot_list(opt, slot) for opt in stock]
        assert bool(fused_slots) == any(stock_slots), slot
        for b, model_slots in enumerate(stock_slots):
            if not model_slots:
                continue
            assert len(fused_slots) == len(model_slots), slot
            for i, (ours, theirs) in enumerate(zip(fused_slots,
                                                   model_slots)):
                # A slot a variable does not have (Muon's velocities of
                # matrices) is None in both.
                assert (ours is None) == (theirs is None), (slot, i)
                if theirs is not None:
                    assert_close(np.asarray(ours)[b], theirs, err_msg=(
                        f"{err_msg} slot {slot}[{i}] model {b}"))


def run_and_compare(name, fused, fused_vars, stock, stock_vars, steps):
    for step, grads in enumerate(steps):
        apply_per_model(stock, stock_vars, grads)
        fused.apply_gradients(zip(grads, fused_vars))
        assert_state_matches(name, fused, fused_vars, stock, stock_vars,
                             err_msg=f"step {step}")


# -- the update rule, per model, eager and compiled --------------------------

CASES = [
    ("AdamW", {}, {"amsgrad": False}),
    ("AdamW", {}, {"amsgrad": True}),
    ("Adamax", {}, {}),
    ("Nadam", {}, {}),
    *[("RMSprop", {"momentum": momentum}, {"centered": centered})
      for momentum in ([0.0, 0.0, 0.0], [0.9, 0.5, 0.0], [0.9, -0.5, 0.3])
      for centered in (False, True)],
    ("Adagrad", {}, {}),
    # Floats shared by all models.
    ("Adagrad", {"initial_accumulator_value": 0.5, "epsilon": 1e-3}, {}),
    ("Adadelta", {}, {}),
    ("Ftrl", {}, {}),
    ("Lion", {}, {}),
    ("Muon", {}, {}),
    ("Muon", {"adam_weight_decay": None}, {"nesterov": False,
                                           "rms_rate": None}),
    ("ScheduleFreeAdamW", {}, {}),
    ("ScheduleFreeAdamW", {}, {"warmup_steps": 4}),
]


CASE_IDS = [f"{n}-{'-'.join(f'{k}={v}' for k, v in {**c, **f}.items())}"
            for n, c, f in CASES]


@pytest.mark.parametrize("name, changes, flags", CASES, ids=CASE_IDS)
def test_matches_stock(name, changes, flags):
    values = dict(VALUES[name], **changes)
    fused, fused_vars, stock, stock_vars = make_pair(name, values, **flags)
    run_and_compare(name, fused, fused_vars, stock, stock_vars,
                    gradient_steps())
    assert int(fused.iterations) == STEPS


@pytest.mark.parametrize("name", NAMES)
def test_matches_stock_inside_xla_compiled_function(name):
    flags = FLAGS.get(name, {})
    fused, fused_vars, stock, stock_vars = make_pair(name, **flags)

    # Built on the first trace (symbolically), as when a train step is the
    # first call: per-model slot initial values must survive that.
    def train_step(grads):
        fused.apply_gradients(zip(grads, fused_vars))

    train_step = compiled(train_step, fused, fused_vars, jit_compile=True)

    for step, grads in enumerate(gradient_steps(steps=4)):
        apply_per_model(stock, stock_vars, grads)
        train_step(grads)
        assert_state_matches(name, fused, fused_vars, stock, stock_vars,
                             err_msg=f"step {step}")


# Regression guard: ops.add with a [B, 1, ..., 1] hyper-parameter takes
# TensorFlow's bias_add path along the last axis when an axis has size B.
@pytest.mark.parametrize("name, changes, flags", CASES, ids=CASE_IDS)
def test_variables_with_an_axis_of_size_b(name, changes, flags):
    shapes = [(4, B), (B, 4), (B,)]
    fused, fused_vars, stock, stock_vars = make_pair(
        name, dict(VALUES[name], **changes), shapes=shapes, **flags)
    run_and_compare(name, fused, fused_vars, stock, stock_vars,
                    gradient_steps(shapes=shapes, steps=3))


@pytest.mark.parametrize("name", ["AdamW", "Adamax", "Nadam"])
def test_the_step_number_comes_from_local_step(name):
    # Per-model step counts, as after skipped steps: model b's count runs
    # offsets[b] ahead, like a stock optimizer whose iterations start there.
    offsets = [0, 3, 7]
    fused, fused_vars, stock, stock_vars = make_pair(name)

    def local_step(variable):
        steps = ops.cast(fused.iterations + 1, variable.dtype) + ops.cast(
            offsets, variable.dtype)
        return to_model_rank(steps, len(variable.shape))

    fused._local_step = local_step
    for opt, variables, offset in zip(stock, stock_vars, offsets):
        opt.build(variables)
        opt.iterations.assign(offset)
    run_and_compare(name, fused, fused_vars, stock, stock_vars,
                    gradient_steps(steps=4))


def test_nadam_advances_u_product_once_per_applied_step():
    # Under gradient accumulation only every second call updates anything;
    # `iterations` counts those updates.
    fused, fused_vars, stock, stock_vars = make_pair(
        "Nadam", gradient_accumulation_steps=2)
    run_and_compare("Nadam", fused, fused_vars, stock, stock_vars,
                    gradient_steps(steps=6))
    assert tuple(fused._u_product.shape) == (B,)
    beta_1 = np.asarray(VALUES["Nadam"]["beta_1"], dtype="float64")
    expected = np.prod([beta_1 * (1 - 0.5 * 0.96 ** t) for t in (1, 2, 3)],
                       axis=0)
    assert_close(fused._u_product, expected)


# -- weight decay (AdamW) -------------------------------------------------


@pytest.mark.parametrize("exclude", [None, "var_names", "var_list"])
def test_adamw_per_model_weight_decay_matches_stock(exclude):
    shapes = [(4, 2), (2,)]
    names = ["kernel", "bias"]
    values = VALUES["AdamW"]
    stock = [keras.optimizers.AdamW(**model_values(values, b))
             for b in range(B)]
    fused = optimizers.AdamW(**values)
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
    run_and_compare("AdamW", fused, fused_vars, stock, stock_vars,
                    gradient_steps(shapes=shapes, steps=5))
    # Weight decay did act (and, when excluded, on the kernel only).
    adam_vars = [keras.Variable(value) for value in initial]
    adam = optimizers.AdamW(**dict(values, weight_decay=0.0))
    for grads in gradient_steps(shapes=shapes, steps=5):
        adam.apply_gradients(zip(grads, adam_vars))
    assert not np.allclose(fused_vars[0], adam_vars[0])
    assert np.allclose(fused_vars[1], adam_vars[1]) == (exclude is not None)


def test_adamw_requires_weight_decay():
    with pytest.raises(ValueError, match="weight_decay=None"):
        optimizers.AdamW(weight_decay=None)
    assert_close(optimizers.AdamW(num_models=B).get_hyperparameter(
        "weight_decay"), [0.004] * B)


# -- hyper-parameters are data ---------------------------------------------


@pytest.mark.parametrize("name, hyper, new", [
    ("AdamW", "weight_decay", [0.5, 0.0, 0.05]),
    ("AdamW", "beta_1", [0.5, 0.95, 0.7]),
    ("Adamax", "beta_2", [0.9, 0.5, 0.999]),
    ("Adamax", "learning_rate", 0.02),
    ("Nadam", "beta_1", [0.5, 0.95, 0.7]),
    ("RMSprop", "rho", [0.5, 0.99, 0.7]),
    # Model 2's stock RMSprop has no momentum slots to switch on.
    ("RMSprop", "momentum", [0.1, 0.95, 0.0]),
    ("Adagrad", "epsilon", [1e-1, 1e-7, 1e-2]),
    ("Adadelta", "rho", [0.5, 0.99, 0.8]),
    ("Ftrl", "l1_regularization_strength", [0.2, 0.0, 0.05]),
    ("Ftrl", "learning_rate_power", [-0.1, -1.0, -0.5]),
    ("Ftrl", "beta", [2.0, 0.0, 0.1]),
    ("Lion", "beta_1", [0.5, 0.99, 0.2]),
])
def test_changing_a_hyperparameter_takes_effect_without_retracing(
        name, hyper, new):
    flags = FLAGS.get(name, {})
    fused, fused_vars, stock, stock_vars = make_pair(name, **flags)
    # Twins that keep the old values: the change must make a difference.
    _, _, control, control_vars = make_pair(name, **flags)
    fused.build(fused_vars)
    traces = []

    def train_step(grads):
        traces.append(None)
        fused.apply_gradients(zip(grads, fused_vars))

    train_step = compiled(train_step, fused, fused_vars)

    for step, grads in enumerate(gradient_steps(steps=6)):
        if step == 3:
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


@pytest.mark.parametrize("name", ["Adagrad", "Ftrl"])
def test_initial_accumulator_value_is_read_when_built(name):
    fused, fused_vars, stock, stock_vars = make_pair(name)
    before_build, after_build = [0.3, 0.0, 2.0], [5.0, 6.0, 7.0]
    fused.set_hyperparameter("initial_accumulator_value", before_build)
    for opt, value in zip(stock, before_build):
        opt.initial_accumulator_value = value
    fused.build(fused_vars)
    for opt, variables in zip(stock, stock_vars):
        opt.build(variables)
    for accumulator, variable in zip(fused._accumulators, fused_vars):
        assert_close(accumulator, np.broadcast_to(
            np.reshape(before_build, (B,) + (1,) * (variable.ndim - 1)),
            variable.shape))
    # As in Keras, a later value changes no accumulator.
    fused.set_hyperparameter("initial_accumulator_value", after_build)
    for opt, value in zip(stock, after_build):
        opt.initial_accumulator_value = value
    run_and_compare(name, fused, fused_vars, stock, stock_vars,
                    gradient_steps(steps=3))


def test_rmsprop_momentum_cannot_be_switched_on_without_slots():
    fused, fused_vars, _, _ = make_pair(
        "RMSprop", dict(VALUES["RMSprop"], momentum=0.0))
    fused.build(fused_vars)
    with pytest.raises(ValueError, match="momentum"):
        fused.set_hyperparameter("momentum", [0.0, 0.5, 0.0])
    fused.set_hyperparameter("momentum", [0.0, -0.5, 0.0])


# -- ranges, as stock Keras checks them ------------------------------------

RANGE_CASES = [
    ("Lion", "beta_1", 0.0),
    ("Lion", "beta_1", 1.5),
    ("Ftrl", "initial_accumulator_value", -0.1),
    ("Ftrl", "learning_rate_power", 0.5),
    ("Ftrl", "l1_regularization_strength", -1.0),
    ("Ftrl", "l2_regularization_strength", -1.0),
    ("Ftrl", "l2_shrinkage_regularization_strength", -0.5),
]


@pytest.mark.parametrize("name, hyper, bad", RANGE_CASES)
def test_out_of_range_values_are_rejected(name, hyper, bad):
    # The oracle rejects the value too.
    with pytest.raises(ValueError):
        getattr(keras.optimizers, name)(**{hyper: bad})
    per_model = list(VALUES[name][hyper])
    per_model[1] = bad
    fused_cls = getattr(optimizers, name)
    with pytest.raises(ValueError, match=hyper) as info:
        fused_cls(**dict(VALUES[name], **{hyper: per_model}))
    assert repr(bad) in str(info.value)
    with pytest.raises(ValueError, match=hyper):
        fused_cls(**{hyper: bad})
    # Checked again when the value changes.
    fused = fused_cls(**VALUES[name])
    with pytest.raises(ValueError, match=hyper):
        fused.set_hyperparameter(hyper, per_model)
    assert_close(fused.get_hyperparameter(hyper), VALUES[name][hyper])


# -- arguments and configuration --------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_arguments_and_defaults_are_stock(name):
    stock_cls = getattr(keras.optimizers, name)
    fused_cls = getattr(optimizers, name)
    stock_params = [p for p in inspect.signature(
        stock_cls.__init__).parameters.values()
        if p.kind is p.POSITIONAL_OR_KEYWORD]
    fused_params = [p for p in inspect.signature(
        fused_cls.__init__).parameters.values()
        if p.kind is p.POSITIONAL_OR_KEYWORD]
    # The fused constructor's own arguments are the stock ones, in order;
    # the rest are keyword arguments of FusedOptimizer.
    assert [(p.name, p.default) for p in fused_params] == [
        (p.name, p.default) for p in stock_params[:len(fused_params)]]
    defaults = {p.name: p.default for p in stock_params[1:]
                if p.name != "name"}
    fused = fused_cls(**defaults)
    stock_config = stock_cls().get_config()
    fused_config = fused.get_config()
    for key, value in stock_config.items():
        if key == "name":
            continue
        assert key in fused_config, key
        if isinstance(value, float):
            assert_close(fused_config[key], value, err_msg=key)
        else:
            assert fused_config[key] == value, key


@pytest.mark.parametrize("name", NAMES)
def test_config_round_trip(name):
    flags = FLAGS.get(name, {})
    fused, fused_vars, _, _ = make_pair(name, **flags)
    fused.apply_gradients(zip(gradient_steps(steps=1)[0], fused_vars))
    changed = [hyper for hyper in fused.hyperparameter_names
               if hyper in VALUES[name]][-1]
    new = [v * 0.5 for v in np.broadcast_to(VALUES[name][changed], (B,))]
    fused.set_hyperparameter(changed, new)
    config = fused.get_config()
    assert config["num_models"] == B
    assert_close(config[changed], new)
    for flag, value in flags.items():
        assert config[flag] is value
    for clone in (
            type(fused).from_config(config),
            keras.saving.deserialize_keras_object(
                keras.saving.serialize_keras_object(fused))):
        assert type(clone) is type(fused)
        assert clone.get_config() == config
        for hyper in fused.hyperparameter_names:
            expected = fused.get_hyperparameter(hyper)
            if expected is None:
                assert clone.get_hyperparameter(hyper) is None
            else:
                assert_close(clone.get_hyperparameter(hyper), expected,
                             err_msg=hyper)


@pytest.mark.parametrize("name", ["Nadam", "RMSprop", "Ftrl"])
def test_optimizer_state_round_trip(name):
    flags = FLAGS.get(name, {})
    saved, saved_vars, _, _ = make_pair(name, **flags)
    restored, restored_vars, _, _ = make_pair(name, seed=5, **flags)
    for grads in gradient_steps(steps=3):
        saved.apply_gradients(zip(grads, saved_vars))
    restored.build(restored_vars)
    store = {}
    saved.save_own_variables(store)
    restored.load_own_variables(store)
    for variable, saved_var in zip(restored_vars, saved_vars):
        variable.assign(saved_var)
    # The restored optimizer (Nadam's `_u_product` included) continues
    # exactly as the saved one.
    grads = gradient_steps(steps=1, seed=9)[0]
    saved.apply_gradients(zip(grads, saved_vars))
    restored.apply_gradients(zip(grads, restored_vars))
    for ours, theirs in zip([*restored.variables, *restored_vars],
                            [*saved.variables, *saved_vars]):
        np.testing.assert_array_equal(ours.numpy(), theirs.numpy(),
                                      err_msg=theirs.path)


# -- training a fused model with fit -----------------------------------------


def mlp():
    x = keras.Input((6,), name="x")
    h = keras.layers.Dense(8, activation="tanh", name="h")(x)
    y = keras.layers.Dense(3, activation="softmax", name="out")(h)
    return keras.Model(x, y, name="mlp")


@pytest.mark.parametrize("name", NAMES)
def test_fit_matches_stock_models(name):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 6)).astype("float32")
    y = rng.integers(0, 3, size=32).astype("int32")
    values, flags = VALUES[name], FLAGS.get(name, {})
    array = hftatf.fuse(mlp(), B)
    stock = array.unfuse()
    # Without XLA, which costs seconds of compilation per optimizer here:
    # the compiled update is checked by
    # test_matches_stock_inside_xla_compiled_function.
    array.compile(getattr(optimizers, name)(**values, **flags),
                  loss="sparse_categorical_crossentropy", jit_compile=STEP_JIT)
    # 32 samples / batch 8: 4 steps.
    history = array.fit(x, y, batch_size=8, epochs=1, shuffle=False,
                        verbose=0)
    trained = array.unfuse()
    for b, model in enumerate(stock):
        optimizer = getattr(keras.optimizers, name)(
            **model_values(values, b), **flags)
        # Built before fit, which builds it where ScheduleFreeAdamW's
        # assignment of the weights to its momentum does not run.
        optimizer.build(model.trainable_variables)
        model.compile(optimizer, loss="sparse_categorical_crossentropy")
        stock_history = model.fit(x, y, batch_size=8, epochs=1,
                                  shuffle=False, verbose=0)
        for ours, theirs in zip(trained[b].weights, model.weights):
            assert_close(ours, theirs, err_msg=f"model {b} {theirs.path}")
        assert_close(history.history[f"loss_{b}"],
                     stock_history.history["loss"])
    assert not np.allclose(trained[0].get_weights()[0],
                           trained[1].get_weights()[0])


def test_muon_decides_its_rule_on_the_stock_variables():
    # Matrices take Muon steps, except embeddings and excluded layers; the
    # fused variables' model axis must not turn vectors into matrices.
    rng = np.random.default_rng(4)
    inputs = keras.Input((3,))
    # Excluded by its name, as an Embedding's would be (a Dense, which
    # stock Keras updates densely too).
    hidden = keras.layers.Dense(4, name="token_embedding")(inputs)
    hidden = keras.layers.Dense(5, activation="tanh", name="skip_me")(hidden)
    model = keras.Model(inputs, keras.layers.Dense(2, name="head")(hidden))
    array = hftatf.fuse(model, B)
    stock = array.unfuse()
    x = rng.normal(size=(16, 3)).astype("float32")
    y = rng.normal(size=(16, 2)).astype("float32")
    rates = [0.02, 0.005, 0.05]
    array.compile(optimizers.Muon(rates, exclude_layers=["skip_me"]),
                  loss="mse", jit_compile=STEP_JIT)
    array.optimizer.build(array.trainable_variables)
    assert [array.optimizer.uses_adam(v) for v in array.trainable_variables
            ] == [True, True, True, True, False, True]
    array.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    for b, model in enumerate(stock):
        model.compile(keras.optimizers.Muon(rates[b],
                                            exclude_layers=["skip_me"]),
                      loss="mse")
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
        for ours, theirs in zip(array.unfuse()[b].weights, model.weights):
            assert_close(ours, theirs, err_msg=f"model {b} {theirs.path}")
