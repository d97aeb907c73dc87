"""Every access to private Keras API, in one place.

A Keras minor release may rename or remove any of these: this module is
where to look when one does. Each entry says which public API is missing
and the versions it was checked on (Keras 3.15, JAX 0.10 unless it says
otherwise). Other hftatf modules import private names from here, never
from `keras.src`; private TensorFlow API (`tensorflow.python`) has its own
module, `hftatf.core.tensorflow_compat`. The few Keras entries that reach
TensorFlow import it on use, so that this module (and hftatf) imports
without TensorFlow on another Keras backend.
"""


# -- layers --

import contextlib  # noqa: E402

from keras.src import backend as _keras_backend  # noqa: E402


def get_keras_mask(tensor):
    """The mask Keras keeps on `tensor`, or None. Keras exports no getter
    (checked on Keras 3.15)."""
    return _keras_backend.get_keras_mask(tensor)


def set_keras_mask(tensor, mask):
    """Attaches `mask` to `tensor` as Keras keeps masks. Keras exports no
    setter (checked on Keras 3.15)."""
    _keras_backend.set_keras_mask(tensor, mask)


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



def inner_layers(layer, include_self=True):
    """`layer` (where `include_self`) and every layer inside it, outer
    layers first: Keras's `_flatten_layers`, which it does not export
    (checked on Keras 3.15)."""
    return list(layer._flatten_layers(include_self=include_self))


@contextlib.contextmanager
def unlocked_tracker(layer):
    """A block in which the built `layer` may add weights, as the stock
    layers' `enable_lora` unlocks theirs (`_tracker`, private in Keras
    3.15)."""
    layer._tracker.unlock()
    try:
        yield
    finally:
        layer._tracker.lock()


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
    # Keras's TensorFlow backend module imports TensorFlow.
    from keras.src.backend.tensorflow import random as _tf_random

    return _tf_random._cast_seed(_seed_generator.draw_seed(seed_generator))


def global_seed_generator(create=False):
    """Keras's global seed generator (which unseeded draws advance): made
    first where `create`, else None before the first draw; Keras 3.15
    exports no accessor."""
    if create:
        return _seed_generator.global_seed_generator()
    return _global_state.get_global_attribute(
        _seed_generator.GLOBAL_SEED_GENERATOR)


def reset_global_seed_generator():
    """Forgets Keras's global seed generator, as before the first draw."""
    _global_state.set_global_attribute(
        _seed_generator.GLOBAL_SEED_GENERATOR, None)

# -- optimizers --
# Fused optimizers (hftatf.optimizers) subclass keras.optimizers.Optimizer
# and read the state that Keras keeps in private attributes. Checked on
# Keras 3.15.

import keras  # noqa: E402
from keras.src.utils import tracking as _keras_tracking  # noqa: E402

from hftatf.core import tensorflow_compat  # noqa: E402

# Public API missing: a build() that adds variables without Keras tracking
# them as attributes (the stock LossScaleOptimizer.build uses it).
no_automatic_dependency_tracking = (
    _keras_tracking.no_automatic_dependency_tracking)

# The private methods of keras.optimizers.Optimizer that fused optimizers
# override, each with what it changes; Keras has no public hook for any.
OPTIMIZER_HOOKS = {
    "_backend_apply_gradients": "accumulation and EMA on each model's own "
                                "step count",
    "_backend_update_step": "updates restricted to some models "
                            "(model_mask); Nadam's per-step product",
    "_clip_gradients": "norms and values taken per model",
    "_apply_weight_decay": "a [B] weight decay and learning rate",
    "_all_reduce_sum_gradients": "replicas' sums of sparse gradients that "
                                 "global clipping made dense (TensorFlow "
                                 "only)",
    "_get_current_learning_rate": "[B] rates, schedules at each model's "
                                  "own step",
    "_update_model_variables_moving_average": "a [B] EMA momentum",
    "_overwrite_model_variables_with_average_value": "EMA overwrite of "
                                                     "some models only",
}

_TENSORFLOW_OPTIMIZER_HOOKS = ("_all_reduce_sum_gradients",)


