"""Each model of an array as a stock Keras model that trains on.

`unfuse`, `export_models` and `hftatf.callbacks.ModelCheckpoint` give model
`b` the stock optimizer of the fused one's class, with model `b`'s
hyper-parameters and state. The oracle: the array trained one more epoch
against each stock model trained the same epoch with stock `fit`; their
weights must agree, which they do only if every slot, step count and
hyper-parameter was carried over.
"""

import keras
import numpy as np
import pytest
from backend_steps import apply_stock
from testing import STEP_JIT, assert_close

import hftatf
from hftatf import optimizers
from hftatf.optimizers import schedules
from hftatf.optimizers.stock import copy_state

B = 2
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def model():
    keras.utils.set_random_seed(1)
    inputs = keras.Input((5,))
    hidden = keras.layers.Dense(6, activation="tanh", name="hidden")(inputs)
    return keras.Model(inputs, keras.layers.Dense(3, name="logits")(hidden))


def data():
    rng = np.random.default_rng(0)
    return (rng.standard_normal((24, 5)).astype("float32"),
            rng.integers(0, 3, 24))


def fit(model_, x, y, epochs=1):
    model_.fit(x, y, batch_size=8, epochs=epochs, shuffle=False, verbose=0)


def trained_array(optimizer, epochs=1, **compile_kwargs):
    array = hftatf.fuse(model(), num_models=B)
    array.compile(optimizer=optimizer, loss=LOSS, jit_compile=STEP_JIT,
                  **compile_kwargs)
    fit(array, *data(), epochs=epochs)
    return array


def assert_trains_on_as_the_array(array, models, x, y):
    """Trains `models` (model b of `array` each) and `array` one more epoch
    and compares every weight."""
    for stock in models:
        fit(stock, x, y)
    fit(array, x, y)
    for b, stock in enumerate(models):
        for got, want in zip(stock.get_weights(),
                             array.unfuse(compile=False)[b].get_weights()):
            assert_close(got, want, atol=2e-6, rtol=2e-6,
                         err_msg=f"model {b}")


