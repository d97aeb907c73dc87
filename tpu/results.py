"""A run's results files: the per-model history and `results.csv`.

The launcher logs every epoch of every model to `model_dir/history.csv`
(`hftatf.callbacks.CSVLogger`: one row per epoch and model), so a resumed
run's results and plots cover the epochs before the interruption too. At
the end it writes `model_dir/results.csv` (one row per model: its
hyper-parameters and final values, `hftatf.report.model_results`).
"""

import csv
import math
import pathlib

HISTORY_FILE = "history.csv"
RESULTS_FILE = "results.csv"


def read_history(path, num_models):
    """The per-model logs of `history.csv` as a Keras-style history dict:
    `{f"{name}_{b}": [value at each epoch]}`, epochs in order (missing
    values as NaN). Empty if the file does not exist."""
    path = pathlib.Path(path)
    if not path.exists():
        return {}
    with path.open(newline="") as file:
        rows = list(csv.DictReader(file))
    epochs = sorted({int(row["epoch"]) for row in rows})
    position = {epoch: i for i, epoch in enumerate(epochs)}
    history = {}
    for row in rows:
        b = int(row["model"])
        if b >= num_models:
            continue
        for name, value in row.items():
            if name in ("epoch", "model") or name is None:
                continue
            values = history.setdefault(f"{name}_{b}",
                                        [math.nan] * len(epochs))
            values[position[int(row["epoch"])]] = _float(value)
    return history


def trim_history(path, epoch):
    """Drops the rows of epochs `epoch` and later from `history.csv` (those
    a killed run logged after its last backup); with `epoch` 0, the file."""
    path = pathlib.Path(path)
    if not path.exists():
        return
    if epoch == 0:
        path.unlink()
        return
    with path.open(newline="") as file:
        reader = csv.reader(file)
        header = next(reader, None)
        rows = [row for row in reader if row and int(row[0]) < epoch]
    temporary = path.with_name(f".{path.name}.tmp")
    with temporary.open("w", newline="") as file:
        writer = csv.writer(file)
        if header:
            writer.writerow(header)
        writer.writerows(rows)
    temporary.replace(path)


def _float(value):
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def write_csv(rows, path):
    """Writes the rows to `path` (header: the first row's keys)."""
    path = pathlib.Path(path)
    temporary = path.with_name(f".{path.name}.tmp")
    with temporary.open("w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=list(rows[0]) if rows
                                else ["model"])
        writer.writeheader()
        writer.writerows(rows)
    temporary.replace(path)
    return path
