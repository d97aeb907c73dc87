"""Per-model layers that hand each other their pieces: a tensor stacked from
B per-model results is read back as those results, so that the stacked
copy (and its gradient) is never computed between two per-model layers."""

import keras
import numpy as np
import pytest

pytestmark = pytest.mark.backends(
    "tensorflow", reason="a stacked tensor's pieces are TensorFlow's graph "
    "records; JAX's tracers keep none")
tf = pytest.importorskip("tensorflow")

from keras import ops  # noqa: E402
from testing import assert_close, optimized_transposes  # noqa: E402

import hftatf  # noqa: E402
from hftatf.core import axis  # noqa: E402
from hftatf.layers import SwapModelAxis, dense, fold, kernels  # noqa: E402
from hftatf.layers.backends import tensorflow_ops  # noqa: E402
from hftatf.layers.normalization import batch_normalization  # noqa: E402

B = 3
BATCH = 6


def test_stacked_pieces_are_the_stacked_tensors_in_a_graph():
    found = {}

    @tf.function
    def trace(x, y, z):
        stacked = tf.stack([x, y, z], axis=1)
        found["axis 1"] = axis.pieces_if_stacked(stacked, 3, 1)
        found["axis 0"] = axis.pieces_if_stacked(stacked, 3, 0)
        found["two models"] = axis.pieces_if_stacked(stacked, 2, 1)
        found["copy"] = axis.pieces_if_stacked(tf.identity(stacked), 3, 1)
        found["negative axis"] = axis.pieces_if_stacked(
            tf.stack([x, y, z], axis=-2), 3, 1)
        found["pieces"] = axis.split_models(stacked, 3, 1)
        return stacked

    x, y, z = (tf.fill((BATCH, 2), float(v)) for v in range(3))
    trace(x, y, z)
    graph_inputs = trace.get_concrete_function(x, y, z).graph.inputs[:3]
    assert found["axis 1"] == graph_inputs
    assert found["pieces"] == graph_inputs
    assert found["negative axis"] == graph_inputs
    assert found["axis 0"] is None
    assert found["two models"] is None
    assert found["copy"] is None


def test_eager_tensors_are_sliced():
    stacked = tf.stack([tf.fill((BATCH, 2), float(v)) for v in range(B)])
    assert axis.pieces_if_stacked(stacked, B, 0) is None
    pieces = axis.split_models(stacked, B, 0)
    for b, piece in enumerate(pieces):
        np.testing.assert_array_equal(piece, np.full((BATCH, 2), b))
    one = axis.split_models(stacked[:1], 1, 0)
    assert len(one) == 1 and tuple(one[0].shape) == (BATCH, 2)


