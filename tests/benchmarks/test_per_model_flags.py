"""The per-model-layer benchmark's arguments (nothing trains here; its
layers are tested in tests/layers/test_per_model.py)."""

import pathlib
import sys

import pytest

# The harness lives next to the package, not inside it.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

from benchmarks import per_model  # noqa: E402


def test_parse_args_reads_the_array_sizes():
    assert per_model.parse_args([]).num_models == [1, 4, 8]
    args = per_model.parse_args(["--num_models", "2,3", "--rounds", "1"])
    assert args.num_models == [2, 3] and args.rounds == 1


@pytest.mark.parametrize("argv,message", [
    (["--rounds", "0"], "--rounds must be at least 1"),
    (["--num_models", "0"], "--num_models must be positive"),
    (["--num_models", "x"], "--num_models must be a comma list of int"),
    (["--num_models", "2,2"], "--num_models lists 2 more than once"),
    (["--warmup_steps", "0"], "--warmup_steps must be at least 1"),
    (["--steps", "0"], "--steps must be at least 1"),
    (["--batch_size", "0"], "--batch_size must be at least 1"),
])
def test_parse_args_rejects_values_it_cannot_measure(argv, message, capsys):
    with pytest.raises(SystemExit) as error:
        per_model.parse_args(argv)
    assert error.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.startswith("usage: python -m benchmarks.per_model")
