"""FusedPReLU against its oracle: B stock `keras.layers.PReLU` layers.

Every test builds B stock layers with random alphas, stacks them into one
`FusedPReLU`, and compares outputs, input gradients and alpha gradients of
every model slice with its stock layer.
"""

import keras
import numpy as np
import pytest
from testing import (
    assert_close,
    compare_layer_with_stock,
    layer_outputs_and_gradients,
    randomize_weights,
    stacked_weights,
)

from hftatf.layers import FusedActivityRegularization, FusedPReLU, resolve

BATCH = 5
NUM_MODELS = 3


def stock_layers(shape, rng, num_models=NUM_MODELS, **kwargs):
    """B built stock PReLU layers for inputs `(batch, *shape)`, random
    alphas."""
    layers = []
    for _ in range(num_models):
        layer = keras.layers.PReLU(**kwargs)
        layer.build((None, *shape))
        randomize_weights(layer, rng)
        layers.append(layer)
    return layers


def fused_twin(stock, shape, **kwargs):
    fused = FusedPReLU(len(stock), **kwargs)
    fused.build((None, len(stock), *shape))
    assert [tuple(w.shape) for w in fused.weights] == [
        (len(stock), *w.shape) for w in stock[0].weights]
    fused.set_weights(stacked_weights(stock))
    return fused


def fused_inputs(rng, shape, num_models=NUM_MODELS):
    return rng.standard_normal((BATCH, num_models, *shape)).astype("float32")


CASES = [
    ((4,), None),
    ((3, 4), None),
    ((3, 4), [1]),
    ((3, 4), 2),
    ((3, 2, 4), [1, 2]),
    ((3, 2, 4), (1, 3)),
    ((3, 2, 4), [1, 2, 3]),
    # The stock layer indexes the alpha shape with `axis - 1`, so -1 shares
    # the second-to-last axis; the array does the same.
    ((3, 2, 4), -1),
]


@pytest.mark.parametrize("num_models", [1, NUM_MODELS])
@pytest.mark.parametrize("shape,shared_axes", CASES,
                         ids=[f"{len(s) + 1}d-shared{a}" for s, a in CASES])
def test_matches_stock_prelu(shape, shared_axes, num_models):
    rng = np.random.default_rng(0)
    stock = stock_layers(shape, rng, num_models, shared_axes=shared_axes)
    fused = fused_twin(stock, shape, shared_axes=shared_axes)
    compare_layer_with_stock(stock, fused, [fused_inputs(rng, shape,
                                                         num_models)], rng)


def test_training_flag_does_not_change_output():
    rng = np.random.default_rng(1)
    fused = fused_twin(stock_layers((4,), rng), (4,))
    x = fused_inputs(rng, (4,))
    np.testing.assert_array_equal(fused(x, training=True),
                                  fused(x, training=False))


def test_default_initial_alpha_matches_stock():
    stock = keras.layers.PReLU()
    stock.build((None, 3, 4))
    fused = FusedPReLU(2)
    fused.build((None, 2, 3, 4))
    np.testing.assert_array_equal(np.asarray(fused.alpha),
                                  np.stack([np.asarray(stock.alpha)] * 2))


def test_seeded_initializer_starts_each_model_differently():
    initializer = keras.initializers.RandomUniform(seed=3)
    stock = keras.layers.PReLU(alpha_initializer=initializer)
    stock.build((None, 4))
    fused = FusedPReLU(3, alpha_initializer=initializer)
    fused.build((None, 3, 4))
    alpha = np.asarray(fused.alpha)
    np.testing.assert_array_equal(alpha[0], np.asarray(stock.alpha))
    assert not np.allclose(alpha[0], alpha[1])


def test_regularizer_and_constraint_per_model():
    rng = np.random.default_rng(2)
    kwargs = {"alpha_regularizer": keras.regularizers.L2(0.1),
              "alpha_constraint": keras.constraints.MaxNorm(1.0, axis=0)}
    stock = stock_layers((3, 4), rng, **kwargs)
    fused = fused_twin(stock, (3, 4), **kwargs)
    (loss,) = fused.losses
    assert loss.shape == (NUM_MODELS,)
    for b, layer in enumerate(stock):
        assert_close(loss[b], layer.losses[0])
        assert_close(fused.alpha.constraint(fused.alpha)[b],
                     layer.alpha.constraint(layer.alpha))


def test_mask_passes_through():
    fused = FusedPReLU(2)
    x = np.ones((BATCH, 2, 6, 4), "float32")
    mask = np.arange(BATCH * 2 * 6).reshape(BATCH, 2, 6) % 3 > 0
    np.testing.assert_array_equal(fused.compute_mask(x, mask), mask)


@pytest.fixture
def mixed_bfloat16():
    previous = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    yield
    keras.mixed_precision.set_global_policy(previous)


