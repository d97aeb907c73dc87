"""FusedEinsumDense against its oracle: B stock `keras.layers.EinsumDense`.

Every test builds B stock layers with random weights (bias included), stacks
the same weights into one `FusedEinsumDense`, and compares what model `b`
computes on `x[:, b]` with what stock layer `b` computes on `x[:, b]`.
"""

import keras
import numpy as np
import pytest
from testing import (
    assert_close,
    compare_layer_with_stock,
    randomize_weights,
    stacked_weights,
)

import hftatf
from hftatf.layers import FusedEinsumDense, resolve

BATCH = 3


def stock_and_fused(num_models, equation, output_shape, inner_shape, rng,
                    **kwargs):
    """B built stock layers with random weights, and their fused twin."""
    stock = []
    for _ in range(num_models):
        layer = keras.layers.EinsumDense(equation, output_shape, **kwargs)
        layer.build((BATCH, *inner_shape))
        randomize_weights(layer, rng)
        stock.append(layer)
    fused = FusedEinsumDense(num_models, equation, output_shape, **kwargs)
    fused.build((BATCH, num_models, *inner_shape))
    fused.set_weights(stacked_weights(stock))
    return stock, fused


# (equation, output_shape, bias_axes, per-model input shape without batch)
CASES = [
    ("ab,bc->ac", 4, "c", (5,)),
    ("ab,bc->ac", 4, None, (5,)),
    ("abc,cd->abd", (None, 4), "d", (3, 5)),
    ("abc,cd->abd", (3, 4), "bd", (3, 5)),
    ("abc,cde->abde", (None, 2, 3), "de", (3, 5)),
    ("abc,cde->abde", (None, 2, 3), "d", (3, 5)),
    ("abcd,cde->abe", (None, 6), "e", (3, 2, 4)),
    ("abc,bcd->ad", 4, "d", (3, 5)),
    ("...b,bc->...c", 4, "c", (5,)),
    ("...b,bc->...c", 4, "c", (3, 5)),
    ("...b,bc->...c", 4, None, (2, 3, 5)),
    ("...ab,bc->...ac", (3, 4), "c", (3, 5)),
    ("...ab,bc->...ac", (4,), "c", (5,)),
    ("ab...,bc->ac...", 4, "c", (5, 6)),
    ("ab...,bc->ac...", 4, "c", (5, 2, 3)),
    ("ab...,bc->ac...", 4, None, (5,)),
]


@pytest.mark.parametrize("equation,output_shape,bias_axes,inner_shape",
                         CASES, ids=[f"{c[0]}|{c[2]}|{c[3]}" for c in CASES])
def test_matches_stock_einsum_dense(equation, output_shape, bias_axes,
                                    inner_shape):
    rng = np.random.default_rng(0)
    stock, fused = stock_and_fused(2, equation, output_shape, inner_shape,
                                   rng, bias_axes=bias_axes)
    assert [tuple(w.shape) for w in fused.weights] == [
        (2, *w.shape) for w in stock[0].weights]
    x = rng.standard_normal((BATCH, 2, *inner_shape)).astype("float32")
    y = compare_layer_with_stock(stock, fused, [x], rng)
    assert fused.compute_output_shape(x.shape) == y[0].shape


@pytest.mark.parametrize("activation", ["relu", "softmax"])
def test_matches_stock_with_activation_and_three_models(activation):
    rng = np.random.default_rng(1)
    stock, fused = stock_and_fused(3, "abc,cd->abd", (None, 4), (3, 5), rng,
                                   bias_axes="d", activation=activation)
    x = rng.standard_normal((BATCH, 3, 3, 5)).astype("float32")
    compare_layer_with_stock(stock, fused, [x], rng)


@pytest.mark.backends("tensorflow", reason="XLA by `tf.function`; JAX "
                      "compiles every op (test_stateless_jit.py: `jax.jit`)")
def test_matches_stock_under_xla():
    import tensorflow as tf

    rng = np.random.default_rng(2)
    stock, fused = stock_and_fused(3, "...b,bc->...c", 4, (3, 5), rng,
                                   bias_axes="c")
    x = rng.standard_normal((BATCH, 3, 3, 5)).astype("float32")
    y = np.asarray(tf.function(fused, jit_compile=True)(x))
    for b in range(3):
        assert_close(y[:, b], stock[b](x[:, b]))


XLA_ON_TF = pytest.mark.backends(
    "tensorflow", reason="XLA by `tf.function`; JAX compiles every op")

# A bias on one axis whose size is also the last (or first) output axis's:
# the stock layer's `ops.add` adds it there, with TensorFlow's bias_add.
# (equation, output_shape, bias_axes, per-model input shape)
BIAS_ADD_CASES = [
    ("abc,cde->abde", (None, 4, 4), "d", (3, 5)),  # on the last axis
    ("abc,cde->abde", (None, 2, 5), "d", (2, 5)),  # on the first axis
    ("abc,cd->abd", (3, 3), "d", (3, 5)),  # on the last axis, as named
]


