"""Every family of fused layers under `jax.jit` and `jax.grad`, as stock
Keras layers run on JAX: a stateless call of the fused layer, compiled,
against B stock layers holding the same weights (outputs, gradients of
the inputs and of every trainable weight, updated non-trainable state).
"""

import keras
import numpy as np
import pytest
from testing import (
    assert_close,
    layer_outputs_and_gradients,
    randomize_weights,
    stacked_weights,
)

from hftatf.core import compat
from hftatf.layers import resolve

pytestmark = pytest.mark.backends(
    "jax", reason="`jax.jit` of a stateless call is the JAX backend's step")

NUM_MODELS = 2
BATCH = 3

# (stock layer, per-model input shapes, fused form's own arguments)
FAMILIES = {
    "dense": (lambda: keras.layers.Dense(4, activation="relu"), [(5,)], {}),
    "einsum_dense": (lambda: keras.layers.EinsumDense(
        "abc,cd->abd", output_shape=(None, 3), bias_axes="d"), [(4, 5)], {}),
    "conv1d": (lambda: keras.layers.Conv1D(3, 3), [(8, 2)], {}),
    "conv2d_per_model": (lambda: keras.layers.Conv2D(
        3, 3, padding="same"), [(6, 6, 2)], {"implementation": "per_model"}),
    "conv2d_grouped": (lambda: keras.layers.Conv2D(
        4, 3, strides=2, groups=2), [(7, 7, 2)],
        {"implementation": "grouped"}),
    "conv3d": (lambda: keras.layers.Conv3D(2, 2), [(4, 4, 4, 2)], {}),
    "conv2d_transpose_per_model": (lambda: keras.layers.Conv2DTranspose(
        3, 3, strides=2), [(4, 4, 2)], {"implementation": "per_model"}),
    "conv2d_transpose_grouped": (lambda: keras.layers.Conv2DTranspose(
        3, 3, strides=2, padding="same"), [(4, 4, 2)],
        {"implementation": "grouped"}),
    "depthwise_conv2d": (lambda: keras.layers.DepthwiseConv2D(
        3, depth_multiplier=2), [(5, 5, 2)], {}),
    "separable_conv1d": (lambda: keras.layers.SeparableConv1D(
        3, 3), [(7, 2)], {}),
    "embedding": (lambda: keras.layers.Embedding(6, 3), [(4,)], {}),
    "multi_head_attention": (lambda: keras.layers.MultiHeadAttention(
        2, 3), [(4, 5), (3, 5)], {}),
    "lstm": (lambda: keras.layers.LSTM(3, return_sequences=True),
             [(4, 2)], {}),
    "gru": (lambda: keras.layers.GRU(3), [(4, 2)], {}),
    "batch_normalization": (lambda: keras.layers.BatchNormalization(),
                            [(4,)], {}),
    "layer_normalization": (lambda: keras.layers.LayerNormalization(),
                            [(3, 4)], {}),
}


def _inputs(name, shapes, rng):
    """Fused inputs `[batch, B, *shape]`: ids for an embedding."""
    if name == "embedding":
        return [rng.integers(0, 6, (BATCH, NUM_MODELS, *shapes[0]))]
    return [rng.standard_normal((BATCH, NUM_MODELS, *shape))
            .astype("float32") for shape in shapes]


def _jitted_call(layer, inputs, cotangents, training):
    """`layer.stateless_call` under `jax.jit`, with `jax.grad` of
    `sum(output * cotangent)` over the float inputs and the trainable
    weights: `(outputs, input gradients, weight gradients, non-trainable
    values after the call)`."""
    import jax

    floating = [i for i, x in enumerate(inputs)
                if np.issubdtype(x.dtype, np.floating)]
    # As `Layer.__call__` hands `training` on: where `call` takes it.
    kwargs = ({"training": training}
              if compat.call_takes_training(layer) else {})

    def scalar(trainable, tensors):
        given = list(inputs)
        for i, tensor in zip(floating, tensors):
            given[i] = tensor
        outputs, non_trainable = layer.stateless_call(
            trainable, [v.value for v in layer.non_trainable_variables],
            *given, **kwargs)
        flat = keras.tree.flatten(outputs)
        total = sum(keras.ops.sum(o * c) for o, c in zip(flat, cotangents))
        return total, (flat, non_trainable)

    step = jax.jit(jax.value_and_grad(scalar, argnums=(0, 1), has_aux=True))
    (_, (outputs, non_trainable)), (dw, dx) = step(
        [v.value for v in layer.trainable_variables],
        [inputs[i] for i in floating])
    return ([np.asarray(o) for o in outputs], [np.asarray(g) for g in dx],
            [np.asarray(g) for g in dw], [np.asarray(v) for v in non_trainable])


@pytest.mark.parametrize("training", [False, True])
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_jitted_stateless_call_matches_stock(name, training):
    make, shapes, arguments = FAMILIES[name]
    rng = np.random.default_rng(0)
    inputs = _inputs(name, shapes, rng)
    stock = []
    for _ in range(NUM_MODELS):
        layer = make()
        layer(*[x[:, 0] for x in inputs])
        randomize_weights(layer, rng)
        stock.append(layer)
    fused = type(resolve.fuse_layer(stock[0], NUM_MODELS)).from_config(
        {**stock[0].get_config(), "num_models": NUM_MODELS, **arguments})
    fused(*inputs)
    fused.set_weights(stacked_weights(stock))
    cotangents = [rng.standard_normal(y.shape).astype("float32") for y in
                  keras.tree.flatten(fused(*inputs, training=training))]
    fused.set_weights(stacked_weights(stock))

    outputs, dx, dw, after = _jitted_call(fused, inputs, cotangents, training)
    for b, layer in enumerate(stock):
        y_b, dx_b, dw_b = layer_outputs_and_gradients(
            layer, [x[:, b] for x in inputs], [c[:, b] for c in cotangents],
            training=training)
        for y, want in zip(outputs, y_b):
            assert_close(y[:, b], want, err_msg=f"output, model {b}")
        for grad, want in zip(dx, dx_b):
            assert_close(grad[:, b], want, err_msg=f"input grad, model {b}")
        assert len(dw) == len(dw_b)
        for grad, want, weight in zip(dw, dw_b, layer.trainable_weights):
            assert_close(grad[b], want, err_msg=f"{weight.path}, model {b}")
        for value, weight in zip(after, layer.non_trainable_weights):
            assert_close(value[b], np.asarray(weight),
                         err_msg=f"{weight.path} after the call, model {b}")
