"""Hyper-parameters that cannot be right are refused by the constructor.

Every fused optimizer refuses, for the arguments it has: a learning rate
that is NaN, infinite or negative (a float, one per model, or a schedule's
rates), `beta_1`/`beta_2` outside [0, 1), a negative `epsilon`, negative
clipping, a negative or non-finite weight decay, a momentum outside [0, 1].
The message names the argument, the model (for one value per model), the
value received, the interval expected and the fix. Values stock Keras
accepts and that can be right (a learning rate of 0, `epsilon=0`, ...)
are accepted.
"""

import inspect
import math
import re

import keras
import pytest

from hftatf import optimizers
from hftatf.core.validation import check_learning_rate
from hftatf.optimizers import schedules

CLASSES = sorted(
    (cls for cls in vars(optimizers).values()
     if isinstance(cls, type) and issubclass(cls, optimizers.FusedOptimizer)
     and cls not in (optimizers.FusedOptimizer,
                     optimizers.LossScaleOptimizer)),
    key=lambda cls: cls.__name__)

# The base arguments every fused optimizer takes through `**kwargs`.
BASE = ("learning_rate", "weight_decay", "clipnorm", "clipvalue",
        "global_clipnorm")

# (argument, bad value, expected interval) for every optimizer with that
# argument; `beta_*` of the classes whose range differs are listed apart.
BAD = [
    ("learning_rate", math.nan, ">= 0"),
    ("learning_rate", math.inf, ">= 0"),
    ("learning_rate", -1.0, ">= 0"),
    ("weight_decay", -1.0, ">= 0"),
    ("weight_decay", math.inf, ">= 0"),
    ("weight_decay", math.nan, ">= 0"),
    ("clipnorm", -1.0, ">= 0"),
    ("clipvalue", -0.5, ">= 0"),
    ("global_clipnorm", -1.0, ">= 0"),
    ("epsilon", -1.0, ">= 0"),
    ("beta_1", 1.0, "in [0, 1)"),
    ("beta_1", -0.1, "in [0, 1)"),
    ("beta_2", 1.0, "in [0, 1)"),
    ("beta_2", 1.5, "in [0, 1)"),
    ("momentum", 1.5, "in [0, 1]"),
    ("momentum", -0.1, "in [0, 1]"),
]
# The ranges of `beta_1`/`beta_2` where a class differs (see its source).
OWN_RANGES = {
    ("Lion", "beta_1"): [(0.0, "in (0, 1]"), (1.5, "in (0, 1]")],
    ("Lion", "beta_2"): [(1.5, "in [0, 1]"), (-0.1, "in [0, 1]")],
    ("Adamax", "beta_2"): [(1.5, "in [0, 1]")],
    ("RMSprop", "momentum"): [(1.5, "<= 1"), (math.inf, "<= 1")],
    ("ScheduleFreeAdamW", "beta_1"): [(0.0, "in (0, 1]"),
                                      (1.5, "in (0, 1]")],
}


def arguments(cls):
    names = set(inspect.signature(cls).parameters) | set(BASE)
    if cls is optimizers.Muon:
        # Muon's Adam betas carry the prefix of its arguments.
        names |= {"beta_1", "beta_2"}
    return names


def argument_name(cls, name):
    if cls is optimizers.Muon and name.startswith("beta"):
        return f"adam_{name}"
    return name


def bad_cases():
    for cls in CLASSES:
        for name, value, interval in BAD:
            if name not in arguments(cls):
                continue
            own = OWN_RANGES.get((cls.__name__, name))
            if own is not None:
                continue
            yield cls, argument_name(cls, name), value, interval
        for (class_name, name), cases in OWN_RANGES.items():
            if class_name == cls.__name__:
                for value, interval in cases:
                    yield cls, name, value, interval


def case_id(case):
    cls, name, value, _ = case
    return f"{cls.__name__}-{name}={value}"


CASES = list(bad_cases())


def message(name, interval, where):
    return (rf"`{name}` must be a finite number {interval}.* for every "
            rf"model; {where}\. Pass ")


@pytest.mark.parametrize("case", CASES, ids=map(case_id, CASES))
def test_a_bad_value_is_refused(case):
    cls, name, value, interval = case
    with pytest.raises(ValueError, match=message(
            name, re.escape(interval),
            rf"received: {name}={re.escape(repr(value))}")):
        cls(**{name: value})


@pytest.mark.parametrize("case", CASES, ids=map(case_id, CASES))
def test_a_bad_value_of_one_model_is_named(case):
    cls, name, value, interval = case
    good = 0.5 if name != "learning_rate" else 0.01
    values = [good, value, good]
    with pytest.raises(ValueError, match=message(
            name, re.escape(interval),
            rf"model 1 has {name}={re.escape(repr(value))} \(received: "
            rf"{name}={re.escape(repr(values))}\)")):
        cls(**{name: values})


def test_the_fix_gives_the_default():
    with pytest.raises(ValueError, match=r"Pass a finite number in \[0, 1\) "
                       r"\(the default is 0\.9\), or one such number per "
                       r"model\.$"):
        optimizers.Adam(beta_1=1.0)


