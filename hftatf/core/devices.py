"""Where the computation being traced runs: the device rule of the
layers' kernel choices and of the array's defaults."""

import tensorflow as tf

from hftatf.core import compat

_ACCELERATORS = ("GPU", "TPU")


def compiling_with_xla():
    """Whether the computation being traced will be compiled by XLA (inside
    a `tf.function(jit_compile=True)`, as Keras builds for
    `jit_compile=True`). Layers use it to pick the formulation XLA compiles
    well, where TensorFlow's own kernels prefer another."""
    return compat.graph_in_xla_context(tf.compat.v1.get_default_graph())


def runs_on_accelerator():
    """Whether the computation being traced runs on a GPU or TPU.

    The device rule of the layers' kernel choices:
    1. under a `tf.distribute` strategy, whether the strategy's worker
       devices are GPUs or TPUs;
    2. otherwise, on a machine where TensorFlow sees no GPU or TPU, never
       (and nothing is placed to find out: free in eager layer calls too);
    3. otherwise, the device the call is placed on: a `tf.device` scope
       while tracing a graph, the device an eager op runs on when eager;
       with no placement requested (a graph traced outside any device
       scope), the accelerator TensorFlow then places the computation on.
    """
    if tf.distribute.has_strategy():
        return any(_is_accelerator(device) for device
                   in tf.distribute.get_strategy().extended.worker_devices)
    if not has_accelerator():
        return False
    # An eager op reports the device it ran on, a graph op the device its
    # scope requests ("" when no scope does).
    placed = tf.identity(tf.zeros(())).device
    return not placed or _is_accelerator(placed)


def _is_accelerator(device):
    return tf.DeviceSpec.from_string(device).device_type in _ACCELERATORS


def has_accelerator():
    """Whether TensorFlow sees a logical GPU or TPU (where it places a
    computation that requests no device)."""
    return any(tf.config.list_logical_devices(kind) for kind in _ACCELERATORS)
