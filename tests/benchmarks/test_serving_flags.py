"""The serving benchmark's arguments: every bad value is a usage error
naming the flag (nothing is served here)."""

import pathlib
import sys

import pytest

# The harness lives next to the package, not inside it.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

from benchmarks import serving  # noqa: E402


def test_parse_args_reads_the_lists():
    args = serving.parse_args(["--models", "cnn", "--num-models", "2,16"])
    assert args.models == ["cnn"] and args.num_models == [2, 16]


@pytest.mark.parametrize("argv,message", [
    (["--models", "rnn"], "unknown --models ['rnn']"),
    (["--models", "mlp,mlp"], "--models lists mlp more than once"),
    (["--num-models", "0"], "--num-models must be positive"),
    (["--num-models", "two"], "--num-models must be a comma list of int"),
    (["--batch-size", "0"], "--batch-size must be at least 1"),
    (["--repeats", "0"], "--repeats must be at least 1"),
    (["--calls", "0"], "--calls must be at least 1"),
])
def test_parse_args_rejects_values_it_cannot_measure(argv, message, capsys):
    with pytest.raises(SystemExit) as error:
        serving.parse_args(argv)
    assert error.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.startswith("usage: python -m benchmarks.serving")
