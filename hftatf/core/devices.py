"""Where the computation being traced runs: the device rule of the
layers' kernel choices and of the array's defaults.

Each question is answered per Keras backend here, and nowhere else: on
TensorFlow from its strategy, device scopes and graph; on JAX, where XLA
compiles every computation, from JAX's default backend.
"""

import os
import sys

import keras

from hftatf.core import compat

_ACCELERATORS = ("GPU", "TPU")


def _backend():
    return keras.backend.backend()


def compiling_with_xla():
    """Whether the computation being traced will be compiled by XLA: always
    on JAX; on TensorFlow, inside a `tf.function(jit_compile=True)`, as
    Keras builds for `jit_compile=True`. Layers use it to pick the
    formulation XLA compiles well, where TensorFlow's own kernels prefer
    another."""
    return compat.compiled_by_xla()


def runs_on_accelerator():
    """Whether the computation being traced runs on a GPU or TPU.

    The device rule of the layers' kernel choices. On JAX: whether JAX's
    default backend is a GPU or TPU (where it places every computation).
    On TensorFlow:
    1. under a `tf.distribute` strategy, whether the strategy's worker
       devices are GPUs or TPUs;
    2. otherwise, on a machine where TensorFlow sees no GPU or TPU, never
       (and nothing is placed to find out: free in eager layer calls too);
    3. otherwise, the device the call is placed on: a `tf.device` scope
       while tracing a graph, the device an eager op runs on when eager;
       with no placement requested (a graph traced outside any device
       scope), the accelerator TensorFlow then places the computation on.
    """
    if _backend() != "tensorflow":
        return has_accelerator()
    import tensorflow as tf  # The TensorFlow backend has it imported.

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
    import tensorflow as tf  # Only reached on the TensorFlow backend.

    return tf.DeviceSpec.from_string(device).device_type in _ACCELERATORS


def has_accelerator():
    """Whether the backend sees a GPU or TPU where it places a computation
    that requests no device: a logical one of TensorFlow's, or JAX's
    default backend."""
    backend = _backend()
    if backend == "jax":
        import jax  # The JAX backend has it imported.

        # "gpu" (or "cuda", "rocm" by some plugins) or "tpu".
        return jax.default_backend() != "cpu"
    if backend != "tensorflow":
        return False
    import tensorflow as tf  # The TensorFlow backend has it imported.

    return any(tf.config.list_logical_devices(kind) for kind in _ACCELERATORS)


def describe_device():
    """The device arrays train on: the accelerator's name and count, or
    None on a CPU."""
    backend = _backend()
    if backend == "jax":
        import jax  # The JAX backend has it imported.

        devices = jax.devices()
        if devices[0].platform == "cpu":
            return None
        return (f"{devices[0].platform.upper()} {devices[0].device_kind} "
                f"x{len(devices)}")
    if backend != "tensorflow":
        return None
    import tensorflow as tf  # The TensorFlow backend has it imported.

    tpus = tf.config.list_logical_devices("TPU")
    if tpus:
        return f"TPU x{len(tpus)}"
    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        details = tf.config.experimental.get_device_details(gpus[0])
        return f"GPU {details.get('device_name', 'unknown')} x{len(gpus)}"
    return None


def reset_peak_memory():
    """Starts measuring the accelerator's peak memory anew; returns the
    device whose peak `peak_memory` then reads, None where the backend
    cannot reset it (a CPU; JAX, whose peak only grows)."""
    if _backend() != "tensorflow":
        return None
    import tensorflow as tf  # The TensorFlow backend has it imported.

    gpus = tf.config.list_logical_devices("GPU")
    if not gpus:
        return None
    device = gpus[0].name.replace("/device:", "")
    tf.config.experimental.reset_memory_stats(device)
    return device


def peak_memory(device):
    """The peak bytes of `device` (from `reset_peak_memory`) since the
    reset."""
    import tensorflow as tf  # Only reached on the TensorFlow backend.

    return tf.config.experimental.get_memory_info(device)["peak"]


def is_out_of_memory(error):
    """Whether `error` says the accelerator ran out of memory (TensorFlow's
    `ResourceExhaustedError`, XLA's RESOURCE_EXHAUSTED status on JAX)."""
    tf = sys.modules.get("tensorflow")
    if tf is not None and isinstance(error, tf.errors.ResourceExhaustedError):
        return True
    return "RESOURCE_EXHAUSTED" in str(error)


def available_memory():
    """The bytes an array may still take where it trains, or None where
    the backend does not say: on JAX, the default device's limit less what
    it holds (an accelerator's, or the host's on a CPU); on TensorFlow,
    the host's on a machine without a GPU or TPU (TensorFlow reports no
    accelerator's limit)."""
    backend = _backend()
    if backend == "jax":
        import jax  # The JAX backend has it imported.

        stats = jax.devices()[0].memory_stats() or {}
        if "bytes_limit" in stats:
            return stats["bytes_limit"] - stats.get("bytes_in_use", 0)
    elif has_accelerator():
        return None
    return _host_available_memory()


def _host_available_memory():
    """The host's available bytes (`MemAvailable` on Linux: free memory
    and the caches the kernel can drop), or None where unknown."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None
