"""Per-model schedules against B stock Keras schedules, one per model.

Entry b of a fused schedule's `[B]` rates must be what the stock schedule
with model b's parameters returns, at every step, whether the step is
shared (a scalar) or per model (a `[B]` vector); and a fused optimizer with
a fused schedule must train as B stock optimizers with stock schedules.
"""

import keras
import numpy as np
import pytest
from backend_steps import compiled
from keras import ops
from testing import (
    apply_per_model,
    assert_close,
    assert_slices_match,
    per_model_arrays,
    stock_variables,
)

from hftatf import optimizers
from hftatf.optimizers import schedules

B = 3
STEPS = 16
stock_schedules = keras.optimizers.schedules


def model_values(values, model):
    return {name: value[model] if isinstance(value, list) else value
            for name, value in values.items()}


# name: (fused class, stock class, per-model arguments, shared arguments,
# stock arguments added for model b)
CASES = {
    "cosine": (schedules.CosineDecay, stock_schedules.CosineDecay,
               {"initial_learning_rate": [0.1, 0.05, 0.01],
                "decay_steps": [10, 5, 20], "alpha": [0.0, 0.2, 0.5]}, {}),
    "cosine_warmup": (
        schedules.CosineDecay, stock_schedules.CosineDecay,
        {"initial_learning_rate": [0.0, 0.05, 0.01],
         "decay_steps": [8, 5, 20], "alpha": [0.0, 0.2, 0.5],
         "warmup_target": [1.0, 0.5, 0.2], "warmup_steps": [4, 0, 7]}, {}),
    # A None target turns warm-up off for one model only.
    "cosine_some_warmup": (
        schedules.CosineDecay, stock_schedules.CosineDecay,
        {"initial_learning_rate": 0.1, "decay_steps": [8, 5, 20],
         "warmup_target": [1.0, None, 0.2], "warmup_steps": [4, 3, 2.5]},
        {}),
    "exponential": (
        schedules.ExponentialDecay, stock_schedules.ExponentialDecay,
        {"initial_learning_rate": [0.1, 0.05, 1.0],
         "decay_steps": [3, 5, 2.5], "decay_rate": [0.5, 0.9, 0.99]}, {}),
    "exponential_staircase": (
        schedules.ExponentialDecay, stock_schedules.ExponentialDecay,
        # Rates of at most 0.1: Adam trains with these, and its float32
        # 1 - beta_2 (stock Keras rounds the Python value instead) gives
        # relative differences of ~1e-5 that a rate of 1 would show.
        {"initial_learning_rate": [0.1, 0.05, 0.08],
         "decay_steps": [3, 5, 2], "decay_rate": [0.5, 0.9, 0.3]},
        {"staircase": True}),
    "piecewise": (
        schedules.PiecewiseConstantDecay,
        stock_schedules.PiecewiseConstantDecay,
        {}, {}),
}
PIECEWISE = {"boundaries": [[2, 4, 1], 7, [9, 12, 3]],
             "values": [[1.0, 0.5, 0.3], 0.1, [0.01, 0.02, 0.03],
                        [0.001, 0.0, 0.5]]}


