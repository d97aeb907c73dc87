"""The per-thread state of a fused optimizer's step, and variable reads.

A step keeps, per optimizer, the mask of the models it applies to
(`MASKS`), its cache of broadcast hyper-parameters (`BROADCASTS`) and the
models whose sparse gradients global clipping merged (`MERGED`). They are
kept per thread: tf.distribute runs each replica in a thread of its own.
"""

import contextlib
import threading

import keras
from keras import ops

from hftatf import sparse

MASKS = threading.local()
BROADCASTS = threading.local()
MERGED = threading.local()


def entry(store, optimizer):
    """This thread's entry of `optimizer` in `store`, or None."""
    return store.__dict__.get(id(optimizer))


@contextlib.contextmanager
def set_for(store, optimizer, value):
    """Within, this thread's entry of `optimizer` in `store` (a
    `threading.local`) is `value`, unless `value` is None; the previous
    entry (or none) is restored after."""
    entries = store.__dict__
    previous = entries.get(id(optimizer))
    if value is not None:
        entries[id(optimizer)] = value
    try:
        yield
    finally:
        if previous is None:
            entries.pop(id(optimizer), None)
        else:
            entries[id(optimizer)] = previous


def unwrap(variable):
    """The backend variable of a Keras variable; anything else as it is."""
    return variable.value if isinstance(variable, keras.Variable) else variable


def read(variable):
    """The value of a Keras or backend variable, as a tensor: a snapshot,
    which later assignments to the variable do not change."""
    return ops.copy(unwrap(variable))


def dense(value, variable):
    """`value`, sparse or dense, as a dense tensor of `variable`'s shape
    and dtype."""
    return ops.cast(sparse.dense(value, variable.shape), variable.dtype)


def rows_of(value, variable):
    """`value` as TensorFlow's variables add it: a sparse value of rows of
    the model axis as it is (scattered), one of finer rows made dense."""
    if sparse.is_sparse(value) and sparse.rows_per_model(
            value, variable.shape) > 1:
        return sparse.dense(value, variable.shape)
    return value