@pytest.mark.parametrize("equation, output_shape, bias_axes, inner_shape",
                         BIAS_ADD_CASES, ids=[str(c[1]) for c in
                                              BIAS_ADD_CASES])
@pytest.mark.parametrize("num_models", [1, 3])
@pytest.mark.parametrize("xla", [False, pytest.param(True, marks=XLA_ON_TF)],
                         ids=["eager", "xla"])
def test_bias_goes_where_the_stock_layer_adds_it(
        equation, output_shape, bias_axes, inner_shape, num_models, xla):
    rng = np.random.default_rng(4)
    stock, fused = stock_and_fused(num_models, equation, output_shape,
                                   inner_shape, rng, bias_axes=bias_axes)
    x = rng.standard_normal(
        (BATCH, num_models, *inner_shape)).astype("float32")
    call = fused
    if xla:
        import tensorflow as tf

        call = tf.function(fused, jit_compile=True)
    y = np.asarray(call(x))
    for b in range(num_models):
        assert_close(y[:, b], stock[b](x[:, b]))


def test_symbolic_output_shape():
    layer = FusedEinsumDense(2, "...b,bc->...c", 4, bias_axes="c")
    y = layer(keras.Input((2, 7, 5)))
    assert tuple(y.shape) == (None, 2, 7, 4)
    layer = FusedEinsumDense(2, "abc,cde->abde", (None, 2, 3))
    assert layer.compute_output_shape((None, 2, 7, 5)) == (None, 2, 7, 2, 3)


# Initialisation: each slice is a separate stock EinsumDense.


@pytest.mark.parametrize("initializer", ["GlorotUniform", "HeNormal",
                                         "RandomNormal"])
def test_seeded_slices_equal_stock_layers_seeded_per_model(initializer):
    # The stock layer tells a VarianceScaling initializer the kernel's fan
    # axes; a slice initialised as a [B, 5, 2, 3] whole, or without the fan
    # axes, would differ.
    equation, output_shape, inner = "abc,cde->abde", (None, 2, 3), (4, 5)
    cls = getattr(keras.initializers, initializer)
    fused = FusedEinsumDense(3, equation, output_shape,
                             kernel_initializer=cls(seed=7))
    fused.build((None, 3, *inner))
    for b in range(3):
        stock = keras.layers.EinsumDense(equation, output_shape,
                                         kernel_initializer=cls(seed=7 + b))
        stock.build((None, *inner))
        assert_close(fused.kernel[b], stock.kernel, atol=0, rtol=0,
                     err_msg=f"model {b}")


def test_unseeded_slices_differ():
    fused = FusedEinsumDense(3, "ab,bc->ac", 4)
    fused.build((None, 3, 5))
    kernel = np.asarray(fused.kernel)
    assert not np.allclose(kernel[0], kernel[1])
    assert not np.allclose(kernel[1], kernel[2])


# Regularizers and constraints, per model slice.


def test_regularizers_give_per_model_losses():
    rng = np.random.default_rng(3)
    kwargs = {"bias_axes": "d",
              "kernel_regularizer": keras.regularizers.L2(0.01),
              "bias_regularizer": keras.regularizers.L1(0.02),
              "activity_regularizer": keras.regularizers.L2(0.03)}
    stock, fused = stock_and_fused(3, "abc,cd->abd", (None, 4), (3, 5), rng,
                                   **kwargs)
    x = rng.standard_normal((BATCH, 3, 3, 5)).astype("float32")
    fused(x)
    losses = [np.asarray(loss) for loss in fused.losses]
    assert [loss.shape for loss in losses] == [(3,)] * 3
    for b, layer in enumerate(stock):
        layer(x[:, b])
        assert_close([loss[b] for loss in losses],
                     [np.asarray(loss) for loss in layer.losses],
                     err_msg=f"model {b}")


def test_constraints_apply_per_slice():
    rng = np.random.default_rng(4)
    kwargs = {"bias_axes": "d",
              "kernel_constraint": keras.constraints.MaxNorm(1.0, axis=0),
              "bias_constraint": keras.constraints.NonNeg()}
    stock, fused = stock_and_fused(3, "abc,cd->abd", (None, 4), (3, 5), rng,
                                   **kwargs)
    grads = [rng.standard_normal(w.shape).astype("float32")
             for w in fused.trainable_weights]
    keras.optimizers.SGD(0.5).apply(grads, fused.trainable_weights)
    for b, layer in enumerate(stock):
        keras.optimizers.SGD(0.5).apply([g[b] for g in grads],
                                        layer.trainable_weights)
        for got, expected in zip(fused.get_model_weights(b),
                                 layer.get_weights()):
            assert_close(got, expected, err_msg=f"model {b}")


# Serialization and fusing.


