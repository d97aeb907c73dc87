"""Fused optimizers in the JAX trainer's step: `stateless_apply` in `jax.jit`.

Keras's JAX trainer applies an optimizer as a pure function of the values
of its variables, jitted. Each fused optimizer, applied so with a model mask
for three steps, must update model b as a stock Keras optimizer with model
b's hyper-parameters, applied the same way, updates a stock model that
takes the steps its mask gives it; the models a step leaves out keep every
bit of their state.
"""

import keras
import numpy as np
import pytest
from testing import assert_close, assert_slices_match, per_model_arrays

from hftatf import optimizers
from hftatf.core import compat

pytestmark = pytest.mark.backends(
    "jax", reason="jax.jit of stateless_apply is the JAX trainer's step")

B = 3
SHAPES = [(5,), (4, 2), (2, 3, 4)]
# Which models take each step: all, then two of them.
MASKS = [[True, True, True], [True, False, True], [False, True, True]]
RATES = [0.01, 0.003, 0.05]

# `(stock class, per-model values, shared arguments)`: every fused
# optimizer with one value per model of its learning rate and of another
# hyper-parameter, and the base options (clipping, weight decay, EMA,
# gradient accumulation) on Adam and SGD.
CASES = {
    "sgd_nesterov": ("SGD", {"learning_rate": [0.1, 0.05, 0.2],
                             "momentum": [0.9, 0.5, 0.0]},
                     {"nesterov": True}),
    "adam_amsgrad": ("Adam", {"learning_rate": RATES,
                              "beta_1": [0.9, 0.8, 0.5]}, {"amsgrad": True}),
    "adamw": ("AdamW", {"learning_rate": RATES,
                        "weight_decay": [0.004, 0.1, 0.5]}, {}),
    "adamax": ("Adamax", {"learning_rate": RATES,
                          "beta_2": [0.999, 0.9, 0.5]}, {}),
    "nadam": ("Nadam", {"learning_rate": RATES,
                        "beta_1": [0.9, 0.8, 0.5]}, {}),
    "rmsprop_centered": ("RMSprop", {"learning_rate": RATES,
                                     "momentum": [0.9, 0.5, 0.0]},
                         {"centered": True}),
    "adagrad": ("Adagrad", {"learning_rate": RATES,
                            "initial_accumulator_value": [0.1, 0.0, 1.0]},
                {}),
    "adadelta": ("Adadelta", {"learning_rate": [1.0, 0.5, 2.0],
                              "rho": [0.95, 0.9, 0.5]}, {}),
    "ftrl": ("Ftrl", {"learning_rate": RATES,
                      "l1_regularization_strength": [0.0, 0.01, 0.1]}, {}),
    "lion": ("Lion", {"learning_rate": RATES,
                      "beta_1": [0.9, 0.5, 0.99]}, {}),
    "adafactor": ("Adafactor", {"learning_rate": RATES,
                                "clip_threshold": [1.0, 0.5, 2.0]}, {}),
    "lamb": ("Lamb", {"learning_rate": RATES,
                      "beta_1": [0.9, 0.8, 0.5]}, {}),
    # The (4, 2) variables take Muon steps, the others Adam steps.
    "muon": ("Muon", {"learning_rate": RATES,
                      "momentum": [0.95, 0.9, 0.5]}, {}),
    "schedule_free_adamw": ("ScheduleFreeAdamW",
                            {"learning_rate": RATES,
                             "beta_1": [0.9, 0.8, 0.5]},
                            {"warmup_steps": 2}),
    "adam_clipnorm": ("Adam", {"learning_rate": RATES,
                               "clipnorm": [0.5, 0.0, 2.0]}, {}),
    "sgd_global_clipnorm": ("SGD", {"learning_rate": RATES,
                                    "global_clipnorm": [0.5, 3.0, 0.0]}, {}),
    "adam_clipvalue": ("Adam", {"learning_rate": RATES,
                                "clipvalue": [0.1, 0.5, 0.0]}, {}),
    "adam_ema": ("Adam", {"learning_rate": RATES,
                          "ema_momentum": [0.9, 0.5, 0.99]},
                 {"use_ema": True, "ema_overwrite_frequency": 2}),
    "sgd_accumulation": ("SGD", {"learning_rate": RATES,
                                 "momentum": [0.9, 0.5, 0.7]},
                         {"gradient_accumulation_steps": 2}),
}


def for_model(values, model):
    return {name: value[model] for name, value in values.items()}


def gradients(steps, seed=1):
    rng = np.random.default_rng(seed)
    return [per_model_arrays(rng, SHAPES, B, scale=2.0)
            for _ in range(steps)]


def stateless_steps(optimizer, variables, steps, masks=None):
    """Applies `optimizer` to the Keras `variables`, one jitted
    `stateless_apply` per step of `steps` (with `masks[i]` as its model
    mask where given), and assigns the final values back. Returns the
    values of `optimizer.variables` and `variables` after each step."""
    import jax

    optimizer.build(variables)

    @jax.jit
    def step(state, grads, trained, mask):
        if mask is None:
            return optimizer.stateless_apply(state, grads, trained)
        return optimizer.stateless_apply(state, grads, trained,
                                         model_mask=mask)

    state = [v.value for v in optimizer.variables]
    trained = [v.value for v in variables]
    history = []
    for index, grads in enumerate(steps):
        mask = None if masks is None else np.array(masks[index])
        trained, state = step(state, grads, trained, mask)
        history.append([np.asarray(v) for v in [*state, *trained]])
    for variable, value in zip([*optimizer.variables, *variables],
                               [*state, *trained]):
        variable.assign(value)
    return history


