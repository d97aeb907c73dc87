"""`hftatf.optimizers.get`: fused optimizers by name, by config, and by
converting stock Keras optimizers.

A converted stock optimizer must train the array as B copies of the stock
optimizer would train B models; whatever cannot be converted that way must
be refused with an error that says why. The tests run over every class of
`keras.optimizers`, so a fused class added later is tested as soon as it
exists.
"""

import inspect

import keras
import numpy as np
import pytest
from testing import (
    apply_per_model,
    assert_close,
    assert_slices_match,
    per_model_arrays,
    stock_variables,
)

from hftatf import optimizers

B = 3
SHAPES = [(5,), (4, B)]

STOCK_CLASSES = sorted(
    name for name, obj in vars(keras.optimizers).items()
    if inspect.isclass(obj) and issubclass(obj, keras.optimizers.Optimizer)
    and obj is not keras.optimizers.Optimizer
    # These wrap other optimizers; they have tests of their own below.
    and name not in ("LossScaleOptimizer", "MultiOptimizer"))
FUSED_CLASSES = sorted(
    name for name in optimizers.__all__
    if inspect.isclass(getattr(optimizers, name))
    and issubclass(getattr(optimizers, name), optimizers.FusedOptimizer)
    and name != "FusedOptimizer")
# Stock arguments that every stock optimizer takes and that change its
# math: a rate other than the default, and clipping.
STOCK_ARGS = {"learning_rate": 0.0123, "clipnorm": 0.5}


def _is_fused(name):
    return name in FUSED_CLASSES


def test_the_lists_are_not_empty():
    assert {"Adam", "SGD", "Lamb", "Adafactor"} <= set(STOCK_CLASSES)
    assert {"Adam", "SGD", "Lamb", "Adafactor", "Lars"} <= set(FUSED_CLASSES)


# -- by name and by config ---------------------------------------------------


def _wraps_another_optimizer(cls):
    parameters = list(inspect.signature(cls).parameters.values())
    return parameters[0].default is parameters[0].empty


@pytest.mark.parametrize("name", FUSED_CLASSES)
def test_get_by_name(name):
    cls = getattr(optimizers, name)
    if _wraps_another_optimizer(cls):
        # LossScaleOptimizer: no default inner optimizer, so no name.
        with pytest.raises(ValueError, match="Unknown fused optimizer"):
            optimizers.get(name)
        return
    for identifier in (name, name.lower(), name.upper()):
        opt = optimizers.get(identifier)
        assert type(opt) is cls
        assert opt.get_config() == cls().get_config() | {"name": opt.name}


def test_get_by_unknown_name_lists_the_known_ones():
    with pytest.raises(ValueError, match="lamb") as info:
        optimizers.get("nope")
    assert "Unknown fused optimizer 'nope'" in str(info.value)


@pytest.mark.parametrize("name", ["Lamb", "Adafactor", "Lars"])
def test_get_from_a_fused_config(name):
    cls = getattr(optimizers, name)
    opt = cls(learning_rate=[0.1, 0.2, 0.3])
    assert optimizers.get(opt) is opt
    clone = optimizers.get(keras.saving.serialize_keras_object(opt))
    assert type(clone) is cls
    assert clone.get_config() == opt.get_config()


def test_get_lars_from_a_plain_config():
    opt = optimizers.get({"class_name": "Lars",
                          "config": {"eta": [0.001, 0.01]}})
    assert type(opt) is optimizers.Lars
    assert_close(opt.get_hyperparameter("eta"), [0.001, 0.01])


@pytest.mark.parametrize("name", STOCK_CLASSES)
def test_get_from_a_stock_config(name):
    stock = getattr(keras.optimizers, name)(**STOCK_ARGS)
    serialized = keras.saving.serialize_keras_object(stock)
    if not _is_fused(name):
        with pytest.raises(TypeError, match=name):
            optimizers.get(serialized)
        return
    fused = optimizers.get(serialized)
    assert type(fused) is getattr(optimizers, name)
    _assert_config_has_stock_values(fused, stock)


# -- converting stock instances ----------------------------------------------


def _assert_config_has_stock_values(fused, stock):
    fused_config = fused.get_config()
    for key, value in stock.get_config().items():
        if key == "name":
            continue
        assert fused_config[key] == value, key
    assert fused_config["num_models"] is None


@pytest.mark.parametrize("name", STOCK_CLASSES)
def test_get_converts_every_stock_class_that_has_a_fused_form(name):
    stock = getattr(keras.optimizers, name)(**STOCK_ARGS)
    if not _is_fused(name):
        with pytest.raises(TypeError, match=f"no fused form of {name}"):
            optimizers.get(stock)
        return
    fused = optimizers.get(stock)
    assert type(fused) is getattr(optimizers, name)
    assert fused.name == stock.name
    _assert_config_has_stock_values(fused, stock)


@pytest.mark.parametrize("name", [n for n in STOCK_CLASSES if _is_fused(n)])
def test_a_converted_optimizer_trains_as_b_stock_copies(name):
    stock_cls = getattr(keras.optimizers, name)
    fused = optimizers.get(stock_cls(**STOCK_ARGS))
    stock = [stock_cls(**STOCK_ARGS) for _ in range(B)]
    initial = per_model_arrays(np.random.default_rng(0), SHAPES, B)
    fused_vars = [keras.Variable(x) for x in initial]
    stock_vars = [stock_variables(initial, b) for b in range(B)]
    rng = np.random.default_rng(1)
    for step in range(3):
        # Large gradients, different per model: clipping acts per model.
        grads = per_model_arrays(rng, SHAPES, B, scale=3.0)
        apply_per_model(stock, stock_vars, grads)
        fused.apply_gradients(zip(grads, fused_vars))
        assert_slices_match(fused_vars, stock_vars, err_msg=f"step {step}")