def make(case, **extra):
    """The fused schedule of `case` and its B stock twins."""
    fused_cls, stock_cls, values, shared = CASES[case]
    if case == "piecewise":
        fused = fused_cls(**PIECEWISE, **extra)
        stock = [stock_cls(
            [b if np.isscalar(b) else b[m] for b in PIECEWISE["boundaries"]],
            [v if np.isscalar(v) else v[m] for v in PIECEWISE["values"]])
            for m in range(B)]
        return fused, stock
    fused = fused_cls(**values, **shared, **extra)
    stock = [stock_cls(**model_values(values, b), **shared) for b in range(B)]
    return fused, stock


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_models_rate_matches_stock_at_every_step(case):
    fused, stock = make(case)
    assert fused.num_models == B
    # The optimizer's step count: an int64 variable.
    step = keras.Variable(0, dtype="int64")
    rates = []
    for value in range(STEPS):
        step.assign(value)
        got = fused(step)
        assert tuple(got.shape) == (B,)
        expected = [float(s(step)) for s in stock]
        assert_close(got, expected, err_msg=f"step {value}")
        rates.append(expected)
    # The models' schedules differ, and change over the steps.
    rates = np.array(rates)
    assert len({tuple(r) for r in rates.T}) == B
    assert all(len(set(r)) > 1 for r in rates.T)


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_models_stock_schedule(case):
    """`stock_schedule(b)`: model b's stock twin, its config included."""
    fused, stock = make(case)
    for b in range(B):
        twin = fused.stock_schedule(b)
        assert type(twin) is type(stock[b])
        expected = stock[b].get_config()
        got = twin.get_config()
        assert got.keys() == expected.keys()
        for key in expected:
            if key != "name":
                np.testing.assert_equal(np.asarray(got[key], float),
                                        np.asarray(expected[key], float))
        for step in range(STEPS):
            assert float(twin(step)) == float(stock[b](step))


def test_step_decay_stock_schedule_and_linear_warmup_has_none():
    twin = schedules.StepDecay([0.1, 1.0], decay_steps=[3, 2]).stock_schedule(1)
    assert type(twin) is stock_schedules.ExponentialDecay
    assert twin.staircase and twin.decay_rate == 0.1
    assert (twin.initial_learning_rate, twin.decay_steps) == (1.0, 2)
    with pytest.raises(TypeError, match="no stock Keras form"):
        schedules.LinearWarmup(0.1, 1, [3, 4]).stock_schedule(0)


def test_step_decay_is_stock_exponential_decay_with_staircase():
    fused = schedules.StepDecay([0.1, 1.0, 0.5], decay_steps=[3, 2, 5])
    stock = [stock_schedules.ExponentialDecay(r, d, 0.1, staircase=True)
             for r, d in zip([0.1, 1.0, 0.5], [3, 2, 5])]
    for step in range(12):
        assert_close(fused(step), [float(s(step)) for s in stock])


@pytest.mark.parametrize("case", ["cosine_warmup", "exponential",
                                  "piecewise"])
def test_per_model_steps(case):
    """A `[B]` step vector: model b's rate at its own step."""
    fused, stock = make(case)
    rng = np.random.default_rng(0)
    for _ in range(5):
        steps = rng.integers(0, 20, size=B)
        expected = [float(s(int(t))) for s, t in zip(stock, steps)]
        assert_close(fused(ops.convert_to_tensor(steps, "int64")), expected)


@pytest.mark.parametrize("case", ["cosine_some_warmup", "piecewise"])
def test_rates_in_a_compiled_function(case):
    fused, stock = make(case)
    traces = []

    def rates(step):
        traces.append(None)
        return fused(step)

    rates = compiled(rates, jit_compile=True)
    for value in (0, 3, 9, 30):
        step = ops.convert_to_tensor(value, "int64")
        assert_close(rates(step), [float(s(step)) for s in stock])
    assert len(traces) == 1


def test_shared_parameters_and_num_models():
    shared = schedules.ExponentialDecay(0.1, 4, 0.5)
    assert shared.num_models is None
    # Without B, a shared schedule returns one rate, as a stock one does.
    assert tuple(shared(3).shape) == ()
    assert_close(shared(3), stock_schedules.ExponentialDecay(0.1, 4, 0.5)(3))
    vector = schedules.ExponentialDecay(0.1, 4, 0.5, num_models=B)
    assert_close(vector(3), [float(shared(3))] * B)


# -- linear warm-up ------------------------------------------------------------


