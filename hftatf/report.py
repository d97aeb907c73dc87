"""An array's models side by side: one row per model, ranked, as a table.

`model_results` turns a per-model history (`{f"{name}_{b}": [value at
each epoch]}`, as `History` and `hftatf.tpu.results.read_history` hold it)
into one row per model: its hyper-parameters and its values at the last
epoch its loss was finite. `format_table` prints them (the best model
marked, each value's change since an earlier table), `rank_models` orders
the models by a monitored value, and `TableLogger` prints the table every
N epochs of `fit`. The launcher prints the same table at the end of a run.
"""

import math

import keras
import numpy as np

from hftatf.core.logs import (
    as_given,
    monitor_direction,
    ordered_names,
    restored_positions,
    split_logs,
)

BEST_MARK = "*"


def metric_names(history, exclude=()):
    """The per-model quantities of `history`, in reading order
    (`hftatf.core.logs.ordered_names`), leaving out `exclude`."""
    names = {key.rpartition("_")[0] for key in history
             if key.rpartition("_")[2].isdigit()}
    return ordered_names(names - set(exclude))


def model_results(history, hyperparameters=None, diverged=None,
                  num_models=None, positions=None):
    """One dict per model: `model`, its hyper-parameters, each logged
    quantity at the last epoch the model's loss was finite (all of one
    epoch: a diverged model's row is where it stood before it diverged)
    or, for a model in `positions`, at the epoch whose weights it holds,
    and `status` (`"diverged"` or `"ok"`). Validation quantities without a
    value in any epoch of any model (a run without validation) are left
    out; those of a run whose every model diverged are kept, as NaN.

    Args:
        history: a per-model history dict.
        hyperparameters: name -> B values (what makes each model), or None.
        diverged: B booleans, or None.
        num_models: B; default: the length of the hyper-parameters.
        positions: `{model index: position in the history's lists}` of the
            epochs whose weights early stopping restored
            (`hftatf.core.logs.restored_positions`), or None.
    """
    hyperparameters = hyperparameters or {}
    positions = positions or {}
    if num_models is None:
        num_models = len(next(iter(hyperparameters.values())))
    names = metric_names(history, exclude=hyperparameters)
    rows = []
    for b in range(num_models):
        row = {"model": b}
        row.update({name: values[b]
                    for name, values in hyperparameters.items()})
        losses = history.get(f"loss_{b}")
        epoch = positions.get(b, None if losses is None
                              else _last_finite_epoch(losses))
        for name in names:
            values = [float(v) for v in history.get(f"{name}_{b}", [])]
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
             and not any(_finite(float(value)) for b in range(num_models)
                         for value in history.get(f"{name}_{b}", []))]
    for row in rows:
        for name in empty:
            del row[name]
    return rows


def _last_finite_epoch(losses):
    """The index of the last finite value of `losses`; None for none."""
    finite = [i for i, value in enumerate(losses) if math.isfinite(value)]
    return finite[-1] if finite else None


def _finite(value):
    return isinstance(value, float) and math.isfinite(value)


def best_monitor(rows, monitor, mode):
    """`(monitor, mode)`, or `("loss", "min")` where no row has a finite
    value of `monitor` (not logged, or a run without validation)."""
    if any(_finite(row.get(monitor)) for row in rows):
        return monitor, mode
    return "loss", "min"


def ranked(rows, monitor, mode):
    """The rows best first by `monitor` (`mode` "max" or "min"; by `loss`
    where `monitor` has no finite value, `best_monitor`); diverged models
    and those without a finite value last, in model order."""
    monitor, mode = best_monitor(rows, monitor, mode)
    finite = [row for row in rows if _finite(row.get(monitor))
              and row.get("status") != "diverged"]
    sign = -1.0 if mode == "max" else 1.0
    finite.sort(key=lambda row: (sign * row[monitor], row["model"]))
    return finite + [row for row in rows if row not in finite]


def best_model(rows, monitor, mode):
    """The row of the best model by `monitor` (`ranked`); None where no
    model has a finite value."""
    order = ranked(rows, monitor, mode) if rows else []
    monitor, _ = best_monitor(rows, monitor, mode)
    if not order or not _finite(order[0].get(monitor)) or (
            order[0].get("status") == "diverged"):
        return None
    return order[0]


def monitor_mode(model, monitor, mode="auto"):
    """`mode`, or for `"auto"` the way `monitor` improves (`"max"` or
    `"min"`), as Keras callbacks infer it."""
    if mode in ("min", "max"):
        return mode
    if mode != "auto":
        raise ValueError(
            f"`mode` must be 'auto', 'min' or 'max'. Received: mode={mode!r}")
    return {"up": "max", "down": "min"}[monitor_direction(model, monitor)]