def test_the_learning_rate_message():
    with pytest.raises(ValueError, match=(
            r"^`learning_rate` must be a finite number >= 0 \(positive, or "
            r"0 to leave that model's weights unchanged\) for every model; "
            r"model 1 has learning_rate=-1\.0 \(received: learning_rate="
            r"\[0\.1, -1\.0\]\)\. Pass a positive learning rate such as "
            r"0\.001, or one per model\.$")):
        optimizers.SGD([0.1, -1.0])
    # The launchers check with the same function.
    with pytest.raises(ValueError, match="model 1 has learning_rate=-1"):
        check_learning_rate([0.1, -1])


@pytest.mark.parametrize("schedule, name", [
    (lambda: schedules.CosineDecay([0.1, -0.1], 10),
     r"CosineDecay\.initial_learning_rate"),
    (lambda: schedules.CosineDecay(0.1, 10, warmup_target=[None, math.nan],
                                   warmup_steps=2),
     r"CosineDecay\.warmup_target"),
    (lambda: schedules.PiecewiseConstantDecay([5], [0.1, [0.1, -1.0]]),
     r"PiecewiseConstantDecay\.values\[1\]"),
    (lambda: schedules.LinearWarmup(schedules.ExponentialDecay(
        -0.1, 10, 0.5), 1, 10), r"ExponentialDecay\.initial_learning_rate"),
    (lambda: keras.optimizers.schedules.CosineDecay(-0.1, 10),
     r"CosineDecay\.initial_learning_rate"),
    (lambda: keras.optimizers.schedules.InverseTimeDecay(math.inf, 10, 0.5),
     r"InverseTimeDecay\.initial_learning_rate"),
], ids=["fused", "warmup_target", "piecewise", "warmup_after", "stock",
        "stock_inf"])
def test_a_bad_rate_of_a_schedule_is_refused(schedule, name):
    with pytest.raises(ValueError, match=rf"`{name}` must be a finite number "
                       r">= 0"):
        optimizers.SGD(schedule())
    with pytest.raises(ValueError, match=rf"`{name}` must be"):
        optimizers.Adam([schedule(), schedule()])


def test_setting_a_bad_value_is_refused():
    optimizer = optimizers.Adam([0.1, 0.2], beta_1=0.9)
    with pytest.raises(ValueError, match="model 0 has learning_rate=nan"):
        optimizer.learning_rate = [math.nan, 0.1]
    with pytest.raises(ValueError, match=r"`beta_1` must be a finite number "
                       r"in \[0, 1\)"):
        optimizer.set_hyperparameter("beta_1", 1.0)
    assert list(optimizer.get_hyperparameter("learning_rate")) == [
        pytest.approx(0.1), pytest.approx(0.2)]


# Edge values that can be right: stock Keras accepts them too.
EDGES = [
    ("learning_rate", 0.0),
    ("weight_decay", 0.0),
    ("clipnorm", 0.0),
    ("clipvalue", 0.0),
    ("global_clipnorm", 0.0),
    ("epsilon", 0.0),
    ("beta_1", 0.0),
    ("beta_2", 0.0),
    ("momentum", 0.0),
    ("momentum", 1.0),
]


def edge_cases():
    for cls in CLASSES:
        for name, value in EDGES:
            if name in arguments(cls) and (cls.__name__, name) not in (
                    ("Lion", "beta_1"), ("ScheduleFreeAdamW", "beta_1")):
                yield cls, argument_name(cls, name), value


EDGE_CASES = list(edge_cases())


@pytest.mark.parametrize("cls, name, value", EDGE_CASES,
                         ids=[f"{c.__name__}-{n}={v}"
                              for c, n, v in EDGE_CASES])
def test_an_edge_value_is_accepted(cls, name, value):
    optimizer = cls(**{name: value})
    assert optimizer.get_hyperparameter(name) is not None
    stock = getattr(keras.optimizers, cls.__name__, None)
    if stock is not None and name in inspect.signature(stock).parameters:
        stock(**{name: value})  # Keras accepts it too.


@pytest.mark.parametrize("cls, name, value", [
    (optimizers.Lion, "beta_1", 1.0),
    (optimizers.ScheduleFreeAdamW, "beta_1", 1.0),
    (optimizers.Adamax, "beta_2", 1.0),
    (optimizers.RMSprop, "momentum", -0.5),
    (optimizers.Adam, "learning_rate", [0.0, 0.1]),
], ids=["lion_beta_1", "schedule_free_beta_1", "adamax_beta_2",
        "rmsprop_momentum_off",
        "a_frozen_model"])
def test_a_value_one_class_can_take_is_accepted(cls, name, value):
    cls(**{name: value})


def test_any_other_hyperparameter_must_be_finite():
    with pytest.raises(ValueError, match=(
            r"^`rho` must be a finite number for every model; model 0 has "
            r"rho=nan \(received: rho=\[nan, 0\.9\]\)\. Pass a finite number "
            r"\(the default is 0\.9\), or one such number per model\.$")):
        optimizers.RMSprop(rho=[math.nan, 0.9])
