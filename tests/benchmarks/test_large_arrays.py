"""`benchmarks.large_arrays`: one process per array size and XLA setting,
a row for each (measured, stopped or failed), and flags checked before
anything runs. Tiny arrays: the timings themselves are not asserted."""

import csv
import pathlib
import sys

import pytest

# The harness lives next to the package, not inside it.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

from testing import BACKEND  # noqa: E402

from benchmarks import large_arrays  # noqa: E402

# On JAX a step without XLA runs op by op, each operation compiled on its
# own, which takes longer than compiling the step.
XLA = "on" if BACKEND == "jax" else "off"


def _rows(directory):
    with open(directory / "results.csv", newline="") as file:
        reader = csv.DictReader(file)
        return reader.fieldnames, list(reader)


def test_a_row_per_array_size_with_every_column(tmp_path):
    large_arrays.main(["--num_models", "2", "--xla", XLA,
                       "--output_dir", str(tmp_path), "--time_limit", "300"])
    # --append keeps the rows of other sizes and settings.
    large_arrays.main(["--num_models", "4", "--xla", XLA, "--append",
                       "--output_dir", str(tmp_path), "--time_limit", "300"])
    columns, rows = _rows(tmp_path)
    assert tuple(columns) == large_arrays.COLUMNS
    assert [(r["num_models"], r["xla"], r["status"]) for r in rows] == [
        ("2", XLA, "ok"), ("4", XLA, "ok")]
    for row in rows:
        # 4-8-3: (4 + 1) x 8 + (8 + 1) x 3 weights per model.
        assert row["parameters"] == "67"
        assert all(float(row[key]) > 0 for key in (
            "fuse_s", "epoch_s", "process_s", "rss_after_epoch_mib",
            "peak_rss_mib"))
        total = sum(float(row[f"{p}_s"]) for p in large_arrays.PHASES)
        assert float(row["total_s"]) == pytest.approx(total, abs=2e-3)
        assert float(row["peak_rss_mib"]) >= float(
            row["rss_after_fuse_mib"]) - 1
    table = (tmp_path / "results.md").read_text().splitlines()
    assert len(table) == 4 and table[2].startswith(f"| 2 | {XLA} | 67 |")
    assert (tmp_path / "large_arrays.png").exists()


@pytest.mark.parametrize("limit,status", [
    (["--time_limit", "0.5"], "timed out"),
    (["--memory_limit", "20"], "over memory"),
])
def test_a_process_past_its_limit_is_stopped_and_recorded(tmp_path, limit,
                                                          status):
    rows = large_arrays.main(["--num_models", "2", "--xla", "on",
                              "--output_dir", str(tmp_path), *limit])
    assert [r["status"] for r in rows] == [status]
    _, written = _rows(tmp_path)
    assert written[0]["status"] == status
    assert written[0]["fuse_s"] == "" and float(written[0]["peak_rss_mib"]) > 0
    assert status in (tmp_path / "results.md").read_text()


def test_a_crashed_process_is_recorded_as_failed(tmp_path, capsys):
    args = large_arrays.parse_args(["--output_dir", str(tmp_path)])
    args.units = [4, 0, 3]  # a Dense layer of no units: Keras refuses it
    row = large_arrays.run_one(args, 2, "off", tmp_path)
    assert row["status"] == "failed" and "fuse_s" not in row
    assert "units" in capsys.readouterr().out


@pytest.mark.parametrize("argv,message", [
    (["--num_models", "0"], "--num_models must be positive"),
    (["--num_models", "2,2"], "--num_models lists 2 more than once"),
    (["--xla", "maybe"], "--xla takes off and on"),
    (["--units", "4"], "--units must list at least two positive widths"),
    (["--units", "4,0,3"], "--units must list at least two positive widths"),
    (["--units", "4,8,1"], "--units must end with at least 2 classes"),
    (["--samples", "0"], "--samples must be at least 1"),
    (["--batch_size", "0"], "--batch_size must be at least 1"),
    (["--time_limit", "0"], "--time_limit must be positive"),
    (["--memory_limit", "-1"], "--memory_limit must be positive"),
])
def test_bad_flags_exit_2_naming_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit) as error:
        large_arrays.parse_args(argv)
    assert error.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.startswith("usage: python -m benchmarks.large_arrays")


def test_defaults_are_the_documented_sizes():
    args = large_arrays.parse_args([])
    assert args.num_models == [10, 100, 1000]
    assert args.xla == ["off", "on"] and args.units == [4, 8, 3]
