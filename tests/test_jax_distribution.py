"""Arrays under `keras.distribution` on JAX, on 4 CPU devices (a
subprocess: JAX takes its device count when it starts), against the same
array trained on one device."""

import json
import os
import pathlib
import subprocess
import sys

import pytest
from testing import JAX_COLLECTIVE_TIMEOUT, with_xla_flags

pytestmark = pytest.mark.backends(
    "jax", reason="keras.distribution lays variables out on JAX only")

SCRIPT = pathlib.Path(__file__).with_name("distributed_training.py")


def run(case):
    env = with_xla_flags({**os.environ, "KERAS_BACKEND": "jax"},
                         "--xla_force_host_platform_device_count=4",
                         JAX_COLLECTIVE_TIMEOUT)
    result = subprocess.run(
        [sys.executable, str(SCRIPT), case], env=env, capture_output=True,
        text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", ["models", "data", "models_and_batch"])
def test_distributed_array_trains_as_on_one_device(case):
    report = run(case)
    assert report["devices"] == 4
    # A batch split over devices sums its gradients in another order; and
    # where each device holds its own models, XLA compiles each device's
    # step for its share of the models, which may round a sum otherwise
    # (up to 16 float32 steps of the weights after these 8 steps, over 8
    # random draws: 4e-7 here, and once 1.07e-6). A model trained on
    # another's data or on the wrong shard would be off by the size of
    # its change, which must be 100 times the tolerance.
    tolerance = 1e-5
    assert report["largest_difference"] <= tolerance, report
    assert report["largest_change"] > 100 * tolerance, report
    assert report["losses_match"], report
    if case != "data":
        assert report["kernel_spec"][0] == "models", report


def test_a_model_count_the_devices_cannot_split_is_refused():
    errors = run("indivisible")["errors"]
    assert len(errors) == 2, errors
    for error in errors:
        assert "num_models=6" in error and "4 devices" in error
    # By name, the ways out are names too.
    assert "'auto' or 'data'" in errors[1]


def test_batches_the_devices_cannot_split_are_refused_before_a_step():
    report = run("partial_batch")
    refusals = report["refusals"]
    assert "a batch of 5 samples (21 samples in batches of 8)" in (
        refusals["fit"])
    assert "a batch of 6 samples" in refusals["predict"]
    assert "over 4 devices" in refusals["predict"]
    assert report["untouched"]


def test_strategy_tpu_off_a_tpu_says_how_to_run_it():
    # JAX's hosts of a pod slice join before anything runs; on a machine
    # that is no TPU VM that fails, and the error names the way out.
    from hftatf import distribute

    with pytest.raises(ValueError, match="use strategy 'auto' on one"):
        distribute.set_jax_distribution("tpu", 2)


def test_strategy_names_set_their_distributions():
    import keras

    from hftatf import distribute

    try:
        assert distribute.set_jax_distribution("cpu", 2) is None
        assert keras.distribution.distribution() is None
        with pytest.raises(ValueError, match="Unknown strategy 'gpu'"):
            distribute.set_jax_distribution("gpu", 2)
    finally:
        keras.distribution.set_distribution(None)
