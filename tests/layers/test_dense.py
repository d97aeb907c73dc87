"""FusedDense against its oracle: B stock `keras.layers.Dense` layers.

Every test builds B stock layers with random weights (bias included), stacks
the same weights into one `FusedDense`, and compares what model `b` of the
array computes on `x[:, b]` with what stock layer `b` computes on `x[:, b]`.
"""

import keras
import numpy as np
import pytest
from testing import (
    assert_close,
    compiled_programs,
    layer_outputs_and_gradients,
    moment_tolerance,
)

from hftatf.layers import FusedDense

BATCH = 4
IN_FEATURES = 5
UNITS = 3


def stock_layers(num_models, in_features, units, rng, **kwargs):
    """B built stock Dense layers, every weight (bias too) random."""
    layers = []
    for _ in range(num_models):
        layer = keras.layers.Dense(units, **kwargs)
        layer.build((None, in_features))
        layer.set_weights([rng.standard_normal(w.shape).astype("float32")
                           for w in layer.get_weights()])
        layers.append(layer)
    return layers


def fused_twin(stock, inner_shape=(), **kwargs):
    """The FusedDense that holds the stock layers' weights, stacked."""
    num_models = len(stock)
    in_features = stock[0].kernel.shape[0]
    fused = FusedDense(num_models, stock[0].units, **kwargs)
    fused.build((None, num_models, *inner_shape, in_features))
    fused.set_weights([np.stack(ws) for ws in
                       zip(*(layer.get_weights() for layer in stock))])
    return fused


def output_and_gradients(layer, x, cotangent, variables):
    """`layer(x)` and the gradients of `sum(layer(x) * cotangent)` w.r.t.
    `x` and `variables`."""
    assert list(variables) == list(layer.trainable_weights)
    (y,), dx, dw = layer_outputs_and_gradients(layer, [x], [cotangent])
    return y, [*dx, *dw]


def compare_with_stock(stock, fused, x, rng):
    """Outputs, input gradients and weight gradients of every model."""
    num_models = len(stock)
    units = stock[0].units
    cotangent = rng.standard_normal(
        (*x.shape[:-1], units)).astype("float32")
    y, (dx, *dweights) = output_and_gradients(
        fused, x, cotangent, fused.trainable_weights)
    assert y.shape == (*x.shape[:-1], units)
    assert len(dweights) == len(stock[0].trainable_weights)
    for b in range(num_models):
        y_b, (dx_b, *dweights_b) = output_and_gradients(
            stock[b], x[:, b], cotangent[:, b], stock[b].trainable_weights)
        assert_close(y[:, b], y_b, err_msg=f"output of model {b}")
        assert_close(dx[:, b], dx_b, err_msg=f"input gradient of model {b}")
        for fused_grad, stock_grad, variable in zip(
                dweights, dweights_b, stock[b].trainable_weights):
            assert_close(fused_grad[b], stock_grad,
                         err_msg=f"gradient of {variable.name}, model {b}")


