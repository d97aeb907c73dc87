"""The model axis: every way hftatf slices, joins or moves it.

Activations are `[batch, B, ...]` (axis 1 is the model axis) or, in the
models-first layout, `[B, batch, ...]` (axis 0); weights are `[B, ...]`.
Each operation on that axis has one name here:

    repeat_models      a shared `[batch, ...]` tensor as every model's
    to_model_rank      `[B]` per-model values as `[B, 1, ..., 1]`
    select_models      some models' slices from one tensor, the rest's
                       from another
    split_models       the B per-model tensors of one tensor
    pieces_if_stacked  the B tensors a tensor was stacked from, if it was
    stack_models       B per-model tensors as one tensor
    stack_values       B per-model eager values (weight slices, results)
                       as one `[B, ...]` tensor
    map_models         a per-sample function on each model's piece
    take_models        models `start:start + count`
    take_model         model `b`'s slice of a `[B, ...]` weight
    concat_models      groups of models joined on the model axis
    swap_model_axis    `[batch, B, ...]` <-> `[B, batch, ...]`
    fold_models        `[batch, B, ...]` -> `[batch * B, ...]`
    unfold_models      the inverse of `fold_models`

Operations that rearrange whole activations keep what Keras attaches to
them (the logits it caches on softmax and sigmoid outputs, which its
crossentropy reads; masks where they say so), so that losses and metrics
read each model's outputs as they read a stock model's.
"""

import keras
import numpy as np
from keras import ops

from hftatf.core import compat, tensorflow_compat

# The model axis of `[batch, B, ...]` activations.
MODEL_AXIS = 1


def model_axis_of(models_first):
    """The model axis of fused activations: 0 with the models first
    (`[B, batch, ...]`), else 1 (`[batch, B, ...]`)."""
    return 0 if models_first else MODEL_AXIS


def repeat_models(tensor, num_models, axis=MODEL_AXIS):
    """A shared `[batch, ...]` tensor (an input or its mask) as every
    model's: `[batch, B, ...]` (`[B, batch, ...]` for `axis=0`)."""
    return rearranged(lambda t: ops.repeat(
        ops.expand_dims(t, axis), num_models, axis=axis), tensor)


def to_model_rank(values, ndim):
    """`[B]` per-model values as `[B, 1, ..., 1]` of rank `ndim`, to
    broadcast against a `[B, ...]` weight."""
    return ops.reshape(values, (-1,) + (1,) * (ndim - 1))


def select_models(models, x, y):
    """`x`'s slices of the models where the `[B]` booleans `models` hold,
    `y`'s of the others (`[B, ...]` tensors of one shape and dtype).

    On TensorFlow, the select of whole rows that a rank-1 condition makes
    (`tf.compat.v1.where`): it copies each model's slice at once, where
    `tf.where` broadcasts the `[B, 1, ..., 1]` condition to every element
    and costs a partial step (frozen models) more time than the update it
    selects from. Elsewhere `keras.ops.where`, which XLA fuses into the
    computation of `x`."""
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        return tf.compat.v1.where(models, x, y)
    return ops.where(to_model_rank(models, len(x.shape)), x, y)


def pieces_if_stacked(tensor, num_models, axis):
    """The B per-model tensors that `tensor` was stacked from on the model
    `axis`, in a traced graph; None where it was made otherwise (or
    eagerly, where tensors keep no record of their op).

    A per-model computation (B stock convolutions on a CPU) stacks its
    results into one `[B, ...]` tensor for the array's next layer. Where
    that layer computes per model too (the next convolution, an
    activation, a normalization), it takes the pieces themselves: the
    stacked copy then has no reader and TensorFlow never computes it, and
    the backward pass needs no stacked gradient either. On a CPU each
    stack is a copy of the activations (and one of their gradients).
    """
    if num_models in (None, 1):
        return None
    op = _traced_op(tensor)
    if op is None or op.type != "Pack" or len(op.inputs) != num_models:
        return None
    stacked_axis = op.get_attr("axis")
    if stacked_axis < 0:
        if tensor.shape.rank is None:
            return None
        stacked_axis += tensor.shape.rank
    return list(op.inputs) if stacked_axis == axis else None


def split_models(tensor, num_models, axis=MODEL_AXIS):
    """The B per-model tensors of `tensor` (the model `axis` dropped),
    with their slices of its logits and mask (a mask with the model axis
    is split, a shared one given to every model).

    Copies are avoided where they can be: a tensor stacked from per-model
    tensors gives those (`pieces_if_stacked`); one just transposed from
    the models-first layout (`swap_model_axis`) is transposed back and
    split on its first axis (TensorFlow's optimizers cancel the two
    transposes, and slices of the leading axis are views). Slices along
    another axis are copies; a single model's is a reshape.
    """
    pieces = _split(tensor, num_models, axis)
    logits = compat.keras_logits(tensor)
    if logits is not None:
        for piece, piece_logits in zip(
                pieces, _split(logits, num_models, axis)):
            compat.keep_logits(piece, piece_logits)
    mask = compat.get_keras_mask(tensor)
    if mask is not None:
        if mask_has_model_axis(tensor, mask):
            masks = _split(mask, num_models, axis)
        elif len(mask.shape) == len(tensor.shape) - 2:
            masks = [mask] * num_models
        else:
            masks = [None] * num_models
        for piece, piece_mask in zip(pieces, masks):
            if piece_mask is not None:
                compat.set_keras_mask(piece, piece_mask)
    return pieces


