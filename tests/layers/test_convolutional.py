"""Fused convolutions against their oracle: B stock Keras convolutions.

Every comparison builds B stock layers with random weights (biases too),
stacks the same weights into the fused layer, and checks that model `b` of
the array computes what stock layer `b` computes on `x[:, b]`: outputs,
input gradients and weight gradients (`compare_layer_with_stock`).
"""

import inspect

import keras
import numpy as np
import pytest
from testing import (
    BACKEND,
    assert_close,
    compare_layer_with_stock,
    layer_outputs_and_gradients,
    moment_tolerance,
    randomize_weights,
    stacked_weights,
    value_and_gradients,
)

import hftatf
from hftatf.layers import (
    FusedConv1D,
    FusedConv1DTranspose,
    FusedConv2D,
    FusedConv2DTranspose,
    FusedConv3D,
    FusedConv3DTranspose,
    FusedDepthwiseConv1D,
    FusedDepthwiseConv2D,
    FusedSeparableConv1D,
    FusedSeparableConv2D,
    resolve,
)
from hftatf.layers.backends import runs_on_accelerator
from hftatf.layers.convolutional import base_conv

BATCH = 2

STOCK = {
    FusedConv1D: keras.layers.Conv1D,
    FusedConv2D: keras.layers.Conv2D,
    FusedConv3D: keras.layers.Conv3D,
    FusedConv1DTranspose: keras.layers.Conv1DTranspose,
    FusedConv2DTranspose: keras.layers.Conv2DTranspose,
    FusedConv3DTranspose: keras.layers.Conv3DTranspose,
    FusedDepthwiseConv1D: keras.layers.DepthwiseConv1D,
    FusedDepthwiseConv2D: keras.layers.DepthwiseConv2D,
    FusedSeparableConv1D: keras.layers.SeparableConv1D,
    FusedSeparableConv2D: keras.layers.SeparableConv2D,
}
# The families whose kernel is chosen by `implementation`.
WITH_IMPLEMENTATION = (FusedConv1D, FusedConv2D, FusedConv3D,
                       FusedConv1DTranspose, FusedConv2DTranspose,
                       FusedConv3DTranspose)


def twins(fused_class, input_shape, rng, num_models=3, implementation=None,
          **kwargs):
    """B built stock layers with random weights, and the fused layer that
    holds the same weights, stacked. `input_shape` is per model, no batch."""
    stock = []
    for _ in range(num_models):
        layer = STOCK[fused_class](**kwargs)
        layer.build((None, *input_shape))
        randomize_weights(layer, rng)
        stock.append(layer)
    if implementation is not None:
        kwargs["implementation"] = implementation
    fused = fused_class(num_models, **kwargs)
    fused.build((None, num_models, *input_shape))
    fused.set_weights(stacked_weights(stock))
    return stock, fused


def fused_input(rng, input_shape, num_models=3):
    return rng.standard_normal(
        (BATCH, num_models, *input_shape)).astype("float32")


def check_against_stock(fused_class, input_shape, num_models=3,
                        implementation=None, **kwargs):
    rng = np.random.default_rng(0)
    stock, fused = twins(fused_class, input_shape, rng, num_models,
                         implementation, **kwargs)
    assert [tuple(w.shape) for w in fused.weights] == [
        (num_models, *w.shape) for w in stock[0].weights]
    x = fused_input(rng, input_shape, num_models)
    y = compare_layer_with_stock(stock, fused, [x], rng)
    expected = fused.compute_output_shape((BATCH, num_models, *input_shape))
    assert y[0].shape == tuple(expected)


# -- Each family against stock, over the arguments that change the math. ----


def case(fused_class, input_shape, num_models=3, **kwargs):
    """A pytest param whose id names the class and the arguments."""
    words = [fused_class.__name__[5:], f"B{num_models}"] + [
        f"{k}={v}" for k, v in kwargs.items()]
    return pytest.param(fused_class, input_shape, num_models, kwargs,
                        id="-".join(words).replace(" ", ""))


CONV_CASES = [
    case(FusedConv1D, (7, 4), filters=3, kernel_size=3),
    case(FusedConv1D, (7, 4), num_models=1, filters=3, kernel_size=3),
    case(FusedConv1D, (8, 4), filters=3, kernel_size=3, strides=2),
    case(FusedConv1D, (8, 4), filters=3, kernel_size=4, strides=3,
         padding="same"),
    case(FusedConv1D, (7, 4), filters=3, kernel_size=3, padding="causal"),
    case(FusedConv1D, (7, 4), filters=3, kernel_size=3, padding="causal",
         dilation_rate=2),
    case(FusedConv1D, (9, 4), filters=3, kernel_size=2, dilation_rate=3,
         padding="same"),
    case(FusedConv1D, (7, 4), num_models=2, filters=6, kernel_size=3,
         groups=2),
    case(FusedConv1D, (7, 4), filters=3, kernel_size=3, use_bias=False,
         activation="relu"),
    case(FusedConv2D, (6, 5, 3), filters=4, kernel_size=3),
    case(FusedConv2D, (6, 5, 3), num_models=1, filters=4, kernel_size=3),
    case(FusedConv2D, (7, 6, 3), filters=4, kernel_size=(3, 2),
         strides=(2, 1), padding="same"),
    case(FusedConv2D, (7, 7, 3), filters=4, kernel_size=3, strides=2),
    case(FusedConv2D, (8, 7, 3), filters=4, kernel_size=3,
         dilation_rate=(2, 1)),
    case(FusedConv2D, (6, 6, 3), filters=4, kernel_size=3,
         dilation_rate=2, padding="same"),
    case(FusedConv2D, (5, 5, 4), num_models=2, filters=6, kernel_size=3,
         groups=2, padding="same"),
    case(FusedConv2D, (5, 5, 4), filters=4, kernel_size=1),
    case(FusedConv2D, (6, 6, 3), filters=4, kernel_size=3, use_bias=False,
         activation="tanh"),
    case(FusedConv2D, (6, 6, 3), filters=4, kernel_size=3,
         activation="softmax"),
    case(FusedConv3D, (4, 4, 4, 2), filters=3, kernel_size=2),
    case(FusedConv3D, (5, 4, 4, 2), filters=3, kernel_size=3, strides=2,
         padding="same"),
    case(FusedConv3D, (5, 5, 4, 2), filters=3, kernel_size=2,
         dilation_rate=(2, 2, 1), activation="relu"),
    case(FusedConv3D, (3, 3, 3, 4), num_models=2, filters=2, kernel_size=2,
         groups=2, use_bias=False),
]


