"""Fused Adafactor, Lamb and Lars: optimizers that take norms, per model.

Adafactor and Lamb are checked against B stock Keras optimizers, one per
model, with model b's hyper-parameters: every variable and every slot, at
every step. Keras has no LARS: Lars is checked against a NumPy reference
written from the paper's formula (You, Gitman and Ginsburg 2017), per model.
Every norm (weight and update norms, root mean squares, factored moments)
must be taken per model: one model's huge or non-finite gradients, or huge
weights, never change another model's step.
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
# Ranks 1 to 3 per model, and axes of size B: a [B, 1, ..., 1]
# hyper-parameter must broadcast over the model axis, never the last axis.
SHAPES = [(5,), (4, 2), (2, 3, 4), (4, B), (B,)]
STEPS = 10
SLOTS = {
    "Adafactor": ("_r", "_c", "_v"),
    "Lamb": ("_momentums", "_velocities"),
}
VALUES = {
    # lr 0.5 is above 1/sqrt(step) for steps 5-10: Adafactor's cap acts.
    # epsilon_2 = 2 is above the weights' RMS: it acts too.
    "Adafactor": {"learning_rate": [0.01, 0.5, 0.1],
                  "beta_2_decay": [-0.8, -0.5, -0.95],
                  "epsilon_1": [1e-30, 1e-6, 1e-2],
                  "epsilon_2": [1e-3, 0.1, 2.0],
                  "clip_threshold": [1.0, 0.5, 2.0]},
    "Lamb": {"learning_rate": [0.01, 0.003, 0.05],
             "beta_1": [0.9, 0.8, 0.5],
             "beta_2": [0.999, 0.99, 0.9],
             "epsilon": [1e-7, 1e-3, 1e-1]},
}


def model_values(values, model):
    return {name: value[model] if isinstance(value, list) else value
            for name, value in values.items()}


def make_pair(name, values=None, shapes=SHAPES, seed=0, **shared):
    """A fused optimizer, its B stock twins, and fused/stock variables that
    start from the same random values."""
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


def assert_state_matches(name, fused, fused_vars, stock, stock_vars,
                         err_msg=""):
    assert_slices_match(fused_vars, stock_vars, err_msg=err_msg)
    for slot in SLOTS[name]:
        assert_slices_match(getattr(fused, slot),
                            [getattr(opt, slot) for opt in stock],
                            err_msg=f"{err_msg} slot {slot}")


def run_against_stock(name, steps=STEPS, **kwargs):
    fused, fused_vars, stock, stock_vars = make_pair(name, **kwargs)
    initial = [v.numpy() for v in fused_vars]
    for step, grads in enumerate(gradient_steps(steps=steps)):
        apply_per_model(stock, stock_vars, grads)
        fused.apply_gradients(zip(grads, fused_vars))
        assert_state_matches(name, fused, fused_vars, stock, stock_vars,
                             err_msg=f"step {step}")
    # The steps did move the weights: the comparison was not vacuous.
    assert max_slice_difference(
        fused_vars, [[v[b] for v in initial] for b in range(B)]) > 1e-3
    return fused, fused_vars


# -- Adafactor and Lamb against stock Keras ----------------------------------


@pytest.mark.parametrize("relative_step", [True, False])
def test_adafactor_matches_stock(relative_step):
    fused, _ = run_against_stock("Adafactor", relative_step=relative_step,
                                 steps=STEPS if relative_step else 5)
    # Factored second moments for per-model rank >= 2, placeholders below.
    assert [tuple(r.shape) for r in fused._r] == [
        (B,), (B, 4), (B, 2, 3), (B, 4), (B,)]
    assert [tuple(c.shape) for c in fused._c] == [
        (B,), (B, 2), (B, 2, 4), (B, B), (B,)]


def test_adafactor_with_a_schedule_matches_stock():
    rates = [keras.optimizers.schedules.ExponentialDecay(r, 3, 0.5)
             for r in (0.2, 0.05, 0.6)]
    values = dict(VALUES["Adafactor"], learning_rate=rates)
    run_against_stock("Adafactor", values=values, steps=5)


def test_lamb_matches_stock():
    run_against_stock("Lamb")


@pytest.mark.parametrize("name", ["Adafactor", "Lamb"])
def test_matches_stock_with_shared_values_and_weight_decay(name):
    values = {"learning_rate": 0.05, "weight_decay": [0.1, 0.0, 0.5]}
    run_against_stock(name, values=values, steps=4)


@pytest.mark.parametrize("options", [
    {"gradient_accumulation_steps": 2},
    {"use_ema": True, "ema_momentum": 0.9, "ema_overwrite_frequency": 3},
], ids=["accumulation", "ema"])
@pytest.mark.parametrize("name", ["Adafactor", "Lamb"])
def test_base_options_match_stock(name, options):
    # Under accumulation the step number (Adafactor's 1/sqrt(step) cap and
    # decay, Lamb's bias corrections) counts applied steps, as in Keras.
    run_against_stock(name, steps=4, **options)


MASKS = [[True, False, True], [False, True, True], [True, True, False],
         [True, False, True]]


@pytest.mark.parametrize("name", ["Adafactor", "Lamb"])
def test_partial_steps_match_stock_optimizers_that_skip_them(name):
    """A model left out of a step keeps its state; the others count only
    their own steps (Adafactor's 1/sqrt(step), Lamb's bias corrections)."""
    fused, fused_vars, stock, stock_vars = make_pair(name)
    for opt, variables in zip(stock, stock_vars):
        opt.build(variables)
    for step, (grads, mask) in enumerate(zip(gradient_steps(steps=4),
                                             MASKS)):
        for b in range(B):
            if mask[b]:
                stock[b].apply_gradients(
                    zip([g[b] for g in grads], stock_vars[b]))
        fused.apply_gradients(zip(grads, fused_vars), model_mask=mask)
        assert_state_matches(name, fused, fused_vars, stock, stock_vars,
                             err_msg=f"step {step}")


@pytest.mark.parametrize("name", ["Adafactor", "Lamb"])
def test_matches_stock_under_xla(name):
    # Fewer variables than SHAPES: XLA compilation is the cost here.
    shapes = [(5,), (2, 3, 4), (4, B)]
    fused, fused_vars, stock, stock_vars = make_pair(name, shapes=shapes)

    # Built on the first trace, as when a train step is the first call.
    def train_step(grads):
        fused.apply_gradients(zip(grads, fused_vars))

    train_step = compiled(train_step, fused, fused_vars, jit_compile=True)

    for step, grads in enumerate(gradient_steps(shapes, steps=3)):
        apply_per_model(stock, stock_vars, grads)
        train_step(grads)
        assert_state_matches(name, fused, fused_vars, stock, stock_vars,
                             err_msg=f"step {step}")


# -- norms are per model -------------------------------------------------------


def _trained_variables(name, perturb):
    """Fused variables after 4 steps, model 0's weights or gradients changed
    by `perturb`."""
    values = VALUES.get(name, LARS_VALUES)
    opt = getattr(optimizers, name)(**values)
    initial = per_model_arrays(np.random.default_rng(0), SHAPES, B)
    if perturb == "huge_weights":
        for value in initial:
            value[0] *= 1e3
    variables = [keras.Variable(value) for value in initial]
    for grads in gradient_steps(steps=4):
        if perturb == "huge_gradients":
            for g in grads:
                g[0] *= 1e6
        elif perturb == "non_finite_gradients":
            for g in grads:
                g[0].flat[0] = np.inf
        opt.apply_gradients(zip(grads, variables))
    return [v.numpy() for v in variables]


@pytest.mark.parametrize("perturb", [
    "huge_gradients", "non_finite_gradients", "huge_weights"])
@pytest.mark.parametrize("name", ["Adafactor", "Lamb", "Lars"])
def test_one_model_never_changes_another_models_step(name, perturb):
    reference = _trained_variables(name, None)
    perturbed = _trained_variables(name, perturb)
    for index, (ref, new) in enumerate(zip(reference, perturbed)):
        # Bit for bit: nothing of model 0 may reach models 1 and 2.
        np.testing.assert_array_equal(new[1:], ref[1:],
                                      err_msg=f"variable {index}")
    if perturb == "non_finite_gradients":
        assert not all(np.isfinite(v[0]).all() for v in perturbed)
    else:
        assert all(np.isfinite(v[0]).all() for v in perturbed)


def test_lamb_huge_gradient_of_one_model_matches_stock():
    fused, fused_vars, stock, stock_vars = make_pair("Lamb")
    for step, grads in enumerate(gradient_steps(steps=3)):
        grads[1][0] *= 1e6
        apply_per_model(stock, stock_vars, grads)
        fused.apply_gradients(zip(grads, fused_vars))
        assert_slices_match(fused_vars, stock_vars, err_msg=f"step {step}")
        assert_slices_match(fused._momentums,
                            [opt._momentums for opt in stock])
        # Stock Keras computes 1 - beta_2 from the Python float, a fused
        # optimizer from its float32 value: (1 - 0.99) differs by ~1e-6
        # relative, which the 1e12 scale of these squared gradients shows.
        assert_slices_match(fused._velocities,
                            [opt._velocities for opt in stock], rtol=1e-4)


def test_lamb_trust_ratio_is_one_for_a_model_with_zero_weights():
    fused, fused_vars, stock, stock_vars = make_pair("Lamb", shapes=[(4, 2)])
    fused_vars[0].assign(np.concatenate(
        [np.zeros((1, 4, 2), "float32"), fused_vars[0].numpy()[1:]]))
    stock_vars[0][0].assign(np.zeros((4, 2), "float32"))
    for step, grads in enumerate(gradient_steps(shapes=[(4, 2)], steps=3)):
        apply_per_model(stock, stock_vars, grads)
        fused.apply_gradients(zip(grads, fused_vars))
        assert_state_matches("Lamb", fused, fused_vars, stock, stock_vars,
                             err_msg=f"step {step}")


# -- LARS against the paper's formula ----------------------------------------

LARS_VALUES = {"learning_rate": [1.0, 0.5, 2.0],
               "momentum": [0.9, 0.5, 0.0],
               "eta": [0.001, 0.02, 0.1],
               "epsilon": [1e-8, 1e-3, 0.0],
               "weight_decay": [0.0, 0.01, 0.1]}


def lars_reference(w, g, v, lr, momentum, eta, epsilon, weight_decay,
                   nesterov, adapt=True):
    """One LARS step of one model on one variable, in float64."""
    w, g, v = (np.asarray(x, "float64") for x in (w, g, v))
    w_norm, g_norm = np.linalg.norm(w), np.linalg.norm(g)
    local_lr = 1.0
    if adapt and w_norm > 0 and g_norm > 0:
        local_lr = eta * w_norm / (g_norm + weight_decay * w_norm + epsilon)
    g = g + weight_decay * w
    v = momentum * v + lr * local_lr * g
    update = momentum * v + lr * local_lr * g if nesterov else v
    return w - update, v


def run_lars_against_reference(values, shapes=SHAPES, steps=STEPS,
                               nesterov=False, names=None, decay=None,
                               adapt=None, configure=None, grads=None,
                               initial=None, in_graph=False, masks=None):
    """Fused Lars against `lars_reference`, per model, per variable.

    `configure(optimizer, variables)` runs before the first step;
    `decay[i]` / `adapt[i]` say whether the reference gives variable i
    weight decay and layer adaptation; `masks[step]` which models take
    each step.
    """
    opt = optimizers.Lars(**values, nesterov=nesterov)
    if initial is None:
        initial = per_model_arrays(np.random.default_rng(0), shapes, B)
    names = names or [None] * len(shapes)
    variables = [keras.Variable(x, name=n) for x, n in zip(initial, names)]
    if configure is not None:
        configure(opt, variables)
    decay = decay or [True] * len(shapes)
    adapt = adapt or [True] * len(shapes)
    ref_w = [x.astype("float64") for x in initial]
    ref_v = [np.zeros_like(x) for x in ref_w]

    def apply(grads, mask):
        opt.apply_gradients(zip(grads, variables), model_mask=mask)

    if in_graph:
        apply = compiled(apply, opt, variables, jit_compile=True)
    grads = grads or gradient_steps(shapes, steps)
    masks = masks or [[True] * B] * len(grads)
    for step, (step_grads, mask) in enumerate(zip(grads, masks)):
        apply(step_grads, mask)
        for i, g in enumerate(step_grads):
            for b in range(B):
                if not mask[b]:
                    continue
                hyper = model_values(values, b)
                ref_w[i][b], ref_v[i][b] = lars_reference(
                    ref_w[i][b], g[b], ref_v[i][b], hyper["learning_rate"],
                    hyper["momentum"], hyper["eta"], hyper["epsilon"],
                    hyper.get("weight_decay", 0.0) if decay[i] else 0.0,
                    nesterov, adapt=adapt[i])
        for i, variable in enumerate(variables):
            assert_close(variable.numpy(), ref_w[i],
                         err_msg=f"step {step} variable {i}")
            assert_close(opt._momentums[i].numpy(), ref_v[i],
                         err_msg=f"step {step} momentum {i}")
    assert max(np.max(np.abs(w - x)) for w, x in zip(ref_w, initial)) > 1e-3
    return opt


@pytest.mark.parametrize("nesterov", [False, True])
def test_lars_matches_the_paper(nesterov):
    run_lars_against_reference(LARS_VALUES, nesterov=nesterov)


def test_lars_without_weight_decay_matches_the_paper():
    values = {k: v for k, v in LARS_VALUES.items() if k != "weight_decay"}
    opt = run_lars_against_reference(values, steps=4)
    assert opt.get_hyperparameter("weight_decay") is None


def test_lars_under_xla_matches_the_paper():
    run_lars_against_reference(LARS_VALUES, steps=4, nesterov=True,
                               in_graph=True)


def test_lars_partial_steps_leave_the_other_models_as_they_were():
    run_lars_against_reference(LARS_VALUES, steps=4, masks=MASKS)


def test_lars_trust_ratio_is_one_for_zero_weights_or_gradients():
    shapes = [(4, 2), (3,)]
    initial = per_model_arrays(np.random.default_rng(0), shapes, B)
    initial[0][1] = 0.0  # model 1's kernel is all zeros
    grads = gradient_steps(shapes, steps=3)
    for step_grads in grads:
        step_grads[1][2] = 0.0  # model 2's vector gets no gradient
    run_lars_against_reference(LARS_VALUES, shapes=shapes, grads=grads,
                               initial=initial)


# (exclusion, weight decay per variable, layer adaptation per variable) for
# a kernel and a bias.
EXCLUSIONS = {
    # Excluded from weight decay, and so (by default) from adaptation.
    "weight_decay_by_name": (
        lambda opt, vs: opt.exclude_from_weight_decay(var_names=["bias"]),
        [True, False], [True, False]),
    "weight_decay_by_variable": (
        lambda opt, vs: opt.exclude_from_weight_decay(var_list=[vs[1]]),
        [True, False], [True, False]),
    # An explicit adaptation exclusion replaces the default.
    "layer_adaptation_by_name": (
        lambda opt, vs: (opt.exclude_from_weight_decay(var_names=["bias"]),
                         opt.exclude_from_layer_adaptation(
                             var_names=["kern"])),
        [True, False], [False, True]),
    "layer_adaptation_by_variable": (
        lambda opt, vs: opt.exclude_from_layer_adaptation(var_list=[vs[1]]),
        [True, True], [True, False]),
}


@pytest.mark.parametrize("exclusion", sorted(EXCLUSIONS))
def test_lars_exclusions_match_the_paper(exclusion):
    configure, decay, adapt = EXCLUSIONS[exclusion]
    run_lars_against_reference(
        LARS_VALUES, shapes=[(4, 2), (2,)], names=["kernel", "bias"],
        decay=decay, adapt=adapt, configure=configure, steps=4)


def test_lars_exclusion_after_build_raises():
    opt = optimizers.Lars()
    opt.build([keras.Variable(np.ones((B, 2), "float32"))])
    with pytest.raises(ValueError, match="before the optimizer is built"):
        opt.exclude_from_layer_adaptation(var_names=["bias"])


def test_lars_clipping_acts_before_the_trust_ratio():
    # Clipped gradients are what the paper's formula sees.
    values = dict(LARS_VALUES, clipnorm=[0.5, 0.0, 2.0])
    grads = [[3.0 * g for g in step] for step in gradient_steps(steps=3)]
    clipped = []
    for step in grads:
        row = []
        for g in step:
            g = g.copy()
            for b, clip in enumerate(values["clipnorm"]):
                norm = np.linalg.norm(g[b])
                if clip > 0 and norm > clip:
                    g[b] *= clip / norm
            row.append(g)
        clipped.append(row)
    opt = optimizers.Lars(**values)
    initial = per_model_arrays(np.random.default_rng(0), SHAPES, B)
    variables = [keras.Variable(x) for x in initial]
    for step in grads:
        opt.apply_gradients(zip(step, variables))
    reference = optimizers.Lars(**LARS_VALUES)
    ref_vars = [keras.Variable(x) for x in initial]
    for step in clipped:
        reference.apply_gradients(zip(step, ref_vars))
    assert_slices_match(variables, [[v.numpy()[b] for v in ref_vars]
                                    for b in range(B)])


# -- hyper-parameters are data -------------------------------------------------


@pytest.mark.parametrize("name, hyper, new", [
    ("Adafactor", "clip_threshold", [0.1, 5.0, 0.3]),
    ("Lamb", "beta_1", [0.5, 0.99, 0.9]),
])
def test_changing_a_hyperparameter_takes_effect_without_retracing(
        name, hyper, new):
    fused, fused_vars, stock, stock_vars = make_pair(name)
    fused.build(fused_vars)
    traces = []

    def train_step(grads):
        traces.append(None)
        fused.apply_gradients(zip(grads, fused_vars))

    train_step = compiled(train_step, fused, fused_vars)

    for step, grads in enumerate(gradient_steps(steps=4)):
        if step == 2:
            fused.set_hyperparameter(hyper, new)
            for b, opt in enumerate(stock):
                setattr(opt, hyper, new[b])
        apply_per_model(stock, stock_vars, grads)
        train_step(grads)
        assert_state_matches(name, fused, fused_vars, stock, stock_vars,
                             err_msg=f"step {step}")
    assert len(traces) == 1


def test_changing_lars_eta_takes_effect_without_retracing():
    opt = optimizers.Lars(**LARS_VALUES)
    control = optimizers.Lars(**dict(LARS_VALUES, eta=[0.5, 0.01, 0.2]))
    initial = per_model_arrays(np.random.default_rng(0), SHAPES, B)
    variables = [keras.Variable(x) for x in initial]
    control_vars = [keras.Variable(x) for x in initial]
    traces = []

    def train_step(grads):
        traces.append(None)
        opt.apply_gradients(zip(grads, variables))

    train_step = compiled(train_step, opt, variables)

    opt.build(variables)
    opt.set_hyperparameter("eta", [0.5, 0.01, 0.2])
    for grads in gradient_steps(steps=3):
        train_step(grads)
        control.apply_gradients(zip(grads, control_vars))
    assert len(traces) == 1
    assert_slices_match(variables, [[v.numpy()[b] for v in control_vars]
                                    for b in range(B)])


# -- configuration, serialization, checkpoints -------------------------------

CONFIGS = {
    "Adafactor": dict(VALUES["Adafactor"], relative_step=False,
                      clipnorm=[1.0, 2.0, 3.0]),
    "Lamb": dict(VALUES["Lamb"], weight_decay=0.01, global_clipnorm=1.0),
    "Lars": dict(LARS_VALUES, nesterov=True, clipvalue=[0.1, 0.2, 0.3]),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_config_round_trips(name):
    cls = getattr(optimizers, name)
    opt = cls(**CONFIGS[name])
    variables = [keras.Variable(x) for x in per_model_arrays(
        np.random.default_rng(0), SHAPES, B)]
    opt.apply_gradients(zip(gradient_steps(steps=1)[0], variables))
    config = opt.get_config()
    assert config["num_models"] == B
    for clone in (cls.from_config(config),
                  keras.saving.deserialize_keras_object(
                      keras.saving.serialize_keras_object(opt))):
        assert type(clone) is cls
        assert clone.get_config() == config
        for hyper in opt.hyperparameter_names:
            expected = opt.get_hyperparameter(hyper)
            if expected is None:
                assert clone.get_hyperparameter(hyper) is None
            else:
                assert_close(clone.get_hyperparameter(hyper), expected,
                             err_msg=hyper)
    for flag in ("relative_step", "nesterov"):
        if flag in CONFIGS[name]:
            assert config[flag] == CONFIGS[name][flag]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_state_round_trips_and_training_continues(name):
    def trained(seed):
        opt = getattr(optimizers, name)(**CONFIGS[name])
        variables = [keras.Variable(x) for x in per_model_arrays(
            np.random.default_rng(0), SHAPES, B)]
        for grads in gradient_steps(steps=2, seed=seed):
            opt.apply_gradients(zip(grads, variables))
        return opt, variables

    saved, saved_vars = trained(seed=1)
    restored, restored_vars = trained(seed=2)
    store = {}
    saved.save_own_variables(store)
    restored.load_own_variables(store)
    for variable, saved_var in zip(restored_vars, saved_vars):
        variable.assign(saved_var)
    grads = gradient_steps(steps=1, seed=9)[0]
    saved.apply_gradients(zip(grads, saved_vars))
    restored.apply_gradients(zip(grads, restored_vars))
    for variable, saved_var in zip(restored_vars, saved_vars):
        np.testing.assert_array_equal(variable.numpy(), saved_var.numpy())


# -- bad input ---------------------------------------------------------------


@pytest.mark.parametrize("kwargs, match", [
    (dict(momentum=1.5), "momentum"),
    (dict(momentum=[0.9, -0.1]), "momentum"),
    (dict(eta=-0.001), "eta"),
    (dict(epsilon=[1e-8, -1.0]), "epsilon"),
    (dict(learning_rate=[0.1, 0.2, 0.3], eta=[0.001, 0.002]), "eta"),
])
def test_lars_bad_hyperparameters_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        optimizers.Lars(**kwargs)


@pytest.mark.parametrize("name, kwargs, error, match", [
    ("Lamb", dict(beta_1=[0.9, 0.8], beta_2=[0.9, 0.8, 0.7]), ValueError,
     "beta_2"),
    ("Lamb", dict(epsilon="small"), TypeError, "epsilon"),
    ("Adafactor", dict(clip_threshold=[1.0, 2.0], num_models=3), ValueError,
     "clip_threshold"),
    ("Adafactor", dict(beta_2_decay=None), TypeError, "beta_2_decay"),
])
def test_bad_hyperparameters_raise(name, kwargs, error, match):
    with pytest.raises(error, match=match):
        getattr(optimizers, name)(**kwargs)