def _split(tensor, num_models, axis):
    """`split_models` of the tensor alone."""
    pieces = pieces_if_stacked(tensor, num_models, axis)
    if pieces is not None:
        return pieces
    if isinstance(tensor, keras.Variable):
        # JAX's ops take a variable's value, never the variable.
        tensor = tensor.value
    if num_models == 1:
        return [ops.squeeze(tensor, axis)]
    swap = (1, 0, *range(2, len(tensor.shape)))
    if axis == 1 and _transposed_by(tensor, swap):
        return ops.unstack(ops.transpose(tensor, swap), num_models, axis=0)
    return unstack(tensor, num_models, axis)


def unstack(tensor, num, axis):
    """`keras.ops.unstack(tensor, num, axis=axis)`, whose gradient is one
    stack of the pieces' gradients. On TensorFlow it is. On JAX, Keras
    slices the `num` pieces one by one, and the gradient of each slice is
    a zero tensor of the whole shape around it: `num` of them, summed,
    where one concatenation does (a per-model 1x1 convolution's training
    step of 3 models took 92 ms that way, 71 ms by a split)."""
    if keras.backend.backend() == "tensorflow":
        return ops.unstack(tensor, num, axis=axis)
    return [ops.squeeze(piece, axis)
            for piece in ops.split(tensor, num, axis=axis)]


def _transposed_by(tensor, order):
    """Whether `tensor` is, in a traced graph, the output of a transpose
    by `order`."""
    op = _traced_op(tensor)
    if op is None or op.type != "Transpose":
        return False
    import tensorflow as tf

    perm = tf.get_static_value(op.inputs[1])
    return perm is not None and tuple(perm.tolist()) == order


def _traced_op(tensor):
    """The TensorFlow op that made `tensor` in a traced graph; None for an
    eager tensor, and on other backends, whose tensors keep no record of
    the op that made them."""
    if keras.backend.backend() != "tensorflow":
        return None
    import tensorflow as tf

    if tf.executing_eagerly() or not isinstance(tensor, tf.Tensor):
        return None
    return getattr(tensor, "op", None)


def stack_models(pieces, axis=MODEL_AXIS):
    """Inverse of `split_models`: the per-model tensors, stacked on the
    model `axis` (read back as pieces by the next per-model layer), with
    their logits and masks stacked alike where every piece has them."""
    def stack(tensors):
        if len(tensors) == 1:
            return ops.expand_dims(tensors[0], axis)
        return ops.stack(tensors, axis=axis)

    output = carry_logits(stack(pieces), pieces, stack)
    masks = [compat.get_keras_mask(p) for p in pieces]
    if pieces and all(m is not None for m in masks):
        compat.set_keras_mask(output, stack(masks))
    return output


# Values joined by one eager stack at most: see `stack_values`.
_STACKED_AT_ONCE = 64


def stack_values(values):
    """B per-model values outside any traced step (weight slices drawn
    one by one, the models' results at the end of an epoch), of one shape,
    as one `[B, ...]` tensor, bit for bit.

    NumPy values are stacked on the host. Others are stacked
    `_STACKED_AT_ONCE` at a time, and those stacks joined alike: on JAX an
    eager stack compiles a program for its number of operands, whose
    compile time grows faster than that number (10,000 values at once took
    minutes); stacks of at most 64 reuse a few programs."""
    values = list(values)
    if all(isinstance(v, (np.ndarray, np.generic)) for v in values):
        return np.stack(values)
    if len(values) <= _STACKED_AT_ONCE:
        return ops.stack(values)
    stacks = [ops.stack(values[start:start + _STACKED_AT_ONCE])
              for start in range(0, len(values), _STACKED_AT_ONCE)]
    while len(stacks) > 1:
        stacks = [ops.concatenate(stacks[start:start + _STACKED_AT_ONCE])
                  for start in range(0, len(stacks), _STACKED_AT_ONCE)]
    return stacks[0]


def map_models(function, tensor, num_models, axis=MODEL_AXIS):
    """`function` (element-wise, or per sample) on `tensor`: on each of
    its pieces where it was stacked from them (`pieces_if_stacked`), then
    stacked again; on `tensor` itself otherwise."""
    pieces = pieces_if_stacked(tensor, num_models, axis)
    if pieces is None:
        return function(tensor)
    return stack_models([function(piece) for piece in pieces], axis)


