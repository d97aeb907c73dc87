"""Trials as arrays: grouping, per-model optimizers, reloading and carrying
trained models, against stock Keras models trained alone."""

import keras
import numpy as np
import pytest
from testing import assert_close

import hftatf
from hftatf.graph import weighted_layers
from hftatf.tuning import arrays

RNG = np.random.default_rng(0)
X = RNG.normal(size=(16, 6)).astype("float32")
Y = RNG.integers(0, 3, size=(16,)).astype("int32")


def stock_model(units=5, optimizer=None, seed=0, loss=None, metrics=None,
                compile=True):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([
        keras.Input((6,)),
        keras.layers.Dense(units, activation="relu"),
        keras.layers.Dense(3, activation="softmax"),
    ])
    if compile:
        model.compile(
            optimizer=optimizer or keras.optimizers.Adam(1e-2),
            loss=loss or "sparse_categorical_crossentropy",
            metrics=["accuracy"] if metrics is None else metrics)
    return model


def trials(optimizers, units=5):
    """One compiled stock model per optimizer, each from its own seed."""
    return [stock_model(units, optimizer, seed=i)
            for i, optimizer in enumerate(optimizers)]


def fused(models, jit_compile=False):
    return arrays.fuse_trials(
        models, [arrays.trial_optimizer(m) for m in models],
        jit_compile=jit_compile)


def train_stock(models, steps):
    for model in models:
        for _ in range(steps):
            model.train_on_batch(X, Y)


def assert_array_holds(array, models, atol=1e-5):
    for index, model in enumerate(models):
        for got, want in zip(array.get_model_weights(index),
                             model.get_weights()):
            assert_close(got, want, atol=atol, rtol=atol,
                         err_msg=f"model {index}")


def test_each_model_of_the_array_trains_as_its_trial_alone():
    optimizers = [keras.optimizers.Adam(1e-2, beta_1=0.8),
                  keras.optimizers.Adam(3e-3, beta_1=0.95, epsilon=1e-5)]
    models = trials(optimizers)
    array = fused(models)
    assert_array_holds(array, models, atol=0)
    stock = trials([type(o).from_config(o.get_config())
                    for o in optimizers])
    train_stock(stock, 3)
    for _ in range(3):
        array.train_on_batch(X, Y)
    assert_array_holds(array, stock)


def test_combined_optimizer_holds_each_trials_values():
    optimizers = [arrays.trial_optimizer(m) for m in trials(
        [keras.optimizers.SGD(0.1, momentum=0.9, nesterov=True),
         keras.optimizers.SGD(0.01, momentum=0.9, nesterov=True)])]
    combined = arrays.combine_optimizers(optimizers)
    assert isinstance(combined, hftatf.optimizers.SGD)
    assert combined.num_models == 2 and combined.nesterov
    np.testing.assert_allclose(combined.get_hyperparameter("learning_rate"),
                               [0.1, 0.01])
    # Agreeing values stay one shared float.
    assert combined.get_config()["momentum"] == pytest.approx(0.9)


def test_stock_loss_scale_optimizer_is_unwrapped():
    model = stock_model(optimizer=keras.optimizers.LossScaleOptimizer(
        keras.optimizers.Adam(1e-3)))
    optimizer = arrays.trial_optimizer(model)
    assert type(optimizer) is hftatf.optimizers.Adam


def key(units=5, optimizer=None, **kwargs):
    model = stock_model(units, optimizer, **kwargs)
    return arrays.group_key(model, arrays.trial_optimizer(model))


def test_group_key_ignores_float_hyperparameters_only():
    reference = key(optimizer=keras.optimizers.Adam(1e-2, beta_1=0.9))
    assert key(optimizer=keras.optimizers.Adam(1e-4, beta_1=0.5),
               seed=3) == reference
    different = {
        "units": key(units=6),
        "structure": key(optimizer=keras.optimizers.Adam(1e-2,
                                                         amsgrad=True)),
        "class": key(optimizer=keras.optimizers.Nadam(1e-2)),
        "unset hyper-parameter": key(optimizer=keras.optimizers.Adam(
            1e-2, clipnorm=1.0)),
        "loss": key(loss=keras.losses.SparseCategoricalCrossentropy(
            ignore_class=0)),
        "metrics": key(metrics=[]),
    }
    for reason, other in different.items():
        assert other != reference, reason
    model = stock_model()
    optimizer = arrays.trial_optimizer(model)
    assert arrays.group_key(model, optimizer, {"batch_size": 32}) != (
        arrays.group_key(model, optimizer, {"batch_size": 64}))


def test_uncompiled_trial_model_is_a_clear_error():
    with pytest.raises(ValueError, match="not compiled"):
        arrays.compile_config(stock_model(compile=False))


