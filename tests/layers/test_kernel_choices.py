"""Every formulation a fused layer may choose computes the stock layer.

Fused layers pick their computation by speed: per shape (`FusedDense` on
inputs with positions takes a broadcasting matmul or a models-first one;
`FusedEinsumDense` takes the dense products where its equation is a
matmul, an einsum with a model axis where it is not), under XLA
or not, per device (convolutions per model on a CPU, folded into the
channel axis on a GPU or TPU), and for one model (the stock product).
Small batched products run on TensorFlow's Eigen kernel on a CPU
(`kernels.batch_matmul`), checked against `tf.linalg.matmul`. Each
choice is checked here against B stock layers, in its own conditions:
eagerly, inside `tf.function(jit_compile=True)`, and with the accelerator
rule forced on a CPU.
"""

import keras
import numpy as np
import pytest

pytestmark = pytest.mark.backends(
    "tensorflow", reason="TensorFlow's kernel choices, graphs and XLA")
tf = pytest.importorskip("tensorflow")

from testing import (  # noqa: E402
    BATCHED_MATMULS,
    compare_layer_with_stock,
    optimized_transposes,
    randomize_weights,
    stacked_weights,
)

from hftatf.core import devices  # noqa: E402
from hftatf.layers import (  # noqa: E402
    FusedBatchNormalization,
    FusedConv2D,
    FusedDense,
    FusedDepthwiseConv2D,
    FusedEinsumDense,
    FusedGroupQueryAttention,
    FusedLayerNormalization,
    FusedMultiHeadAttention,
    FusedSeparableConv2D,
    dense,
)
from hftatf.layers import kernels as layer_kernels  # noqa: E402
from hftatf.layers.backends import tensorflow_ops  # noqa: E402
from hftatf.layers.convolutional import base_conv  # noqa: E402

BATCH = 4


class UnderXLA:
    """Calls `layer` inside `tf.function(jit_compile=True)` (a fresh trace
    per argument structure), as Keras runs a model compiled with XLA; a
    symbolic call (on `keras.KerasTensor`s, for output shapes) and every
    other attribute are the layer's."""

    def __init__(self, layer):
        self.layer = layer
        self.compiled = tf.function(layer, jit_compile=True)

    def __call__(self, *args, **kwargs):
        if any(isinstance(a, keras.KerasTensor) for a in args):
            return self.layer(*args, **kwargs)
        return self.compiled(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.layer, name)


def twins(stock_class, fused_class, per_model_shape, num_models, rng,
          **kwargs):
    """B stock layers with random weights and the fused layer holding them."""
    stock = []
    for _ in range(num_models):
        layer = stock_class(**kwargs)
        layer.build((BATCH, *per_model_shape))
        randomize_weights(layer, rng)
        stock.append(layer)
    fused = fused_class(num_models, **kwargs)
    fused.build((BATCH, num_models, *per_model_shape))
    fused.set_weights(stacked_weights(stock))
    return stock, fused


def check(stock, fused, per_model_shape, xla, rng, **call_kwargs):
    x = rng.standard_normal(
        (BATCH, len(stock), *per_model_shape)).astype("float32")
    compare_layer_with_stock(stock, UnderXLA(fused) if xla else fused, [x],
                             rng, **call_kwargs)


# -- FusedDense --------------------------------------------------------------

# (per-model input shape, units): without XLA, inputs with positions take
# the broadcasting matmul if `in * out <= S * (in + out)`, a models-first
# batched matmul otherwise; under XLA, an einsum (vectors) or a models-first
# batched matmul.
DENSE_CASES = {
    "vector": ((5,), 3),
    "positions-matmul": ((16, 3), 4),
    "positions-models-first": ((2, 8), 8),
    "rank4": ((3, 2, 6), 5),
}


@pytest.mark.parametrize("case", sorted(DENSE_CASES))
@pytest.mark.parametrize("num_models", [1, 3])
@pytest.mark.parametrize("xla", [False, True], ids=["eager", "xla"])
def test_dense_formulations_match_stock(case, num_models, xla):
    shape, units = DENSE_CASES[case]
    rng = np.random.default_rng(0)
    stock, fused = twins(keras.layers.Dense, FusedDense, shape, num_models,
                         rng, units=units, activation="tanh")
    check(stock, fused, shape, xla, rng)


