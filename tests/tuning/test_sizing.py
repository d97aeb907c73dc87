"""Automatic array size: the probing rule, memory limits and the cache."""

import json

import keras
import numpy as np
import pytest
from testing import BACKEND

from hftatf.tuning import sizing

X = np.random.default_rng(0).normal(size=(64, 6)).astype("float32")
Y = np.random.default_rng(1).integers(0, 3, size=(64,)).astype("int32")


def model(units=4):
    return keras.Sequential([keras.Input((6,)),
                             keras.layers.Dense(units, activation="relu"),
                             keras.layers.Dense(3, activation="softmax")])


def out_of_memory_error():
    """The error the backend raises where an array does not fit."""
    if BACKEND == "tensorflow":
        import tensorflow as tf

        return tf.errors.ResourceExhaustedError(None, None, "OOM")
    import jax

    return jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory")


def fake_probe(monkeypatch, throughput, peak=None, out_of_memory=()):
    """Replaces the timing with a table: B -> models x samples / s."""
    probed = []

    def probe(model, num_models, x, y, **kwargs):
        probed.append(num_models)
        if num_models in out_of_memory:
            raise out_of_memory_error()
        return throughput[num_models], None if peak is None else (
            peak * num_models)

    monkeypatch.setattr(sizing, "probe", probe)
    return probed


def choose(tmp_path, **kwargs):
    kwargs.setdefault("path", tmp_path / "cache.json")
    return sizing.auto_num_models(model(), X, Y, loss="mse", batch_size=16,
                                  **kwargs)


def test_keeps_doubling_while_throughput_improves(monkeypatch, tmp_path):
    probed = fake_probe(monkeypatch, {1: 100, 2: 190, 4: 370, 8: 380,
                                      16: 900})
    # 8 gains under 5% over 4: the search stops there, before 16.
    assert choose(tmp_path) == 4
    assert probed == [1, 2, 4, 8]


def test_min_gain_and_max_num_models_bound_the_size(monkeypatch, tmp_path):
    fake_probe(monkeypatch, {1: 100, 2: 190, 4: 370, 8: 700})
    # Each doubling gains about 90%: not the 95% asked for.
    assert choose(tmp_path, cache=False, min_gain=0.95) == 1
    assert choose(tmp_path, cache=False, max_num_models=5) == 4


def test_out_of_memory_ends_the_search(monkeypatch, tmp_path):
    probed = fake_probe(monkeypatch, {1: 100, 2: 190, 4: 370, 8: 700},
                        out_of_memory=(8,))
    assert choose(tmp_path) == 4 and probed == [1, 2, 4, 8]


def test_memory_limit_stops_before_probing(monkeypatch, tmp_path):
    # Peak memory of 100 bytes per model: 8 models (800) would pass 500.
    probed = fake_probe(monkeypatch, {1: 100, 2: 190, 4: 370, 8: 700},
                        peak=100)
    assert choose(tmp_path, memory_limit=500) == 4
    assert probed == [1, 2, 4]


def test_cache_answers_the_same_model_and_device(monkeypatch, tmp_path):
    probed = fake_probe(monkeypatch, {1: 100, 2: 190, 4: 150})
    assert choose(tmp_path) == 2
    entries = json.loads((tmp_path / "cache.json").read_text())
    (entry,) = entries.values()
    assert entry["num_models"] == 2 and entry["device"] == (
        sizing.device_name())
    assert set(entry["throughput"]) == {"1", "2", "4"}
    probed.clear()
    assert choose(tmp_path) == 2 and probed == []
    # Float hyper-parameters do not change the cost: the same entry.
    assert choose(tmp_path, optimizer=keras.optimizers.Adam(0.5)) == 2
    assert choose(tmp_path, optimizer=keras.optimizers.Adam(0.1)) == 2
    assert probed == [1, 2, 4]
    # Another architecture is probed anew.
    sizing.auto_num_models(model(units=5), X, Y, loss="mse", batch_size=16,
                           path=tmp_path / "cache.json")
    assert len(probed) == 6
    assert len(json.loads((tmp_path / "cache.json").read_text())) == 3


def test_cache_file_defaults_to_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("HFTATF_SIZING_CACHE", str(tmp_path / "sizes.json"))
    assert sizing.cache_path() == tmp_path / "sizes.json"


@pytest.mark.parametrize("kwargs, message", [
    ({"max_num_models": 0}, "max_num_models"),
    ({"max_num_models": 2.0}, "max_num_models"),
    ({"min_gain": -0.1}, "min_gain"),
])
def test_bad_arguments_are_clear_errors(kwargs, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        choose(tmp_path, **kwargs)


def test_probe_times_a_real_array():
    throughput, peak = sizing.probe(
        model(), 2, X[:16], Y[:16], optimizer=keras.optimizers.SGD(0.1),
        loss="sparse_categorical_crossentropy", steps=2, repeats=1,
        jit_compile=False)
    assert throughput > 0 and peak is None  # No device memory on a CPU.


def test_probe_batch_reads_arrays_and_datasets():
    x, y = sizing.probe_batch(X, Y, batch_size=8)
    assert x.shape == (8, 6) and y.shape == (8,)
    tf = pytest.importorskip("tensorflow")  # tf.data, on either backend
    dataset = tf.data.Dataset.from_tensor_slices((X, Y)).batch(5)
    x, y = sizing.probe_batch(dataset)
    assert x.shape == (5, 6) and y.shape == (5,)
