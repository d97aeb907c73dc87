"""A run's plots: every model's curves, and final values against each
hyper-parameter the array varies.

`loss_curves.png` has a panel per logged loss (training and validation):
each model's curve per epoch, the best model drawn thick, and a cross
where a diverged model stopped. `hyperparameters.png` has, for each
hyper-parameter that differs between the models, a panel per final value
(`loss`, `val_accuracy`, ...) against it, on a log axis for rates and
other positive values that span a factor of 10 or more. Both need
matplotlib (`pip install "hftatf[data]"`); without it a note is logged and
nothing is plotted.
"""

import math
import pathlib

from absl import logging

from hftatf.report import metric_names

LOSS_CURVES_FILE = "loss_curves.png"
HYPERPARAMETERS_FILE = "hyperparameters.png"

# Beyond this many models the legend names only the best one.
_LEGEND_MODELS = 10


def _figure_modules():
    """matplotlib's `Figure` and `MaxNLocator`, or None (a note logged)."""
    try:
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        logging.warning(
            "matplotlib is not installed: no plots written (pip install "
            "'hftatf[data]' to get %s and %s).", LOSS_CURVES_FILE,
            HYPERPARAMETERS_FILE)
        return None
    return Figure, MaxNLocator


def _panels(count, width=6, height=4):
    """A figure of `count` panels, two a row; returns it and its axes."""
    Figure, _ = _figure_modules()
    columns = min(2, count)
    rows = math.ceil(count / columns)
    figure = Figure(figsize=(width * columns, height * rows),
                    layout="constrained")
    axes = figure.subplots(rows, columns, squeeze=False).ravel()
    for axis in axes[count:]:
        axis.set_visible(False)
    return figure, axes[:count]


def _finite_values(history, name):
    return [value for key, values in history.items()
            if key.rpartition("_")[0] == name for value in values
            if math.isfinite(value)]


def plot_loss_curves(history, labels, path, best=None, diverged=None):
    """Plots each model's losses per epoch to `path`.

    Args:
        history: a per-model history (`{f"{name}_{b}": [...]}`).
        labels: one legend label per model.
        path: the PNG to write.
        best: the best model's index (drawn thick), or None.
        diverged: B booleans: a cross marks each diverged model's last
            finite value.

    Returns:
        `path`, or None where matplotlib is missing or nothing was logged.
    """
    modules = _figure_modules()
    names = [name for name in metric_names(history)
             if name.endswith("loss") and _finite_values(history, name)]
    if modules is None or not names:
        return None
    _, MaxNLocator = modules
    figure, axes = _panels(len(names))
    legend = len(labels) <= _LEGEND_MODELS
    for axis, name in zip(axes, names):
        crossed, unseen = False, 0
        for b, label in enumerate(labels):
            values = history.get(f"{name}_{b}", [])
            epochs = range(1, len(values) + 1)
            thick = b == best
            axis.plot(epochs, values, marker="." if thick or legend else "",
                      linewidth=2.5 if thick else 1.0,
                      alpha=1.0 if thick or best is None else 0.6,
                      zorder=3 if thick else 2,
                      label=(f"{label} (best)" if thick else label)
                      if legend or thick else None)
            finite = [i for i, v in enumerate(values) if math.isfinite(v)]
            if diverged is not None and diverged[b] and not finite:
                unseen += 1
            elif diverged is not None and diverged[b]:
                axis.plot(finite[-1] + 1, values[finite[-1]], "x",
                          color="red", markersize=9, zorder=4,
                          label=None if crossed else "diverged")
                crossed = True
        if unseen:
            # No value to draw: the legend counts them.
            axis.plot([], [], "x", color="darkred", label=(
                f"{unseen} diverged before a finite value (not drawn)"))
        if _spans_orders(history, name, len(labels)):
            # One diverging model's large values would flatten the others.
            axis.set_yscale("log")
        axis.set_xlabel("epoch")
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))
        axis.set_ylabel(name)
        axis.set_title(f"validation {name[4:]}" if name.startswith("val_")
                       else f"training {name}")
        axis.grid(alpha=0.3)
    axes[0].legend(fontsize="small")
    figure.savefig(path, dpi=100)
    return pathlib.Path(path)


def _spans_orders(history, name, num_models):
    """Whether the models' finite values of `name` are all positive and
    span a factor of 100 or more: they read on a log axis."""
    values = [v for b in range(num_models)
              for v in history.get(f"{name}_{b}", []) if math.isfinite(v)]
    return _span(values) >= 100


def varied(columns):
    """The hyper-parameters of `columns` (name -> B values) that differ
    between the models."""
    return [name for name, values in columns.items()
            if len({float(v) for v in values}) > 1]


def log_axis(name, values):
    """Whether `values` of hyper-parameter `name` read best on a log axis:
    rates, and positive values that span a factor of 10 or more."""
    values = [float(v) for v in values]
    return _span(values) > 0 and ("rate" in name or _span(values) >= 10)


def _span(values):
    """The factor between the largest and smallest of positive `values`;
    0 where they are not all positive (or there are none)."""
    return max(values) / min(values) if values and min(values) > 0 else 0


def plot_hyperparameters(rows, columns, path, best=None):
    """Plots each model's final values (`rows`, `report.model_results`)
    against each hyper-parameter that differs between the models
    (`columns`: name -> B values) to `path`: a row of panels per
    hyper-parameter, a panel per final value, the best model ringed.

    Returns:
        `path`, or None where matplotlib is missing or no hyper-parameter
        varies.
    """
    names = varied(columns)
    modules = _figure_modules() if names else None
    if modules is None or not rows:
        return None
    metrics = [key for key in rows[0] if key not in columns
               and key not in ("model", "status")]
    figure, axes = _panels(len(names) * len(metrics), width=4.5,
                           height=3.5)
    for i, (name, metric) in enumerate(
            (name, metric) for name in names for metric in metrics):
        axis = axes[i]
        xs = [float(value) for value in columns[name]]
        ys = [row[metric] for row in rows]
        axis.scatter(xs, ys, zorder=2)
        if best is not None:
            axis.scatter([xs[best]], [ys[best]], s=160, facecolors="none",
                         edgecolors="red", zorder=3, label="best")
            axis.legend(fontsize="small")
        if log_axis(name, xs):
            axis.set_xscale("log")
        axis.set_xlabel(name)
        axis.set_ylabel(f"final {metric}")
        axis.grid(alpha=0.3)
    figure.savefig(path, dpi=100)
    return pathlib.Path(path)