# Under XLA, EinsumDense computes with the models first (the input's first
# two axes swapped): (equation, output shape, bias axes, per-model shape).
EINSUM_CASES = {
    "projection": ("abc,cde->abde", (5, 2, 4), "de", (5, 6)),
    "combine": ("abde,dec->abc", (5, 6), "c", (5, 2, 4)),
    "vector": ("ab,bc->ac", 4, "c", (6,)),
    "ellipsis": ("...b,bc->...c", 4, None, (3, 6)),
    # Kernels large for their positions: products with the models first,
    # the bias summed by rows, or (bias on one of two axes) as it is.
    "projection-models-first": ("abc,cde->abde", (2, 4, 4), "de", (2, 6)),
    "partial-bias-models-first": ("abc,cde->abde", (2, 4, 4), "d", (2, 6)),
    "combine-models-first": ("abde,dec->abc", (2, 16), "c", (2, 4, 4)),
    # Not a matmul of trailing axes: an einsum with a model axis.
    "transposed": ("abc,bd->adc", (4, 6), "d", (5, 6)),
}


@pytest.mark.parametrize("case", sorted(EINSUM_CASES))
@pytest.mark.parametrize("xla", [False, True], ids=["eager", "xla"])
def test_einsum_dense_formulations_match_stock(case, xla):
    equation, output_shape, bias_axes, shape = EINSUM_CASES[case]
    rng = np.random.default_rng(0)
    stock, fused = twins(keras.layers.EinsumDense, FusedEinsumDense, shape, 3,
                         rng, equation=equation, output_shape=output_shape,
                         bias_axes=bias_axes)
    check(stock, fused, shape, xla, rng)


def test_models_first_equation():
    assert dense._models_first("afbc,fcde->afbde") == "fabc,fcde->fabde"


def test_dense_rule_follows_the_sizes():
    op_types = []
    for shape, kernel_shape in (((BATCH, 2, 16, 3), (2, 3, 4)),
                                ((BATCH, 2, 2, 8), (2, 8, 8))):
        graph = tf.function(lambda x, k: dense.per_model_matmul(x, k))
        concrete = graph.get_concrete_function(
            tf.TensorSpec(shape), tf.TensorSpec(kernel_shape))
        op_types.append({op.type for op in concrete.graph.get_operations()})
    # Many positions: one broadcasting batched matmul, no copies.
    assert "BatchMatMulV2" in op_types[0] and "Unpack" not in op_types[0]
    # Few: the models moved first, one batched matmul between transposes.
    assert BATCHED_MATMULS & op_types[1] and "Transpose" in op_types[1]
    assert not {"Unpack", "Einsum"} & op_types[1]


@pytest.mark.parametrize("units", [1, 16])
def test_dense_without_positions_moves_the_models_first(units):
    # `[batch, B, in]` for TensorFlow's kernels: between transposes, for a
    # one-unit output (a logit) too, whose einsum kernel is slower.
    shape = tf.TensorShape((BATCH, 2, 64))
    assert dense.products_models_first(shape, 2, 64, units)
    assert dense.products_models_first(tuple(shape), 2, 64, units)
    graph = tf.function(lambda x, k: dense.per_model_matmul(x, k))
    concrete = graph.get_concrete_function(
        tf.TensorSpec(shape), tf.TensorSpec((2, 64, units)))
    op_types = {op.type for op in concrete.graph.get_operations()}
    assert BATCHED_MATMULS & op_types and "Transpose" in op_types
    assert "Einsum" not in op_types


@pytest.mark.parametrize("equation, output_shape, shape, form", [
    # Multi-head attention's projections: the trailing input axes contract.
    # Form: (contracted axes, in, out, the kernel's output axes).
    ("abc,cde->abde", (None, 2, 3), (4, 5), (1, 5, 6, (2, 3))),
    ("abcd,cde->abe", (None, 6), (4, 2, 5), (2, 10, 6, (6,))),
    ("abc,bcd->ad", 4, (4, 5), (2, 20, 4, (4,))),
    ("...b,bc->...c", 4, (4, 5), (1, 5, 4, (4,))),
    # The contracted axis is not trailing, or the output is reordered.
    ("abc,bd->adc", (4, 5), (4, 5), None),
    ("abc,cd->adb", (4, 4), (4, 5), None),
    ("ab...,bc->ac...", 4, (4, 5), None),
])
def test_einsum_dense_takes_the_dense_products_of_matmul_equations(
        equation, output_shape, shape, form):
    layer = FusedEinsumDense(3, equation, output_shape)
    layer.build((BATCH, 3, *shape))
    assert layer._matmul == form
    graph = tf.function(layer).get_concrete_function(
        tf.TensorSpec((BATCH, 3, *shape))).graph
    op_types = {op.type for op in graph.get_operations()}
    assert ("Einsum" in op_types) == (form is None)