def optimizer_hook(method):
    """Marks `method` as an override of the private Keras optimizer method
    of its name; raises at import if Keras no longer has that method (an
    override Keras does not call would silently do nothing)."""
    name = method.__name__
    # The optimizer of another backend has no TensorFlow-only hook.
    elsewhere = (name in _TENSORFLOW_OPTIMIZER_HOOKS
                 and keras.backend.backend() != "tensorflow")
    if name not in OPTIMIZER_HOOKS or not (
            elsewhere or hasattr(keras.optimizers.Optimizer, name)):
        raise ImportError(
            f"hftatf overrides keras.optimizers.Optimizer.{name}, which this "
            f"Keras ({keras.__version__}) does not have or hftatf does not "
            "list in hftatf.core.compat.OPTIMIZER_HOOKS. Install the Keras "
            "version hftatf supports (3.15).")
    return method


def variable_index(optimizer, variable):
    """The index of `variable` in `optimizer`'s slot lists. Public API
    missing: a variable's slot index (private `_get_variable_index`)."""
    return optimizer._get_variable_index(variable)


def variable_key(optimizer, variable):
    """The key of `variable` in `optimizer`'s exclusion sets. Public API
    missing: `_var_key` (weight-decay exclusions are kept by it)."""
    return optimizer._var_key(variable)


def trained_variables(optimizer):
    """The variables `optimizer` was built on. Public API missing: only
    private `_trainable_variables` holds them (`variables` holds the
    optimizer's own)."""
    return optimizer._trainable_variables


def step_counter(optimizer):
    """The raw step-count variable. Public API missing: `iterations`
    divides it by `gradient_accumulation_steps`; `_iterations` is private."""
    return optimizer._iterations


def learning_rate_setting(optimizer):
    """The learning rate as given (a schedule, a callable or its variable).
    Public API missing: `learning_rate` evaluates schedules; the setting is
    private `_learning_rate`."""
    return optimizer._learning_rate


def moving_averages(optimizer):
    """The EMA variables, one per trained variable (or None). Public API
    missing: private `_model_variables_moving_average`."""
    return optimizer._model_variables_moving_average


def accumulated_gradients(optimizer):
    """The gradient accumulators, one per trained variable. Public API
    missing: private `_accumulated_gradients`."""
    return optimizer._accumulated_gradients


def slot_lists(optimizer):
    """`{attribute: list}` of every list of one slot (a variable, or None)
    per trained variable that `optimizer` holds (`_momentums`,
    `_velocities`, ...). Public API missing: Keras keeps slots in private
    per-kind lists and has no public listing of them by kind."""
    trained = optimizer._trainable_variables
    return {
        attribute: value for attribute, value in vars(optimizer).items()
        if isinstance(value, (list, tuple)) and value
        and value is not optimizer._variables and value is not trained
        and len(value) == len(trained)
        and all(v is None or isinstance(v, keras.Variable) for v in value)
        and any(v is not None for v in value)}


def variable_attributes(optimizer):
    """`{attribute: variable}` of the variables `optimizer` holds as
    attributes (`_u_product`, `dynamic_scale`, ...). Public API missing:
    Keras keeps them in private attributes, unlisted."""
    return {attribute: value for attribute, value in vars(optimizer).items()
            if isinstance(value, keras.Variable)}


def weight_decay_exclusions(optimizer):
    """`(keys, pattern)` of the variables `optimizer` excludes from weight
    decay (either may be None). Public API missing: `exclude_from_weight_
    decay` sets them; only private attributes hold them."""
    return (getattr(optimizer, "_exclude_from_weight_decay", None),
            getattr(optimizer, "_exclude_from_weight_decay_pattern", None))


def set_weight_decay_exclusions(optimizer, keys=None, pattern=None):
    """Sets the exclusions `weight_decay_exclusions` reads, on a built
    optimizer too. Public API missing: `exclude_from_weight_decay` takes
    variables or names, not the keys or compiled pattern of another
    optimizer, and refuses a built optimizer."""
    if keys is not None:
        optimizer._exclude_from_weight_decay = set(keys)
    if pattern is not None:
        optimizer._exclude_from_weight_decay_pattern = pattern
        optimizer._exclude_from_weight_decay_cache = {}


def uses_weight_decay(optimizer, variable):
    """Whether `optimizer` decays `variable`. Public API missing: private
    `_use_weight_decay` applies the exclusions."""
    return optimizer._use_weight_decay(variable)


def filter_empty_gradients(optimizer, grads, variables):
    """The stock `apply`'s removal of None gradients (with its warning).
    Public API missing: private `_filter_empty_gradients`."""
    return optimizer._filter_empty_gradients(grads, variables)


def overwrite_variables_with_gradients(optimizer, grads, variables):
    """The stock `apply`'s handling of `overwrite_with_gradient` variables.
    Public API missing: private `_overwrite_variables_directly_with_
    gradients`."""
    return optimizer._overwrite_variables_directly_with_gradients(
        grads, variables)


