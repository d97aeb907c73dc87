"""Formulations of the fused layers' arithmetic that TensorFlow's CPU
kernels run faster than the plain one, each chosen per device and per
size (XLA, GPUs and TPUs take the plain formulation)."""

import math

import tensorflow as tf
from keras import ops

from hftatf.core.devices import compiling_with_xla, runs_on_accelerator

# Batched products of at most this many multiply-adds run on TensorFlow's
# Eigen kernel on a CPU (see `batch_matmul`).
SMALL_PRODUCT = 2**19


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

    @tf.custom_gradient
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


# The smallest row of biases whose gradient `add_bias_by_rows` sums by a
# product. The gradient of a bias added to 4,096 rows, in processor time on
# a 2-core CPU: 8-18 us either way for rows of 1-16 elements (a product 16
# us against a sum 8 us for 1), then 28 against 94-118 us for rows of 32
# (a convolution's `[64, 8, 8, 32]`), 157 against 208 us for 64, 523
# against 1,080 us for 256.
MIN_BIAS_ROW = 16


def bias_rows(outputs, bias, models=0):
    """How many axes of `outputs` after its first `models` (0, or 1: the
    model axis) `bias` broadcasts over as rows: `bias` is `[*m, 1, ..., 1,
    *t]`, `outputs` `[*m, *rows, *t]`, of the same rank. 0 where `bias` is
    laid out otherwise, where `t` has fewer than `MIN_BIAS_ROW` elements
    (a sum over rows of a few elements is one contiguous reduction, which
    TensorFlow computes faster than the product), and under XLA, whose
    reductions need no help."""
    if compiling_with_xla() or len(bias.shape) != len(outputs.shape):
        return 0
    rows = models
    while rows < len(bias.shape) and bias.shape[rows] == 1:
        rows += 1
    if tuple(bias.shape[rows:]) != tuple(outputs.shape[rows:]) or tuple(
            bias.shape[:models]) != tuple(outputs.shape[:models]) or (
            math.prod(bias.shape[rows:]) < MIN_BIAS_ROW):
        return 0
    return rows - models


def add_bias_by_rows(outputs, bias, models=0):
    """`outputs + bias` (an `AddV2`; `bias` of the rank of `outputs`, whose
    first `models` axes it shares). Where `bias_rows` finds rows, the
    bias's gradient is summed over them as one product by a row of ones
    (batched over the model axis where `models` is 1); elsewhere the
    gradient is TensorFlow's own.

    On a CPU, TensorFlow's `Sum` over the leading or middle axes is slow:
    for the feed-forward bias of a BERT-mini array of 8 with the models
    first (`[8, 64 * 64, 1024]`), 31 ms of processor time against 11 ms
    reducing axis 0 of the batch-first layout; for the bias of a
    per-model convolution (`[64, 8, 8, 32]`, DCGAN's discriminator), about
    0.1 ms each, which a stock layer's `BiasAdd` gradient saves by fusing
    with the filter's gradient. Per-model layers add their biases
    without `BiasAdd` (see `_FusedConvolution._per_model`), and sum their
    gradients here instead."""
    if not bias_rows(outputs, bias, models):
        return outputs + bias

    @ops.custom_gradient
    def add(outputs, bias):
        def gradient(upstream):
            size = math.prod(bias.shape[models:])
            rows = ops.reshape(upstream, (*bias.shape[:models], -1, size))
            ones = ops.ones((*(1,) * models, 1, ops.shape(rows)[-2]),
                            upstream.dtype)
            summed = (batch_matmul(ones, rows) if models
                      else ops.matmul(ones, rows))
            return upstream, ops.reshape(summed, bias.shape)

        return outputs + bias, gradient

    return add(outputs, bias)


def as_one_sample(values, like):
    """Per-model values that broadcast against `like` (`[batch, B, ...]`),
    given as `[1, B, ...]` or `[B, ...]`, broadcast to one sample of it:
    `[B, *like.shape[2:]]`.

    Added to or multiplied with `like`, they then broadcast over the batch
    axis alone, which TensorFlow's CPU kernels run as one row broadcast
    and whose gradient is a reduction over the leading axis, then one over
    a tensor the size of a sample. A `[1, B, 1, ..., n]` operand takes the
    general broadcasting path, and its gradient reduces the batch and inner
    axes at once: for a bias of a BERT-mini array of 8 (`[64, 8, 64, 256]`
    activations), 23.6 ms of processor time against 3.9 ms. The values are
    unchanged: each model still adds (or scales by) its own. Values that
    vary along the batch axis (a layer normalising over it) are returned as
    they are.
    """
    if len(values.shape) == len(like.shape):
        if values.shape[0] != 1:
            return values
        values = ops.squeeze(values, 0)
    return ops.broadcast_to(values, ops.shape(like)[1:])