def test_a_stock_schedule_is_kept():
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, 2, 0.5)
    fused = optimizers.get(keras.optimizers.Lamb(learning_rate=schedule))
    assert fused._hyper_values["learning_rate"] is schedule
    variables = [keras.Variable(np.ones((B, 2), "float32"))]
    fused.apply_gradients([(np.ones((B, 2), "float32"), variables[0])])
    assert_close(fused.learning_rate, [float(schedule(1))] * B)


def test_weight_decay_exclusions_by_name_are_kept():
    stock_cls = keras.optimizers.Lamb
    kwargs = {"learning_rate": 0.05, "weight_decay": 0.5}
    template = stock_cls(**kwargs)
    template.exclude_from_weight_decay(var_names=["bias"])
    fused = optimizers.get(template)
    stock = [stock_cls(**kwargs) for _ in range(B)]
    for opt in stock:
        opt.exclude_from_weight_decay(var_names=["bias"])
    shapes, names = [(4, 2), (2,)], ["kernel", "bias"]
    initial = per_model_arrays(np.random.default_rng(0), shapes, B)
    fused_vars = [keras.Variable(x, name=n) for x, n in zip(initial, names)]
    stock_vars = [stock_variables(initial, b, names) for b in range(B)]
    rng = np.random.default_rng(1)
    for step in range(3):
        grads = per_model_arrays(rng, shapes, B)
        apply_per_model(stock, stock_vars, grads)
        fused.apply_gradients(zip(grads, fused_vars))
        assert_slices_match(fused_vars, stock_vars, err_msg=f"step {step}")
    assert not fused._use_weight_decay(fused_vars[1])
    assert fused._use_weight_decay(fused_vars[0])


# -- refusals ------------------------------------------------------------------


class SubclassedAdam(keras.optimizers.Adam):
    """Same name family, other math: hftatf cannot know what it does."""

    def update_step(self, gradient, variable, learning_rate):
        super().update_step(2 * gradient, variable, learning_rate)


def test_a_subclass_of_a_stock_optimizer_is_refused():
    with pytest.raises(TypeError, match="SubclassedAdam.*not a stock"):
        optimizers.get(SubclassedAdam())


def test_stock_loss_scale_optimizer():
    stock = keras.optimizers.LossScaleOptimizer(
        keras.optimizers.Lamb(learning_rate=0.01), initial_scale=128.0)
    fused_cls = getattr(optimizers, "LossScaleOptimizer", None)
    if fused_cls is None:
        # The stock one checks all models' gradients at once: one model's
        # overflow would skip every model's step.
        with pytest.raises(TypeError, match="LossScaleOptimizer.*all models"):
            optimizers.get(stock)
        return
    fused = optimizers.get(stock)
    assert type(fused) is fused_cls
    assert type(fused.inner_optimizer) is optimizers.Lamb
    assert fused.get_config()["initial_scale"] == 128.0


def test_multi_optimizer_is_refused():
    stock = keras.optimizers.MultiOptimizer(
        keras.optimizers.OptimizerMap(keras.optimizers.Adam()))
    with pytest.raises(TypeError, match="no fused form of MultiOptimizer"):
        optimizers.get(stock)


def test_a_built_stock_optimizer_is_refused():
    stock = keras.optimizers.Lamb()
    stock.build([keras.Variable(np.zeros((2,), "float32"))])
    with pytest.raises(ValueError, match="built"):
        optimizers.get(stock)


def test_a_stock_optimizer_that_took_steps_is_refused():
    stock = keras.optimizers.Adafactor()
    stock.iterations.assign(5)
    with pytest.raises(ValueError, match="5 steps"):
        optimizers.get(stock)


def test_a_callable_learning_rate_is_refused():
    stock = keras.optimizers.Adam(learning_rate=lambda: 0.01)
    with pytest.raises(TypeError, match="callable"):
        optimizers.get(stock)


def test_weight_decay_exclusions_of_stock_variables_are_refused():
    stock = keras.optimizers.Lamb(weight_decay=0.1)
    stock.exclude_from_weight_decay(
        var_list=[keras.Variable(np.zeros((2,), "float32"))])
    with pytest.raises(TypeError, match="var_list"):
        optimizers.get(stock)


def test_a_fused_class_that_changes_an_argument_is_refused(monkeypatch):
    """The check after conversion: a fused class that dropped or changed a
    stock argument would silently train something else."""
    get_config = optimizers.Lamb.get_config

    def wrong_config(self):
        return dict(get_config(self), beta_1=0.5)

    monkeypatch.setattr(optimizers.Lamb, "get_config", wrong_config)
    with pytest.raises(TypeError, match="beta_1"):
        optimizers.get(keras.optimizers.Lamb(beta_1=0.9))


@pytest.mark.parametrize("identifier", [3, None, [0.1], object()])
def test_other_identifiers_are_refused(identifier):
    with pytest.raises(TypeError, match="optimizer"):
        optimizers.get(identifier)


def test_an_unreadable_config_is_refused():
    with pytest.raises(ValueError, match="config"):
        optimizers.get({"class_name": "NoSuchOptimizer", "config": {}})
