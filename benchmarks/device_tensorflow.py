"""The benchmark's device measurements on the TensorFlow backend: the
matmul peak, the FLOPs of a training step from its XLA lowering, and
TensorFlow's log level."""

import time

import numpy as np
import tensorflow as tf

from benchmarks.hlo import hlo_flops
from hftatf.core import devices


def quiet():
    """Every stock model gets its own tf.function: no retracing notes."""
    tf.get_logger().setLevel("ERROR")


def matmul_peak(size=2048, seconds=2.0, dtype="float32"):
    """The device's measured matmul rate (FLOP/s) in `dtype`: the best of
    repeated `size x size` products, with and without XLA, on the device
    TensorFlow places them on.

    Returns:
        `(flops_per_second, details)`, details naming the best setting.
    """
    rng = np.random.default_rng(0)
    a = tf.constant(rng.standard_normal((size, size)), dtype)
    b = tf.constant(rng.standard_normal((size, size)), dtype)
    flops = 2.0 * size**3
    best = {}
    for jit in (False, True):
        product = tf.function(lambda x, y: tf.reduce_sum(tf.matmul(x, y)),
                              jit_compile=jit)
        product(a, b).numpy()
        times, deadline = [], time.perf_counter() + seconds / 2
        while time.perf_counter() < deadline or len(times) < 3:
            start = time.perf_counter()
            product(a, b).numpy()
            times.append(time.perf_counter() - start)
        best[jit] = flops / min(times)
    jit = max(best, key=best.get)
    return best[jit], f"{size}x{size} {dtype} matmul, xla={jit}"


def peak_device_mb():
    """The peak memory TensorFlow allocated on its first GPU so far (MiB),
    or None without a GPU."""
    if not tf.config.list_logical_devices("GPU"):
        return None
    return devices.peak_memory("GPU:0") / 2**20


def train_step_flops(model, batch):
    """The FLOPs of one `model.train_step(batch)` (forward, the gradients
    the step uses, and the optimizer's matmuls if any) read from the XLA
    lowering of the step, or None where the step cannot be lowered.

    These are the FLOPs the model asks for, before XLA rewrites them (on
    CPU it computes a depthwise kernel gradient as a dense one, for one).
    `model` must be compiled and built (trained for a step, say).
    """
    step = tf.function(model.train_step, jit_compile=True)
    try:
        hlo = step.experimental_get_compiler_ir(batch)(stage="hlo")
    except Exception:  # noqa: BLE001 - any failure means "unknown".
        return None
    return hlo_flops(hlo)
