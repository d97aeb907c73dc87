"""Arrays under tf.distribute: strategies from names, and MirroredStrategy
training equal to single-device training."""

import json
import pathlib
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.backends(
    "tensorflow", reason="tf.distribute strategies (on JAX: "
    "test_jax_distribution.py)")
tf = pytest.importorskip("tensorflow")

from hftatf import distribute  # noqa: E402

HERE = pathlib.Path(__file__).parent


@pytest.mark.slow
@pytest.mark.parametrize("replicas, variant", [
    (2, "synchronized"), (4, "synchronized"), (2, "compiled"),
    (2, "passes")])
def test_mirrored_training_equals_one_device(replicas, variant):
    result = subprocess.run(
        [sys.executable, str(HERE / "mirrored_training.py"), str(replicas),
         variant], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["replicas"] == replicas
    assert "loss_2" in report["logs"] and "accuracy_1" in report["logs"]
    # Each replica's forward and backward pass ran compiled with XLA, unless
    # it synchronises replicas.
    # (One device needs no synchronisation.)
    assert report["replica_xla"] == [True, variant != "synchronized"]
    # The same global batch, split across replicas: only the order of
    # float32 sums differs.
    assert report["max_weight_difference"] < 1e-5, report
    assert report["max_log_difference"] < 1e-5, report


def test_mirrored_embedding_arrays_train_as_stock_models():
    # Sparse gradients under MirroredStrategy: global clipping's dense
    # gradients summed over replicas (differed by up to 0.14), Adafactor's
    # rows of unknown size after the sum (failed).
    result = subprocess.run(
        [sys.executable, str(HERE / "mirrored_embeddings.py")],
        capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(report) == 4
    for setting, difference in report.items():
        assert difference < 1e-5, (setting, difference)


def test_cpu_and_mirrored_strategies():
    assert isinstance(distribute.strategy_from_name("cpu"),
                      tf.distribute.OneDeviceStrategy)
    mirrored = distribute.strategy_from_name("mirrored")
    assert isinstance(mirrored, tf.distribute.MirroredStrategy)
    assert mirrored.num_replicas_in_sync == len(
        tf.config.list_logical_devices("CPU"))


def test_auto_without_accelerators_is_the_cpu():
    strategy = distribute.strategy_from_name("auto")
    assert isinstance(strategy, tf.distribute.OneDeviceStrategy)


@pytest.mark.parametrize("tpu, message", [
    (None, "needs a TPU"),
    ("local", "has none"),
    ("grpc://127.0.0.1:9", "not reachable"),
])
def test_missing_tpu_is_a_clear_error(monkeypatch, tpu, message):
    monkeypatch.delenv("TPU_NAME", raising=False)
    with pytest.raises(ValueError, match=message):
        distribute.strategy_from_name("tpu", tpu=tpu)


def test_an_unresolvable_tpu_name_is_a_clear_error_within_seconds(
        monkeypatch):
    # Off Cloud the resolver's look-up of a name fails (no metadata server,
    # no network here); the error names the TPU and what to pass instead.
    monkeypatch.delenv("TPU_NAME", raising=False)
    start = time.monotonic()
    with pytest.raises(ValueError) as raised:
        distribute.strategy_from_name("tpu", tpu="no-such-tpu")
    assert time.monotonic() - start < 30
    message = str(raised.value)
    assert "'no-such-tpu' could not be resolved" in message
    assert "grpc://host:port" in message and "local" in message


def test_unknown_strategy_name():
    with pytest.raises(ValueError, match="Unknown strategy"):
        distribute.strategy_from_name("gpu-cluster")