def take_models(tensor, start, count, axis=0):
    """`tensor`'s models `start:start + count` on `axis`. `start` is a
    Python int, or a scalar tensor inside a loop over groups of models,
    where the slice keeps its static size."""
    if isinstance(start, int):
        index = (slice(None),) * axis + (slice(start, start + count),)
        return tensor[index]
    rank = len(tensor.shape)
    begin = [ops.cast(start, "int32") if d == axis else 0
             for d in range(rank)]
    size = [count if d == axis else -1 for d in range(rank)]
    return ops.slice(tensor, begin, size)


def take_model(stacked, index):
    """`stacked[index]`, model `index`'s slice of a `[B, ...]` tensor (a
    weight's value). On TensorFlow its gradient stays sparse: a sparse
    gradient of the slice (a stock `tf.gather`'s on it, e.g. an
    `Embedding` run per model) becomes the same rows of the weight,
    `index * R` further (`R` rows per model, see `hftatf.sparse`), where
    slicing would make it dense. Other backends' gradients are dense."""
    if keras.backend.backend() != "tensorflow":
        return stacked[index]
    import tensorflow as tf

    num_models = stacked.shape[0]

    @tensorflow_compat.custom_gradient
    def slice_(stacked):
        def gradient(upstream):
            if not isinstance(upstream, tf.IndexedSlices):
                return tf.pad(upstream[None], [[index, num_models - index - 1]]
                              + [[0, 0]] * len(upstream.shape))
            dense_shape = tf.cast(upstream.dense_shape, "int64")
            rows = dense_shape[0]
            return tf.IndexedSlices(
                upstream.values,
                upstream.indices + tf.cast(index * rows,
                                           upstream.indices.dtype),
                dense_shape=tf.concat([[num_models * rows],
                                       dense_shape[1:]], 0))

        return tf.identity(stacked[index]), gradient

    return slice_(stacked)


def concat_models(parts, axis=MODEL_AXIS):
    """Joins `[batch, k, ...]` tensors of consecutive groups of models on
    the model axis, keeping their logits and their masks (per-model masks
    joined, a shared one kept)."""
    if len(parts) == 1:
        return parts[0]

    def concatenate(tensors):
        return ops.concatenate(tensors, axis=axis)

    output = carry_logits(concatenate(parts), parts, concatenate)
    masks = [compat.get_keras_mask(t) for t in parts]
    if all(m is not None for m in masks):
        compat.set_keras_mask(output, concatenate(masks) if mask_has_model_axis(
            parts[0], masks[0]) else masks[0])
    return output


def swap_model_axis(tensor):
    """`[batch, B, ...]` <-> `[B, batch, ...]`, with its logits.

    A tensor stacked on one of the two axes (by a per-model layer, or
    from B copies of a shared one) is stacked on the other instead: a
    per-model layer then reads the pieces with no transpose at all. Where
    one of the two axes has size one, the swap is a reshape."""
    for axis in (0, 1):
        pieces = pieces_if_stacked(tensor, tensor.shape[axis], axis)
        if pieces is not None:
            return stack_models(pieces, 1 - axis)
    for axis in (0, 1):
        if tensor.shape[axis] == 1:
            return rearranged(lambda t, a=axis: ops.expand_dims(
                ops.squeeze(t, a), 1 - a), tensor)
    return rearranged(lambda t: ops.swapaxes(t, 0, 1), tensor)


def fold_models(tensor):
    """`[batch, B, *s]` -> `[batch * B, *s]` (and `[B, batch, *s]` ->
    `[B * batch, *s]`): the models' samples side by side in one batch."""
    return rearranged(
        lambda t: ops.reshape(t, (-1, *ops.shape(t)[2:])), tensor)


def unfold_models(tensor, num_models, models_first=False):
    """The inverse of `fold_models`: `[batch * B, *s]` -> `[batch, B, *s]`,
    or `[B * batch, *s]` -> `[B, batch, *s]` with `models_first`."""
    if models_first:
        shape = (num_models, -1)
    else:
        shape = (-1, num_models)
    return rearranged(
        lambda t: ops.reshape(t, (*shape, *ops.shape(t)[1:])), tensor)


def mask_has_model_axis(tensor, mask):
    """Whether the mask Keras keeps on an array's output `tensor`
    (`[batch, B, ..., features]`) is per model (`[batch, B, ...]`), rather
    than shared by the models (`[batch, ...]`)."""
    return len(mask.shape) == len(tensor.shape) - 1


def carry_logits(output, sources, transform):
    """`output`, which is `transform(sources)` for a list of tensors
    `sources` rearranged (stacked, reshaped, transposed), with the logits
    Keras caches on softmax and sigmoid outputs carried over:
    `transform([logits of s for s in sources])`, where every source has
    them. Keras's crossentropy reads them instead of the probabilities,
    for exactness where the probabilities saturate; a rearrangement would
    lose them."""
    logits = [compat.keras_logits(s) for s in sources]
    if sources and all(t is not None for t in logits):
        compat.keep_logits(output, transform(logits))
    return output


def rearranged(transform, tensor):
    """`transform(tensor)` for a layout change (reshape, transpose, ...),
    keeping the logits Keras caches on softmax and sigmoid outputs."""
    return carry_logits(transform(tensor), [tensor],
                        lambda logits: transform(logits[0]))
