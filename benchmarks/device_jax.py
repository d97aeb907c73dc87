"""The benchmark's device measurements on the JAX backend: the matmul peak
and the FLOPs of a training step from its XLA lowering (`jax.jit`)."""

import time

import jax
import numpy as np


def quiet():
    """JAX prints nothing per traced function: nothing to quiet."""


def matmul_peak(size=2048, seconds=2.0, dtype="float32"):
    """The device's measured matmul rate (FLOP/s) in `dtype`: the best of
    repeated `size x size` products under `jax.jit` (JAX always compiles
    with XLA), on JAX's default device, at the default matmul precision
    (float32 products in TF32 on Ampere and later GPUs, as stock Keras on
    JAX computes them).

    Returns:
        `(flops_per_second, details)`.
    """
    rng = np.random.default_rng(0)
    a = jax.numpy.asarray(rng.standard_normal((size, size)), dtype)
    b = jax.numpy.asarray(rng.standard_normal((size, size)), dtype)
    product = jax.jit(lambda x, y: jax.numpy.sum(x @ y))
    product(a, b).block_until_ready()
    times, deadline = [], time.perf_counter() + seconds
    while time.perf_counter() < deadline or len(times) < 3:
        start = time.perf_counter()
        product(a, b).block_until_ready()
        times.append(time.perf_counter() - start)
    return 2.0 * size**3 / min(times), f"{size}x{size} {dtype} matmul, xla"


def peak_device_mb():
    """The peak memory JAX allocated on its devices so far (MiB, the
    largest over them), or None where they report none (a CPU). JAX
    reserves most of a GPU's memory up front; this is what was in use."""
    peaks = [(device.memory_stats() or {}).get("peak_bytes_in_use")
             for device in jax.local_devices()]
    if any(peak is None for peak in peaks):
        return None
    return max(peaks) / 2**20


def train_step_flops(model, batch):
    """The FLOPs of one stateless `model.train_step(state, batch)` as XLA's
    cost analysis of the compiled step counts them, or None where the step
    cannot be compiled.

    XLA counts every operation (element-wise ones too, a few percent above
    the dots and convolutions alone that `hlo_flops` counts on
    TensorFlow); JAX's HLO text no longer marks names with `%`, which
    `hlo_flops` reads. `model` must be compiled and built (trained for a
    step, say).
    """
    state = (
        [v.value for v in model.trainable_variables],
        [v.value for v in model.non_trainable_variables],
        [v.value for v in model.optimizer.variables]
        if model.optimizer is not None else [],
        [v.value for v in model.metrics_variables],
    )
    try:
        analysis = jax.jit(model.train_step).lower(
            state, batch).compile().cost_analysis()
    except Exception:  # noqa: BLE001 - any failure means "unknown".
        return None
    # A list of one dictionary per computation in some JAX versions.
    if isinstance(analysis, (list, tuple)):
        analysis = analysis[0] if analysis else {}
    flops = (analysis or {}).get("flops")
    return None if flops is None else int(flops)
