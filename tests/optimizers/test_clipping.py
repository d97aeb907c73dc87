"""Per-model gradient clipping of fused optimizers.

`clipnorm`, `global_clipnorm` and `clipvalue` act on each model as the stock
optimizer with that model's value acts on the model alone: norms are taken
per model, never across models, so one model's gradients, however large or
non-finite, never change another model's update.
"""

import keras
import numpy as np
import pytest
from backend_steps import compiled
from testing import (
    apply_per_model,
    assert_slices_match,
    per_model_arrays,
    stock_variables,
)

from hftatf import optimizers

B = 3
SHAPES = [(5,), (4, 2), (2, 3, 4)]
# Gradients of norm ~5-15 per variable, so that every clipping acts.
SCALE = 2.0
HYPERS = {
    "SGD": {"learning_rate": [0.01, 0.05, 0.1], "momentum": [0.9, 0.5, 0.0]},
    "Adam": {"learning_rate": [0.01, 0.003, 0.05], "beta_1": [0.9, 0.8, 0.5]},
}
SLOTS = {"SGD": ("momentums",), "Adam": ("_momentums", "_velocities")}
# A value of 0 turns clipping off for that model, as it does in Keras.
CLIPPING = {
    "clipnorm_per_model": {"clipnorm": [0.5, 0.0, 2.0]},
    "clipnorm_shared": {"clipnorm": 1.0},
    "global_clipnorm_per_model": {"global_clipnorm": [0.5, 3.0, 0.0]},
    "global_clipnorm_shared": {"global_clipnorm": 1.0},
    "clipvalue_per_model": {"clipvalue": [0.1, 0.5, 0.0]},
    "clipvalue_shared": {"clipvalue": 0.2},
}


def for_model(values, model):
    return {name: value[model] if isinstance(value, list) else value
            for name, value in values.items()}


def stock_run(name, clipping, initial):
    """B stock optimizers, model b's hyper-parameters and clipping each."""
    values = dict(HYPERS[name], **clipping)
    stock = [getattr(keras.optimizers, name)(**for_model(values, b))
             for b in range(B)]
    return stock, [stock_variables(initial, b) for b in range(B)]


def fused_run(name, clipping, initial):
    fused = getattr(optimizers, name)(**HYPERS[name], **clipping)
    return fused, [keras.Variable(value) for value in initial]


def gradient_steps(steps, seed=1):
    rng = np.random.default_rng(seed)
    return [per_model_arrays(rng, SHAPES, B, scale=SCALE)
            for _ in range(steps)]


def slots(optimizer, name):
    return [getattr(optimizer, slot) for slot in SLOTS[name]
            if getattr(optimizer, slot, None)]


@pytest.mark.parametrize("in_graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("clipping", CLIPPING.values(), ids=CLIPPING.keys())
@pytest.mark.parametrize("name", ["SGD", "Adam"])
def test_clipping_matches_stock_per_model(name, clipping, in_graph):
    initial = per_model_arrays(np.random.default_rng(0), SHAPES, B)
    stock, stock_vars = stock_run(name, clipping, initial)
    unclipped, unclipped_vars = stock_run(name, {}, initial)
    fused, fused_vars = fused_run(name, clipping, initial)

    def apply(grads):
        fused.apply_gradients(zip(grads, fused_vars))

    if in_graph:
        apply = compiled(apply, fused, fused_vars)
    for step, grads in enumerate(gradient_steps(steps=5)):
        apply_per_model(stock, stock_vars, grads)
        apply_per_model(unclipped, unclipped_vars, grads)
        apply(grads)
        assert_slices_match(fused_vars, stock_vars, err_msg=f"step {step}")
        for fused_slots, stock_slots in zip(
                slots(fused, name), zip(*[slots(s, name) for s in stock])):
            assert_slices_match(fused_slots, stock_slots,
                                err_msg=f"step {step} slots")
    # The clipping did act, on every model whose value is not 0.
    for model, value in enumerate(np.broadcast_to(
            next(iter(clipping.values())), (B,))):
        difference = max(
            float(np.max(np.abs(clipped.numpy() - plain.numpy())))
            for clipped, plain in zip(stock_vars[model],
                                      unclipped_vars[model]))
        assert (difference > 1e-4) == (value > 0), (model, difference)


@pytest.mark.parametrize("bad", [1e6, np.inf, np.nan],
                         ids=["huge", "inf", "nan"])
@pytest.mark.parametrize("clipping", [
    {}, CLIPPING["clipnorm_per_model"], CLIPPING["global_clipnorm_per_model"],
    CLIPPING["global_clipnorm_shared"], CLIPPING["clipvalue_per_model"],
], ids=["none", "clipnorm", "global_clipnorm", "global_clipnorm_shared",
        "clipvalue"])
@pytest.mark.parametrize("name", ["SGD", "Adam"])
def test_a_bad_gradient_does_not_touch_other_models(name, clipping, bad):
    bad_model = 1
    initial = per_model_arrays(np.random.default_rng(0), SHAPES, B)
    normal = gradient_steps(steps=4)
    spoiled = [[g.copy() for g in grads] for grads in normal]
    for grad in spoiled[1]:
        if np.isfinite(bad):
            grad[bad_model] *= bad
        else:
            grad[bad_model].flat[0] = bad
    runs = []
    for steps in (normal, spoiled):
        fused, fused_vars = fused_run(name, clipping, initial)
        states = []
        for grads in steps:
            fused.apply_gradients(zip(grads, fused_vars))
            states.append([v.numpy() for v in [*fused_vars,
                                               *sum(slots(fused, name), [])]])
        runs.append(states)
    for step, (clean, dirty) in enumerate(zip(*runs)):
        for index, (clean_value, dirty_value) in enumerate(zip(clean, dirty)):
            for model in range(B):
                if model != bad_model:
                    np.testing.assert_array_equal(
                        dirty_value[model], clean_value[model],
                        err_msg=f"step {step}, array {index}, model {model}")
    if not clipping:
        # The bad gradient did reach its own model (clipping may map it to
        # what the normal gradient gives).
        assert not np.array_equal(runs[1][-1][0][bad_model],
                                  runs[0][-1][0][bad_model])
    # The model with the bad gradient is updated as its stock twin (NaN
    # where the stock one has NaN).
    stock, stock_vars = stock_run(name, clipping, initial)
    for grads in spoiled:
        apply_per_model(stock, stock_vars, grads)
    assert_slices_match(fused_vars, stock_vars)
