"""A fused optimizer computes on JAX what it computes on TensorFlow.

Partial steps, gradient accumulation and EMA overwrite select per model
instead of branching on which models are due (a branch that assigns
variables leaks tracers on JAX): the jitted stateless JAX steps of
`backend_steps.py`, in a process of their own, must give the weights the
TensorFlow steps give here.
"""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from backend_steps import run
from testing import assert_close

HERE = pathlib.Path(__file__).parent


@pytest.mark.backends(
    "tensorflow", reason="it compares the JAX steps with the TensorFlow "
    "steps of this process")
def test_jax_steps_equal_tensorflow_steps():
    pytest.importorskip("jax")
    env = dict(os.environ, KERAS_BACKEND="jax",
               PYTHONPATH=os.pathsep.join(
                   [str(HERE.parents[1]), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run(
        [sys.executable, str(HERE / "backend_steps.py")], env=env,
        capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["backend"] == "jax"
    assert_close(np.array(report["weights"], "float32"), run(),
                 atol=1e-6, rtol=1e-6)