def test_reloaded_array_trains_new_trials_without_retracing():
    array = fused(trials([keras.optimizers.Adam(1e-2),
                          keras.optimizers.Adam(1e-3)]))
    for _ in range(2):
        array.train_on_batch(X, Y)
    step = array.train_function
    new_optimizers = [keras.optimizers.Adam(5e-3, beta_1=0.7),
                      keras.optimizers.Adam(2e-2, beta_2=0.9)]
    new = [stock_model(optimizer=o, seed=10 + i)
           for i, o in enumerate(new_optimizers)]
    assert arrays.reusable(array, [arrays.trial_optimizer(m) for m in new])
    arrays.reload(array, new, [arrays.trial_optimizer(m) for m in new])
    assert_array_holds(array, new, atol=0)
    np.testing.assert_array_equal(array.optimizer.model_iterations, [0, 0])
    np.testing.assert_allclose(
        array.optimizer.get_hyperparameter("beta_1"), [0.7, 0.9])
    stock = [stock_model(optimizer=type(o).from_config(o.get_config()),
                         seed=10 + i) for i, o in enumerate(new_optimizers)]
    train_stock(stock, 2)
    for _ in range(2):
        array.train_on_batch(X, Y)
    assert array.train_function is step
    assert_array_holds(array, stock)


def test_array_with_a_diverged_model_is_not_reused():
    array = fused(trials([keras.optimizers.SGD(1e-2)] * 2))
    array.train_on_batch(X, Y)
    assert arrays.reusable(array)
    array.set_model_weights(1, [np.full_like(w, np.nan)
                                for w in array.get_model_weights(1)])
    array.train_on_batch(X, Y)
    assert array.diverged_models[1]
    assert not arrays.reusable(array)


def test_array_without_momentum_slots_is_not_reused_for_momentum():
    array = fused(trials([keras.optimizers.SGD(1e-2)] * 2))
    array.train_on_batch(X, Y)
    plain = [keras.optimizers.SGD(3e-2), keras.optimizers.SGD(1e-3)]
    momentum = [keras.optimizers.SGD(1e-2, momentum=0.9),
                keras.optimizers.SGD(1e-2)]
    for optimizers, reused in ((plain, True), (momentum, False)):
        new = trials(optimizers)
        assert arrays.reusable(
            array, [arrays.trial_optimizer(m) for m in new]) is reused
    # Refused before any weight is replaced.
    before = [np.asarray(w) for w in array.weights]
    with pytest.raises(ValueError, match="Cannot reload array"):
        arrays.reload(array, new, [arrays.trial_optimizer(m) for m in new])
    for weight, value in zip(array.weights, before):
        np.testing.assert_array_equal(weight, value)
    # The optimizer `reload_optimizer` built is the one loaded.
    new = trials(plain)
    fresh = arrays.reload_optimizer(
        array, [arrays.trial_optimizer(m) for m in new])
    arrays.reload(array, new, fresh)
    np.testing.assert_allclose(
        array.optimizer.get_hyperparameter("learning_rate"), [3e-2, 1e-3])
    assert_array_holds(array, new, atol=0)


def continued_steps(array, steps):
    for _ in range(steps):
        array.train_on_batch(X, Y)
    return array


def test_selected_winners_continue_exactly_where_they_were():
    optimizers = [keras.optimizers.Adam(r) for r in (1e-2, 3e-3, 1e-3)]
    array = continued_steps(fused(trials(optimizers)), 2)
    winners = arrays.continue_models(
        [(array, 2), (array, 0)], [None, None], [None, None])
    assert winners.num_models == 2
    np.testing.assert_array_equal(winners.optimizer.model_iterations,
                                  [2, 2])
    # The models of an array train independently: the whole array,
    # trained on, is the reference for its winners.
    continued_steps(winners, 2)
    continued_steps(array, 2)
    for slot, index in enumerate((2, 0)):
        for got, want in zip(winners.get_model_weights(slot),
                             array.get_model_weights(index)):
            assert_close(got, want, err_msg=f"winner {slot}")