def test_linear_warmup_to_a_constant_is_stock_cosine_warmup():
    # Stock CosineDecay with alpha=1 is a linear warm-up to a constant.
    fused = schedules.LinearWarmup(after=[0.4, 1.0, 0.1],
                                   warmup_epochs=[2, 0.5, 0],
                                   steps_per_epoch=[3, 4, 5],
                                   initial_learning_rate=[0.0, 0.1, 0.05])
    stock = [stock_schedules.CosineDecay(start, decay_steps=100, alpha=1.0,
                                         warmup_target=after,
                                         warmup_steps=steps)
             for start, after, steps in [(0.0, 0.4, 6), (0.1, 1.0, 2),
                                         (0.05, 0.1, 0)]]
    for step in range(10):
        assert_close(fused(step), [float(s(step)) for s in stock],
                     err_msg=f"step {step}")


def _warmup_reference(base, start, warmup_steps, step):
    """The formula of the docstring, with a stock base schedule."""
    if step < warmup_steps:
        target = float(base(warmup_steps))
        return start + (target - start) * step / warmup_steps
    return float(base(step))


@pytest.mark.parametrize("base", ["fused", "stock_list", "stock_shared"])
def test_linear_warmup_before_a_schedule(base):
    rates, decay_steps = [0.5, 0.2, 1.0], [4, 6, 3]
    stock = [stock_schedules.ExponentialDecay(r, d, 0.5)
             for r, d in zip(rates, decay_steps)]
    if base == "fused":
        after = schedules.ExponentialDecay(rates, decay_steps, 0.5)
    elif base == "stock_list":
        after = stock
    else:
        stock = [stock_schedules.PiecewiseConstantDecay([5, 9],
                                                        [1.0, 0.1, 0.01])]
        stock = stock * B
        after = stock[0]
    epochs, steps_per_epoch, start = [1, 2, 0.5], 3, [0.0, 0.05, 0.1]
    fused = schedules.LinearWarmup(after, epochs, steps_per_epoch, start)
    for step in range(14):
        expected = [_warmup_reference(stock[b], start[b],
                                      epochs[b] * steps_per_epoch, step)
                    for b in range(B)]
        assert_close(fused(keras.ops.convert_to_tensor(step, "int64")),
                     expected, err_msg=f"step {step}")
    steps = ops.convert_to_tensor([1, 7, 0], "int64")
    expected = [_warmup_reference(stock[b], start[b],
                                  epochs[b] * steps_per_epoch, int(steps[b]))
                for b in range(B)]
    assert_close(fused(steps), expected)


# -- training with fused schedules -------------------------------------------


TRAINING = {
    "sgd_cosine_warmup": ("SGD", {"momentum": [0.9, 0.5, 0.0]},
                          "cosine_warmup"),
    "adam_exponential": ("Adam", {"beta_1": [0.9, 0.8, 0.5]},
                         "exponential_staircase"),
    "lamb_piecewise": ("Lamb", {"beta_2": [0.999, 0.99, 0.9]},
                       "piecewise"),
}


@pytest.mark.parametrize("in_graph", [False, True])
@pytest.mark.parametrize("training", sorted(TRAINING))
def test_fused_optimizer_with_a_fused_schedule_matches_stock(
        training, in_graph):
    name, values, case = TRAINING[training]
    fused_schedule, stock_schedule = make(case)
    stock = [getattr(keras.optimizers, name)(
        learning_rate=stock_schedule[b], **model_values(values, b))
        for b in range(B)]
    fused = getattr(optimizers, name)(learning_rate=fused_schedule, **values)
    shapes = [(5,), (4, B)]
    initial = per_model_arrays(np.random.default_rng(0), shapes, B)
    fused_vars = [keras.Variable(x) for x in initial]
    stock_vars = [stock_variables(initial, b) for b in range(B)]

    def apply(grads):
        fused.apply_gradients(zip(grads, fused_vars))

    if in_graph:
        apply = compiled(apply, fused, fused_vars)
    rng = np.random.default_rng(1)
    for step in range(10):
        grads = per_model_arrays(rng, shapes, B)
        assert_close(fused.learning_rate,
                     [float(opt.learning_rate) for opt in stock],
                     err_msg=f"step {step}")
        apply_per_model(stock, stock_vars, grads)
        apply(grads)
        assert_slices_match(fused_vars, stock_vars, err_msg=f"step {step}")


