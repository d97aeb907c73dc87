"""Every access to private TensorFlow API, in one place.

The counterpart of `hftatf.core.compat` (private Keras API) for
TensorFlow: a TensorFlow minor release may rename or remove any of these,
and this module is where to look when one does. Each entry says which
public API is missing and the TensorFlow version it was checked on (2.21
unless it says otherwise). TensorFlow is imported inside each entry, on
use, so that this module (and hftatf) imports without TensorFlow on
another Keras backend; only TensorFlow code paths call it.
"""

import weakref


def graph_in_xla_context(graph):
    """Whether `graph` (or a graph it is nested in) is compiled by XLA.
    TensorFlow has no public API for it (checked on TF 2.21)."""
    from tensorflow.python.ops import control_flow_util

    return control_flow_util.GraphOrParentsInXlaContext(graph)


def maybe_merge_call(fn, strategy, *args):
    """`fn(strategy, *args)` in the cross-replica context, as the
    TensorFlow optimizer makes its updates. Public API missing:
    `tf.__internal__.distribute.interim.maybe_merge_call` (TensorFlow
    2.21)."""
    import tensorflow as tf  # Only reached on the TensorFlow backend.

    return tf.__internal__.distribute.interim.maybe_merge_call(
        fn, strategy, *args)


def random_ops_util():
    """TensorFlow's module that turns a stateless draw's seed into a key
    and counter: no public API lets draws take their key from the seed
    (`hftatf.seeds`)."""
    from tensorflow.python.ops import random_ops_util as module

    return module


def vectorized_map(function, elements):
    """`tf.vectorized_map(function, elements, fallback_to_while_loop=False)`
    built inline in the graph being traced: under XLA `tf.vectorized_map`
    builds its loop as a function of its own, whose gradient takes the
    loop's reduction axes as arguments, which XLA needs as constants; XLA
    then makes every input of the loop (the batch, the weights) a
    compile-time constant and compiles the step anew at every batch, until
    the process runs out of memory. `parallel_for` has no public way to
    build inline, nor a public registry: `Bitcast`, which Keras's
    `ops.argmax` of floats reaches through `signbit`, has no converter in
    TensorFlow 2.21 (a bitcast changes at most the last axis, so the
    stacked input's is every model's)."""
    import tensorflow as tf
    from tensorflow.python.ops.parallel_for import control_flow_ops, pfor

    if "Bitcast" not in pfor._pfor_converter_registry:

        @pfor.RegisterPFor("Bitcast")
        def _convert_bitcast(pfor_input):
            return pfor.wrap(tf.bitcast(pfor_input.stacked_input(0),
                                        pfor_input.get_attr("type")), True)

    elements = tf.nest.map_structure(tf.convert_to_tensor, elements)
    size = max(t.shape[0] for t in tf.nest.flatten(elements))
    return control_flow_ops._pfor_impl(
        lambda i: function(tf.nest.map_structure(lambda t: tf.gather(t, i),
                                                 elements)),
        size, fallback_to_while_loop=False)


def scalar_summary_metadata():
    """The metadata of TensorBoard's scalars plugin (what `tf.summary
    .scalar` writes, which needs the tensorboard package); writing it with
    `tf.summary.write` needs only TensorFlow."""
    # TensorFlow's protocol buffers have no public module.
    from tensorflow.core.framework import summary_pb2

    return summary_pb2.SummaryMetadata(
        plugin_data=summary_pb2.SummaryMetadata.PluginData(
            plugin_name="scalars"))


def custom_gradient(function):
    """`tf.custom_gradient(function)` that lets a traced graph go.

    Traced in a `tf.function`, `tf.custom_gradient` registers the gradient
    function in TensorFlow's process-wide gradient registry under a new
    name (`CustomGradient-<uid>`, named in an attribute of its `IdentityN`
    op) and never removes it; the function holds the traced graph, so
    every step traced with it stayed in memory for the life of the
    process (TensorFlow 2.21). Here the graph holds the gradient function,
    the registry entry only its name, and the entry goes with the graph.
    TensorFlow exports no way to unregister a gradient (checked on 2.21).
    """
    import tensorflow as tf
    from tensorflow.python.framework import ops as tf_ops

    decorated = tf.custom_gradient(function)

    def call(*args):
        outputs = decorated(*args)
        if not tf.executing_eagerly():
            _hold_gradient_in_graph(
                tf.nest.flatten(outputs)[0].op, tf_ops._gradient_registry)
        return outputs

    return call


def _hold_gradient_in_graph(op, registry):
    name = op.get_attr("_gradient_op_type").decode()
    entry = registry._registry[name]
    if not hasattr(op.graph, "_hftatf_gradients"):
        op.graph._hftatf_gradients = {}
    op.graph._hftatf_gradients[name] = entry["type"]

    held = weakref.ref(op.graph)

    def gradient(op, *upstream):
        # A SavedModel traces the gradients it saves with no op (None).
        graph = held() if op is None else op.graph
        return graph._hftatf_gradients[name](op, *upstream)

    registry._registry[name] = dict(entry, type=gradient)
    weakref.finalize(op.graph, registry._registry.pop, name, None)


def __getattr__(name):
    """`CapturableResource`: the base class of TensorFlow's state outside
    Keras variables (a lookup table's; TensorFlow 2.21 exports none),
    imported on first use, as TensorFlow is."""
    if name == "CapturableResource":
        from tensorflow.python.trackable import resource

        return resource.CapturableResource
    raise AttributeError(
        f"module 'hftatf.core.tensorflow_compat' has no attribute {name!r}")
