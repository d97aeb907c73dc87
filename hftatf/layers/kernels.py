"""Formulations of the fused layers' arithmetic that TensorFlow's CPU
kernels run faster than the plain one, each chosen per device and per
size (XLA, GPUs and TPUs, and so JAX, take the plain formulation).
`batch_matmul` is the backend's (`hftatf.layers.backends`)."""

import math

from keras import ops

from hftatf.layers.backends import (
    batch_matmul,
    compiling_with_xla,
    custom_gradient,
)

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

    @custom_gradient
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
