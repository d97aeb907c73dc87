"""Automatic array size: the largest B that fits and still pays.

An array of B models runs one fused step where B stock models would run B
steps; the step gets slower as B grows, and throughput (models x samples
per second) grows while the device has idle capacity. `auto_num_models`
fuses the model for B = 1, 2, 4, ..., times a few training steps of each
(after a warm-up that absorbs tracing and compilation) and keeps the
largest B whose throughput beat the best smaller array by `min_gain`. A B
that runs out of memory (or whose extrapolated peak memory exceeds
`memory_limit`) ends the search.

Results are cached in a JSON file, keyed by the model's architecture and
compile arguments, the batch shape, the device and the library versions, so
a search that builds the same architecture again (or another process on the
same kind of machine) does not probe again.
"""

import hashlib
import json
import os
import pathlib
import platform
import sys
import tempfile
import time

import keras
import numpy as np

import hftatf
from hftatf.core import devices
from hftatf.core.compat import get_data_adapter
from hftatf.graph import architecture
from hftatf.tuning import arrays

__all__ = ["auto_num_models", "cache_path", "device_name", "probe",
           "probe_batch"]

# The default cache file; HFTATF_SIZING_CACHE overrides it.
_CACHE_ENV = "HFTATF_SIZING_CACHE"


def cache_path():
    """The JSON file that caches array sizes: `$HFTATF_SIZING_CACHE`, or
    `~/.cache/hftatf/num_models.json`."""
    path = os.environ.get(_CACHE_ENV)
    if path:
        return pathlib.Path(path)
    return pathlib.Path.home() / ".cache" / "hftatf" / "num_models.json"


def device_name():
    """A description of the device arrays train on: the accelerator's name
    and count, or the CPU's architecture and core count."""
    accelerator = devices.describe_device()
    if accelerator is not None:
        return accelerator
    return (f"CPU {platform.machine()} {platform.processor() or ''} "
            f"x{os.cpu_count()}").replace("  ", " ")


def probe_batch(x, y=None, batch_size=None):
    """The first `(x, y)` batch of training data given as `fit` takes it
    (arrays, dicts, a `tf.data.Dataset`, a `keras.utils.PyDataset`)."""
    adapter = get_data_adapter(x, y, batch_size=batch_size or 32,
                               shuffle=False)
    batch = next(iter(adapter.get_numpy_iterator()))
    x, y, _ = keras.utils.unpack_x_y_sample_weight(batch)
    return x, y


def _fresh_optimizer(optimizer):
    """A new, unbuilt copy of `optimizer` (a name, a stock optimizer, or a
    fused one with shared hyper-parameters) for one probe."""
    if isinstance(optimizer, str):
        return optimizer
    config = optimizer.get_config()
    if "num_models" in config:
        config["num_models"] = None
    return type(optimizer).from_config(config)


def probe(model, num_models, x, y, optimizer="sgd", loss=None, metrics=None,
          steps=5, repeats=3, jit_compile="auto"):
    """Times training steps of `model` fused as an array of `num_models`.

    Args:
        model: a plain functional or Sequential Keras model.
        num_models: the array size B to probe.
        x, y: one batch of training data (shared by the models).
        optimizer: a fused or stock optimizer or its name (copied).
        loss, metrics: as for `compile`.
        steps: timed steps per repeat.
        repeats: timed repeats; the fastest is kept (the others carry
            interference from other processes).
        jit_compile: as for `FusedModel.compile`.

    Returns:
        `(throughput, peak_bytes)`: models x samples per second, and the
        device's peak memory during the probe (None where the backend
        does not report it: on a CPU, on JAX).

    Raises:
        The backend's out-of-memory error (`devices.is_out_of_memory`) if
        the array does not fit.
    """
    array = hftatf.fuse(model, num_models)
    array.compile(optimizer=_fresh_optimizer(optimizer), loss=loss,
                  metrics=metrics, jit_compile=jit_compile)
    device = devices.reset_peak_memory()
    for _ in range(2):  # Tracing and compilation.
        array.train_on_batch(x, y)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(steps):
            # Returns NumPy values: the step has finished on the device.
            array.train_on_batch(x, y)
        best = min(best, (time.perf_counter() - start) / steps)
    peak = None
    if device is not None:
        peak = devices.peak_memory(device)
    batch = len(keras.tree.flatten(x)[0])
    return num_models * batch / best, peak


