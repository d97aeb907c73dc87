"""A run's results: per-model history, table, CSV and loss curves.

The launcher logs every epoch of every model to `model_dir/history.csv`
(`hftatf.callbacks.CSVLogger`: one row per epoch and model), so a resumed
run's results and curves cover the epochs before the interruption too. At
the end it writes `model_dir/results.csv` (one row per model: its
hyper-parameters and final values) and `model_dir/loss_curves.png`.
"""

import csv
import math
import pathlib

from absl import logging

HISTORY_FILE = "history.csv"
RESULTS_FILE = "results.csv"
PLOT_FILE = "loss_curves.png"


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


def metric_names(history, exclude=()):
    """The per-model quantities of `history`, training ones first (loss
    first), then validation ones."""
    names = {key.rpartition("_")[0] for key in history
             if key.rpartition("_")[2].isdigit()}
    names -= set(exclude)

    def order(name):
        base = name[4:] if name.startswith("val_") else name
        return (name.startswith("val_"), base != "loss", base)

    return sorted(names, key=order)


def model_results(history, hyperparameters, diverged=None):
    """One dict per model: `model`, its hyper-parameters, each logged
    quantity at the last epoch the model's loss was finite (all of one
    epoch: a diverged model's row is where it stood before it diverged),
    and `status` (`"diverged"` or `"ok"`). Validation quantities without a
    value (a run without validation) are left out.

    Args:
        history: a Keras-style history dict (`read_history`).
        hyperparameters: name -> B values (what makes each model).
        diverged: B booleans, or None.
    """
    num_models = len(next(iter(hyperparameters.values())))
    names = metric_names(history, exclude=hyperparameters)
    rows = []
    for b in range(num_models):
        row = {"model": b}
        row.update({name: values[b]
                    for name, values in hyperparameters.items()})
        losses = history.get(f"loss_{b}")
        epoch = None if losses is None else _last_finite_epoch(losses)
        for name in names:
            values = history.get(f"{name}_{b}", [])
            if losses is not None and epoch is None:
                row[name] = math.nan  # Not finite from its first epoch.
            elif epoch is None:
                values = [v for v in values if not math.isnan(v)]
                row[name] = values[-1] if values else math.nan
            else:
                row[name] = values[epoch] if epoch < len(values) else math.nan
        if diverged is not None:
            row["status"] = "diverged" if diverged[b] else "ok"
        rows.append(row)
    empty = [name for name in names if name.startswith("val_")
             and all(math.isnan(row[name]) for row in rows)]
    for row in rows:
        for name in empty:
            del row[name]
    return rows


def _last_finite_epoch(losses):
    """The index of the last finite value of `losses`; None for none."""
    finite = [i for i, value in enumerate(losses) if math.isfinite(value)]
    return finite[-1] if finite else None


def best_monitor(rows, monitor, mode):
    """`(monitor, mode)`, or `("loss", "min")` where no row has a finite
    value of `monitor` (not logged, or a run without validation)."""
    if any(_finite(row.get(monitor)) for row in rows):
        return monitor, mode
    return "loss", "min"


def _finite(value):
    return isinstance(value, float) and math.isfinite(value)


def best_model(rows, monitor, mode):
    """The row of the best model by `monitor` (`mode` "max" or "min");
    by `loss` where `monitor` has no finite value (`best_monitor`); None
    without finite values."""
    if not rows:
        return None
    monitor, mode = best_monitor(rows, monitor, mode)
    finite = [row for row in rows if _finite(row.get(monitor))
              and row.get("status") != "diverged"]
    if not finite:
        return None
    choose = max if mode == "max" else min
    return choose(finite, key=lambda row: row[monitor])


def format_table(rows):
    """The rows as an aligned text table."""
    if not rows:
        return "(no models)"
    columns = list(rows[0])
    cells = [[_format(row.get(column)) for column in columns]
             for row in rows]
    widths = [max(len(column), *(len(r[i]) for r in cells))
              for i, column in enumerate(columns)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(r, widths))
              for r in cells]
    return "\n".join(lines)


def _format(value):
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else str(value)


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


def plot_losses(history, labels, path):
    """Plots each model's losses (training and validation, one panel per
    logged loss) per epoch to `path`; returns `path`, or None where
    matplotlib is not installed (a note is logged) or nothing was logged."""
    try:
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        logging.warning(
            "matplotlib is not installed: no loss curves plotted (pip "
            "install 'hftatf[plot]' to get %s).", pathlib.Path(path).name)
        return None
    # Every per-model loss: `loss` and `val_loss`, or a GAN's `d_loss`,
    # `g_loss`, ...
    panels = [name for name in metric_names(history)
              if name.endswith("loss") and any(
                  _finite(value) for key, values in history.items()
                  if key.rpartition("_")[0] == name for value in values)]
    if not panels:
        return None
    columns = min(2, len(panels))
    rows = math.ceil(len(panels) / columns)
    figure = Figure(figsize=(6 * columns, 4 * rows), layout="constrained")
    axes = figure.subplots(rows, columns, squeeze=False).ravel()
    for axis in axes[len(panels):]:
        axis.set_visible(False)
    for axis, name in zip(axes, panels):
        for b, label in enumerate(labels):
            values = history.get(f"{name}_{b}", [])
            axis.plot(range(1, len(values) + 1), values, marker=".",
                      label=label)
        axis.set_xlabel("epoch")
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))
        axis.set_ylabel(name)
        axis.set_title(f"validation {name[4:]}" if name.startswith("val_")
                       else f"training {name}")
        axis.grid(alpha=0.3)
    axes[0].legend(fontsize="small")
    figure.savefig(path, dpi=100)
    return pathlib.Path(path)