def configured_layer():
    return FusedEinsumDense(
        3, "...b,bc->...c", 4, activation="tanh", bias_axes="c",
        kernel_initializer=keras.initializers.HeNormal(seed=3),
        bias_initializer="ones",
        kernel_regularizer=keras.regularizers.L2(0.01),
        bias_regularizer=keras.regularizers.L1(0.02),
        activity_regularizer=keras.regularizers.L1(0.03),
        kernel_constraint=keras.constraints.MaxNorm(2.0, axis=0),
        bias_constraint=keras.constraints.NonNeg(),
        name="fused_einsum_dense_under_test",
    )


def test_config_round_trip():
    layer = configured_layer()
    config = layer.get_config()
    assert config["num_models"] == 3
    clone = FusedEinsumDense.from_config(config)
    assert clone.get_config() == config
    layer.build((None, 3, 2, 5))
    clone.build((None, 3, 2, 5))
    clone.set_weights(layer.get_weights())
    x = np.random.default_rng(5).standard_normal(
        (BATCH, 3, 2, 5)).astype("float32")
    assert_close(clone.call(x), layer.call(x))


def test_serialize_deserialize_keras_object():
    layer = configured_layer()
    restored = keras.saving.deserialize_keras_object(
        keras.saving.serialize_keras_object(layer))
    assert type(restored) is FusedEinsumDense
    assert restored.get_config() == layer.get_config()


def test_registry_builds_from_stock_config():
    stock = keras.layers.EinsumDense("abc,cd->abd", (None, 4), bias_axes="d",
                                     activation="relu", name="proj")
    fused = resolve.fuse_layer(stock, 2)
    assert type(fused) is FusedEinsumDense
    assert fused.name == "proj"
    assert fused.equation == stock.equation
    assert fused.bias_axes == "d"


def test_fuse_models_outputs_equal_each_model():
    rng = np.random.default_rng(6)

    def model():
        x = keras.Input((3, 5))
        h = keras.layers.EinsumDense("abc,cde->abde", (None, 2, 4),
                                     bias_axes="de", activation="relu")(x)
        y = keras.layers.EinsumDense("...de,dec->...c", 3, bias_axes="c")(h)
        return keras.Model(x, y)

    models = [model() for _ in range(2)]
    for m in models:
        for layer in m.layers:
            if layer.weights:
                randomize_weights(layer, rng)
    array = hftatf.fuse_models(models)
    x = rng.standard_normal((BATCH, 3, 5)).astype("float32")
    y = np.asarray(array(x))
    for b, m in enumerate(models):
        assert_close(y[:, b], m(x), err_msg=f"model {b}")


# Bad input.


@pytest.mark.parametrize("arg", ["quantization_config",
                                 "gptq_unpacked_column_size"])
def test_rejects_quantization(arg):
    with pytest.raises(ValueError, match=arg):
        FusedEinsumDense(2, "ab,bc->ac", 4, **{arg: 4})


def test_fusing_a_quantized_layer_names_it_and_the_argument():
    # The refusal itself, not the whole config Keras's `from_config`
    # prints around it.
    inputs = keras.Input((4,))
    outputs = keras.layers.EinsumDense("ab,bc->ac", 3, name="small")(inputs)
    model = keras.Model(inputs, outputs)
    model.quantize("int8")
    with pytest.raises(ValueError, match=r"'small' \(EinsumDense\): "
                       r"FusedEinsumDense does not support "
                       r"`quantization_config`") as error:
        hftatf.fuse(model, 2)
    assert "Error when deserializing" not in str(error.value)


@pytest.mark.parametrize("equation", ["ab,bc", "a...b,bc->a...c", "ab->b",
                                      "...a...,ab->b"])
def test_rejects_invalid_equation(equation):
    with pytest.raises(ValueError, match="Invalid einsum equation"):
        FusedEinsumDense(2, equation, 4)


def test_rejects_wrong_output_shape_length():
    layer = FusedEinsumDense(2, "abc,cd->abd", 4)
    with pytest.raises(ValueError, match="needs an `output_shape` of 2"):
        layer.build((None, 2, 3, 5))


def test_rejects_mismatched_shared_dimension_like_stock():
    with pytest.raises(ValueError, match="do not match at shared dimension"):
        keras.layers.EinsumDense("abc,cd->abd", (7, 4)).build((None, 3, 5))
    with pytest.raises(ValueError, match="do not match at shared dimension"):
        FusedEinsumDense(2, "abc,cd->abd", (7, 4)).build((None, 2, 3, 5))


def test_rejects_bias_axis_not_in_output():
    with pytest.raises(ValueError, match="Bias dimension 'x'"):
        FusedEinsumDense(2, "ab,bc->ac", 4, bias_axes="x").build(
            (None, 2, 5))


def test_rejects_wrong_rank_for_plain_equation():
    with pytest.raises(ValueError, match="rank 2"):
        FusedEinsumDense(2, "ab,bc->ac", 4).build((None, 2, 3, 5))


def test_rejects_wrong_model_axis():
    layer = FusedEinsumDense(3, "ab,bc->ac", 4)
    with pytest.raises(ValueError, match="num_models=3 on axis 1"):
        layer(np.zeros((BATCH, 2, 5), "float32"))
