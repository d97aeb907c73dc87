"""`benchmarks.kernels`: the fused XLA programs (`benchmarks.kernel_forms`)
compute each model's own training step, and the command runs end to end.

The benchmark runs under JAX, in subprocesses (JAX and TensorFlow each
bring their own XLA runtime, kept out of the test process).
"""

import csv
import importlib.util
import os
import subprocess
import sys

import pytest

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("jax") is None,
                       reason="benchmarks.kernels needs JAX"),
    # Its programs are JAX's alone, whatever Keras's backend: they run in
    # the suite's JAX run only.
    pytest.mark.backends("jax", reason="benchmarks.kernels runs JAX "
                         "programs without Keras"),
]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))


def _python(code):
    """Runs `code` after `import benchmarks.kernel_forms as k` with the
    quick shapes; returns its last line of output."""
    prelude = ("import benchmarks.kernel_forms as k\n"
               "import benchmarks.kernels\n"
               "benchmarks.kernels.parse_args(['--quick'])\n")
    result = subprocess.run(
        [sys.executable, "-c", prelude + code], cwd=ROOT, env=_env(),
        capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.strip().splitlines()[-1]


def _env():
    return dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)


@pytest.mark.parametrize("workload,form", [
    ("mlp", "fused"), ("convnet", "grouped"), ("convnet", "per_model"),
    ("transformer", "fused")])
def test_fused_program_is_each_models_own_step(workload, form):
    error = float(_python(f"print(k.check({workload!r}, {form!r}))"))
    assert error < 1e-5


@pytest.mark.parametrize("sabotage", [
    # Model b's activations read with model b+1's kernel.
    "k._dense = (lambda d: lambda x, p: d(x, {'kernel': "
    "k.jnp.roll(p['kernel'], 1, 0), 'bias': p['bias']}))(k._dense)",
    # Channels folded without moving the model axis next to them.
    "k._fold = lambda x: k.jnp.reshape(x, (x.shape[0], *x.shape[2:4], -1))",
])
def test_check_catches_a_wrong_fused_program(sabotage):
    workload = "mlp" if "_dense" in sabotage else "convnet"
    error = float(_python(f"{sabotage}\nprint(k.check({workload!r}, "
                          "'grouped'))"))
    assert error > 1e-2


def test_command_writes_a_row_per_workload_form_and_size(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.kernels", "--quick",
         "--workloads", "mlp,convnet", "--num_models", "1,2",
         "--seconds", "0.01", "--repeats", "1",
         "--output_dir", str(tmp_path)],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    with open(tmp_path / "kernels.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["workload"], r["form"], r["num_models"]) for r in rows] == [
        ("mlp", "fused", "1"), ("mlp", "fused", "2"),
        ("convnet", "grouped", "1"), ("convnet", "grouped", "2"),
        ("convnet", "per_model", "1"), ("convnet", "per_model", "2")]
    for row in rows:
        assert float(row["speedup"]) > 0
        assert float(row["fused_model_samples_per_s"]) == pytest.approx(
            int(row["num_models"]) * 1e3 * 64 / float(row["fused_ms"])
            if row["workload"] == "mlp" else
            int(row["num_models"]) * 1e3 * 16 / float(row["fused_ms"]))
    assert "| workload | form | B |" in result.stdout


@pytest.mark.parametrize("args, message", [
    (["--workloads", "vgg"], "unknown workloads ['vgg']"),
    (["--num_models", "1,0"], "--num_models must be positive"),
    (["--repeats", "0"], "--repeats must be at least 1"),
    (["--seconds", "0"], "--seconds must be positive"),
    (["--batch_size", "0"], "--batch_size must be at least 1"),
])
def test_bad_flags_are_refused_before_anything_runs(args, message):
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.kernels", *args],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 2
    assert message in result.stderr
