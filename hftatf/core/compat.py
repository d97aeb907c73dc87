"""Every access to private Keras and TensorFlow API, in one place.

A Keras or TensorFlow minor release may rename or remove any of these:
this module is where to look when one does. Each entry says which public
API is missing and the versions it was checked on (Keras 3.15, TensorFlow
2.21, JAX 0.10 unless it says otherwise). Other hftatf modules import
private names from here, never from `keras.src` or `tensorflow.python`.
"""

# -- training --
# What `FusedModel` (hftatf.model, hftatf.training) and its passes and seeds
# take from Keras's and TensorFlow's private API, one line each saying which
# public API is missing (checked on Keras 3.15.1, TensorFlow 2.21).

import keras  # noqa: E402
from keras.src.backend import (  # noqa: E402,F401
    # No public symbolic run of a function (`keras.ops` has it per op).
    compute_output_spec,
    # No public read or write of a tensor's Keras mask (`_keras_mask`).
    get_keras_mask,
    set_keras_mask,
)

# No public division of a loss by the number of replicas (Keras's own
# losses do it inside `Loss.__call__`).
from keras.src.losses.loss import (  # noqa: E402,F401
    scale_loss_for_distribution,
    unscale_loss_for_distribution,
)

# No public class for what `Model.compile` builds from loss and metric
# arguments (names, nested outputs, loss weights, "accuracy").
from keras.src.trainers.compile_utils import (  # noqa: E402,F401
    CompileLoss,
    CompileMetrics,
)

# No public test of whether every layer supports XLA (`jit_compile="auto"`).
from keras.src.trainers.trainer import model_supports_jit  # noqa: E402,F401

# No public way to keep attributes set in `compile` out of tracking.
from keras.src.utils.tracking import (  # noqa: E402,F401
    no_automatic_dependency_tracking,
)

# Private methods of `keras.Model` that `FusedModel` overrides, for want of
# a public hook (tests/test_model.py checks that Keras still has them):
TRAINER_OVERRIDES = (
    # builds the per-model losses and metrics before a strategy traces.
    "_symbolic_build",
    # decides `jit_compile="auto"`.
    "_resolve_auto_jit_compile",
    # the order of `evaluate`'s list of results.
    "_flatten_metrics_in_order",
)


def flatten_layers(layer, include_self=True):
    """`layer` and every layer inside it, depth first: no public API lists
    the layers nested in layers (`Layer._flatten_layers`)."""
    return layer._flatten_layers(include_self=include_self)


def compile_config(model):
    """The arguments of `model`'s last `compile`, as a dict to update:
    `get_compile_config` returns a serialized copy."""
    return model._compile_config.config


def distribute_strategy(model):
    """The strategy `model` was built under, None outside one: the public
    `distribute_strategy` gives the default strategy there."""
    return model._distribute_strategy


def tracked_metrics(model):
    """The metrics tracked as attributes of `model` (`Model._metrics`): no
    public API lists them apart from the compiled ones."""
    return model._metrics


def inputs_structure(model):
    """The structure `model`'s inputs were given in (`_inputs_struct`): no
    public API keeps whether a functional model took a dict or a list."""
    return model._inputs_struct


def seed_generators(layer):
    """The `keras.random.SeedGenerator`s of `layer` itself (no public
    listing)."""
    return getattr(layer, "_seed_generators", ())


def make_step_function(model, step):
    """`step` wrapped by the TensorFlow trainer as Keras wraps its
    `train_step` (distribution, XLA, `steps_per_execution`):
    `TensorFlowTrainer._make_function` has no public counterpart."""
    return model._make_function(step)


def trainer_overrides_missing():
    """The names of `TRAINER_OVERRIDES` that `keras.Model` lacks."""
    return [name for name in TRAINER_OVERRIDES
            if not callable(getattr(keras.Model, name, None))]


def tensorflow_random_ops_util():
    """TensorFlow's module that turns a stateless draw's seed into a key
    and counter: no public API lets draws take their key from the seed
    (`hftatf.seeds`). TensorFlow is imported here, on use, so that this
    module stays importable without it."""
    from tensorflow.python.ops import random_ops_util

    return random_ops_util


def keras_logits(tensor):
    """The logits Keras keeps on a softmax or sigmoid output (its
    crossentropy reads them for exactness), or None: no public API gives
    them (`_keras_logits`)."""
    return getattr(tensor, "_keras_logits", None)