@pytest.mark.parametrize("num_models", [1, 3])
@pytest.mark.parametrize("inner_shape", [(), (4,)], ids=["rank2", "rank3"])
@pytest.mark.parametrize("use_bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("activation", [None, "relu", "tanh", "softmax"])
def test_matches_stock_dense(num_models, inner_shape, use_bias, activation):
    rng = np.random.default_rng(0)
    kwargs = {"activation": activation, "use_bias": use_bias}
    stock = stock_layers(num_models, IN_FEATURES, UNITS, rng, **kwargs)
    fused = fused_twin(stock, inner_shape, **kwargs)
    assert [tuple(w.shape) for w in fused.weights] == [
        (num_models, *w.shape) for w in stock[0].weights]
    x = rng.standard_normal(
        (BATCH, num_models, *inner_shape, IN_FEATURES)).astype("float32")
    compare_with_stock(stock, fused, x, rng)


@pytest.mark.backends("tensorflow", reason="XLA by `tf.function`; on JAX "
                      "every call is compiled (test_stateless_jit.py)")
def test_matches_stock_dense_under_xla():
    import tensorflow as tf

    rng = np.random.default_rng(1)
    stock = stock_layers(3, IN_FEATURES, UNITS, rng, activation="tanh")
    fused = fused_twin(stock, activation="tanh")
    x = rng.standard_normal((BATCH, 3, IN_FEATURES)).astype("float32")
    y = np.asarray(tf.function(fused, jit_compile=True)(x))
    for b in range(3):
        assert_close(y[:, b], stock[b](x[:, b]))


def test_training_flag_does_not_change_output():
    rng = np.random.default_rng(2)
    fused = fused_twin(stock_layers(2, IN_FEATURES, UNITS, rng))
    x = rng.standard_normal((BATCH, 2, IN_FEATURES)).astype("float32")
    assert_close(fused(x, training=True), fused(x, training=False))


def test_model_weights_round_trip():
    rng = np.random.default_rng(3)
    stock = stock_layers(3, IN_FEATURES, UNITS, rng)
    fused = FusedDense(3, UNITS)
    fused.build((None, 3, IN_FEATURES))
    for b, layer in enumerate(stock):
        fused.set_model_weights(b, layer.get_weights())
    for b, layer in enumerate(stock):
        for got, expected in zip(fused.get_model_weights(b),
                                 layer.get_weights()):
            np.testing.assert_array_equal(got, expected)
    x = rng.standard_normal((BATCH, 3, IN_FEATURES)).astype("float32")
    compare_with_stock(stock, fused, x, rng)


def test_set_model_weights_rejects_wrong_weights():
    fused = FusedDense(2, UNITS)
    fused.build((None, 2, IN_FEATURES))
    kernel, bias = fused.get_model_weights(0)
    with pytest.raises(ValueError, match="holds 2 weights per model"):
        fused.set_model_weights(0, [kernel])
    with pytest.raises(ValueError, match=r"per-model shape \(5, 3\)"):
        fused.set_model_weights(0, [kernel.T, bias])


def test_mask_passes_through():
    fused = FusedDense(2, UNITS)
    x = np.ones((BATCH, 2, 4, IN_FEATURES), "float32")
    mask = np.arange(BATCH * 2 * 4).reshape(BATCH, 2, 4) % 3 > 0
    np.testing.assert_array_equal(fused.compute_mask(x, mask), mask)


# Initialisation: each slice is a separate stock Dense.


@pytest.mark.parametrize("initializer", ["glorot_uniform", "he_normal",
                                         "lecun_uniform"])
def test_slices_have_the_variance_of_a_stock_kernel(initializer):
    num_models, in_features, units = 8, 20, 30
    fused = FusedDense(num_models, units, kernel_initializer=initializer)
    fused.build((None, num_models, in_features))
    kernel = np.asarray(fused.kernel)
    stock = []
    for _ in range(num_models):
        layer = keras.layers.Dense(units, kernel_initializer=initializer)
        layer.build((None, in_features))
        stock.append(np.asarray(layer.kernel))
    stock = np.stack(stock)
    # A [B, in, units] kernel initialised whole has fans B times larger and
    # a variance B = 8 times smaller: far outside this tolerance.
    ratio = np.var(kernel) / np.var(stock)
    assert abs(ratio - 1.0) < moment_tolerance(kernel, stock), ratio
    for b in range(num_models):
        slice_ratio = np.var(kernel[b]) / np.var(stock)
        assert abs(slice_ratio - 1.0) < moment_tolerance(kernel[b], stock), (
            b, slice_ratio)


def test_glorot_uniform_slices_use_the_stock_limit():
    num_models, in_features, units = 8, 20, 30
    fused = FusedDense(num_models, units)
    fused.build((None, num_models, in_features))
    kernel = np.asarray(fused.kernel)
    # Glorot's definition: U(-limit, limit), limit = sqrt(6 / (fan_in +
    # fan_out)) with the fans of the stock [in, units] kernel.
    limit = np.sqrt(6.0 / (in_features + units))
    whole_limit = limit / np.sqrt(num_models)
    for b in range(num_models):
        assert np.abs(kernel[b]).max() <= limit
        assert np.abs(kernel[b]).max() > whole_limit


@pytest.mark.parametrize("initializer", [
    None,
    keras.initializers.GlorotUniform(seed=11),
    keras.initializers.GlorotUniform(seed=keras.random.SeedGenerator(11)),
    keras.initializers.RandomNormal(seed=5),
], ids=["unseeded", "int-seed", "seed-generator", "random-normal"])
def test_slices_differ(initializer):
    kwargs = {} if initializer is None else {
        "kernel_initializer": initializer, "bias_initializer": initializer}
    fused = FusedDense(4, UNITS, **kwargs)
    fused.build((None, 4, IN_FEATURES))
    weights = fused.get_weights() if initializer is not None else [
        np.asarray(fused.kernel)]
    for w in weights:
        for b in range(4):
            for c in range(b):
                assert not np.array_equal(w[b], w[c]), (b, c)


@pytest.mark.parametrize("initializer_class", [
    keras.initializers.GlorotUniform,
    keras.initializers.HeNormal,
    keras.initializers.RandomUniform,
    keras.initializers.Orthogonal,
])
def test_seeded_slice_zero_equals_stock(initializer_class):
    seed = 42
    fused = FusedDense(3, UNITS,
                       kernel_initializer=initializer_class(seed=seed),
                       bias_initializer=keras.initializers.RandomNormal(
                           seed=seed + 100))
    fused.build((None, 3, IN_FEATURES))
    stock = keras.layers.Dense(
        UNITS, kernel_initializer=initializer_class(seed=seed),
        bias_initializer=keras.initializers.RandomNormal(seed=seed + 100))
    stock.build((None, IN_FEATURES))
    for got, expected in zip(fused.get_model_weights(0), stock.get_weights()):
        np.testing.assert_array_equal(got, expected)

    again = FusedDense(3, UNITS,
                       kernel_initializer=initializer_class(seed=seed),
                       bias_initializer=keras.initializers.RandomNormal(
                           seed=seed + 100))
    again.build((None, 3, IN_FEATURES))
    for got, expected in zip(again.get_weights(), fused.get_weights()):
        np.testing.assert_array_equal(got, expected)


def test_many_seeded_slices_each_equal_the_stock_draw_of_their_seed(caplog):
    # Slices are joined in stacks of at most 64 (on JAX an eager stack of
    # B operands compiles a program whose compile time grows faster than
    # B: B = 10,000 took minutes); every slice is still exactly its stock
    # layer's draw with seed + b, in order.
    num_models, seed = 150, 7
    fused = FusedDense(num_models, UNITS,
                       kernel_initializer=keras.initializers.GlorotUniform(
                           seed=seed))
    with compiled_programs(caplog) as operands:
        fused.build((None, num_models, IN_FEATURES))
    for b in (0, 63, 64, 127, 128, num_models - 1):
        stock = keras.layers.Dense(
            UNITS, kernel_initializer=keras.initializers.GlorotUniform(
                seed=seed + b))
        stock.build((None, IN_FEATURES))
        np.testing.assert_array_equal(fused.get_model_weights(b)[0],
                                      stock.get_weights()[0])
    assert max(operands, default=0) <= 64, operands


@pytest.mark.parametrize("initializer", [
    "zeros", "ones", keras.initializers.Constant(0.25),
    keras.initializers.Constant(np.arange(UNITS, dtype="float32"))])
def test_constant_initializers_give_every_slice_the_stock_values(
        initializer):
    # Drawn once for the whole weight, not per slice.
    fused = FusedDense(5, UNITS, kernel_initializer=initializer,
                       bias_initializer=initializer)
    fused.build((None, 5, IN_FEATURES))
    stock = keras.layers.Dense(UNITS, kernel_initializer=initializer,
                               bias_initializer=initializer)
    stock.build((None, IN_FEATURES))
    for b in range(5):
        for got, expected in zip(fused.get_model_weights(b),
                                 stock.get_weights()):
            np.testing.assert_array_equal(got, expected)


def test_orthogonal_initializer_is_orthogonal_per_slice():
    units = 4
    fused = FusedDense(3, units, kernel_initializer="orthogonal")
    fused.build((None, 3, 6))
    for b, kernel in enumerate(np.asarray(fused.kernel)):
        assert_close(kernel.T @ kernel, np.eye(units), atol=1e-5,
                     err_msg=f"model {b}")


# Regularizers and constraints, per model slice.


def test_weight_regularizers_give_per_model_losses():
    rng = np.random.default_rng(4)
    kwargs = {"kernel_regularizer": keras.regularizers.L2(0.01),
              "bias_regularizer": keras.regularizers.L1(0.02)}
    stock = stock_layers(3, IN_FEATURES, UNITS, rng, **kwargs)
    fused = fused_twin(stock, **kwargs)
    losses = [np.asarray(loss) for loss in fused.losses]
    assert [loss.shape for loss in losses] == [(3,), (3,)]
    kernel_loss, bias_loss = losses
    for b, layer in enumerate(stock):
        assert_close(kernel_loss[b], kwargs["kernel_regularizer"](
            fused.kernel[b]))
        assert_close(bias_loss[b], kwargs["bias_regularizer"](fused.bias[b]))
        assert_close([kernel_loss[b], bias_loss[b]],
                     [np.asarray(loss) for loss in layer.losses],
                     err_msg=f"model {b}")


def test_kernel_constraint_applies_per_slice():
    rng = np.random.default_rng(5)
    kwargs = {"kernel_constraint": keras.constraints.MaxNorm(2.0, axis=0),
              "bias_constraint": keras.constraints.NonNeg()}
    stock = stock_layers(3, IN_FEATURES, UNITS, rng, **kwargs)
    for layer in stock:  # Norms well above 2, so the constraint bites.
        layer.kernel.assign(3.0 * layer.kernel)
    fused = fused_twin(stock, **kwargs)
    constrained = np.asarray(fused.kernel.constraint(fused.kernel))
    for b, layer in enumerate(stock):
        assert_close(constrained[b], kwargs["kernel_constraint"](
            layer.kernel))
        assert_close(constrained[b], layer.kernel.constraint(layer.kernel))
        assert_close(fused.bias.constraint(fused.bias)[b],
                     layer.bias.constraint(layer.bias))


def test_constraints_after_an_optimizer_step_match_stock():
    rng = np.random.default_rng(6)
    kwargs = {"kernel_constraint": keras.constraints.MaxNorm(2.0, axis=0),
              "bias_constraint": keras.constraints.NonNeg()}
    stock = stock_layers(3, IN_FEATURES, UNITS, rng, **kwargs)
    fused = fused_twin(stock, **kwargs)
    grads = [rng.standard_normal(w.shape).astype("float32")
             for w in fused.trainable_weights]
    keras.optimizers.SGD(0.5).apply(grads, fused.trainable_weights)
    for b, layer in enumerate(stock):
        keras.optimizers.SGD(0.5).apply([g[b] for g in grads],
                                        layer.trainable_weights)
        for got, expected in zip(fused.get_model_weights(b),
                                 layer.get_weights()):
            assert_close(got, expected, err_msg=f"model {b}")


@pytest.mark.parametrize("inner_shape", [(), (4,)], ids=["rank2", "rank3"])
def test_activity_regularizer_gives_per_model_losses(inner_shape):
    rng = np.random.default_rng(7)
    kwargs = {"activity_regularizer": keras.regularizers.L2(0.01)}
    stock = stock_layers(3, IN_FEATURES, UNITS, rng, **kwargs)
    fused = fused_twin(stock, inner_shape, **kwargs)
    x = rng.standard_normal(
        (BATCH, 3, *inner_shape, IN_FEATURES)).astype("float32")
    fused(x)
    assert len(fused.losses) == 1
    loss = np.asarray(fused.losses[0])
    assert loss.shape == (3,)
    for b, layer in enumerate(stock):
        layer(x[:, b])
        assert_close(loss[b], layer.losses[0], err_msg=f"model {b}")


# Serialization.


def configured_layer():
    return FusedDense(
        3, UNITS, activation="tanh", use_bias=True,
        kernel_initializer=keras.initializers.HeNormal(seed=3),
        bias_initializer="ones",
        kernel_regularizer=keras.regularizers.L2(0.01),
        bias_regularizer=keras.regularizers.L1(0.02),
        activity_regularizer=keras.regularizers.L1(0.03),
        kernel_constraint=keras.constraints.MaxNorm(2.0, axis=0),
        bias_constraint=keras.constraints.NonNeg(),
        name="fused_dense_under_test",
    )


def test_config_round_trip():
    layer = configured_layer()
    config = layer.get_config()
    assert config["num_models"] == 3
    assert config["units"] == UNITS
    clone = FusedDense.from_config(config)
    assert clone.get_config() == config
    layer.build((None, 3, IN_FEATURES))
    clone.build((None, 3, IN_FEATURES))
    clone.set_weights(layer.get_weights())
    x = np.random.default_rng(8).standard_normal(
        (BATCH, 3, IN_FEATURES)).astype("float32")
    # Called through `call`, as the activity regularizer is tested apart.
    assert_close(clone.call(x), layer.call(x))


def test_serialize_deserialize_keras_object():
    layer = configured_layer()
    serialized = keras.saving.serialize_keras_object(layer)
    restored = keras.saving.deserialize_keras_object(serialized)
    assert type(restored) is FusedDense
    assert restored.get_config() == layer.get_config()


def test_saved_model_file_round_trip(tmp_path):
    rng = np.random.default_rng(9)
    inputs = keras.Input((3, 4, IN_FEATURES))
    hidden = FusedDense(3, 6, activation="relu")(inputs)
    outputs = FusedDense(3, UNITS, use_bias=False)(hidden)
    model = keras.Model(inputs, outputs)
    for w in model.weights:
        w.assign(rng.standard_normal(w.shape).astype("float32"))
    x = rng.standard_normal((BATCH, 3, 4, IN_FEATURES)).astype("float32")
    path = tmp_path / "fused_dense.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert [type(layer) for layer in loaded.layers] == [
        type(layer) for layer in model.layers]
    for got, expected in zip(loaded.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(loaded(x), model(x))


# Bad input.


@pytest.mark.parametrize("num_models,error", [
    (0, ValueError), (-1, ValueError), (2.5, TypeError), (True, TypeError),
    ("3", TypeError), (None, TypeError),
])
def test_rejects_bad_num_models(num_models, error):
    with pytest.raises(error, match="num_models"):
        FusedDense(num_models, UNITS)


def test_accepts_numpy_integer_num_models():
    layer = FusedDense(np.int64(3), UNITS)
    assert layer.num_models == 3
    assert type(layer.get_config()["num_models"]) is int


@pytest.mark.parametrize("units", [0, -2, 2.0, True])
def test_rejects_bad_units(units):
    with pytest.raises(ValueError, match="units"):
        FusedDense(2, units)


def test_rejects_quantization():
    with pytest.raises(ValueError, match="quantization_config"):
        FusedDense(2, UNITS, quantization_config={"mode": "int8"})


def test_rejects_wrong_model_axis():
    layer = FusedDense(3, UNITS)
    with pytest.raises(ValueError, match="num_models=3 on axis 1"):
        layer(np.zeros((BATCH, 4, IN_FEATURES), "float32"))


def test_rejects_input_without_model_axis():
    layer = FusedDense(3, UNITS)
    with pytest.raises(ValueError):
        layer(np.zeros((BATCH, IN_FEATURES), "float32"))


def test_built_layer_rejects_wrong_model_axis():
    layer = FusedDense(3, UNITS)
    layer(np.zeros((BATCH, 3, IN_FEATURES), "float32"))
    with pytest.raises(ValueError, match="axis 1"):
        layer(np.zeros((BATCH, 4, IN_FEATURES), "float32"))


def test_built_layer_rejects_wrong_feature_size_like_stock():
    stock = keras.layers.Dense(UNITS)
    stock(np.zeros((BATCH, IN_FEATURES), "float32"))
    with pytest.raises(ValueError):
        stock(np.zeros((BATCH, IN_FEATURES + 1), "float32"))
    layer = FusedDense(3, UNITS)
    layer(np.zeros((BATCH, 3, IN_FEATURES), "float32"))
    with pytest.raises(ValueError):
        layer(np.zeros((BATCH, 3, IN_FEATURES + 1), "float32"))