def test_compiling_with_xla_tells_the_trace():
    seen = []

    def record(x):
        seen.append(devices.compiling_with_xla())
        return x

    tf.function(record, jit_compile=True)(tf.zeros(()))
    tf.function(record)(tf.zeros(()))
    record(tf.zeros(()))
    assert seen == [True, False, False]


# -- kernels.batch_matmul ----------------------------------------------------

def products_and_gradients(matmul, adjoint_a, adjoint_b):
    """A function of `a` and `b`: `matmul(a, b)`, the gradients of a loss
    of it, and the gradients of a loss of the first gradient."""

    def products(a, b):
        with tf.GradientTape() as outer:
            outer.watch([a, b])
            with tf.GradientTape() as tape:
                tape.watch([a, b])
                y = matmul(a, b, adjoint_a=adjoint_a, adjoint_b=adjoint_b)
                loss = tf.reduce_sum(tf.sin(y))
            grad_a, grad_b = tape.gradient(loss, [a, b])
            total = tf.reduce_sum(grad_a * grad_a)
        return (y, grad_a, grad_b, *outer.gradient(total, [a, b]))

    return products


def batched_products(a_shape, b_shape, adjoint_a, adjoint_b, dtype="float32",
                     jit_compile=False):
    """`products_and_gradients` of `batch_matmul` as a `tf.function`, and
    the op types of its graph for inputs of these shapes."""
    graph = tf.function(products_and_gradients(
        layer_kernels.batch_matmul, adjoint_a, adjoint_b),
        jit_compile=jit_compile)
    concrete = graph.get_concrete_function(tf.TensorSpec(a_shape, dtype),
                                           tf.TensorSpec(b_shape, dtype))
    return graph, {op.type for op in concrete.graph.get_operations()}


def operand_shapes(batch_a, batch_b, rows, inner, columns, adjoint_a,
                   adjoint_b):
    return ((*batch_a, inner, rows) if adjoint_a
            else (*batch_a, rows, inner),
            (*batch_b, columns, inner) if adjoint_b
            else (*batch_b, inner, columns))


@pytest.mark.parametrize("adjoint_a", [False, True])
@pytest.mark.parametrize("adjoint_b", [False, True])
@pytest.mark.parametrize("batch_a, batch_b, rows, inner, columns", [
    ((3,), (3,), 5, 4, 1),          # a one-unit logit: Eigen at any size
    ((3,), (3,), 5, 4, 6),          # small
    ((2, 3), (2, 3), 4, 3, 5),      # two batch axes
    ((1,), (3,), 5, 4, 6),          # broadcast batch axes, either operand
    ((3,), (1,), 5, 4, 1),
    ((2, 1), (1, 3), 4, 3, 5),
])
def test_batch_matmul_matches_tensorflow(batch_a, batch_b, rows, inner,
                                         columns, adjoint_a, adjoint_b):
    shapes = operand_shapes(batch_a, batch_b, rows, inner, columns,
                            adjoint_a, adjoint_b)
    graph, op_types = batched_products(*shapes, adjoint_a, adjoint_b)
    # Every product, of the gradients too, runs on the Eigen kernel.
    assert "BatchMatMulV3" in op_types and "BatchMatMulV2" not in op_types
    rng = np.random.default_rng(3)
    a, b = (tf.constant(rng.standard_normal(s).astype("float32"))
            for s in shapes)
    reference = products_and_gradients(tf.linalg.matmul, adjoint_a,
                                       adjoint_b)
    for got, want in zip(graph(a, b), reference(a, b), strict=True):
        # Float32 sums in another order: the second-order gradients of
        # broadcast operands add up to 3 products of values near 40.
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_batch_matmul_sizes_a_broadcast_product_by_its_output():
    # [1, 64, 64] @ [2, 64, 64] multiplies 2 pairs: 2**19 multiply-adds,
    # on the Eigen kernel; [1, 64, 64] @ [4, 64, 64] is twice that.
    _, op_types = batched_products((1, 64, 64), (2, 64, 64), False, False)
    assert "BatchMatMulV3" in op_types and "BatchMatMulV2" not in op_types
    _, op_types = batched_products((1, 64, 64), (4, 64, 64), False, False)
    assert "BatchMatMulV2" in op_types and "BatchMatMulV3" not in op_types


