"""The fused layers' TensorFlow operations (see `hftatf.layers.backends`):
TensorFlow's CPU-kernel choices, graph tricks and sparse gradients."""

import math

import tensorflow as tf
from keras import ops

from hftatf.core import compat, devices, tensorflow_compat
from hftatf.core.axis import pieces_if_stacked, split_models, stack_models

# Batched products of at most this many multiply-adds run on TensorFlow's
# Eigen kernel on a CPU (see `batch_matmul`).
SMALL_PRODUCT = 2**19

compiling_with_xla = devices.compiling_with_xla
runs_on_accelerator = devices.runs_on_accelerator
executing_eagerly = tf.executing_eagerly
init_scope = tf.init_scope
custom_gradient = tensorflow_compat.custom_gradient


def gather_clamps_ids():
    """XLA's gather clamps an out-of-range id to the last row; TensorFlow's
    own kernel fails on it on a CPU and fills zeros on a GPU."""
    return compiling_with_xla()


def batch_matmul(a, b, adjoint_a=False, adjoint_b=False):
    """`a @ b` for `a` `[..., M, K]` and `b` `[..., K, N]`, each operand
    transposed first where its adjoint flag is set (real dtypes only). The
    leading (batch) axes broadcast as in `tf.linalg.matmul`.

    The batched products of small arrays are small: a one-unit logit of 2
    models, `[2, 64, 1024] @ [2, 1024, 1]`, is 131,072 multiply-adds.
    TensorFlow's oneDNN batched matmul (`BatchMatMulV2` on a CPU) spends
    about 0.1 ms on every call before it multiplies (`[2, 1, 1] @ [2, 1,
    1]`: 0.12-0.15 ms of wall time), where its Eigen kernel
    (`BatchMatMulV3`) takes 0.02-0.04 ms. Measured op by op, the Eigen
    kernel was the faster in every product of up to 2**19 multiply-adds
    (25 shapes, 2 and 8 models), the oneDNN one from about 8 million
    (`[8, 256, 64] @ [8, 64, 64]`: 0.27 against 0.29 ms; `[8, 256, 1024]
    @ [8, 1024, 64]`: 1.4 against 3.6 ms), except for matrix-vector
    products (`N = 1`), which it computes more slowly at every size
    (`[8, 4096, 1024] @ [8, 1024, 1]`: 8.3 against 5.4 ms). So on a CPU,
    outside XLA, a float32 product of known size up to `SMALL_PRODUCT`
    multiply-adds, or with `N = 1`, runs on the Eigen kernel, and so do
    its gradients by the same rule for their own sizes: the logit above
    with its gradients took 0.11-0.14 ms instead of 0.29-0.32 ms (0.72
    instead of 0.97-1.0 ms with 16 models). Everything else (XLA, GPUs and
    TPUs, other dtypes, unknown batch axes, larger or unknown sizes) is
    `tf.linalg.matmul`.
    """
    # Tensors: a variable read inside a custom gradient would need a
    # gradient of its own.
    a, b = tf.convert_to_tensor(a), tf.convert_to_tensor(b)
    if not _eigen_product(a, b, adjoint_a, adjoint_b):
        return tf.linalg.matmul(a, b, adjoint_a=adjoint_a,
                                adjoint_b=adjoint_b)

    @custom_gradient
    def product(a, b):
        def gradient(upstream):
            # As TensorFlow differentiates `BatchMatMulV3`.
            if adjoint_a:
                grad_a = batch_matmul(b, upstream, adjoint_a=adjoint_b,
                                      adjoint_b=True)
            else:
                grad_a = batch_matmul(upstream, b, adjoint_b=not adjoint_b)
            if adjoint_b:
                grad_b = batch_matmul(upstream, a, adjoint_a=True,
                                      adjoint_b=adjoint_a)
            else:
                grad_b = batch_matmul(a, upstream, adjoint_a=not adjoint_a)
            return (_sum_broadcast(grad_a, a.shape),
                    _sum_broadcast(grad_b, b.shape))

        return tf.raw_ops.BatchMatMulV3(x=a, y=b, Tout=a.dtype,
                                        adj_x=adjoint_a,
                                        adj_y=adjoint_b), gradient

    return product(a, b)