def auto_num_models(model, x, y=None, optimizer="sgd", loss=None,
                    metrics=None, batch_size=None, max_num_models=64,
                    min_gain=0.05, memory_limit=None, steps=5, repeats=3,
                    jit_compile="auto", cache=True, path=None):
    """The largest array size B that fits the device and improves
    throughput, for `model` trained on batches like the first of `x, y`.

    Candidates are 1, 2, 4, ... up to `max_num_models`. B is kept while its
    throughput (models x samples per second) exceeds the best smaller
    candidate's by more than `min_gain`; the search stops at the first B
    that does not, that runs out of memory, or whose peak memory,
    extrapolated from the smaller probes, would exceed `memory_limit`.

    Args:
        model: a plain functional or Sequential Keras model (as built for
            one trial).
        x, y: training data as `fit` takes it; only its first batch is used.
        optimizer, loss, metrics: what the array compiles with (the
            optimizer is copied for each probe).
        batch_size: the batch size of `x, y` given as arrays.
        max_num_models: the largest B tried.
        min_gain: the relative throughput gain a doubling must bring.
        memory_limit: bytes of device memory the array may use; None for
            no limit but the device's own (an out-of-memory error).
        steps, repeats: timing of each probe (see `probe`).
        jit_compile: as for `FusedModel.compile`.
        cache: whether to read and write the cache file.
        path: the cache file; defaults to `cache_path()`.

    Returns:
        An int B >= 1.
    """
    if isinstance(max_num_models, bool) or not isinstance(
            max_num_models, int) or max_num_models < 1:
        raise ValueError(
            "`max_num_models` must be a positive int. Received: "
            f"max_num_models={max_num_models!r}.")
    if not min_gain >= 0:
        raise ValueError(
            f"`min_gain` must be >= 0. Received: min_gain={min_gain!r}.")
    x, y = probe_batch(x, y, batch_size)
    key = _cache_key(model, x, optimizer, loss, metrics, max_num_models,
                     min_gain, memory_limit, jit_compile)
    path = pathlib.Path(path) if path is not None else cache_path()
    if cache:
        entry = _read_cache(path).get(key)
        if entry is not None:
            return int(entry["num_models"])
    chosen, measured = 1, {}
    best = 0.0
    peaks = []
    candidate = 1
    while candidate <= max_num_models:
        if memory_limit is not None and len(peaks) >= 2:
            # Peak memory grows about linearly in B.
            (b0, p0), (b1, p1) = peaks[-2:]
            predicted = p1 + (p1 - p0) / (b1 - b0) * (candidate - b1)
            if predicted > memory_limit:
                break
        try:
            throughput, peak = probe(
                model, candidate, x, y, optimizer=optimizer, loss=loss,
                metrics=metrics, steps=steps, repeats=repeats,
                jit_compile=jit_compile)
        except Exception as error:  # The backend's out-of-memory error.
            if not devices.is_out_of_memory(error):
                raise
            break
        measured[candidate] = throughput
        if peak is not None:
            if memory_limit is not None and peak > memory_limit:
                break
            peaks.append((candidate, peak))
        if candidate > 1 and throughput <= best * (1.0 + min_gain):
            break
        chosen, best = candidate, max(best, throughput)
        candidate *= 2
    if cache:
        _write_cache(path, key, {
            "num_models": chosen,
            "throughput": {str(b): t for b, t in measured.items()},
            "device": device_name(),
            "time": time.time(),
        })
    return chosen


def _cache_key(model, x, optimizer, loss, metrics, *settings):
    # The optimizer's structure (class, options), not its float values:
    # the throughput is the same for every learning rate.
    optimizer_description = optimizer if isinstance(optimizer, str) else (
        arrays.optimizer_structure(
            hftatf.optimizers.get(_fresh_optimizer(optimizer))))
    description = {
        "architecture": architecture(model),
        "inputs": [(tuple(np.shape(t)), str(np.asarray(t).dtype))
                   for t in keras.tree.flatten(x)],
        "optimizer": optimizer_description,
        "loss": keras.saving.serialize_keras_object(loss),
        "metrics": keras.saving.serialize_keras_object(metrics),
        "settings": settings,
        "device": device_name(),
        "versions": [hftatf.__version__, keras.backend.backend(),
                     keras.__version__, *_backend_versions()],
    }
    text = json.dumps(description, sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()


def _read_cache(path):
    try:
        return json.loads(pathlib.Path(path).read_text())
    except (OSError, ValueError):
        return {}


def _write_cache(path, key, entry):
    """Adds `entry` under `key`; concurrent writers (the workers of a
    distributed search) each replace the file whole, never half-written."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    entries = _read_cache(path)
    entries[key] = entry
    handle, temporary = tempfile.mkstemp(dir=path.parent,
                                         prefix=path.name + ".")
    with os.fdopen(handle, "w") as file:
        json.dump(entries, file, indent=1, sort_keys=True)
    os.replace(temporary, path)


def _backend_versions():
    """The versions of the backend's libraries that this process imported
    (a cached size holds for them only)."""
    return [f"{name} {sys.modules[name].__version__}"
            for name in ("tensorflow", "jax")
            if sys.modules.get(name) is not None]