def test_batch_matmul_takes_the_oneDNN_kernel_for_large_products():
    # 2 x 128 x 64 x 64 = 2**20 multiply-adds, above SMALL_PRODUCT; so are
    # both gradients.
    assert 2 * 128 * 64 * 64 > tensorflow_ops.SMALL_PRODUCT
    _, op_types = batched_products((2, 128, 64), (2, 64, 64), False, False)
    assert "BatchMatMulV2" in op_types and "BatchMatMulV3" not in op_types
    # At the limit, every product is small.
    assert 2 * 64 * 64 * 64 == tensorflow_ops.SMALL_PRODUCT
    _, op_types = batched_products((2, 64, 64), (2, 64, 64), False, False)
    assert "BatchMatMulV3" in op_types and "BatchMatMulV2" not in op_types


def test_batch_matmul_runs_large_matrix_vector_products_on_eigen():
    # [2, 4096, 1024] @ [2, 1024, 1]: the product and the kernel's gradient
    # (a matrix-vector product too) on the Eigen kernel, the input's
    # gradient (an outer product of 2**23 multiply-adds) on oneDNN's.
    @tf.function
    def first_order(a, b):
        with tf.GradientTape() as tape:
            tape.watch([a, b])
            y = layer_kernels.batch_matmul(a, b)
        return y, tape.gradient(y, [a, b])

    concrete = first_order.get_concrete_function(
        tf.TensorSpec((2, 4096, 1024)), tf.TensorSpec((2, 1024, 1)))
    kernels = sorted((op.type, tuple(op.outputs[0].shape))
                     for op in concrete.graph.get_operations()
                     if op.type.startswith("BatchMatMul"))
    assert kernels == [("BatchMatMulV2", (2, 4096, 1024)),
                       ("BatchMatMulV3", (2, 1024, 1)),
                       ("BatchMatMulV3", (2, 4096, 1))]


@pytest.mark.parametrize("a_shape, b_shape, dtype, jit_compile", [
    ((2, 4, 3), (2, 3, 5), "float32", True),        # XLA
    ((2, 4, 3), (2, 3, 5), "float16", False),       # other dtypes
    ((2, 4, 3), (2, 3, 5), "bfloat16", False),
    ((4, 2, 4, 3), (2, 3, 5), "float32", False),    # ranks that differ
    ((2, None, 3), (2, 3, 5), "float32", False),    # unknown size
    ((None, 4, 3), (None, 3, 1), "float32", False),  # unknown batch axes
])
def test_batch_matmul_leaves_other_products_to_tensorflow(
        a_shape, b_shape, dtype, jit_compile):
    _, op_types = batched_products(a_shape, b_shape, False, False, dtype,
                                   jit_compile)
    assert "BatchMatMulV3" not in op_types
    assert "BatchMatMulV2" in op_types


def test_batch_matmul_of_unknown_rows_with_one_column_runs_on_eigen():
    _, op_types = batched_products((2, None, 3), (2, 3, 1), False, False)
    assert "BatchMatMulV3" in op_types


def test_batch_matmul_leaves_accelerators_to_tensorflow(monkeypatch):
    monkeypatch.setattr(tensorflow_ops, "runs_on_accelerator",
                        lambda: True)
    _, op_types = batched_products((2, 4, 3), (2, 3, 1), False, False)
    assert "BatchMatMulV3" not in op_types


# -- FusedBatchNormalization -------------------------------------------------

@pytest.mark.parametrize("shape", [(6,), (5, 4), (3, 3, 4)],
                         ids=["rank2", "rank3", "rank4"])
@pytest.mark.parametrize("num_models", [1, 3])
@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("xla", [False, True], ids=["eager", "xla"])
def test_batch_normalization_matches_stock(shape, num_models, training, xla):
    rng = np.random.default_rng(1)
    stock, fused = twins(keras.layers.BatchNormalization,
                         FusedBatchNormalization, shape, num_models, rng,
                         momentum=0.8)
    check(stock, fused, shape, xla, rng, training=training)


