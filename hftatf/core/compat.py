"""Every access to private Keras and TensorFlow API, in one place.

A Keras or TensorFlow minor release may rename or remove any of these:
this module is where to look when one does. Each entry says which public
API is missing and the versions it was checked on (Keras 3.15, TensorFlow
2.21, JAX 0.10 unless it says otherwise). Other hftatf modules import
private names from here, never from `keras.src` or `tensorflow.python`.
"""


# -- layers --

from keras.src import backend as _keras_backend  # noqa: E402
from tensorflow.python.ops import control_flow_util  # noqa: E402


def get_keras_mask(tensor):
    """The mask Keras keeps on `tensor`, or None. Keras exports no getter
    (checked on Keras 3.15)."""
    return _keras_backend.get_keras_mask(tensor)


def set_keras_mask(tensor, mask):
    """Attaches `mask` to `tensor` as Keras keeps masks. Keras exports no
    setter (checked on Keras 3.15)."""
    _keras_backend.set_keras_mask(tensor, mask)


def graph_in_xla_context(graph):
    """Whether `graph` (or a graph it is nested in) is compiled by XLA.
    TensorFlow has no public API for it (checked on TF 2.21)."""
    return control_flow_util.GraphOrParentsInXlaContext(graph)


def keras_logits(tensor):
    """The logits Keras caches on a softmax or sigmoid output (the private
    attribute `_keras_logits`, which its crossentropy reads; no public
    API, checked on Keras 3.15), or None."""
    return getattr(tensor, "_keras_logits", None)


def keep_logits(tensor, logits):
    """Attaches `logits` to `tensor` as Keras caches them on softmax and
    sigmoid outputs (where the tensor type takes attributes; see
    `keras_logits`)."""
    try:
        tensor._keras_logits = logits
    except AttributeError:
        pass
