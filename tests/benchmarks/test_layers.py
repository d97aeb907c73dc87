"""The per-layer benchmark: its arguments, its step's gradients and one
tiny measurement of each kind (not a timing test: it checks the harness
runs both sides and reports what it measured), on either backend."""

import pathlib
import sys

import keras
import numpy as np
import pytest
from testing import assert_close

# The harness lives next to the package, not inside it.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

from benchmarks import layers  # noqa: E402


def test_parse_args_defaults_to_the_default_cases():
    args = layers.parse_args([])
    assert args.cases == list(layers.DEFAULT_CASES)
    # XLA by default where stock Keras compiles its steps (JAX).
    on_jax = keras.backend.backend() == "jax"
    assert args.num_models == [8] and args.jit == [on_jax]


@pytest.mark.parametrize("jit_compile", [False, True])
def test_training_step_gives_the_gradients_of_half_the_squared_output(
        jit_compile):
    layer = keras.layers.Dense(3, use_bias=False)
    x = np.random.default_rng(0).normal(size=(4, 2)).astype("float32")
    dx, dw = layers.training_step(layer, jit_compile)(
        keras.ops.convert_to_tensor(x))
    kernel = np.asarray(layer.kernel)
    y = x @ kernel
    assert_close(dx, y @ kernel.T)
    assert_close(dw, x.T @ y)


def test_parse_args_reads_one_case():
    args = layers.parse_args([
        "--layer", "Dense", "--config", "units=4,use_bias=false",
        "--input_shape", "2,3,5", "--num_models", "1,2", "--jit",
        "false,true"])
    assert args.cases == [("Dense", {"units": 4, "use_bias": False},
                           (2, 3, 5))]
    assert args.num_models == [1, 2] and args.jit == [False, True]


@pytest.mark.parametrize("argv", [
    ["--layer", "NoSuchLayer", "--input_shape", "2,3"],
    ["--layer", "Dense"],
    ["--config", "units=4"],
    ["--num_models", "0"],
    ["--jit", "maybe"],
    ["--steps", "0"],
    ["--shared_input"],
    ["--layer", "LayerNormalization", "--input_shape", "2,3",
     "--shared_input"],
])
def test_parse_args_rejects_bad_input(argv):
    with pytest.raises(SystemExit):
        layers.parse_args(argv)


@pytest.mark.parametrize("argv,message", [
    (["--layer", "Dense", "--input_shape", "8,4"],
     "--config '' does not make a keras.layers.Dense"),
    (["--num_models", "2,2"], "--num_models lists 2 more than once"),
    (["--jit", "true,true"], "--jit lists true more than once"),
    (["--layer", "Dense", "--config", "units=2", "--input_shape", "0,4"],
     "--input_shape takes positive integers"),
    (["--layer", "Dense", "--config", "units=2", "--input_shape", "8,x"],
     "--input_shape takes positive integers"),
])
def test_parse_args_names_the_flag_to_fix(argv, message, capsys):
    with pytest.raises(SystemExit) as error:
        layers.parse_args(argv)
    assert error.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("name,config,shape", [
    ("Dense", {"units": 3}, (4, 5, 2)),
    ("BatchNormalization", {}, (4, 5, 2)),
    ("DepthwiseConv2D", {"kernel_size": 3, "padding": "same"},
     (2, 4, 4, 3)),
])
def test_measure_case_times_both_sides(name, config, shape):
    row = layers.measure_case(name, config, shape, num_models=2,
                              jit_compile=False, steps=1, rounds=2)
    assert row["layer"] == name and row["num_models"] == 2
    for key in ("stock_wall_ms", "fused_wall_ms", "stock_cpu_ms",
                "fused_cpu_ms", "wall_speedup", "cpu_speedup"):
        assert row[key] > 0, key
    # One model's output is [batch, ..., channels] of float32.
    units = config.get("units", shape[-1])
    expected = 4 * shape[0] * int(np.prod(shape[1:-1])) * units / 2**20
    assert row["model_output_mib"] == pytest.approx(expected)
    assert row["array_output_mib"] == pytest.approx(2 * expected)


@pytest.mark.parametrize("name,config,shape", [
    ("Dense", {"units": 3}, (4, 5)),
    ("Conv2D", {"filters": 2, "kernel_size": 3}, (2, 5, 5, 3)),
])
def test_measure_case_with_a_shared_input(name, config, shape):
    row = layers.measure_case(name, config, shape, num_models=2,
                              jit_compile=False, steps=1, rounds=1,
                              shared_input=True)
    assert row["shared_input"] and row["cpu_speedup"] > 0
    assert layers._describe(row).endswith("(shared)")


def test_main_prints_a_row_per_setting(capsys):
    rows = layers.main(["--layer", "Activation", "--config",
                        "activation=relu", "--input_shape", "2,3",
                        "--num_models", "1,2", "--steps", "1", "--rounds",
                        "1"])
    assert [r["num_models"] for r in rows] == [1, 2]
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].split()[:2] == ["case", "B"]
    assert len(lines) == 3 and lines[2].startswith("Activation(")