def test_mixed_bfloat16_matches_stock(mixed_bfloat16):
    rng = np.random.default_rng(3)
    stock = stock_layers((3, 4), rng, shared_axes=[1])
    fused = fused_twin(stock, (3, 4), shared_axes=[1])
    x = fused_inputs(rng, (3, 4))
    cotangent = rng.standard_normal(x.shape).astype("float32")
    (y,), (dx,), (dalpha,) = layer_outputs_and_gradients(fused, [x],
                                                         [cotangent])
    assert y.dtype == np.dtype("bfloat16")
    for b, layer in enumerate(stock):
        (y_b,), (dx_b,), (dalpha_b,) = layer_outputs_and_gradients(
            layer, [x[:, b]], [cotangent[:, b]])
        # Stock PReLU computes in bfloat16 (alpha autocast, like the array):
        # the same bfloat16 operations give the same values; the alpha
        # gradient sums bfloat16 terms, whose order may move the result by
        # a unit in the last place (2^-8 relative).
        np.testing.assert_array_equal(y[:, b], y_b)
        np.testing.assert_array_equal(dx[:, b], dx_b)
        assert_close(dalpha[b], dalpha_b, atol=1e-2, rtol=1e-2)


def test_config_round_trip():
    layer = FusedPReLU(3, alpha_initializer="random_normal",
                       alpha_regularizer=keras.regularizers.L1(0.1),
                       alpha_constraint="non_neg", shared_axes=[1],
                       name="prelu")
    config = layer.get_config()
    assert config["num_models"] == 3
    clone = FusedPReLU.from_config(config)
    assert clone.get_config() == config
    restored = keras.saving.deserialize_keras_object(
        keras.saving.serialize_keras_object(layer))
    assert type(restored) is FusedPReLU
    assert restored.get_config() == config
    layer.build((None, 3, 2, 4))
    clone.build((None, 3, 2, 4))
    clone.set_weights(layer.get_weights())
    x = np.random.default_rng(4).standard_normal((BATCH, 3, 2, 4))
    np.testing.assert_array_equal(clone(x), layer(x))


def test_registered_for_stock_prelu():
    stock = keras.layers.PReLU(shared_axes=[1, 2], alpha_initializer="ones")
    fused = resolve.fuse_layer(stock, 2)
    assert type(fused) is FusedPReLU
    config = fused.get_config()
    assert config.pop("num_models") == 2
    config.pop("activity_regularizer")
    assert config == {k: v for k, v in stock.get_config().items()
                      if k != "activity_regularizer"}


def test_saved_array_file_round_trip(tmp_path):
    rng = np.random.default_rng(5)
    inputs = keras.Input((NUM_MODELS, 3, 4))
    outputs = FusedPReLU(NUM_MODELS, shared_axes=[1])(inputs)
    model = keras.Model(inputs, outputs)
    for w in model.weights:
        w.assign(rng.standard_normal(w.shape).astype("float32"))
    path = tmp_path / "prelu.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    x = fused_inputs(rng, (3, 4))
    np.testing.assert_array_equal(loaded(x), model(x))


def test_rejects_wrong_model_axis():
    with pytest.raises(ValueError, match="num_models=3 on axis 1"):
        FusedPReLU(3)(np.zeros((BATCH, 4, 6), "float32"))


def test_built_layer_rejects_wrong_size_on_unshared_axis_like_stock():
    stock = keras.layers.PReLU(shared_axes=[1])
    stock(np.zeros((BATCH, 3, 4), "float32"))
    with pytest.raises(ValueError):
        stock(np.zeros((BATCH, 3, 5), "float32"))
    fused = FusedPReLU(2, shared_axes=[1])
    fused(np.zeros((BATCH, 2, 3, 4), "float32"))
    # The shared axis may change size, as in the stock layer; the other not.
    fused(np.zeros((BATCH, 2, 7, 4), "float32"))
    with pytest.raises(ValueError):
        fused(np.zeros((BATCH, 2, 3, 5), "float32"))


# ActivityRegularization: the identity, with a penalty per model.


def test_activity_regularization_penalises_each_model_like_stock():
    rng = np.random.default_rng(30)
    x = rng.standard_normal((4, 3, 5)).astype("float32")
    fused = resolve.fuse_layer(
        keras.layers.ActivityRegularization(l1=0.1, l2=0.01), 3)
    assert isinstance(fused, FusedActivityRegularization)
    np.testing.assert_array_equal(fused(x), x)
    (loss,) = fused.losses
    assert tuple(loss.shape) == (3,)
    for b in range(3):
        stock = keras.layers.ActivityRegularization(l1=0.1, l2=0.01)
        stock(x[:, b])
        assert_close(loss[b], sum(stock.losses), err_msg=f"model {b}")
    again = FusedActivityRegularization.from_config(fused.get_config())
    assert (again.l1, again.l2) == (0.1, 0.01)
