"""Every access to private Keras and TensorFlow API, in one place.

A Keras or TensorFlow minor release may rename or remove any of these:
this module is where to look when one does. Each entry says which public
API is missing and the versions it was checked on (Keras 3.15, TensorFlow
2.21, JAX 0.10 unless it says otherwise). Other hftatf modules import
private names from here, never from `keras.src` or `tensorflow.python`.
"""

# -- conversion and export --
#
# hftatf.graph, .fuse, .rewrite, .export, .serving, .backup, .callbacks,
# .tuning and the model zoo.
# Checked on Keras 3.15 and TensorFlow 2.21.

from keras.src.backend.common import global_state  # noqa: E402
from keras.src.losses.loss import (  # noqa: E402,F401
    scale_loss_for_distribution,
    unscale_loss_for_distribution,
)
from keras.src.models.functional import Functional  # noqa: E402,F401
from keras.src.random import seed_generator  # noqa: E402
from keras.src.trainers.data_adapters import get_data_adapter  # noqa: E402,F401
from keras.src.utils.io_utils import print_msg  # noqa: E402,F401

# `Functional` is the class of functional models, whose methods an
# overriding subclass replaces (no public name). `print_msg` prints as
# Keras' own callbacks do (to absl logging where Keras is told to). The
# data adapter reads the first batch of anything `fit` takes. The loss
# scaling for distribution is what Keras losses apply under a strategy
# (the zoo's GAN steps compute their losses themselves).


def is_functional_graph(model):
    """Whether `model` records its graph as a functional model does (no
    public test: a subclassed model has no nodes)."""
    return hasattr(model, "_nodes_by_depth")


def nodes_by_depth(model):
    """`{depth: [node]}` of a functional model (no public graph API)."""
    return model._nodes_by_depth


def keras_history(tensor):
    """The `(operation, node_index, tensor_index)` that made a symbolic
    tensor (no public accessor)."""
    return tensor._keras_history


def run_through_graph(model, inputs, call_fn):
    """Runs a functional model's graph on `inputs`, calling
    `call_fn(operation, *args, **kwargs)` for each operation (no public
    graph traversal)."""
    return model._run_through_graph(inputs, operation_fn=lambda op: op,
                                    call_fn=call_fn)


def flatten_layers(layer, include_self=True):
    """Every layer inside `layer`, nested ones included (no public
    recursive listing)."""
    return layer._flatten_layers(include_self=include_self)


def compile_config(model):
    """The arguments `model.compile` was called with ({} if it was not;
    `get_compile_config` returns them serialized)."""
    return model._compile_config.config if model.compiled else {}


def metric_direction(metric):
    """`"up"` or `"down"`: whether `metric` improves by growing, as Keras'
    callbacks read it in mode "auto"; None where it does not say."""
    return getattr(metric, "_direction", None)


def set_initial_epoch(model, epoch):
    """Makes `fit` start at `epoch`, as `keras.callbacks.BackupAndRestore`
    does on resuming (no public setter)."""
    model._initial_epoch = epoch


def seed_generators(layer):
    """The seed generators of `layer` itself (not of layers inside it)."""
    return getattr(layer, "_seed_generators", ())


def global_seed_generator(create=True):
    """The generator unseeded random ops draw from; None if none was made
    and not `create` (no public accessor)."""
    if create:
        return seed_generator.global_seed_generator()
    return global_state.get_global_attribute(
        seed_generator.GLOBAL_SEED_GENERATOR)


def exclude_from_weight_decay_like(optimizer, source):
    """Gives `optimizer` the weight-decay exclusions of `source` (the
    variable names; `exclude_from_weight_decay` takes variables or names,
    but no getter returns them)."""
    pattern = getattr(source, "_exclude_from_weight_decay_pattern", None)
    if pattern is not None:
        optimizer._exclude_from_weight_decay = set()
        optimizer._exclude_from_weight_decay_pattern = pattern
        optimizer._exclude_from_weight_decay_cache = {}


def scalar_summary_metadata():
    """The metadata of TensorBoard's scalars plugin (what `tf.summary
    .scalar` writes, which needs the tensorboard package); writing it with
    `tf.summary.write` needs only TensorFlow."""
    # TensorFlow's protocol buffers have no public module.
    from tensorflow.core.framework import summary_pb2

    return summary_pb2.SummaryMetadata(
        plugin_data=summary_pb2.SummaryMetadata.PluginData(
            plugin_name="scalars"))