def test_batch_normalization_on_a_middle_axis_matches_stock():
    rng = np.random.default_rng(2)
    stock, fused = twins(keras.layers.BatchNormalization,
                         FusedBatchNormalization, (4, 3), 3, rng, axis=1)
    check(stock, fused, (4, 3), False, rng, training=True)


# -- Convolutions --------------------------------------------------------------

CONV_CASES = {
    "conv": (keras.layers.Conv2D, FusedConv2D,
             dict(filters=3, kernel_size=3, padding="same",
                  activation="relu")),
    "depthwise": (keras.layers.DepthwiseConv2D, FusedDepthwiseConv2D,
                  dict(kernel_size=3, depth_multiplier=2)),
    "separable": (keras.layers.SeparableConv2D, FusedSeparableConv2D,
                  dict(filters=3, kernel_size=3, strides=2)),
}


@pytest.mark.parametrize("case", sorted(CONV_CASES))
@pytest.mark.parametrize("num_models", [1, 3])
@pytest.mark.parametrize("xla", [False, True], ids=["eager", "xla"])
def test_cpu_convolutions_match_stock(case, num_models, xla):
    stock_class, fused_class, kwargs = CONV_CASES[case]
    rng = np.random.default_rng(3)
    stock, fused = twins(stock_class, fused_class, (6, 6, 2), num_models,
                         rng, **kwargs)
    check(stock, fused, (6, 6, 2), xla, rng)


@pytest.mark.parametrize("case", ["depthwise", "separable"])
def test_accelerator_convolutions_match_stock(case, monkeypatch):
    # The folded forms GPUs and TPUs run, computed here by XLA on the CPU.
    monkeypatch.setattr(base_conv, "runs_on_accelerator", lambda: True)
    stock_class, fused_class, kwargs = CONV_CASES[case]
    rng = np.random.default_rng(4)
    stock, fused = twins(stock_class, fused_class, (6, 6, 2), 3, rng,
                         **kwargs)
    check(stock, fused, (6, 6, 2), True, rng)


def test_per_model_convolution_slices_with_one_unstack():
    # One Unpack of the input, none of the B strided slices whose gradients
    # would each be the size of the whole input.
    fused = FusedConv2D(3, 2, 3, implementation="per_model")
    fused.build((BATCH, 3, 5, 5, 2))
    concrete = tf.function(fused).get_concrete_function(
        tf.TensorSpec((BATCH, 3, 5, 5, 2)))
    op_types = [op.type for op in concrete.graph.get_operations()]
    assert op_types.count("Unpack") == 3  # the input, kernel and bias
    assert "StridedSlice" not in op_types


@pytest.mark.parametrize("layer", [
    FusedEinsumDense(3, "abc,cd->abd", (None, 6), bias_axes="d"),
    FusedEinsumDense(3, "abc,bd->adc", (4, 5), bias_axes="d"),
    FusedLayerNormalization(3),
    FusedDense(3, 6),
], ids=["einsum-matmul", "einsum", "layer-norm", "dense"])
def test_per_model_weights_broadcast_over_the_batch_axis_alone(layer):
    # TensorFlow's CPU kernels reduce a `[1, B, 1, n]` operand's gradient
    # over the batch and inner axes at once, several times slower than over
    # the batch axis, then over one sample: each reduction of the
    # activations' gradient must be over axis 0 alone.
    shape = (BATCH, 3, 4, 5)
    layer.build(shape)

    def gradients(x):
        with tf.GradientTape() as tape:
            y = layer(x)
        return tape.gradient(y, layer.trainable_weights)

    # A graph whose inner tensors can be fetched: the reduction axes of the
    # gradients' sums are computed at run time.
    wrapped = tf.compat.v1.wrap_function(gradients, [tf.TensorSpec(shape)])
    sums = [op for op in wrapped.graph.get_operations() if op.type == "Sum"
            and op.inputs[0].shape.rank == 4
            and op.inputs[0].shape[0] == BATCH]
    assert sums
    axes = wrapped.prune(wrapped.inputs, [op.inputs[1] for op in sums])(
        tf.ones(shape))
    reduced = [list(np.reshape(value, -1)) for value in axes]
    assert [0] in reduced
    for op, value in zip(sums, reduced):
        # `[]`: a batched matmul's gradient with nothing to reduce.
        assert value in ([], [0]), op.name