def _eigen_product(a, b, adjoint_a, adjoint_b):
    """Whether `batch_matmul` runs the Eigen kernel (see there)."""
    if (a.dtype != tf.float32 or b.dtype != tf.float32
            or a.shape.rank is None or a.shape.rank < 3
            or a.shape.rank != b.shape.rank):
        return False
    batch = _broadcast_batch(a.shape[:-2], b.shape[:-2])
    if batch is None:
        return False
    rows, inner = a.shape[-2:]
    if adjoint_a:
        rows, inner = inner, rows
    columns = b.shape[-2] if adjoint_b else b.shape[-1]
    if compiling_with_xla() or runs_on_accelerator():
        return False
    if columns == 1:
        return True
    sizes = (*batch, rows, inner, columns)
    return None not in sizes and math.prod(sizes) <= SMALL_PRODUCT


def _broadcast_batch(batch_a, batch_b):
    """The broadcast of two batch shapes of the same rank, each axis equal
    or 1 in one of them; None where an axis is unknown or they do not
    broadcast."""
    batch = []
    for size_a, size_b in zip(batch_a, batch_b):
        if size_a is None or size_b is None:
            return None
        if size_a != size_b and 1 not in (size_a, size_b):
            return None
        batch.append(max(size_a, size_b))
    return batch


def _sum_broadcast(gradient, shape):
    """`gradient` of a batched product's output, summed over the batch axes
    that the operand of `shape` broadcast over."""
    axes = [axis for axis, size in enumerate(shape[:-2])
            if size == 1 and gradient.shape[axis] != 1]
    if not axes:
        return gradient
    return tf.reduce_sum(gradient, axis=axes, keepdims=True)


def run_with_xla(function, *args):
    """Runs `function(*args)` compiled by XLA, which (unlike TensorFlow's CPU
    kernels) can differentiate grouped convolutions on every device."""
    return tf.function(function, jit_compile=True)(*args)


def conv_transpose_grouped(inputs, kernel, output_shape, strides, padding,
                           dilation_rate):
    """The transposed convolution of `inputs` (`[batch, *spatial, G * C]`)
    by `kernel` (`[*k, F, G * C]`) to `output_shape` (`[batch,
    *new_spatial, G * F]`), group `g` of the channels by its own `[*k, F,
    C]` slice: the gradient of a grouped convolution, as the TensorFlow
    backend's `conv_transpose` computes it for one group."""
    return tf.nn.conv_transpose(
        inputs, kernel, output_shape, list(strides),
        padding=padding.upper(), dilations=dilation_rate)


def adds_vectors_as_biases():
    """Keras's TensorFlow `add` adds an operand that squeezes to a vector of
    length `n` with `tf.nn.bias_add`: on the last axis of the other operand
    if its size is `n`, else on axis 1 if that one's is."""
    return True


def with_unknown_batch(folded):
    """`folded`, in a traced step, with its batch size left unknown.

    Keras's TensorFlow `add` takes an operand that squeezes to a vector of
    known length for a bias (`tf.nn.bias_add`) where that length equals
    dimension 1 or the last of the other operand. A `[batch * B, 1]`
    column of per-sample values (a `Dense(1)` output, a mean with
    `keepdims`) would then be added along the wrong axis where
    `batch * B` equals that dimension, though the stock model, at
    `batch`, adds it right. An unknown batch never takes the shortcut.
    (Run eagerly, every shape is known: the shortcut stays, as it does in
    stock Keras where `batch` equals that dimension.)
    """
    if (isinstance(folded, tf.Tensor) and not tf.executing_eagerly()
            and folded.shape.rank and folded.shape[0] is not None):
        return tf.compat.v1.placeholder_with_default(
            folded, [None, *folded.shape[1:]])
    return folded