def chain_model(rate=0.3):
    """Per-model convolutions with every kind of layer between them that
    reads pieces: normalization, activations, dropout, a merge."""
    inputs = keras.Input((7, 7, 2))
    x = keras.layers.Conv2D(5, 3, padding="same", use_bias=False)(inputs)
    x = keras.layers.BatchNormalization(momentum=0.8)(x)
    x = keras.layers.LeakyReLU(0.2)(x)
    shortcut = x
    x = keras.layers.Conv2D(5, 3, padding="same", activation="tanh")(x)
    x = keras.layers.Dropout(rate, seed=4)(x)
    x = keras.layers.Add()([x, shortcut])
    x = keras.layers.Conv2DTranspose(4, 3, strides=2, use_bias=False)(x)
    x = keras.layers.BatchNormalization()(x)
    x = keras.layers.ReLU()(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    outputs = keras.layers.Dense(3)(x)
    return keras.Model(inputs, outputs)


def _without_pieces(monkeypatch):
    """The array's layers as they compute without reading pieces."""
    for module in (axis, dense, fold, batch_normalization, tensorflow_ops):
        monkeypatch.setattr(module, "pieces_if_stacked",
                            lambda *args, **kwargs: None)


def _training_step(array):
    """A traced forward and backward pass of `array` in training: its
    outputs and the gradients of its weights."""
    variables = array.trainable_variables

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            outputs = array(x, training=True)
            loss = ops.sum(ops.square(outputs - y))
        return outputs, tape.gradient(loss, variables)

    return step


def _stacked_activations(array, x, y):
    """The stacked activations and activation gradients a training step
    computes: `Pack`s that its results or variable updates need, shaped as
    one `[B, batch, ...]` activation of the models-first layout."""
    graph = _training_step(array).get_concrete_function(x, y).graph
    # What TensorFlow runs: the ops the results and the variable updates
    # need (the rest of the traced graph is pruned).
    live, pending = set(), [t.op for t in graph.outputs] + list(
        graph.control_outputs)
    while pending:
        op = pending.pop()
        if op not in live:
            live.add(op)
            pending.extend(t.op for t in op.inputs)
            pending.extend(op.control_inputs)
    # (Folds for stock layers leave the batch's static size unknown.)
    return [op.name for op in live
            if op.type == "Pack" and len(op.outputs[0].shape) >= 3
            and op.outputs[0].shape[0] == B
            and op.outputs[0].shape[1] in (BATCH, None)]


def _data(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((BATCH, 7, 7, 2)).astype("float32")
    y = rng.standard_normal((BATCH, B, 3)).astype("float32")
    return x, y


def test_per_model_layers_stack_nothing_between_them(monkeypatch):
    array = hftatf.fuse(chain_model(), B, layout="models_first")
    x, y = _data()
    # From the first convolution to the Dense every layer computes per
    # model: no activation and no gradient is stacked.
    assert _stacked_activations(array, x, y) == []
    # Stacking each convolution's output and the gradients of the inputs
    # of the last two: five copies of activations.
    _without_pieces(monkeypatch)
    unpieced = hftatf.fuse(chain_model(), B, layout="models_first")
    assert len(_stacked_activations(unpieced, x, y)) == 5


@pytest.mark.parametrize("layout", ["models_first", "batch_first"])
def test_an_array_reading_pieces_trains_as_its_stock_models(layout):
    keras.utils.set_random_seed(3)
    # No dropout against the oracle: a stock model draws masks of its own
    # (the array's are checked against its other path below).
    stock = [chain_model(rate=0.0) for _ in range(B)]
    array = hftatf.fuse_models(stock, layout=layout)
    x, y = _data(1)
    for model in stock:
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    array.compile(optimizer=hftatf.optimizers.SGD(0.05), loss="mse")
    array.fit(x, y, batch_size=3, epochs=2, shuffle=False, verbose=0)
    for b, model in enumerate(stock):
        model.fit(x, y[:, b], batch_size=3, epochs=2, shuffle=False,
                  verbose=0)
    # Every weight, the moving statistics of the normalizations included.
    for b, model in enumerate(stock):
        for ours, theirs in zip(array.unfuse()[b].get_weights(),
                                model.get_weights()):
            assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_reading_pieces_computes_what_the_stacked_layers_compute(
        monkeypatch):
    x, y = _data(2)
    keras.utils.set_random_seed(5)
    model = chain_model()

    def run(array):
        # Two training passes (the dropouts draw from equal seeds: the
        # same masks), then the weights with the moving statistics.
        step = _training_step(array)
        return keras.tree.flatten([step(x, y), step(x, y),
                                   array.get_weights()])

    pieced = hftatf.fuse(model, B, layout="models_first")
    weights = pieced.get_weights()
    ours = run(pieced)
    _without_pieces(monkeypatch)
    stacked = hftatf.fuse(model, B, layout="models_first")
    stacked.set_weights(weights)
    theirs = run(stacked)
    assert len(ours) == len(theirs)
    # The same sums in other orders: float32 rounding of values up to ~3
    # over a few steps (1.9e-6 measured), where reading wrong pieces would
    # be off by the size of the values themselves.
    for value, expected in zip(ours, theirs):
        assert_close(value, expected, rtol=1e-5, atol=5e-6)


def test_swapping_a_stacked_tensor_stacks_it_on_the_other_axis():
    pieces = [tf.fill((BATCH, 4), float(b)) for b in range(B)]
    swap = SwapModelAxis()

    @tf.function
    def call(*pieces):
        return swap(tf.stack(pieces, axis=1))

    outputs = call(*pieces)
    np.testing.assert_array_equal(outputs, tf.stack(pieces, axis=0))
    assert optimized_transposes(call, *pieces) == 0
    # Anything else is transposed.
    x = tf.reshape(tf.range(BATCH * B * 4, dtype="float32"), (BATCH, B, 4))
    np.testing.assert_array_equal(swap(x), np.swapaxes(x, 0, 1))


def test_the_losses_take_each_model_output_as_it_was_computed():
    found = {}

    @tf.function
    def split(*pieces):
        found["slices"] = axis.split_models(tf.stack(pieces, axis=1), B)
        return found["slices"]

    pieces = [tf.fill((BATCH, 2), float(b)) for b in range(B)]
    for b, piece in enumerate(split(*pieces)):
        np.testing.assert_array_equal(piece, pieces[b])
    graph = split.get_concrete_function(*pieces).graph
    assert found["slices"] == graph.inputs[:B]


@pytest.mark.parametrize("models_first", [True, False])
@pytest.mark.parametrize("positions, contracted, output_dims, bias_shape", [
    ((), 1, None, (4,)),            # Dense on [batch, in]
    ((5,), 1, None, (4,)),          # Dense on sequences
    ((5,), 2, (2, 2), (5, 1, 2)),   # EinsumDense-like: two contracted axes
])
def test_products_of_pieces_are_the_stacked_products(
        models_first, positions, contracted, output_dims, bias_shape):
    rng = np.random.default_rng(7)
    axis = 0 if models_first else 1
    contracted_shape = (3, 2)[:contracted] if contracted == 2 else (6,)
    pieces = [tf.constant(rng.standard_normal(
        (BATCH, *positions, *contracted_shape)).astype("float32"))
        for _ in range(B)]
    kernel = tf.constant(rng.standard_normal((B, 6, 4)).astype("float32"))
    bias = tf.constant(rng.standard_normal((B, *bias_shape)).astype(
        "float32"))

    @tf.function
    def products(kernel, bias, *pieces):
        with tf.GradientTape(persistent=True) as tape:
            tape.watch([kernel, bias, *pieces])
            stacked = tf.stack(pieces, axis)
            # The product of the pieces, and of a copy (no pieces found).
            outputs = [dense.per_model_matmul(
                inputs, kernel, bias, activation=ops.tanh,
                contracted=contracted, output_dims=output_dims,
                models_first=models_first)
                for inputs in (stacked, tf.identity(stacked))]
            weights = rng.standard_normal(outputs[0].shape).astype(
                "float32")
            losses = [ops.sum(out * weights) for out in outputs]
        return outputs, [tape.gradient(loss, [kernel, bias, *pieces])
                         for loss in losses]

    (ours, theirs), (our_grads, their_grads) = products(kernel, bias, *pieces)
    assert tuple(ours.shape) == tuple(theirs.shape)
    assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    for value, expected in zip(our_grads, their_grads):
        assert_close(value, expected, rtol=1e-5, atol=1e-6)
    # Against each model's own product, computed here.
    for b, piece in enumerate(pieces):
        rows = np.reshape(piece, (-1, 6)) @ kernel[b]
        expected = np.tanh(np.reshape(
            rows, (BATCH, *positions, *(output_dims or (4,)))) + bias[b])
        got = ours[b] if models_first else ours[:, b]
        assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_a_dense_after_per_model_layers_reads_their_pieces():
    """Each model's stock product (no batched matmul) on its pooled
    features, which are never stacked."""
    array = hftatf.fuse(chain_model(), B, layout="models_first")
    x, y = _data()
    graph = _training_step(array).get_concrete_function(x, y).graph
    types = {op.type for op in graph.get_operations()}
    assert not types & {"BatchMatMulV2", "BatchMatMulV3", "Einsum"}


@pytest.mark.parametrize("outputs_shape, bias_shape, models, rows", [
    ((BATCH, 4, 4, 16), (1, 1, 1, 16), 0, 3),  # a convolution's channels
    ((BATCH, 4, 5), (1, 4, 5), 0, 1),         # per position and channel
    ((B, BATCH, 4, 32), (B, 1, 1, 32), 1, 2),  # models first
    ((BATCH, 4, 5), (1, 4, 1), 0, 0),         # not along the last axes
    ((BATCH, 5), (5,), 0, 0),                 # ranks differ
    ((BATCH, 4, 4, 8), (1, 1, 1, 8), 0, 0),   # rows too small to gain
])
def test_biases_summed_over_rows_train_as_added_ones(outputs_shape,
                                                     bias_shape, models,
                                                     rows):
    rng = np.random.default_rng(11)
    outputs = tf.constant(rng.standard_normal(outputs_shape), "float32")
    bias = tf.constant(rng.standard_normal(bias_shape), "float32")
    assert kernels.bias_rows(outputs, bias, models) == rows
    # Summed by rows where they are found, TensorFlow's own sum elsewhere.
    weights = tf.constant(rng.standard_normal(outputs_shape), "float32")

    @tf.function
    def gradients(function):
        with tf.GradientTape() as tape:
            tape.watch([outputs, bias])
            loss = ops.sum(function(outputs, bias) * weights)
        return tape.gradient(loss, [outputs, bias])

    ours = gradients(lambda x, b: kernels.add_bias_by_rows(x, b, models))
    theirs = gradients(lambda x, b: x + b)
    for value, expected in zip(ours, theirs):
        assert tuple(value.shape) == tuple(expected.shape)
        assert_close(value, expected, rtol=1e-5, atol=1e-5)
