"""Sparse gradients of `[B, ...]` weights: rows grouped by model.

The gradient of an embedding table is sparse: only the rows looked up get
one, once per occurrence of their id in the batch. Stock Keras keeps it a
`tf.IndexedSlices` of the `[input_dim, output_dim]` table, and a stock
optimizer applies its element-wise operations to each occurrence before
occurrences of the same row are summed: Adam's second moment of a row takes
`sum(g_i ** 2)` over its occurrences, not `(sum(g_i)) ** 2`; `clipnorm`
takes the norm of the occurrences.

A fused table `[B, input_dim, output_dim]` has the same gradient, model by
model, as one `tf.IndexedSlices` of the table flattened to
`[B * input_dim, output_dim]`: model `b`'s rows are
`b * input_dim ... (b + 1) * input_dim - 1`. In general an `IndexedSlices`
gradient of a `[B, ...]` weight has `dense_shape[0] = B * R` rows, `R` of
them per model (`R = 1`: rows of the model axis itself, as `tf.gather` on
the weight gives). The functions here read one such gradient per model;
`dense(gradient, variable.shape)` makes it dense (`tf.convert_to_tensor`
gives the flattened `[B * R, ...]`).

Only TensorFlow makes sparse gradients (Keras on JAX applies embedding
gradients dense), so this module imports TensorFlow only where it is given
one.
"""

import math

from keras import ops

from hftatf.core.optional import imported_tensorflow, tensorflow


def _tf():
    return tensorflow("A sparse (tf.IndexedSlices) gradient")


def _segment_reduction(name):
    """TensorFlow's `tf.math.{name}`, imported where it is called: only a
    sparse gradient's rows are joined by it."""
    return lambda *args: getattr(_tf().math, name)(*args)


def is_sparse(gradient):
    tf = imported_tensorflow()
    return tf is not None and isinstance(gradient, tf.IndexedSlices)


def rows_per_model(gradient, shape):
    """`R`, for a gradient of a weight of static `shape` `[B, ...]`: the
    product of the dimensions its rows stand for (`shape[1:k]`, where the
    values are `[n, *shape[k:]]`)."""
    k = len(shape) - len(gradient.values.shape) + 1
    return math.prod(shape[1:k])


def model_ids(gradient, num_models):
    """`[n]`: the model each row of `gradient` belongs to."""
    indices = gradient.indices
    rows = ops.cast(gradient.dense_shape[0], indices.dtype) // num_models
    return indices // rows


def dense(gradient, shape):
    """`gradient` as a dense tensor of `shape` (occurrences of a row
    summed), or unchanged where it is dense already."""
    if not is_sparse(gradient):
        return gradient
    return ops.reshape(_tf().convert_to_tensor(gradient), shape)


def identity(gradient):
    """`tf.identity` of a dense or sparse gradient (of each of its
    parts)."""
    tf = _tf()
    if not is_sparse(gradient):
        return tf.identity(gradient)
    return tf.IndexedSlices(tf.identity(gradient.values),
                            tf.identity(gradient.indices),
                            tf.identity(gradient.dense_shape))


def with_values(gradient, values):
    """`gradient` with `values` in place of its own (one per occurrence;
    for a dense gradient, `values` itself)."""
    if not is_sparse(gradient):
        return values
    return _tf().IndexedSlices(values, gradient.indices, gradient.dense_shape)


def at_rows(tensor, gradient, num_models):
    """`[n, ...]`: the rows of `tensor` (a `[B, ...]` tensor of the
    weight's shape, or a `[B, 1, ..., 1]` per-model value) at each
    occurrence of `gradient`, to combine with its values element-wise."""
    values = gradient.values
    if all(d == 1 for d in tensor.shape[1:]):
        per_model = ops.reshape(tensor, (num_models,)
                                + (1,) * (len(values.shape) - 1))
        return ops.take(per_model, model_ids(gradient, num_models), axis=0)
    # (The values' static shape may be unknown after a cross-replica sum.)
    rest = tuple(tensor.shape[len(tensor.shape) - len(values.shape) + 1:])
    rows = ops.reshape(tensor, (-1,) + rest)
    return ops.take(rows, gradient.indices, axis=0)


def merged(gradient, models, num_models):
    """`gradient` with the occurrences of each row of the models where the
    `[B]` boolean `models` holds summed into one (the others' as they
    are): what a stock optimizer applies after an operation that makes its
    gradient dense."""
    indices = gradient.indices
    keys = ops.where(ops.take(models, model_ids(gradient, num_models)),
                     ops.cast(indices, "int64"),
                     ops.cast(gradient.dense_shape[0], "int64")
                     + ops.arange(ops.shape(indices)[0], dtype="int64"))
    tf = _tf()
    keys, segments = tf.unique(keys)
    count = ops.shape(keys)[0]
    return tf.IndexedSlices(
        tf.math.unsorted_segment_sum(gradient.values, segments, count),
        tf.math.unsorted_segment_max(indices, segments, count),
        gradient.dense_shape)


def reduce_per_model(tensor, num_models, reduce_rows, join_rows):
    """`[B]`: each model's elements of a `[B, ...]` tensor reduced by
    `reduce_rows` (`[rows, n] -> [rows]`). For a sparse gradient, each of
    its rows is reduced and a model's rows joined by `join_rows` (a
    segment reduction, e.g. `tf.math.unsorted_segment_sum`)."""
    if is_sparse(tensor):
        values = tensor.values
        rows = reduce_rows(ops.reshape(values, (ops.shape(values)[0], -1)))
        return join_rows(rows, model_ids(tensor, num_models), num_models)
    return reduce_rows(ops.reshape(tensor, (num_models, -1)))


def sum_per_model(gradient, num_models, values):
    """`[B]`: the sum of each model's `values` (one per occurrence of
    `gradient`, `[n, ...]`)."""
    return reduce_per_model(with_values(gradient, values), num_models,
                            lambda rows: ops.sum(rows, axis=1),
                            _segment_reduction("unsorted_segment_sum"))


def total_per_model(tensor, num_models):
    """`[B]`: the sum of each model's elements of a `[B, ...]` tensor (or
    sparse gradient)."""
    return reduce_per_model(tensor, num_models,
                            lambda rows: ops.sum(rows, axis=1),
                            _segment_reduction("unsorted_segment_sum"))


def finite_per_model(tensor, num_models):
    """`[B]` booleans: whether each model's elements of a `[B, ...]`
    tensor (or sparse gradient) are all finite."""
    return reduce_per_model(
        tensor, num_models,
        lambda rows: ops.cast(ops.all(ops.isfinite(rows), axis=1), "int32"),
        _segment_reduction("unsorted_segment_min")) > 0


def offset(gradient, start, count):
    """A gradient of models `start:start + count`, as rows of the whole
    array's weight: its indices moved by `start` models."""
    rows = ops.cast(gradient.dense_shape[0], gradient.indices.dtype) // count
    return gradient.indices + ops.cast(start, gradient.indices.dtype) * rows