def rank_models(array, monitor="val_loss", mode="auto", history=None):
    """The models of `array` best first by `monitor`: a list of
    `(model index, value)`, the value at the epoch whose weights the model
    holds (the best, where `hftatf.callbacks.EarlyStopping` restored it;
    else its last epoch with a finite loss, as the launcher's table shows
    it). Diverged models, and models without a finite value, come last.

    Args:
        array: a trained `FusedModel`.
        monitor: the quantity, without the model suffix (`"val_accuracy"`).
            Where it has no value (no validation) the training `loss`
            ranks the models.
        mode: "auto" (the direction Keras callbacks infer), "min" or "max".
        history: a per-model history dict, or the `keras.callbacks.History`
            that `fit` returns; default: that of the array's last `fit`.
    """
    if history is None:
        history = getattr(array, "history", None)
    positions = {}
    if isinstance(history, keras.callbacks.History):
        history, positions = history.history, restored_positions(history)
    if not history:
        raise ValueError(
            f"Array '{array.name}' has no history to rank its models by: "
            "call `fit` first, or pass `history=` (a dict of per-model "
            "values such as `fit(...).history`).")
    rows = model_results(history, diverged=array.diverged_models,
                         num_models=array.num_models, positions=positions)
    mode = monitor_mode(array, monitor, mode)
    key, _ = best_monitor(rows, monitor, mode)
    return [(row["model"], row.get(key, math.nan))
            for row in ranked(rows, monitor, mode)]


def format_value(value):
    """A logged value in the table: 4 significant digits."""
    return f"{value:.4g}"


def format_hyperparameter(value):
    """A hyper-parameter as its user wrote it (`hftatf.core.logs.as_given`):
    `0.03`, also where it went through float32 (`0.029999999329447746`)."""
    return str(as_given(value))


def format_table(rows, hyperparameters=(), best=None, previous=None):
    """The rows as an aligned text table.

    Args:
        rows: `model_results` rows.
        hyperparameters: the names of the hyper-parameter columns (shown
            as given, `format_hyperparameter`).
        best: the best model's index, marked `*` in its row; or None.
        previous: the rows of an earlier table: each value shows its change
            since then (`0.412 (-0.031)`).
    """
    if not rows:
        return "(no models)"
    columns = list(rows[0])
    earlier = {row["model"]: row for row in previous or ()}

    def cell(row, column):
        value = row.get(column)
        if column in hyperparameters:
            return format_hyperparameter(value)
        if column == "model":
            return f"{value}{BEST_MARK if value == best else ' '}"
        if not isinstance(value, float):
            return "" if value is None else str(value)
        text = format_value(value)
        before = earlier.get(row["model"], {}).get(column)
        if isinstance(before, float) and math.isfinite(value) and (
                math.isfinite(before)):
            text += f" ({value - before:+.2g})"
        return text

    return aligned(columns, [[cell(row, column) for column in columns]
                             for row in rows])


def aligned(header, cells, left=False):
    """The `header` and rows of `cells` (strings) as text in columns two
    spaces apart, each as wide as its widest cell; right-aligned, or
    left-aligned with `left`."""
    widths = [max(len(name), *(len(row[i]) for row in cells))
              for i, name in enumerate(header)]

    def line(row):
        return "  ".join(text.ljust(width) if left else text.rjust(width)
                         for text, width in zip(row, widths))

    return "\n".join(line(row) for row in [header, *cells])


class TableLogger(keras.callbacks.Callback):
    """Prints the per-model table of an array every `every_n_epochs`
    epochs of `fit`: each model's values at that epoch (`model_results`),
    their change since the previous table, and the best model by `monitor`
    marked `*`.

    Args:
        every_n_epochs: how often (epochs) to print the table.
        monitor: the quantity that picks the best model, without the model
            suffix (the training `loss` where it has no value).
        mode: "auto", "min" or "max", as for Keras callbacks.
        hyperparameters: name -> B values, shown as columns.
        print_fn: prints each table (default: `print`).
    """

    def __init__(self, every_n_epochs=1, monitor="val_loss", mode="auto",
                 hyperparameters=None, print_fn=print):
        super().__init__()
        if not isinstance(every_n_epochs, int) or every_n_epochs < 1:
            raise ValueError(
                "`every_n_epochs` must be a positive integer. Received: "
                f"every_n_epochs={every_n_epochs!r}")
        self.every_n_epochs = every_n_epochs
        self.monitor = monitor
        self.mode = mode
        self.hyperparameters = hyperparameters or {}
        self.print_fn = print_fn
        self.history = {}
        self.tables = []
        self._pending = None

    def on_train_begin(self, logs=None):
        self.history, self.tables, self._epochs = {}, [], 0
        self._pending = None

    def on_epoch_end(self, epoch, logs=None):
        num_models = self.model.num_models
        per_model, _ = split_logs(logs, num_models)
        for name, values in per_model.items():
            for b, value in enumerate(values):
                self.history.setdefault(f"{name}_{b}", [math.nan] * (
                    self._epochs)).append(float(np.mean(value)))
        self._epochs += 1
        for values in self.history.values():
            values.extend([math.nan] * (self._epochs - len(values)))
        if (epoch + 1) % self.every_n_epochs == 0:
            # Printed once the epoch's progress bar has ended (Keras calls
            # it after every other callback).
            self._pending = f"Epoch {epoch + 1}:\n{self.table()}"

    def on_epoch_begin(self, epoch, logs=None):
        self._print_pending()

    def on_train_end(self, logs=None):
        self._print_pending()

    def _print_pending(self):
        if self._pending is not None:
            self.print_fn(self._pending)
            self._pending = None

    def table(self):
        """The table of the epochs so far (recorded in `tables`)."""
        rows = model_results(self.history, self.hyperparameters,
                             diverged=self.model.diverged_models,
                             num_models=self.model.num_models)
        mode = monitor_mode(self.model, self.monitor, self.mode)
        best = best_model(rows, self.monitor, mode)
        text = format_table(
            rows, list(self.hyperparameters),
            best=None if best is None else best["model"],
            previous=self.tables[-1] if self.tables else None)
        self.tables.append(rows)
        return text