def test_winners_of_two_arrays_are_gathered_with_their_state():
    first = trials([keras.optimizers.Adam(1e-2), keras.optimizers.Adam(1e-3)])
    second = [stock_model(optimizer=keras.optimizers.Adam(r), seed=5 + i)
              for i, r in enumerate((3e-2, 3e-3))]
    a = continued_steps(fused(first), 2)
    b = continued_steps(fused(second), 1)
    models = [first[1], second[0]]
    optimizers = [arrays.trial_optimizer(m) for m in models]
    gathered = arrays.continue_models([(a, 1), (b, 0)], models, optimizers,
                                      jit_compile=False)
    np.testing.assert_array_equal(gathered.optimizer.model_iterations,
                                  [2, 1])
    np.testing.assert_allclose(
        gathered.optimizer.get_hyperparameter("learning_rate"),
        [1e-3, 3e-2])
    continued_steps(gathered, 2)
    continued_steps(a, 2)
    continued_steps(b, 2)
    for slot, (source, index) in enumerate(((a, 1), (b, 0))):
        for got, want in zip(gathered.get_model_weights(slot),
                             source.get_model_weights(index)):
            assert_close(got, want, err_msg=f"model {slot}")


def test_copy_between_different_architectures_is_refused():
    small = fused(trials([keras.optimizers.SGD(0.1)], units=4))
    large = fused(trials([keras.optimizers.SGD(0.1)], units=6))
    with pytest.raises(ValueError, match="per-model shape"):
        arrays.copy_model(small, 0, large, 0)


def test_trained_model_is_written_into_its_trial_model():
    models = trials([keras.optimizers.SGD(0.1), keras.optimizers.SGD(0.2)])
    array = continued_steps(fused(models), 1)
    stacked = arrays.stacked_weights(array)
    target = stock_model(seed=9)
    arrays.set_model(target, stacked, 1)
    for got, want in zip(target.get_weights(), array.get_model_weights(1)):
        np.testing.assert_array_equal(got, want)


def squared_error_of_probabilities(y_true, y_pred):
    one_hot = keras.ops.one_hot(keras.ops.cast(y_true, "int32"), 3)
    return keras.ops.mean(keras.ops.square(one_hot - y_pred), axis=-1)


def top_probability(y_true, y_pred):
    return keras.ops.max(y_pred, axis=-1)


class MeanLabel(keras.metrics.Mean):
    def update_state(self, y_true, y_pred, sample_weight=None):
        return super().update_state(y_true, sample_weight)


def test_losses_and_metrics_not_registered_with_keras_train_as_stock():
    # Stock compile takes them as they are: no registration needed.
    def build(seed):
        return stock_model(
            optimizer=keras.optimizers.SGD(0.1), seed=seed,
            loss=squared_error_of_probabilities,
            metrics=[keras.metrics.MeanMetricWrapper(
                top_probability, name="top"),
                     MeanLabel(name="mean_label")])

    models = [build(seed) for seed in (0, 1)]
    array = fused(models)
    logs = array.evaluate(X, Y, verbose=0, return_dict=True)
    for b, model in enumerate(models):
        expected = model.evaluate(X, Y, verbose=0, return_dict=True)
        for name in ("loss", "top", "mean_label"):
            assert_close(logs[f"{name}_{b}"], expected[name],
                         err_msg=f"model {b} {name}")
    train_stock(models, 2)
    for _ in range(2):
        array.train_on_batch(X, Y)
    assert_array_holds(array, models)


def deep_and_cross(seed):
    """keras.io's deep & cross pattern: raw operations on the cross path
    count towards the depth by which Keras orders the stock model's
    layers, so the array lists them in another order; both paths' Dense
    layers have one shape, so a pairing by position would go unseen."""
    keras.utils.set_random_seed(seed)
    x0 = keras.Input((6,))
    cross = x0
    for _ in range(2):
        cross = x0 * keras.layers.Dense(6)(cross) + cross
    deep = x0
    for _ in range(2):
        deep = keras.layers.ReLU()(keras.layers.Dense(6)(deep))
    model = keras.Model(x0, keras.layers.Dense(3, activation="softmax")(
        keras.layers.concatenate([cross, deep])))
    model.compile(optimizer=keras.optimizers.Adam(1e-2),
                  loss="sparse_categorical_crossentropy")
    return model


def test_trial_models_are_read_and_written_layer_by_layer():
    array = fused([deep_and_cross(seed) for seed in (0, 1)])
    array.train_on_batch(X, Y)
    stock_order = [path for path, _ in weighted_layers(deep_and_cross(0))]
    assert [path for path, _ in weighted_layers(array)] != stock_order
    new = [deep_and_cross(seed) for seed in (10, 11)]
    arrays.reload(array, new, [arrays.trial_optimizer(m) for m in new])
    for b, (got, model) in enumerate(zip(array.unfuse(compile=False), new)):
        for ours, theirs in zip(got.get_weights(), model.get_weights()):
            np.testing.assert_array_equal(ours, theirs, err_msg=f"model {b}")
    target = deep_and_cross(9)
    arrays.set_model(target, arrays.stacked_weights(array), 1)
    for ours, theirs in zip(target.get_weights(), new[1].get_weights()):
        np.testing.assert_array_equal(ours, theirs)