@pytest.mark.gpu
@pytest.mark.parametrize("fused_class,input_shape,num_models,kwargs",
                         CONV_CASES)
def test_conv_matches_stock(fused_class, input_shape, num_models, kwargs):
    check_against_stock(fused_class, input_shape, num_models, **kwargs)


TRANSPOSE_CASES = [
    case(FusedConv1DTranspose, (5, 3), filters=2, kernel_size=3),
    case(FusedConv1DTranspose, (5, 3), num_models=1, filters=2,
         kernel_size=3),
    case(FusedConv1DTranspose, (5, 3), filters=2, kernel_size=3, strides=2),
    case(FusedConv1DTranspose, (5, 3), filters=2, kernel_size=3, strides=2,
         padding="same", output_padding=1),
    case(FusedConv1DTranspose, (5, 3), filters=2, kernel_size=3,
         dilation_rate=2, use_bias=False),
    case(FusedConv2DTranspose, (4, 3, 3), filters=2, kernel_size=3),
    case(FusedConv2DTranspose, (4, 3, 3), filters=2, kernel_size=(3, 2),
         strides=(2, 1), padding="same"),
    case(FusedConv2DTranspose, (4, 4, 3), filters=2, kernel_size=3,
         strides=3, output_padding=(2, 1), activation="relu"),
    case(FusedConv2DTranspose, (4, 4, 3), filters=2, kernel_size=3,
         strides=2, padding="same", output_padding=0),
    case(FusedConv2DTranspose, (4, 4, 3), filters=2, kernel_size=2,
         dilation_rate=2, padding="same"),
    case(FusedConv2DTranspose, (4, 4, 3), filters=2, kernel_size=3,
         use_bias=False, activation="tanh"),
    case(FusedConv3DTranspose, (3, 3, 2, 2), filters=2, kernel_size=2),
    case(FusedConv3DTranspose, (3, 3, 2, 2), filters=2, kernel_size=3,
         strides=2, padding="same", output_padding=1),
    case(FusedConv3DTranspose, (3, 3, 2, 2), filters=2, kernel_size=2,
         dilation_rate=(2, 1, 1), use_bias=False),
]


@pytest.mark.gpu
@pytest.mark.parametrize("fused_class,input_shape,num_models,kwargs",
                         TRANSPOSE_CASES)
def test_conv_transpose_matches_stock(fused_class, input_shape, num_models,
                                      kwargs):
    check_against_stock(fused_class, input_shape, num_models, **kwargs)