# -- configuration -------------------------------------------------------------


ROUND_TRIPS = {
    "cosine": lambda: make("cosine_some_warmup")[0],
    "exponential": lambda: make("exponential_staircase")[0],
    "step": lambda: schedules.StepDecay([0.1, 0.2], 3, num_models=2),
    "piecewise": lambda: make("piecewise")[0],
    "warmup_fused": lambda: schedules.LinearWarmup(
        make("cosine")[0], [1, 2, 3], 4, initial_learning_rate=0.01),
    "warmup_stock_list": lambda: schedules.LinearWarmup(
        make("exponential")[1], 2, [3, 4, 5]),
    "warmup_constant": lambda: schedules.LinearWarmup([0.1, 0.2], 2, 3),
}


@pytest.mark.parametrize("case", sorted(ROUND_TRIPS))
def test_config_round_trips(case):
    schedule = ROUND_TRIPS[case]()
    config = schedule.get_config()
    serialized = keras.saving.serialize_keras_object(schedule)
    assert serialized["registered_name"] == (
        f"hftatf>{type(schedule).__name__}")
    for clone in (type(schedule).from_config(config),
                  keras.saving.deserialize_keras_object(serialized),
                  keras.optimizers.schedules.deserialize(serialized)):
        assert type(clone) is type(schedule)
        assert clone.get_config() == config
        for step in (0, 2, 5, 11):
            assert_close(clone(step), schedule(step))


def test_optimizer_with_a_fused_schedule_round_trips():
    opt = optimizers.Adam(learning_rate=make("cosine_warmup")[0])
    clone = keras.saving.deserialize_keras_object(
        keras.saving.serialize_keras_object(opt))
    rate = clone._hyper_values["learning_rate"]
    assert type(rate) is schedules.CosineDecay
    assert rate.get_config() == make("cosine_warmup")[0].get_config()


# -- bad input ---------------------------------------------------------------


@pytest.mark.parametrize("make_bad, error, match", [
    (lambda: schedules.CosineDecay(0.1, decay_steps=[5, 0, 3]), ValueError,
     "decay_steps"),
    (lambda: schedules.ExponentialDecay(0.1, -1, 0.5), ValueError,
     "decay_steps"),
    (lambda: schedules.CosineDecay([0.1, 0.2], 5, alpha=[0.0, 0.1, 0.2]),
     ValueError, "alpha"),
    (lambda: schedules.ExponentialDecay([0.1, 0.2], 5, 0.5, num_models=3),
     ValueError, "initial_learning_rate"),
    (lambda: schedules.ExponentialDecay("fast", 5, 0.5), TypeError,
     "initial_learning_rate"),
    (lambda: schedules.CosineDecay(0.1, 5, warmup_steps=-1), ValueError,
     "warmup_steps"),
    (lambda: schedules.PiecewiseConstantDecay([1, 2], [0.1, 0.2]),
     ValueError, "boundaries"),
    (lambda: schedules.PiecewiseConstantDecay([[1, 2], [3, 4, 5]],
                                              [0.1, 0.2, 0.3]),
     ValueError, "boundaries"),
    (lambda: schedules.LinearWarmup("cosine", 1, 10), TypeError, "after"),
    (lambda: schedules.LinearWarmup(0.1, 1, 0), ValueError,
     "steps_per_epoch"),
    (lambda: schedules.LinearWarmup(
        schedules.ExponentialDecay([0.1, 0.2], 5, 0.5), [1, 2, 3], 10),
     ValueError, "warmup_epochs"),
])
def test_bad_arguments_raise(make_bad, error, match):
    with pytest.raises(error, match=match):
        make_bad()
