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


# Keras classes and helpers the fused layers mirror or recognise. Keras
# exports none of these (checked on Keras 3.15).
from keras.src.applications import convnext as _convnext  # noqa: E402
from keras.src.applications import (  # noqa: E402
    inception_resnet_v2 as _inception_resnet_v2,
)
from keras.src.backend.common import backend_utils as _backend_utils  # noqa: E402
from keras.src.backend.common import global_state as _global_state  # noqa: E402
from keras.src.backend.tensorflow import random as _tf_random  # noqa: E402
from keras.src.layers.attention import (  # noqa: E402
    multi_head_attention as _multi_head_attention,
)
from keras.src.layers.convolutional import (  # noqa: E402
    base_conv as _base_conv,
)
from keras.src.layers.convolutional import (  # noqa: E402
    base_conv_transpose as _base_conv_transpose,
)
from keras.src.layers.convolutional import (  # noqa: E402
    base_depthwise_conv as _base_depthwise_conv,
)
from keras.src.layers.convolutional import (  # noqa: E402
    base_separable_conv as _base_separable_conv,
)
from keras.src.layers.rnn import conv_lstm as _conv_lstm  # noqa: E402
from keras.src.layers.rnn import dropout_rnn_cell as _dropout_rnn_cell  # noqa: E402
from keras.src.ops import operation_utils as _operation_utils  # noqa: E402
from keras.src.random import seed_generator as _seed_generator  # noqa: E402
from keras.src.utils import argument_validation as _validation  # noqa: E402
from keras.src.utils import is_default as _is_default  # noqa: E402
from tensorflow.python.trackable import resource as _resource  # noqa: E402

# keras.applications layers that hftatf fuses (folded, or a fused form).
LayerScale = _convnext.LayerScale
StochasticDepth = _convnext.StochasticDepth  # draws without a SeedGenerator
CustomScaleLayer = _inception_resnet_v2.CustomScaleLayer

# The stock einsum equations of MultiHeadAttention: using them keeps the
# fused weights' shapes and the order of attention axes the stock layer's.
build_attention_equation = _multi_head_attention._build_attention_equation
build_proj_equation = _multi_head_attention._build_proj_equation
projection_output_shape = _multi_head_attention._get_output_shape

# The stock layers' argument checks and output shapes.
standardize_tuple = _validation.standardize_tuple
standardize_padding = _validation.standardize_padding
compute_conv_output_shape = _operation_utils.compute_conv_output_shape
compute_conv_transpose_output_shape = (
    _backend_utils.compute_conv_transpose_output_shape)

# The stock recurrent machinery the fused cells and ConvLSTMs reuse.
DropoutRNNCell = _dropout_rnn_cell.DropoutRNNCell
ConvLSTM = _conv_lstm.ConvLSTM

# The stock base classes of the four convolution families.
STOCK_CONVOLUTIONS = (_base_conv.BaseConv,
                      _base_conv_transpose.BaseConvTranspose,
                      _base_depthwise_conv.BaseDepthwiseConv,
                      _base_separable_conv.BaseSeparableConv)

# State outside Keras variables (a lookup table's; TensorFlow 2.21
# exports no base class of its resources).
CapturableResource = _resource.CapturableResource


def inner_layers(layer, include_self=True):
    """`layer` (where `include_self`) and every layer inside it, outer
    layers first: Keras's `_flatten_layers`, which it does not export
    (checked on Keras 3.15)."""
    return list(layer._flatten_layers(include_self=include_self))


def inbound_nodes(layer):
    """The nodes of the calls of `layer` in functional graphs
    (`_inbound_nodes`; Keras 3.15 exports no accessor)."""
    return layer._inbound_nodes


def call_takes_training(layer):
    """Whether `layer.call` takes `training` (Keras's own private flag,
    checked on Keras 3.15; a public alternative would inspect `call`)."""
    return layer._call_has_training_arg


def call_takes_mask(layer):
    """Whether `layer.call` takes `mask` (as `call_takes_training`)."""
    return layer._call_has_mask_arg


def lambda_output_shape(layer):
    """The `output_shape` a stock `Lambda` was built with (private; Keras
    3.15 exports it only inside `get_config`, serialized)."""
    return layer._output_shape


def has_default_build(layer):
    """Whether `layer.build` is the stock default (Keras's `is_default`,
    not exported in Keras 3.15)."""
    return _is_default(layer.build)


def random_crop_seed_generator(layer):
    """The seed generator a stock `RandomCrop` draws its windows from
    (private `_get_seed_generator`, Keras 3.15)."""
    return layer._get_seed_generator(layer.backend._backend)


def draw_tf_seed(seed_generator):
    """The next seed of `seed_generator` as TensorFlow's stateless random
    ops take it, as the stock TensorFlow backend draws (Keras 3.15 exports
    neither `draw_seed` nor the cast)."""
    return _tf_random._cast_seed(_seed_generator.draw_seed(seed_generator))


def global_seed_generator():
    """Keras's global seed generator (which unseeded draws advance), or
    None before the first; Keras 3.15 exports no accessor."""
    return _global_state.get_global_attribute(
        _seed_generator.GLOBAL_SEED_GENERATOR)


def reset_global_seed_generator():
    """Forgets Keras's global seed generator, as before the first draw."""
    _global_state.set_global_attribute(
        _seed_generator.GLOBAL_SEED_GENERATOR, None)