DEPTHWISE_CASES = [
    case(FusedDepthwiseConv1D, (7, 3), kernel_size=3),
    case(FusedDepthwiseConv1D, (7, 3), num_models=1, kernel_size=3,
         depth_multiplier=2),
    case(FusedDepthwiseConv1D, (8, 3), kernel_size=3, depth_multiplier=2,
         strides=2, padding="same"),
    case(FusedDepthwiseConv1D, (9, 3), kernel_size=2, dilation_rate=3,
         use_bias=False, activation="relu"),
    case(FusedDepthwiseConv1D, (11, 3), kernel_size=3, strides=2,
         dilation_rate=2, padding="same"),
    case(FusedDepthwiseConv2D, (6, 5, 3), kernel_size=3),
    case(FusedDepthwiseConv2D, (6, 5, 3), kernel_size=(3, 2),
         depth_multiplier=3, strides=(2, 1), padding="same"),
    case(FusedDepthwiseConv2D, (7, 7, 3), kernel_size=3, dilation_rate=2,
         depth_multiplier=2),
    case(FusedDepthwiseConv2D, (9, 9, 2), kernel_size=3, strides=2,
         dilation_rate=2),
    case(FusedDepthwiseConv2D, (6, 6, 3), kernel_size=3, use_bias=False,
         activation="tanh"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("fused_class,input_shape,num_models,kwargs",
                         DEPTHWISE_CASES)
def test_depthwise_conv_matches_stock(fused_class, input_shape, num_models,
                                      kwargs):
    check_against_stock(fused_class, input_shape, num_models, **kwargs)


SEPARABLE_CASES = [
    case(FusedSeparableConv1D, (7, 3), filters=4, kernel_size=3),
    case(FusedSeparableConv1D, (7, 3), num_models=1, filters=4,
         kernel_size=3, depth_multiplier=2),
    case(FusedSeparableConv1D, (8, 3), filters=4, kernel_size=3,
         depth_multiplier=2, strides=2, padding="same"),
    case(FusedSeparableConv1D, (9, 3), filters=4, kernel_size=2,
         dilation_rate=3, use_bias=False, activation="relu"),
    case(FusedSeparableConv1D, (11, 3), filters=2, kernel_size=3, strides=2,
         dilation_rate=2, padding="same"),
    case(FusedSeparableConv2D, (6, 5, 3), filters=4, kernel_size=3),
    case(FusedSeparableConv2D, (6, 5, 3), filters=4, kernel_size=(3, 2),
         depth_multiplier=2, strides=(2, 1), padding="same"),
    case(FusedSeparableConv2D, (7, 7, 3), filters=4, kernel_size=3,
         dilation_rate=2, activation="tanh"),
    case(FusedSeparableConv2D, (9, 9, 2), filters=3, kernel_size=3,
         strides=2, dilation_rate=2, depth_multiplier=2),
    case(FusedSeparableConv2D, (6, 6, 3), filters=4, kernel_size=3,
         use_bias=False),
]


@pytest.mark.gpu
@pytest.mark.parametrize("fused_class,input_shape,num_models,kwargs",
                         SEPARABLE_CASES)
def test_separable_conv_matches_stock(fused_class, input_shape, num_models,
                                      kwargs):
    check_against_stock(fused_class, input_shape, num_models, **kwargs)


@pytest.mark.parametrize("fused_class,input_shape,num_models,kwargs",
                         DEPTHWISE_CASES + SEPARABLE_CASES)
def test_folded_accelerator_kernels_match_stock(
        monkeypatch, fused_class, input_shape, num_models, kwargs):
    # On a GPU or TPU, depthwise and separable convolutions fold the models
    # into the channel axis; on this CPU they run per model. The folded form
    # is a plain depthwise convolution that the CPU runs too.
    monkeypatch.setattr(base_conv, "runs_on_accelerator", lambda: True)
    check_against_stock(fused_class, input_shape, num_models, **kwargs)


@pytest.mark.backends("tensorflow", reason="counts TensorFlow's ops")
@pytest.mark.parametrize("fused_class,kwargs,op_type", [
    (FusedDepthwiseConv2D, {"kernel_size": 3}, "DepthwiseConv2dNative"),
    (FusedSeparableConv2D, {"filters": 2, "kernel_size": 3},
     "DepthwiseConv2dNative"),
])
def test_depthwise_kernels_fold_only_on_accelerators(
        monkeypatch, fused_class, kwargs, op_type):
    x = np.ones((BATCH, 3, 5, 5, 2), "float32")
    assert convolution_ops(fused_class(3, **kwargs), x, op_type) == 3
    monkeypatch.setattr(base_conv, "runs_on_accelerator", lambda: True)
    assert convolution_ops(fused_class(3, **kwargs), x, op_type) == 1


# -- Kernels: grouped under XLA, the "auto" choice on CPU. ------------------


def jit_outputs_and_gradients(layer, x, cotangent):
    """Output and gradients (input, then trainable weights) of
    `sum(layer(x) * cotangent)`, computed inside one XLA-compiled step
    (on JAX, where XLA compiles every op, op by op; a whole step under
    `jax.jit`: test_stateless_jit.py)."""
    if BACKEND != "tensorflow":
        (y,), (dx,), dw = layer_outputs_and_gradients(layer, [x], [cotangent])
        return y, [dx, *dw]
    import tensorflow as tf

    @tf.function(jit_compile=True)
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x)
            scalar = tf.reduce_sum(y * cotangent)
        return y, tape.gradient(scalar, [x, *layer.trainable_weights])
    y, grads = step(tf.constant(x))
    return np.asarray(y), [np.asarray(g) for g in grads]


XLA_CASES = [
    case(FusedConv1D, (7, 4), filters=3, kernel_size=3, padding="causal",
         dilation_rate=2),
    case(FusedConv2D, (6, 5, 4), filters=6, kernel_size=3, groups=2,
         strides=2, padding="same"),
    case(FusedConv3D, (4, 4, 3, 2), filters=3, kernel_size=2),
    case(FusedConv1DTranspose, (5, 3), filters=2, kernel_size=3,
         dilation_rate=2),
    case(FusedConv2DTranspose, (4, 3, 3), filters=2, kernel_size=3,
         strides=2, padding="same", output_padding=1),
    case(FusedConv3DTranspose, (3, 2, 2, 2), filters=2, kernel_size=2,
         strides=2),
]


@pytest.mark.parametrize("fused_class,input_shape,num_models,kwargs",
                         XLA_CASES)
def test_grouped_kernel_under_xla_matches_per_model(
        fused_class, input_shape, num_models, kwargs):
    rng = np.random.default_rng(1)
    stock, grouped = twins(fused_class, input_shape, rng, num_models,
                           "grouped", **kwargs)
    per_model = fused_class(num_models, implementation="per_model", **kwargs)
    per_model.build((None, num_models, *input_shape))
    per_model.set_weights(grouped.get_weights())
    x = fused_input(rng, input_shape, num_models)
    cotangent = rng.standard_normal(
        per_model.compute_output_shape(x.shape)).astype("float32")
    y, dx, dw = layer_outputs_and_gradients(per_model, [x], [cotangent])
    y_xla, (dx_xla, *dw_xla) = jit_outputs_and_gradients(
        grouped, x, cotangent)
    assert_close(y_xla, y[0], err_msg="output")
    assert_close(dx_xla, dx[0], err_msg="input gradient")
    for got, expected, weight in zip(dw_xla, dw, per_model.weights):
        assert_close(got, expected, err_msg=f"gradient of {weight.name}")
    # And the per-model kernel is stock, slice by slice.
    for b, layer in enumerate(stock):
        assert_close(y[0][:, b], layer(x[:, b]), err_msg=f"model {b}")


DEFAULT_XLA_CASES = [
    case(FusedConv2D, (5, 5, 3), filters=4, kernel_size=3),
    case(FusedConv2DTranspose, (4, 3, 3), filters=2, kernel_size=3,
         strides=2),
    case(FusedDepthwiseConv2D, (5, 5, 3), kernel_size=3,
         depth_multiplier=2),
    case(FusedSeparableConv1D, (7, 3), filters=4, kernel_size=3,
         depth_multiplier=2),
]


@pytest.mark.parametrize("fused_class,input_shape,num_models,kwargs",
                         DEFAULT_XLA_CASES)
def test_default_kernel_under_xla_matches_stock(
        fused_class, input_shape, num_models, kwargs):
    rng = np.random.default_rng(2)
    stock, fused = twins(fused_class, input_shape, rng, num_models, **kwargs)
    x = fused_input(rng, input_shape, num_models)
    cotangent = rng.standard_normal(
        fused.compute_output_shape(x.shape)).astype("float32")
    y, (dx, *dw) = jit_outputs_and_gradients(fused, x, cotangent)
    for b, layer in enumerate(stock):
        (y_b,), (dx_b,), dw_b = layer_outputs_and_gradients(
            layer, [x[:, b]], [cotangent[:, b]])
        assert_close(y[:, b], y_b, err_msg=f"output of model {b}")
        assert_close(dx[:, b], dx_b, err_msg=f"input gradient of model {b}")
        for got, expected in zip(dw, dw_b):
            assert_close(got[b], expected, err_msg=f"weight gradient {b}")


def convolution_ops(layer, x, op_type):
    """The number of `op_type` ops in the graph of `layer(x)` traced by a
    plain (non-XLA) `tf.function`, outside nested functions."""
    import tensorflow as tf

    graph = tf.function(layer).get_concrete_function(
        tf.TensorSpec(x.shape)).graph
    return sum(op.type == op_type for op in graph.get_operations())


# The auto rule's cases: a layer, its arguments, and its convolution op.
AUTO_RULE_CASES = [
    (FusedConv2D, {"filters": 2, "kernel_size": 3}, "Conv2D"),
    (FusedConv2DTranspose, {"filters": 2, "kernel_size": 3, "strides": 2},
     "Conv2DBackpropInput"),
]


@pytest.mark.backends("tensorflow", reason="counts TensorFlow's ops")
@pytest.mark.parametrize("fused_class,kwargs,op_type", AUTO_RULE_CASES)
def test_auto_uses_per_model_kernels_on_cpu(fused_class, kwargs, op_type):
    import tensorflow as tf

    x = np.ones((BATCH, 3, 5, 5, 2), "float32")
    assert not runs_on_accelerator()
    auto = fused_class(3, **kwargs)
    grouped = fused_class(3, implementation="grouped", **kwargs)
    assert auto.implementation == "auto"
    # Per-model: three convolutions in the graph; grouped: one, inside the
    # nested XLA function.
    assert convolution_ops(auto, x, op_type) == 3
    assert convolution_ops(grouped, x, op_type) == 0
    # Gradients on CPU in plain graph mode, where TensorFlow's CPU kernels
    # cannot differentiate a grouped convolution.
    @tf.function
    def gradients(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            scalar = tf.reduce_sum(tf.square(auto(x)))
        return tape.gradient(scalar, [x, *auto.weights])
    assert all(np.all(np.isfinite(g)) for g in gradients(tf.constant(x)))


@pytest.mark.gpu
@pytest.mark.backends("tensorflow", reason="counts TensorFlow's ops")
@pytest.mark.parametrize("fused_class,kwargs,op_type", AUTO_RULE_CASES)
def test_auto_uses_grouped_kernels_on_gpu(fused_class, kwargs, op_type):
    if not runs_on_accelerator():
        pytest.skip("needs a GPU (HFTATF_TEST_GPU=1)")
    x = np.ones((BATCH, 3, 5, 5, 2), "float32")
    auto = fused_class(3, **kwargs)
    per_model = fused_class(3, implementation="per_model", **kwargs)
    # Grouped: one convolution, inside the nested XLA function; per model:
    # three in the graph.
    assert convolution_ops(auto, x, op_type) == 0
    assert convolution_ops(per_model, x, op_type) == 3
    per_model.set_weights(auto.get_weights())
    assert_close(auto(x), per_model(x))


@pytest.mark.backends("tensorflow",
                      reason="TensorFlow's placement: scopes, strategies")
def test_auto_rule_reads_the_placement(monkeypatch):
    import tensorflow as tf

    traced = {}

    def trace(name):
        traced[name] = runs_on_accelerator()

    trace("eager")
    tf.function(lambda: trace("graph")).get_concrete_function()
    tf.function(lambda: trace("xla"), jit_compile=True).get_concrete_function()
    with tf.distribute.MirroredStrategy(["/cpu:0"]).scope():
        trace("strategy")
    assert traced == {"eager": False, "graph": False, "xla": False,
                      "strategy": False}

    # On a machine that shows a GPU, a graph traced outside any device scope
    # is placed on it, and one traced in a CPU scope is not.
    real = tf.config.list_logical_devices
    monkeypatch.setattr(
        tf.config, "list_logical_devices",
        lambda kind=None: ["GPU:0"] if kind == "GPU" else real(kind))

    def scoped(device):
        def function():
            with tf.device(device):
                trace(device)
        return function

    tf.function(lambda: trace("graph")).get_concrete_function()
    tf.function(scoped("/CPU:0")).get_concrete_function()
    tf.function(scoped("/GPU:0")).get_concrete_function()
    trace("eager")  # Eager ops report where they ran: on this CPU.
    assert traced["graph"] and traced["/GPU:0"]
    assert not traced["/CPU:0"] and not traced["eager"]


@pytest.mark.backends("tensorflow", reason="ops added to TensorFlow's graphs")
def test_auto_rule_places_nothing_on_a_machine_without_accelerators():
    import tensorflow as tf

    # Eager layer calls ask on every call: without a GPU or TPU to tell
    # apart, the rule adds no op to find out.
    def trace():
        graph = tf.compat.v1.get_default_graph()
        before = len(graph.get_operations())
        assert not runs_on_accelerator()
        assert len(graph.get_operations()) == before

    tf.function(trace).get_concrete_function()


# -- Initialisation: every slice is a separate stock kernel. ----------------


INIT_CASES = [
    (FusedConv2D, {"filters": 8, "kernel_size": 3}, (6, 6, 4),
     {"kernel": "kernel_initializer"}),
    (FusedConv1D, {"filters": 8, "kernel_size": 3, "groups": 2}, (6, 4),
     {"kernel": "kernel_initializer"}),
    (FusedConv2DTranspose, {"filters": 6, "kernel_size": 3}, (4, 4, 5),
     {"kernel": "kernel_initializer"}),
    (FusedDepthwiseConv2D, {"kernel_size": 3, "depth_multiplier": 4},
     (6, 6, 8), {"kernel": "depthwise_initializer"}),
    (FusedSeparableConv2D, {"filters": 8, "kernel_size": 3,
                            "depth_multiplier": 2}, (6, 6, 8),
     {"depthwise_kernel": "depthwise_initializer",
      "pointwise_kernel": "pointwise_initializer"}),
]


@pytest.mark.parametrize("initializer", ["he_normal", "glorot_uniform"])
@pytest.mark.parametrize(
    "fused_class,kwargs,input_shape,initializer_args", INIT_CASES,
    ids=[c[0].__name__ for c in INIT_CASES])
def test_kernel_slices_are_independent_stock_draws(
        fused_class, kwargs, input_shape, initializer_args, initializer):
    num_models = 8
    kwargs = {**kwargs, **{arg: initializer
                           for arg in initializer_args.values()}}
    fused = fused_class(num_models, **kwargs)
    fused.build((None, num_models, *input_shape))
    stock = []
    for _ in range(num_models):
        layer = STOCK[fused_class](**kwargs)
        layer.build((None, *input_shape))
        stock.append(layer)
    for name in initializer_args:
        kernel = np.asarray(getattr(fused, name))
        stock_kernel = np.stack([np.asarray(getattr(layer, name))
                                 for layer in stock])
        for b in range(num_models):
            for c in range(b):
                assert not np.array_equal(kernel[b], kernel[c]), (name, b, c)
        # Fans counting B would shrink the variance B = 8 times.
        ratio = np.var(kernel) / np.var(stock_kernel)
        assert abs(ratio - 1.0) < moment_tolerance(kernel, stock_kernel), (
            name, ratio)
        for b in range(num_models):
            ratio = np.var(kernel[b]) / np.var(stock_kernel)
            assert abs(ratio - 1.0) < moment_tolerance(
                kernel[b], stock_kernel), (name, b, ratio)


def test_glorot_slices_use_the_stock_fans():
    num_models, kernel_size, channels, filters = 8, 3, 4, 6
    fused = FusedConv2D(num_models, filters, kernel_size)
    fused.build((None, num_models, 5, 5, channels))
    kernel = np.asarray(fused.kernel)
    # Glorot: U(-limit, limit) with the fans of the stock [3, 3, 4, 6]
    # kernel, receptive field included.
    area = kernel_size * kernel_size
    limit = np.sqrt(6.0 / (area * channels + area * filters))
    for b in range(num_models):
        assert np.abs(kernel[b]).max() <= limit
        assert np.abs(kernel[b]).max() > limit / np.sqrt(num_models)


def test_seeded_slice_zero_equals_stock():
    init = {"kernel_initializer": keras.initializers.HeUniform(seed=7),
            "bias_initializer": keras.initializers.RandomNormal(seed=9)}
    fused = FusedConv2D(3, 4, 3, **init)
    fused.build((None, 3, 5, 5, 2))
    stock = keras.layers.Conv2D(4, 3, **init)
    stock.build((None, 5, 5, 2))
    for got, expected in zip(fused.get_model_weights(0), stock.get_weights()):
        np.testing.assert_array_equal(got, expected)


# -- Regularizers and constraints, per model slice. -------------------------


@pytest.mark.parametrize("fused_class,kwargs,input_shape", [
    (FusedConv2D, {"filters": 3, "kernel_size": 2,
                   "kernel_regularizer": keras.regularizers.L2(0.01),
                   "bias_regularizer": keras.regularizers.L1(0.02),
                   "activity_regularizer": keras.regularizers.L2(0.03)},
     (4, 4, 2)),
    (FusedConv1DTranspose, {"filters": 3, "kernel_size": 2,
                            "kernel_regularizer": keras.regularizers.L1(0.01),
                            "activity_regularizer": keras.regularizers.L1(
                                0.03)}, (4, 2)),
    (FusedSeparableConv1D, {
        "filters": 3, "kernel_size": 2,
        "depthwise_regularizer": keras.regularizers.L2(0.01),
        "pointwise_regularizer": keras.regularizers.L1(0.02),
        "bias_regularizer": keras.regularizers.L2(0.04)}, (5, 2)),
    (FusedDepthwiseConv1D, {
        "kernel_size": 2,
        "depthwise_regularizer": keras.regularizers.L2(0.01),
        "activity_regularizer": keras.regularizers.L2(0.02)}, (5, 2)),
], ids=["Conv2D", "Conv1DTranspose", "SeparableConv1D", "DepthwiseConv1D"])
def test_regularizers_give_per_model_losses(fused_class, kwargs,
                                            input_shape):
    rng = np.random.default_rng(3)
    stock, fused = twins(fused_class, input_shape, rng, **kwargs)
    x = fused_input(rng, input_shape)
    fused(x)
    losses = np.stack([np.asarray(loss) for loss in fused.losses])
    assert losses.shape == (len(stock[0].losses) + (
        "activity_regularizer" in kwargs), 3)
    for b, layer in enumerate(stock):
        layer(x[:, b])
        assert_close(losses[:, b], [np.asarray(loss) for loss in layer.losses],
                     err_msg=f"model {b}")


def test_constraints_apply_per_slice():
    rng = np.random.default_rng(4)
    kwargs = {"depthwise_constraint": keras.constraints.MaxNorm(1.0, axis=0),
              "pointwise_constraint": keras.constraints.UnitNorm(axis=-2),
              "bias_constraint": keras.constraints.NonNeg()}
    stock, fused = twins(FusedSeparableConv2D, (4, 4, 3), rng, filters=2,
                         kernel_size=2, **kwargs)
    for weight, weights in zip(fused.weights, zip(*(s.weights
                                                     for s in stock))):
        constrained = np.asarray(weight.constraint(weight))
        for b, stock_weight in enumerate(weights):
            assert_close(constrained[b],
                         stock_weight.constraint(stock_weight),
                         err_msg=f"{weight.name}, model {b}")


# -- Mixed precision. -------------------------------------------------------


@pytest.fixture
def bfloat16_policy():
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    yield
    keras.mixed_precision.set_global_policy("float32")


@pytest.mark.parametrize("fused_class,kwargs,input_shape,implementation", [
    (FusedConv2D, {"filters": 4, "kernel_size": 3}, (5, 5, 3), "per_model"),
    (FusedConv2D, {"filters": 4, "kernel_size": 3, "groups": 1}, (5, 5, 3),
     "grouped"),
    (FusedConv1DTranspose, {"filters": 3, "kernel_size": 3, "strides": 2},
     (4, 3), "per_model"),
    (FusedDepthwiseConv2D, {"kernel_size": 3, "depth_multiplier": 2},
     (5, 5, 3), None),
    (FusedSeparableConv2D, {"filters": 4, "kernel_size": 3}, (5, 5, 3),
     None),
], ids=["Conv2D", "Conv2D-grouped", "Conv1DTranspose", "DepthwiseConv2D",
        "SeparableConv2D"])
def test_mixed_bfloat16_matches_stock_under_the_same_policy(
        bfloat16_policy, fused_class, kwargs, input_shape, implementation):
    rng = np.random.default_rng(5)
    stock, fused = twins(fused_class, input_shape, rng, num_models=2,
                         implementation=implementation, **kwargs)
    assert fused.compute_dtype == "bfloat16"
    assert {w.dtype for w in fused.weights} == {"float32"}
    x = fused_input(rng, input_shape, num_models=2)
    assert fused(x).dtype == "bfloat16"
    # bfloat16 keeps 8 significant bits (spacing 2**-8 relative): a sum
    # rounded to bfloat16 in another order (the bias gradient: a broadcast
    # add's reduction here, BiasAddGrad in stock) moves by a few units of
    # that spacing; measured at most 0.0625 on values of size ~6. A wrong
    # weight, model or channel order moves values by their own size (1-30).
    compare_layer_with_stock(stock, fused, [x], rng, atol=0.1, rtol=2e-2)


# -- hftatf.fuse of a small CNN. --------------------------------------------


def small_cnn(seed):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([
        keras.Input((10, 10, 3)),
        keras.layers.Conv2D(4, 3, activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.DepthwiseConv2D(3, depth_multiplier=2, padding="same"),
        keras.layers.SeparableConv2D(5, 3, padding="same",
                                     activation="relu"),
        keras.layers.Conv2DTranspose(3, 3, strides=2, padding="same"),
        keras.layers.GlobalAveragePooling2D(),
        keras.layers.Dense(2),
    ])
    rng = np.random.default_rng(seed)
    for layer in model.layers:
        if layer.weights:
            randomize_weights(layer, rng, scale=0.5)
    return model


@pytest.mark.gpu
def test_fuse_models_of_a_small_cnn_matches_each_model():
    models = [small_cnn(seed) for seed in range(3)]
    array = hftatf.fuse_models(models)
    assert [type(layer).__name__ for layer in array.layers
            if layer.weights] == [
        "FusedConv2D", "FusedDepthwiseConv2D", "FusedSeparableConv2D",
        "FusedConv2DTranspose", "FusedDense"]
    x = np.random.default_rng(6).standard_normal(
        (4, 10, 10, 3)).astype("float32")
    y = np.asarray(array(x))
    assert y.shape == (4, 3, 2)
    for b, model in enumerate(models):
        assert_close(y[:, b], model(x), err_msg=f"model {b}")
    # The gradient of the models' summed losses: slice b of every weight's
    # gradient must be model b's own (no model reaches another's loss).
    def squares(model):
        def loss(x):
            outputs = model(x)
            return outputs, keras.ops.sum(keras.ops.square(outputs))
        return loss

    _, _, fused_grads = value_and_gradients(
        squares(array), [x], array.trainable_weights)
    for b, model in enumerate(models):
        _, _, model_grads = value_and_gradients(
            squares(model), [x], model.trainable_weights)
        for got, expected in zip(fused_grads, model_grads):
            assert_close(np.asarray(got)[b], expected,
                         err_msg=f"model {b}")


# -- API: signatures, registry, serialization. ------------------------------


@pytest.mark.parametrize("fused_class", list(STOCK), ids=lambda c: c.__name__)
def test_signature_is_the_stock_one_plus_num_models(fused_class):
    def parameters(function):
        return [(p.name, p.default) for p in
                inspect.signature(function).parameters.values()]
    stock = parameters(STOCK[fused_class].__init__)
    expected = [stock[0], ("num_models", inspect.Parameter.empty),
                *stock[1:-1]]
    if fused_class in WITH_IMPLEMENTATION:
        expected.append(("implementation", "auto"))
    expected.append(stock[-1])
    assert parameters(fused_class.__init__) == expected


@pytest.mark.parametrize("fused_class", list(STOCK), ids=lambda c: c.__name__)
def test_registry_maps_stock_to_fused(fused_class):
    assert resolve.fused_form(STOCK[fused_class](
        **({"kernel_size": 2} if "Depthwise" in fused_class.__name__ else
           {"filters": 2, "kernel_size": 2}))) is fused_class


CONFIGURED = [
    (FusedConv1D, dict(filters=4, kernel_size=3, strides=2, padding="causal",
                       groups=2, activation="relu", use_bias=False,
                       implementation="grouped"), (8, 4)),
    (FusedConv2D, dict(filters=4, kernel_size=(3, 2), padding="same",
                       dilation_rate=(2, 1),
                       kernel_initializer=keras.initializers.HeNormal(seed=3),
                       bias_initializer="ones",
                       kernel_regularizer=keras.regularizers.L2(0.01),
                       bias_regularizer=keras.regularizers.L1(0.02),
                       activity_regularizer=keras.regularizers.L1(0.03),
                       kernel_constraint=keras.constraints.MaxNorm(2.0),
                       bias_constraint=keras.constraints.NonNeg(),
                       implementation="per_model"), (5, 5, 2)),
    (FusedConv3D, dict(filters=2, kernel_size=2, strides=(1, 2, 1)),
     (3, 4, 3, 2)),
    (FusedConv1DTranspose, dict(filters=2, kernel_size=3, strides=2,
                                output_padding=1, activation="tanh"),
     (4, 3)),
    (FusedConv2DTranspose, dict(filters=2, kernel_size=3, dilation_rate=2,
                                padding="same", implementation="grouped"),
     (4, 4, 3)),
    (FusedConv3DTranspose, dict(filters=2, kernel_size=2, strides=2,
                                output_padding=(1, 0, 1)), (2, 2, 2, 1)),
    (FusedDepthwiseConv1D, dict(kernel_size=3, depth_multiplier=2,
                                strides=2, padding="same",
                                depthwise_regularizer="l2"), (6, 3)),
    (FusedDepthwiseConv2D, dict(kernel_size=3, depth_multiplier=3,
                                dilation_rate=2, use_bias=False), (6, 6, 2)),
    (FusedSeparableConv1D, dict(filters=3, kernel_size=2, depth_multiplier=2,
                                pointwise_initializer="he_normal",
                                pointwise_constraint="non_neg"), (5, 2)),
    (FusedSeparableConv2D, dict(filters=3, kernel_size=2, strides=2,
                                activation="relu",
                                pointwise_regularizer="l1"), (5, 5, 2)),
]


@pytest.mark.parametrize("fused_class,kwargs,input_shape", CONFIGURED,
                         ids=[c[0].__name__ for c in CONFIGURED])
def test_config_round_trip(fused_class, kwargs, input_shape):
    layer = fused_class(2, name="fused_under_test", **kwargs)
    config = layer.get_config()
    assert config["num_models"] == 2
    assert config["data_format"] == "channels_last"
    if fused_class in WITH_IMPLEMENTATION:
        assert config["implementation"] == kwargs.get(
            "implementation", "auto")
    clone = fused_class.from_config(config)
    assert clone.get_config() == config
    restored = keras.saving.deserialize_keras_object(
        keras.saving.serialize_keras_object(layer))
    assert type(restored) is fused_class
    assert restored.get_config() == config
    # The stock layer's config is the fused one's, less the array's keys.
    stock_kwargs = {k: v for k, v in kwargs.items() if k != "implementation"}
    stock = STOCK[fused_class](name="fused_under_test", **stock_kwargs)
    from_stock = fused_class.from_stock(stock, 2)
    assert {k: v for k, v in config.items()
            if k not in ("num_models", "implementation", "shared_input")} == {
        k: v for k, v in stock.get_config().items()}
    if "implementation" not in kwargs:
        assert from_stock.get_config() == config
    # Same weights, same outputs (through `call`: the activity regularizer
    # is tested apart).
    layer.build((None, 2, *input_shape))
    clone.build((None, 2, *input_shape))
    clone.set_weights(layer.get_weights())
    x = fused_input(np.random.default_rng(7), input_shape, num_models=2)
    assert_close(clone.call(x), layer.call(x))


def test_saved_model_file_round_trip(tmp_path):
    rng = np.random.default_rng(8)
    inputs = keras.Input((2, 6, 6, 3))
    hidden = FusedConv2D(2, 4, 3, activation="relu")(inputs)
    hidden = FusedDepthwiseConv2D(2, 3, padding="same")(hidden)
    hidden = FusedSeparableConv2D(2, 3, 2)(hidden)
    outputs = FusedConv2DTranspose(2, 2, 3, strides=2,
                                   implementation="per_model")(hidden)
    model = keras.Model(inputs, outputs)
    for weight in model.weights:
        weight.assign(rng.standard_normal(weight.shape).astype("float32"))
    path = tmp_path / "fused_cnn.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert [type(layer) for layer in loaded.layers] == [
        type(layer) for layer in model.layers]
    x = fused_input(rng, (6, 6, 3), num_models=2)
    np.testing.assert_array_equal(loaded(x), model(x))


# -- Bad input. -------------------------------------------------------------


def minimal_kwargs(fused_class):
    if fused_class in (FusedDepthwiseConv1D, FusedDepthwiseConv2D):
        return {"kernel_size": 2}
    return {"filters": 2, "kernel_size": 2}


@pytest.mark.parametrize("fused_class", list(STOCK), ids=lambda c: c.__name__)
def test_rejects_channels_first(fused_class):
    with pytest.raises(ValueError, match="channels_last.*channels_first"):
        fused_class(2, data_format="channels_first",
                    **minimal_kwargs(fused_class))


@pytest.fixture
def channels_first_default():
    keras.config.set_image_data_format("channels_first")
    yield
    keras.config.set_image_data_format("channels_last")


def test_rejects_none_data_format_resolving_to_channels_first(
        channels_first_default):
    with pytest.raises(ValueError, match="image_data_format.*channels_first"):
        FusedConv2D(2, 2, 2)
    stock = keras.layers.Conv2D(2, 2)
    assert stock.data_format == "channels_first"
    with pytest.raises(ValueError, match="channels_last"):
        FusedConv2D.from_stock(stock, 2)


def test_accepts_none_data_format_resolving_to_channels_last():
    assert FusedConv2D(2, 2, 2, data_format=None).data_format == (
        "channels_last")


@pytest.mark.parametrize("fused_class", [FusedConv2D, FusedConv1DTranspose,
                                         FusedDepthwiseConv2D,
                                         FusedSeparableConv1D],
                         ids=lambda c: c.__name__)
def test_rejects_wrong_model_axis(fused_class):
    layer = fused_class(3, **minimal_kwargs(fused_class))
    rank = layer.rank
    with pytest.raises(ValueError, match="num_models=3 on axis 1"):
        layer(np.zeros((BATCH, 4, *(4,) * rank, 2), "float32"))
    # A stock-shaped input (no model axis) is one axis short.
    with pytest.raises(ValueError, match=r"\[batch, num_models, "):
        layer(np.zeros((BATCH, 3, *(4,) * rank), "float32"))
    layer(np.zeros((BATCH, 3, *(4,) * rank, 2), "float32"))
    with pytest.raises(ValueError, match="axis 1"):
        layer(np.zeros((BATCH, 4, *(4,) * rank, 2), "float32"))
    with pytest.raises(ValueError):
        layer(np.zeros((BATCH, 3, *(4,) * rank, 3), "float32"))


def test_rejects_unknown_implementation():
    with pytest.raises(ValueError, match="'auto', 'grouped', 'per_model'"):
        FusedConv2D(2, 2, 2, implementation="fast")
    with pytest.raises(ValueError, match="implementation='cudnn'"):
        FusedConv2DTranspose(2, 2, 2, implementation="cudnn")


def test_rejects_lora_where_the_stock_layer_has_none():
    with pytest.raises(ValueError, match="lora_rank"):
        FusedConv2DTranspose(2, 2, 2, lora_rank=4)


def test_rejects_explicit_padding_list():
    with pytest.raises(ValueError, match="ZeroPadding"):
        FusedConv2D(2, 2, 2, padding=[[1, 1], [1, 1]])


@pytest.mark.parametrize("fused_class,kwargs", [
    (FusedConv2D, {"filters": 2, "kernel_size": 2, "padding": "causal"}),
    (FusedConv1D, {"filters": 0, "kernel_size": 2}),
    (FusedConv1D, {"filters": 3, "kernel_size": 2, "groups": 2}),
    (FusedConv1D, {"filters": 2, "kernel_size": 2, "groups": 0}),
    (FusedConv2D, {"filters": 2, "kernel_size": 0}),
    (FusedConv2D, {"filters": 2, "kernel_size": 2, "strides": 0}),
    (FusedConv2D, {"filters": 2, "kernel_size": (2, 2, 2)}),
    (FusedConv2D, {"filters": 2, "kernel_size": 2, "strides": 2,
                   "dilation_rate": 2}),
    (FusedConv1DTranspose, {"filters": 2, "kernel_size": 2, "strides": 2,
                            "output_padding": 2}),
    (FusedConv2DTranspose, {"filters": 2, "kernel_size": 2,
                            "padding": "causal"}),
    (FusedConv2DTranspose, {"filters": 2, "kernel_size": 2, "strides": 2,
                            "dilation_rate": 2}),
    (FusedDepthwiseConv1D, {"kernel_size": 2, "padding": "causal"}),
    (FusedDepthwiseConv2D, {"kernel_size": 2, "depth_multiplier": 0}),
    (FusedSeparableConv2D, {"filters": -1, "kernel_size": 2}),
    (FusedSeparableConv1D, {"filters": 2, "kernel_size": 2,
                            "padding": "full"}),
])
def test_rejects_what_stock_rejects(fused_class, kwargs):
    with pytest.raises(ValueError):
        STOCK[fused_class](**kwargs)
    with pytest.raises(ValueError):
        fused_class(2, **kwargs)


@pytest.mark.parametrize("fused_class,kwargs,input_shape", [
    (FusedConv2D, {"filters": 4, "kernel_size": 2, "groups": 2}, (4, 4, 3)),
    (FusedConv1D, {"filters": 2, "kernel_size": 5}, (3, 2)),
    (FusedDepthwiseConv2D, {"kernel_size": 5}, (3, 3, 2)),
])
def test_build_rejects_what_stock_rejects(fused_class, kwargs, input_shape):
    with pytest.raises(ValueError):
        STOCK[fused_class](**kwargs).build((None, *input_shape))
    with pytest.raises(ValueError):
        fused_class(2, **kwargs).build((None, 2, *input_shape))


def _biased_convolutions():
    """Per-model convolutions with biases whose outputs go to a layer that
    reads them stacked: the models' output gradients come out of one
    unstack."""
    inputs = keras.Input((7, 7, 2))
    x = keras.layers.Conv2D(5, 3, padding="same")(inputs)
    x = keras.layers.LayerNormalization()(x)
    x = keras.layers.Conv2D(5, 3, padding="same")(x)
    x = keras.layers.LayerNormalization()(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, keras.layers.Dense(3)(x))


@pytest.mark.backends("tensorflow", reason="TensorFlow's CPU graph optimizer")
@pytest.mark.parametrize("layout", ["models_first", "batch_first"])
def test_each_model_bias_gets_its_own_gradient_in_graphs(layout):
    import tensorflow as tf

    # TensorFlow's CPU graph optimizer fused a BiasAdd's gradient into a
    # filter gradient reading the same unstack, sometimes another model's:
    # in about one graph in six. Forty graphs, each optimized on its own.
    rng = np.random.default_rng(6)
    x = rng.standard_normal((BATCH, 7, 7, 2)).astype("float32")
    y = rng.standard_normal((BATCH, 3, 3)).astype("float32")
    keras.utils.set_random_seed(6)
    array = hftatf.fuse(_biased_convolutions(), 3, layout=layout)

    def gradients(x, y):
        with tf.GradientTape() as tape:
            outputs = array(x, training=True)
            loss = tf.reduce_sum(tf.square(outputs - y))
        return tape.gradient(loss, array.trainable_variables)

    expected = gradients(x, y)  # eager: no graph optimizer
    for _ in range(40):
        for value, eager in zip(tf.function(gradients)(x, y), expected):
            assert_close(value, eager, rtol=1e-4, atol=1e-5)