def stock_stateless_steps(stock, initial, steps, masks):
    """Stock optimizer `b` takes, on its copy of model b's variables, the
    steps `masks` give model b, as `stateless_steps` applies them.
    Returns each model's variables."""
    stock_vars = []
    for b, optimizer in enumerate(stock):
        variables = [keras.Variable(value[b]) for value in initial]
        taken = [[g[b] for g in grads]
                 for grads, mask in zip(steps, masks) if mask[b]]
        stateless_steps(optimizer, variables, taken)
        stock_vars.append(variables)
    return stock_vars


def assert_left_out_models_keep_their_state(optimizer, history, masks):
    """Every `[B, ...]` value of a model a step left out is, bit for bit,
    what it was before the step."""
    shapes = [tuple(v.shape) for v in optimizer.variables]
    for index in range(1, len(history)):
        for position, (old, new) in enumerate(zip(history[index - 1],
                                                  history[index])):
            model_axis = position >= len(shapes) or (
                len(shapes[position]) and shapes[position][0] == B)
            for b in np.flatnonzero(~np.asarray(masks[index])):
                if model_axis:
                    np.testing.assert_array_equal(
                        new[b], old[b],
                        err_msg=f"step {index}, value {position}, model {b}")


def assert_slots_match(fused, stock):
    """Every slot list the stock optimizers hold, model by model."""
    for attribute, slots in compat.slot_lists(fused).items():
        for b, optimizer in enumerate(stock):
            stock_slots = compat.slot_lists(optimizer).get(attribute)
            if stock_slots is None:
                continue
            for index, (ours, theirs) in enumerate(zip(slots, stock_slots)):
                assert (ours is None) == (theirs is None), attribute
                if theirs is not None:
                    assert_close(np.asarray(ours)[b], theirs, err_msg=(
                        f"{attribute}[{index}], model {b}"))


@pytest.mark.parametrize("case", sorted(CASES))
def test_jitted_stateless_apply_with_a_mask_matches_stock(case):
    name, values, shared = CASES[case]
    initial = per_model_arrays(np.random.default_rng(0), SHAPES, B)
    fused = getattr(optimizers, name)(**values, **shared)
    fused_vars = [keras.Variable(value) for value in initial]
    steps = gradients(len(MASKS))
    history = stateless_steps(fused, fused_vars, steps, MASKS)
    stock = [getattr(keras.optimizers, name)(**for_model(values, b),
                                             **shared) for b in range(B)]
    stock_vars = stock_stateless_steps(stock, initial, steps, MASKS)
    assert_slices_match(fused_vars, stock_vars)
    assert_slots_match(fused, stock)
    np.testing.assert_array_equal(np.asarray(fused.model_iterations),
                                  [int(opt.iterations) for opt in stock])
    assert_left_out_models_keep_their_state(fused, history, MASKS)


def test_jitted_stateless_lars_with_a_mask_equals_its_eager_steps():
    # Lars has no stock Keras form: its eager steps, which
    # test_norm_optimizers.py holds to the paper's update, are the oracle.
    values = {"learning_rate": RATES, "momentum": [0.9, 0.5, 0.0],
              "weight_decay": [0.0, 1e-3, 1e-2]}
    initial = per_model_arrays(np.random.default_rng(0), SHAPES, B)
    fused = optimizers.Lars(**values)
    fused_vars = [keras.Variable(value) for value in initial]
    steps = gradients(len(MASKS))
    history = stateless_steps(fused, fused_vars, steps, MASKS)
    eager = optimizers.Lars(**values)
    eager_vars = [keras.Variable(value) for value in initial]
    for grads, mask in zip(steps, MASKS):
        eager.apply(grads, eager_vars, model_mask=np.array(mask))
    for ours, theirs in zip(fused.variables + fused_vars,
                            eager.variables + eager_vars):
        assert_close(ours, theirs, err_msg=ours.path)
    assert_left_out_models_keep_their_state(fused, history, MASKS)


def test_jitted_stateless_loss_scaling_with_a_mask_matches_stock():
    # Model 1 overflows at step 2, which model 0 is left out of: model 1's
    # step is skipped and its scale halved; model 2's scale grows twice.
    values = {"learning_rate": RATES, "momentum": [0.9, 0.5, 0.7]}
    scaling = {"initial_scale": 8.0, "dynamic_growth_steps": 2}
    initial = per_model_arrays(np.random.default_rng(0), SHAPES, B)
    steps = gradients(len(MASKS) + 1)
    steps[2][1][1].flat[3] = np.inf
    masks = MASKS + [[True, True, True]]
    fused = optimizers.LossScaleOptimizer(optimizers.SGD(**values),
                                          **scaling)
    fused_vars = [keras.Variable(value) for value in initial]
    history = stateless_steps(fused, fused_vars, steps, masks)
    stock = [keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(**for_model(values, b)), **scaling)
        for b in range(B)]
    stock_vars = stock_stateless_steps(stock, initial, steps, masks)
    assert_slices_match(fused_vars, stock_vars)
    np.testing.assert_array_equal(
        np.asarray(fused.dynamic_scale),
        [float(opt.dynamic_scale) for opt in stock])
    np.testing.assert_array_equal(
        np.asarray(fused.step_counter),
        [int(opt.step_counter) for opt in stock])
    np.testing.assert_array_equal(
        np.asarray(fused.model_iterations),
        [int(opt.iterations) for opt in stock])
    assert_slots_match(fused.inner_optimizer,
                       [opt.inner_optimizer for opt in stock])
    assert_left_out_models_keep_their_state(fused, history, masks)
    assert list(np.asarray(fused.dynamic_scale)) == [16.0, 4.0, 32.0]