def dropout_models_first(layer, inputs, num_models, training):
    """The stock `Dropout` `layer` on `inputs` with the models first, `[B,
    batch, ...]`, drawing exactly the masks it draws with the models second.

    The stock layer on the folded batch `[batch * B, ...]` draws its
    uniform noise in that order; here the same draw (same seed, shape and
    algorithm) is compared with the rate, and only the boolean mask moves
    the models first: one copy of a quarter of the activations' bytes, where
    swapping the activations for the stock layer would move them twice
    (and their gradients twice more). The output is TensorFlow's
    `stateless_dropout`'s, `where(keep, x * (1 / (1 - rate)), 0)`.
    """
    if not training or layer.rate == 0:
        return inputs
    if layer.rate == 1.0:
        return tf.zeros_like(inputs)
    seed = compat.draw_tf_seed(layer.seed_generator)
    shape = ops.shape(inputs)
    # The noise shape of the folded batch with the models second.
    folded = [shape[1] * num_models, *shape[2:]]
    noise_shape = folded if layer.noise_shape is None else [
        size if dim is None else dim
        for size, dim in zip(folded, layer.noise_shape)]
    keep = tf.random.stateless_uniform(
        noise_shape, seed=seed, dtype=inputs.dtype, alg=None) >= layer.rate
    keep = ops.reshape(keep, (shape[1], num_models, *noise_shape[1:]))
    keep = ops.swapaxes(keep, 0, 1)
    scale = tf.convert_to_tensor(1 / (1 - layer.rate), dtype=inputs.dtype)
    zero = tf.zeros((), inputs.dtype)
    pieces = pieces_if_stacked(inputs, num_models, 0)
    if pieces is None:
        return tf.where(keep, inputs * scale, zero)
    return stack_models([tf.where(k, piece * scale, zero) for k, piece in
                         zip(split_models(keep, num_models, 0), pieces)], 0)


def look_up(embeddings, ids):
    """`embeddings` (`[B, input_dim, output_dim]`) flattened to
    `[B * input_dim, output_dim]`, at the flat `ids`. Its gradient is the
    stock gather's, an `IndexedSlices` of the flattened table (one row per
    id), where a gather on a reshape would give a dense one."""

    @custom_gradient
    def rows_at_ids(embeddings):
        rows = math.prod(embeddings.shape[:2])
        table = tf.reshape(embeddings, (rows, embeddings.shape[2]))
        outputs = tf.gather(table, ids)

        def gradient(upstream):
            values = tf.reshape(upstream, (-1, embeddings.shape[2]))
            return tf.IndexedSlices(
                values, tf.reshape(ids, (-1,)),
                dense_shape=tf.constant((rows, embeddings.shape[2]),
                                        "int64"))

        return outputs, gradient

    return rows_at_ids(tf.convert_to_tensor(embeddings))


def holds_outside_state(value):
    """Whether `value` is a TensorFlow variable or resource (state that a
    layer keeps outside Keras variables)."""
    return isinstance(
        value, (tf.Variable, tensorflow_compat.CapturableResource))


def trace(function, specs):
    """Traces `function` on symbolic tensors of `specs` (Keras tensors'
    shapes and dtypes), without running it."""
    tf.function(function, autograph=False).get_concrete_function(
        *[tf.TensorSpec(spec.shape, spec.dtype) for spec in specs])


def read_after_assignment(value, read):
    """What a trainable weight read `read` gives after a call assigns it
    `value`: `value`, differentiated as TensorFlow differentiates a
    variable (the gradient of reads after the assignment is the
    weight's, never the gradient through the computation of `value`)."""
    return ops.stop_gradient(value) + (read - ops.stop_gradient(read))