OPTIMIZERS = {
    "adam": lambda: optimizers.Adam([0.02, 0.01], beta_1=[0.9, 0.7]),
    "adam_amsgrad": lambda: optimizers.Adam(0.02, amsgrad=True),
    "sgd_nesterov": lambda: optimizers.SGD([0.1, 0.05], momentum=[0.9, 0.5],
                                           nesterov=True),
    "adamw_ema_clipnorm": lambda: optimizers.AdamW(
        0.02, weight_decay=[0.1, 0.01], use_ema=True,
        ema_momentum=[0.9, 0.5], ema_overwrite_frequency=2,
        clipnorm=[0.0, 0.5]),
    "rmsprop_centered_accumulated": lambda: optimizers.RMSprop(
        0.01, centered=True, momentum=0.5, gradient_accumulation_steps=2),
    "nadam_global_clipnorm": lambda: optimizers.Nadam(
        [0.01, 0.02], global_clipnorm=[0.3, 0.0]),
    "adafactor": lambda: optimizers.Adafactor(0.05),
    "adagrad_clipvalue": lambda: optimizers.Adagrad(0.1, clipvalue=0.05),
    "adadelta": lambda: optimizers.Adadelta(1.0, rho=[0.9, 0.5]),
    "adamax": lambda: optimizers.Adamax([0.02, 0.01]),
    "ftrl": lambda: optimizers.Ftrl(0.1, l1_regularization_strength=0.01),
    "lamb": lambda: optimizers.Lamb(0.01),
    "lion": lambda: optimizers.Lion([1e-3, 3e-3]),
    "muon": lambda: optimizers.Muon(0.01),
    "schedule_free_adamw": lambda: optimizers.ScheduleFreeAdamW(0.01),
    "cosine_decay": lambda: optimizers.SGD(schedules.CosineDecay(
        [0.1, 0.2], 5, warmup_target=[None, 0.3], warmup_steps=[0, 2])),
    "step_decay": lambda: optimizers.Adam(schedules.StepDecay(
        0.02, [2, 3], decay_rate=[0.5, 0.1])),
    "piecewise": lambda: optimizers.SGD(schedules.PiecewiseConstantDecay(
        [[2, 4], 5], [0.1, [0.05, 0.2], 0.01])),
    "stock_schedules": lambda: optimizers.SGD([
        keras.optimizers.schedules.ExponentialDecay(0.1, 3, 0.5),
        keras.optimizers.schedules.InverseTimeDecay(0.2, 2, 0.5)]),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_unfused_models_train_on_as_the_array(name):
    array = trained_array(OPTIMIZERS[name]())
    models = array.unfuse()
    for b, stock in enumerate(models):
        assert type(stock.optimizer) is getattr(
            keras.optimizers, type(array.optimizer).__name__)
        assert int(stock.optimizer.iterations) == int(
            array.optimizer.model_iterations[b])
    assert_trains_on_as_the_array(array, models, *data())


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_copied_state_steps_on_as_the_fused_optimizer(name):
    """Without `fit`: model b's state, copied into its stock optimizer,
    takes the next steps as the fused optimizer takes them, each applied
    as the backend's trainer applies it."""
    fused = OPTIMIZERS[name]()
    rng = np.random.default_rng(0)
    shapes = {"hidden": (5, 6), "bias": (6,), "logits": (6, 3)}
    fused_vars = [keras.Variable(
        rng.standard_normal((B, *shape)).astype("float32"), name=name)
        for name, shape in shapes.items()]
    steps = [[rng.standard_normal(v.shape).astype("float32")
              for v in fused_vars] for _ in range(5)]
    for grads in steps[:3]:
        fused.apply(grads, fused_vars)
    stock = []
    for b in range(B):
        stock_vars = [keras.Variable(np.asarray(v)[b], name=v.name)
                      for v in fused_vars]
        stock.append((copy_state(fused, b, optimizers.stock_optimizer(
            fused, b), list(zip(fused_vars, stock_vars))), stock_vars))
    for grads in steps[3:]:
        fused.apply(grads, fused_vars)
        for b, (optimizer, variables) in enumerate(stock):
            apply_stock(optimizer, [g[b] for g in grads], variables)
    for b, (_, variables) in enumerate(stock):
        for ours, theirs in zip(fused_vars, variables):
            assert_close(np.asarray(ours)[b], theirs,
                         err_msg=f"model {b} {theirs.name}")


def test_the_state_is_what_makes_them_agree():
    """A stock model with model b's weights and hyper-parameters but a
    fresh optimizer does not train as the array: the comparison above
    tells state from no state."""
    array = trained_array(optimizers.Adam([0.02, 0.01]))
    carried = array.unfuse()
    fresh = array.unfuse(compile=False)
    for b, stock in enumerate(fresh):
        stock.compile(keras.optimizers.Adam([0.02, 0.01][b]), loss=LOSS)
        fit(stock, *data())
        fit(carried[b], *data())
        gap = max(np.max(np.abs(f - c)) for f, c in zip(
            stock.get_weights(), carried[b].get_weights()))
        assert gap > 1e-3, f"model {b}"


def test_current_hyperparameters_and_per_model_steps():
    """Rates changed after compile (as ReduceLROnPlateau changes them) and
    a model frozen for an epoch (fewer steps: its own bias correction)."""
    array = trained_array(optimizers.Adam([0.02, 0.01]))
    array.freeze_models([1])
    fit(array, *data())
    array.unfreeze_models([1])
    array.optimizer.set_hyperparameter("learning_rate", [0.005, 0.03])
    models = array.unfuse()
    assert [int(m.optimizer.iterations) for m in models] == [6, 3]
    assert [float(m.optimizer.learning_rate) for m in models] == [
        pytest.approx(0.005), pytest.approx(0.03)]
    assert_trains_on_as_the_array(array, models, *data())


def test_weight_decay_exclusions_carry_over():
    optimizer = optimizers.AdamW(0.02, weight_decay=0.5)
    array = hftatf.fuse(model(), num_models=B)
    array.compile(optimizer=optimizer, loss=LOSS, jit_compile=STEP_JIT)
    array.build((None, 5))
    kernel = array.get_layer("hidden").kernel
    optimizer.exclude_from_weight_decay(var_list=[kernel], var_names=["bias"])
    fit(array, *data())
    assert_trains_on_as_the_array(array, array.unfuse(), *data())


def test_an_exclusion_pattern_may_name_a_layer():
    # The stock optimizer on TensorFlow matches a pattern against the
    # variable's path ("logits/kernel:0"), not its name alone.
    array = hftatf.fuse(model(), num_models=B)
    stock = array.unfuse(compile=False)
    optimizer = optimizers.SGD(0.1, weight_decay=[0.5, 0.3])
    optimizer.exclude_from_weight_decay(var_names=["logits"])
    array.compile(optimizer=optimizer, loss=LOSS, jit_compile=STEP_JIT)
    fit(array, *data())
    for b, twin in enumerate(stock):
        stock_optimizer = keras.optimizers.SGD(0.1,
                                               weight_decay=[0.5, 0.3][b])
        stock_optimizer.exclude_from_weight_decay(var_names=["logits"])
        twin.compile(optimizer=stock_optimizer, loss=LOSS)
        fit(twin, *data())
        for got, want in zip(array.unfuse(compile=False)[b].get_weights(),
                             twin.get_weights()):
            assert_close(got, want, err_msg=f"model {b}")


def test_compiled_like_the_array():
    array = trained_array(
        optimizers.SGD(0.1), metrics=["accuracy"],
        weighted_metrics=[keras.metrics.SparseCategoricalCrossentropy(
            from_logits=True, name="xent")])
    x, y = data()
    logs = array.evaluate(x, y, verbose=0, return_dict=True)
    for b, stock in enumerate(array.unfuse()):
        got = stock.evaluate(x, y, verbose=0, return_dict=True)
        for name in ("loss", "accuracy", "xent"):
            assert_close(got[name], logs[f"{name}_{b}"], err_msg=name)


def test_loss_scale_state_carries_over():
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        array = trained_array(optimizers.Adam([0.02, 0.01]))
        models = array.unfuse()
    finally:
        keras.mixed_precision.set_global_policy("float32")
    fused = array.optimizer
    for b, stock in enumerate(models):
        assert isinstance(stock.optimizer, keras.optimizers.LossScaleOptimizer)
        assert float(stock.optimizer.dynamic_scale) == float(
            fused.dynamic_scale[b])
        assert int(stock.optimizer.step_counter) == int(fused.step_counter[b])
        inner = stock.optimizer.inner_optimizer
        assert int(inner.iterations) == 3
        momentum = inner._momentums[inner._get_variable_index(
            stock.get_layer("hidden").kernel)]
        assert_close(momentum, fused.inner_optimizer._momentums[
            fused.inner_optimizer._get_variable_index(
                array.get_layer("hidden").kernel)][b], atol=0, rtol=0)


def test_saved_model_keeps_its_optimizer(tmp_path):
    array = trained_array(optimizers.Adam([0.02, 0.01]))
    paths = []
    for b, stock in enumerate(array.unfuse()):
        paths.append(tmp_path / f"model_{b}.keras")
        stock.save(paths[-1])
    loaded = [keras.models.load_model(path) for path in paths]
    assert all(int(m.optimizer.iterations) == 3 for m in loaded)
    assert_trains_on_as_the_array(array, loaded, *data())


def test_export_and_checkpoint_files_train_on(tmp_path):
    array = trained_array(optimizers.RMSprop([0.01, 0.02], momentum=0.5))
    array.export_models(tmp_path / "export", format="keras")
    checkpoint = hftatf.callbacks.ModelCheckpoint(
        str(tmp_path / "ckpt" / "model_{model}.keras"), monitor="loss",
        save_best_only=False)
    fit(array, *data())
    exported = [keras.models.load_model(tmp_path / "export" / f"model_{b}" /
                                        "model.keras") for b in range(B)]
    assert all(int(m.optimizer.iterations) == 3 for m in exported)
    # The export was taken one epoch back: train the copies two epochs
    # against the array's one more, from the checkpoints of this epoch.
    array.fit(*data(), batch_size=8, epochs=1, shuffle=False, verbose=0,
              callbacks=[checkpoint])
    saved = [keras.models.load_model(tmp_path / "ckpt" / f"model_{b}.keras")
             for b in range(B)]
    assert all(int(m.optimizer.iterations) == 9 for m in saved)
    for stock in exported:
        fit(stock, *data(), epochs=2)
    for b, stock in enumerate(exported):
        for got, want in zip(stock.get_weights(), saved[b].get_weights()):
            # Each export trained on as the array did until the checkpoint.
            assert_close(got, want, atol=2e-6, rtol=2e-6)
    assert_trains_on_as_the_array(array, saved, *data())


@pytest.mark.parametrize("formats", [
    ("keras",),
    pytest.param(("keras", "checkpoint"), marks=pytest.mark.backends(
        "tensorflow", reason="TF checkpoints are written on TensorFlow "
        "only"))], ids=["keras", "keras_and_checkpoint"])
def test_load_models_compiled_trains_on(tmp_path, formats):
    array = trained_array(optimizers.Adam([0.02, 0.01]))
    array.export_models(tmp_path, format=formats)
    assert not any(m.compiled for m in hftatf.load_models(tmp_path))
    loaded = hftatf.load_models(tmp_path, compile=True)
    assert all(int(m.optimizer.iterations) == 3 for m in loaded)
    assert_trains_on_as_the_array(array, loaded, *data())


def test_uncompiled_where_asked_or_not_compiled():
    assert not any(m.compiled for m in hftatf.fuse(
        model(), num_models=B).unfuse())
    array = trained_array(optimizers.SGD(0.1))
    assert not any(m.compiled for m in array.unfuse(compile=False))


@pytest.mark.parametrize("optimizer", [
    lambda: optimizers.Lars(0.1),
    lambda: optimizers.SGD(schedules.LinearWarmup(0.1, 1, 3)),
], ids=["lars", "linear_warmup"])
def test_no_stock_form_leaves_the_models_uncompiled(optimizer):
    array = trained_array(optimizer())
    with pytest.warns(UserWarning, match="left uncompiled.*no stock"):
        models = array.unfuse()
    assert not any(m.compiled for m in models)
    with pytest.raises(TypeError, match="no stock"):
        optimizers.stock_optimizer(array.optimizer, 0)


class SlotsNamedElsewhere(optimizers.Adam):
    """Adam keeping its slots under names of its own, not the stock
    `_momentums` and `_velocities`: it breaks the slot contract of
    `FusedOptimizer`."""

    def build(self, variables):
        super(optimizers.Adam, self).build(variables)
        self._m, self._v = self.add_optimizer_variables(
            variables, ["momentum", "velocity"])


class SlotsOfTheWrongShape(optimizers.Adam):
    """Adam keeping one momentum for all models: no model axis."""

    def build(self, variables):
        super().build(variables)
        self._momentums = [self.add_variable((4,), name="momentum")]


@pytest.mark.parametrize("cls, found", [
    (SlotsNamedElsewhere, r"SlotsNamedElsewhere has no attribute "
     r"`_momentums` \(its lists of one slot per variable: `_m`, `_v`\)"),
    (SlotsOfTheWrongShape, r"SlotsOfTheWrongShape holds a slot of shape "
     r"\(4,\) for variable 'kernel' in `_momentums`, where the stock slot "
     r"has shape \(3,\): expected shape \(2, 3\)"),
], ids=["named_elsewhere", "wrong_shape"])
def test_a_slot_outside_the_contract_is_named(cls, found):
    fused = cls(0.01)
    fused_kernel = keras.Variable(np.ones((B, 3)), name="kernel")
    fused.build([fused_kernel])
    stock_kernel = keras.Variable(np.ones(3), name="kernel")
    with pytest.raises(ValueError, match=(
            r"stock Adam keeps slots in `_momentums`, and " + found
            + r"\. Expected: `_momentums`, a list of one \[num_models, "
            r"\.\.\.\] slot \(or None\) per variable.*Fix: in "
            + cls.__name__ + r"\.build, store these slots as "
            r"`self\._momentums = self\.add_optimizer_variables")):
        copy_state(fused, 0, keras.optimizers.Adam(0.01),
                   [(fused_kernel, stock_kernel)])