@pytest.mark.parametrize("num_models", [1, 3])
def test_multi_head_attention_runs_no_general_einsum(num_models):
    # The stock layer's equations, with the model axis folded into the
    # batch axis, are those Keras's TensorFlow backend turns into
    # transposes and batched matmuls; with a model axis they would take
    # TensorFlow's general (slower) Einsum kernel. The projections are
    # dense products. Dropout keeps the explicit-scores path.
    layer = FusedMultiHeadAttention(num_models, num_heads=2, key_dim=4,
                                    dropout=0.1)
    shape = (BATCH, num_models, 5, 6)
    layer.build(shape, shape)

    @tf.function
    def gradients(x):
        with tf.GradientTape() as tape:
            y = layer(x, x, training=True)
        return tape.gradient(y, layer.trainable_weights)

    graph = gradients.get_concrete_function(tf.TensorSpec(shape)).graph
    op_types = {op.type for op in graph.get_operations()}
    assert "BatchMatMulV2" in op_types and "Einsum" not in op_types


def forward_and_backward(call):
    """A `tf.function` of `x` and a cotangent: `call(x)` and the gradient
    of `x`."""
    @tf.function
    def step(x, cotangent):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = call(x)
        return y, tape.gradient(y, x, output_gradients=cotangent)
    return step


def test_consecutive_products_keep_the_models_first_layout():
    # Two Dense layers too large for their positions compute with the
    # models first; the first one's transpose back and the second one's
    # transpose forth cancel, as do their gradients: the pair moves its
    # input and output once, as one layer does.
    rng = np.random.default_rng(0)
    shape = (BATCH, 3, 2, 8)
    first = FusedDense(3, 16, activation="gelu")
    second = FusedDense(3, 8)
    x = rng.standard_normal(shape).astype("float32")
    assert dense.products_models_first(shape, 3, 8, 16)
    one = optimized_transposes(forward_and_backward(first), x,
                               np.asarray(first(x)))
    two = optimized_transposes(
        forward_and_backward(lambda x: second(first(x))), x, x)
    assert one > 0 and two == one


@pytest.mark.parametrize("dropout", [0.0, 0.1], ids=["fused", "scores"])
@pytest.mark.parametrize("kind", ["multi-head", "grouped-query"])
def test_attention_folds_the_models_first(kind, dropout):
    # Projections with the models first hand their outputs to attention
    # folded models first, and attention's output to the output projection,
    # without moving them: beyond the stock layer's own transposes, the
    # fused layer moves its input and output once, as one Dense does, and
    # the input's gradient once per projection (query, key and value).
    rng = np.random.default_rng(0)
    if kind == "multi-head":
        stock = keras.layers.MultiHeadAttention(2, 8, dropout=dropout)
        fused = FusedMultiHeadAttention(3, 2, 8, dropout=dropout)
    else:
        stock = keras.layers.GroupQueryAttention(8, 4, 2, dropout=dropout)
        fused = FusedGroupQueryAttention(3, 8, 4, 2, dropout=dropout)
    shape = (BATCH, 3, 4, 16)
    x = rng.standard_normal(shape).astype("float32")
    fused_count = optimized_transposes(
        forward_and_backward(lambda x: fused(x, x, training=True)), x, x)
    stock_count = optimized_transposes(
        forward_and_backward(lambda x: stock(x, x, training=True)),
        x[:, 0], x[:, 0])
    projection = FusedDense(3, 16)
    assert dense.products_models_first(shape, 3, 16, 16)
    one_dense = optimized_transposes(forward_and_backward(projection), x, x)
    assert fused_count == stock_count + one_dense + 2


def test_models_first_bias_gradient_is_a_batched_matmul():
    # TensorFlow's CPU Sum over the middle axes of `[B, rows, n]` is slow:
    # with the models first, the bias gradient is a batched matmul by ones,
    # and no Sum reduces the activations' gradient.
    layer = FusedDense(3, 16)
    shape = (BATCH, 3, 2, 8)
    layer.build(shape)

    @tf.function
    def gradients(x):
        with tf.GradientTape() as tape:
            y = layer(x)
        return tape.gradient(y, layer.bias)

    graph = gradients.get_concrete_function(tf.TensorSpec(shape)).graph
    sums = [op for op in graph.get_operations() if op.type == "Sum"
            and op.inputs[0].shape.rank > 2]
    assert not sums
    assert any(op.type in BATCHED_MATMULS and op.inputs[0].shape[1] == 1
               for op in graph.get_operations())
