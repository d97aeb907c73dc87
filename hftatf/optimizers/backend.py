"""What a fused optimizer does differently on each Keras backend.

TensorFlow runs replicas of a step under `tf.distribute`, and traces steps
into graphs that create variables outside themselves (`tf.init_scope`).
The other backends have neither: JAX shards arrays with
`keras.distribution`, and its trainer builds the optimizer before it traces
a step. Everything else a fused optimizer computes with `keras.ops`, alike
on every backend; these functions are where the difference is decided.
"""

import contextlib

import keras


def _tensorflow():
    """The `tensorflow` module where Keras runs on TensorFlow, else None
    (TensorFlow is optional on the other backends)."""
    if keras.backend.backend() != "tensorflow":
        return None
    import tensorflow as tf

    return tf


def has_strategy():
    """Whether the step runs under a `tf.distribute` strategy."""
    tf = _tensorflow()
    return tf is not None and tf.distribute.has_strategy()


def replicas_in_sync():
    """The number of replicas the step runs on: that of the `tf.distribute`
    replica context, 1 outside one (and on the other backends, whose steps
    have no replicas)."""
    tf = _tensorflow()
    context = None if tf is None else tf.distribute.get_replica_context()
    return 1 if context is None else context.num_replicas_in_sync


def sum_over_replicas(value):
    """`value` summed over the replicas of a `tf.distribute` step (where
    `replicas_in_sync() > 1`)."""
    tf = _tensorflow()
    return tf.distribute.get_replica_context().all_reduce(
        tf.distribute.ReduceOp.SUM, value)


def outside_traced_functions():
    """A context that reads values outside any TensorFlow function being
    traced (`tf.init_scope`), so that a variable created from them can be
    lifted out of the function; on the other backends it does nothing."""
    tf = _tensorflow()
    return contextlib.nullcontext() if tf is None else tf.init_scope()


def weight_decay_subject(variable):
    """What a stock optimizer matches its weight-decay exclusions against:
    on TensorFlow the `tf.Variable` of a Keras variable, whose name is its
    path (`"logits/kernel:0"`, so a pattern may name a layer); elsewhere
    the Keras variable itself, named `"kernel"`."""
    if _tensorflow() is None:
        return variable
    return variable.value if isinstance(variable, keras.Variable) else variable
