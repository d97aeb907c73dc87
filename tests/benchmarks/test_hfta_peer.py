"""benchmarks/hfta_peer.sh: HFTA's own PyTorch arrays, dry-run on the CPU
where PyTorch and a snapshot of HFTA are at hand (CI has neither: skipped
there), and the side-by-side table it joins hftatf's results into."""

import csv
import importlib.util
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from benchmarks import hfta_peer

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "hfta_peer.sh"
HFTA_DIR = pathlib.Path(os.environ.get("HFTA_DIR", ROOT / ".peer" / "hfta"))
# An interpreter with PyTorch, where the suite's has none (as in the script).
PEER_PYTHON = os.environ.get("PEER_PYTHON", sys.executable)


def _has_torch():
    if PEER_PYTHON == sys.executable:
        return importlib.util.find_spec("torch") is not None
    return subprocess.run([PEER_PYTHON, "-c", "import torch"],
                          capture_output=True).returncode == 0


def _missing():
    if not (HFTA_DIR / "hfta" / "ops" / "__init__.py").is_file():
        return (f"no snapshot of HFTA at {HFTA_DIR} (set HFTA_DIR or place "
                "one as benchmarks/hfta_peer.sh says)")
    if shutil.which("bash") is None:
        return "needs bash"
    if not _has_torch():
        return (f"PyTorch is not installed for {PEER_PYTHON} (set "
                "PEER_PYTHON to an interpreter that has it)")
    return None


@pytest.mark.backends("jax", reason="runs PyTorch, not Keras: one suite "
                      "(the GPU run's JAX) is enough")
def test_dry_run_trains_hfta_arrays_and_writes_csv(tmp_path):
    missing = _missing()
    if missing:
        pytest.skip(missing)
    environment = {**os.environ, "OUT_DIR": str(tmp_path), "HFTATF": "0",
                   "HFTA_DIR": str(HFTA_DIR), "PEER_PYTHON": PEER_PYTHON}
    done = subprocess.run(["bash", str(SCRIPT), "--dry-run"], cwd=ROOT,
                          env=environment, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    with open(tmp_path / "hfta_peer.csv") as file:
        rows = list(csv.DictReader(file))
    assert [(r["model"], r["mode"], r["num_models"]) for r in rows] == [
        (model, mode, size) for model in ("resnet18", "pointnet")
        for mode, size in (("serial", "1"), ("fused", "1"), ("fused", "2"))]
    assert all(r["status"] == "ok" and float(r["model_samples_per_s"]) > 0
               for r in rows)
    assert all(float(r["fused_over_serial"]) > 0
               for r in rows if r["mode"] == "fused")
    assert (tmp_path / "hfta_peer.md").read_text().startswith("| model |")


def _write(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as file:
        writer = csv.DictWriter(file, list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def test_side_by_side_divides_by_serial_at_one_model(tmp_path, capsys):
    def hfta(mode, b, rate, precision="fp32"):
        return {"model": "pointnet", "mode": mode, "num_models": b,
                "precision": precision, "model_samples_per_s": rate}

    _write(tmp_path / "hfta_peer.csv",
           [hfta("serial", 1, 100), hfta("fused", 8, 400),
            hfta("fused", 8, 999, "bf16")])
    row = {"model": "pointnet", "mode": "serial", "num_models": 1,
           "samples_per_s": 200}
    # benchmarks.run writes serial rows at every B (scaled from one timed
    # model): the ratio divides by the one at B = 1.
    _write(tmp_path / "hftatf" / "results.csv",
           [row, {**row, "num_models": 8, "samples_per_s": 190},
            {**row, "mode": "fused", "num_models": 8,
             "samples_per_s": 1000}])
    hfta_peer.main(["--side_by_side", str(tmp_path)])
    table = (tmp_path / "side_by_side.md").read_text().splitlines()
    assert table[2] == ("| pointnet | 8 | 100 | 400 | 4.00 | 200 | 1000 | "
                        "5.00 | 2.50 |")
    assert len(table) == 3
    assert "| pointnet | 8 |" in capsys.readouterr().out