def check_variables_are_known(optimizer, variables):
    """The stock `apply`'s check that `variables` are those built on.
    Public API missing: private `_check_variables_are_known`."""
    optimizer._check_variables_are_known(variables)


def distribution_strategy(optimizer):
    """The tf.distribute strategy the optimizer was created under. Public
    API missing: private `_distribution_strategy` (TensorFlow backend)."""
    return optimizer._distribution_strategy


def compiled_by_xla():
    """Whether the step being traced is compiled by XLA: always on JAX,
    where XLA compiles every computation (and where a cond whose branches
    assign variables leaks tracers), else whether the TensorFlow function
    is. Public API missing: `control_flow_util.GraphOrParentsInXlaContext`
    (TensorFlow 2.21)."""
    if keras.backend.backend() == "jax":
        return True
    import tensorflow as tf  # Only reached on the TensorFlow backend.

    return tensorflow_compat.graph_in_xla_context(
        tf.compat.v1.get_default_graph())

# -- conversion and export --
#
# hftatf.graph, .fuse, .rewrite, .export, .serving, .backup, .callbacks,
# .tuning and the model zoo.
# Checked on Keras 3.15 and TensorFlow 2.21.

from keras.src.losses.loss import (  # noqa: E402,F401
    scale_loss_for_distribution,
    unscale_loss_for_distribution,
)
from keras.src.models.functional import Functional  # noqa: E402,F401
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


def set_nodes_by_depth(model, by_depth):
    """Sets the `{depth: [node]}` by which a functional model runs its
    graph, deepest first (no public graph API)."""
    model._nodes_by_depth = by_depth


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


def epoch_element_spec(iterator):
    """The `tf.TypeSpec`s of a batch of Keras's TensorFlow epoch
    `iterator` (None if it has none), read without taking a batch: the
    dataset it iterates is private (checked on Keras 3.15)."""
    dataset = getattr(iterator, "_distributed_dataset", None)
    return getattr(dataset, "element_spec", None)


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




def exclude_from_weight_decay_like(optimizer, source):
    """Gives `optimizer` the weight-decay exclusions of `source` (the
    variable names; `exclude_from_weight_decay` takes variables or names,
    but no getter returns them)."""
    pattern = getattr(source, "_exclude_from_weight_decay_pattern", None)
    if pattern is not None:
        optimizer._exclude_from_weight_decay = set()
        optimizer._exclude_from_weight_decay_pattern = pattern
        optimizer._exclude_from_weight_decay_cache = {}


# -- training --
# What `FusedModel` (hftatf.model, hftatf.training) and its passes take
# from Keras's private API, one line each saying which public API is
# missing (checked on Keras 3.15.1; TensorFlow's, such as the seeds' key
# derivation, is in `tensorflow_compat`).

# No public symbolic run of a function (`keras.ops` has it per op).
from keras.src.backend import compute_output_spec  # noqa: E402,F401

# No public class for what `Model.compile` builds from loss and metric
# arguments (names, nested outputs, loss weights, "accuracy").
from keras.src.trainers.compile_utils import (  # noqa: E402,F401
    CompileLoss,
    CompileMetrics,
)

# No public test of whether every layer supports XLA (`jit_compile="auto"`).
from keras.src.trainers.trainer import model_supports_jit  # noqa: E402,F401

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






def distribute_strategy(model):
    """The strategy `model` was built under, None outside one (and on a
    backend without `tf.distribute`): the public `distribute_strategy`
    gives the default strategy there."""
    return getattr(model, "_distribute_strategy", None)


def tracked_metrics(model):
    """The metrics tracked as attributes of `model` (`Model._metrics`): no
    public API lists them apart from the compiled ones."""
    return model._metrics


def inputs_structure(model):
    """The structure `model`'s inputs were given in (`_inputs_struct`): no
    public API keeps whether a functional model took a dict or a list."""
    return model._inputs_struct




def make_step_function(model, step):
    """`step` wrapped by the TensorFlow trainer as Keras wraps its
    `train_step` (distribution, XLA, `steps_per_execution`):
    `TensorFlowTrainer._make_function` has no public counterpart."""
    return model._make_function(step)


def trainer_overrides_missing():
    """The names of `TRAINER_OVERRIDES` that `keras.Model` lacks."""
    return [name for name in TRAINER_OVERRIDES
            if not callable(getattr(keras.Model, name, None))]
