"""The arguments of a stock layer's call, apart from its per-model tensors.

`FusedPerModel` runs a stock layer once per model: each call takes that
model's slice of the tensor arguments, and the other arguments (flags,
shapes, constants) as they were given. `split_arguments` takes the tensors
out of a call's arguments, leaving marks in their places;
`filled_arguments` puts a model's tensors back.
"""

import keras
import numpy as np
from keras import ops

# Marks where a tensor argument of the stock call sits in the arguments
# `split_arguments` returns (`FusedPerModel`'s `stock_arguments`).
_TENSOR = "__hftatf_tensor__"


def split_arguments(args, kwargs):
    """The per-model tensors of a call's `args` and `kwargs`, in order, and
    the call's arguments with each replaced by a mark of its index.

    In a symbolic call (building a model), the symbolic tensors are the
    per-model ones and a concrete value (a NumPy array, a constant tensor)
    is a constant all models take as it is, as in the stock model; in a
    call on data, every tensor and array is per model."""
    tensors = []
    symbolic = any(isinstance(value, keras.KerasTensor)
                   for value in keras.tree.flatten((args, kwargs)))

    def mark(value):
        concrete = ops.is_tensor(value) or isinstance(value, np.ndarray)
        if isinstance(value, keras.KerasTensor) or (
                concrete and not symbolic):
            tensors.append(value)
            return {_TENSOR: len(tensors) - 1}
        return _Constant(value) if concrete else value

    arguments = {"args": keras.tree.map_structure(mark, list(args)),
                 "kwargs": keras.tree.map_structure(mark, dict(kwargs))}
    return tensors, arguments


class _Constant:
    """A constant argument of the stock call, held apart from the per-model
    tensors (Keras takes no tensors mixed with other values in one
    argument)."""

    def __init__(self, value):
        self.value = value


def _is_mark(value):
    return isinstance(value, dict) and set(value) == {_TENSOR}


def filled_arguments(arguments, tensors):
    """`(args, kwargs)` of a call, from its `arguments` with marks
    (`split_arguments`) and the `tensors` that go in their places."""
    def fill(value):
        if _is_mark(value):
            return tensors[int(value[_TENSOR])]
        if isinstance(value, _Constant):
            return value.value
        if isinstance(value, dict):
            return {key: fill(item) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(fill(item) for item in value)
        return value

    return list(fill(arguments["args"])), fill(arguments["kwargs"])
