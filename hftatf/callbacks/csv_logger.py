"""`CSVLogger`: each model's epoch results as rows of one table."""

import csv
import os

import keras
import numpy as np

from hftatf.callbacks.base import (
    check_hyperparameter_names,
    checked_array,
    hyperparameter_values,
)
from hftatf.core import files
from hftatf.core.logs import split_logs


class CSVLogger(keras.callbacks.Callback):
    """Streams each model's epoch results to a CSV file, one row per epoch
    and model.

    Columns: `epoch`, `model`, then every per-model quantity of the logs
    under its name without the model suffix (`loss`, `accuracy`,
    `val_loss`, ...; sorted, as stock Keras sorts them), then the optimizer
    hyper-parameters named in `hyperparameters` (model `b`'s current value),
    then any log entry that is not per model (the same on every row). The
    means over models are left out: the table is tidy, one observation per
    row, and loads directly into pandas (`pd.read_csv`) or a plotting tool;
    missing values (e.g. `val_*` on epochs without validation) are written
    as `NA`.

    Args:
        filename: the CSV file's path.
        separator: the string that separates the columns.
        append: whether to append to an existing file (its header is kept)
            rather than overwrite it.
        hyperparameters: names of the optimizer's per-model hyper-parameters
            to write too; those the optimizer does not have are left out.
            Defaults to `("learning_rate",)`.
    """

    def __init__(self, filename, separator=",", append=False,
                 hyperparameters=("learning_rate",)):
        super().__init__()
        self.sep = separator
        self.filename = os.fspath(filename)
        self.append = append
        self.hyperparameters = check_hyperparameter_names(hyperparameters)
        self.keys = None
        self.writer = None
        self.append_header = True
        self.csv_file = None

    def on_train_begin(self, logs=None):
        checked_array(self)
        if self.append:
            if files.exists(self.filename):
                with files.open_file(self.filename, "r") as f:
                    self.append_header = not bool(len(f.readline()))
            mode = "a"
        else:
            mode = "w"
        self._close()
        self.csv_file = files.open_file(self.filename, mode)
        self.writer = None
        self.keys = None

    def on_epoch_end(self, epoch, logs=None):
        array = checked_array(self)
        per_model, shared = split_logs(logs, array.num_models)
        hypers = hyperparameter_values(
            self.model.optimizer,
            [n for n in self.hyperparameters if n not in per_model])
        if self.keys is None:
            names = sorted(per_model)
            if not any(n.startswith("val_") for n in names):
                # Epochs with validation will add these later (not for
                # hyper-parameters another callback logged).
                own = getattr(self.model.optimizer, "hyperparameter_names",
                              ())
                names += [f"val_{n}" for n in names if n not in own]
            self.keys = names + [n for n in hypers if n not in names]
            self.keys += sorted(k for k in shared if k not in self.keys)
        if self.writer is None:

            class Dialect(csv.excel):
                delimiter = self.sep

            self.writer = csv.DictWriter(
                self.csv_file, fieldnames=["epoch", "model", *self.keys],
                dialect=Dialect)
            if self.append_header:
                self.writer.writeheader()
        values = {**shared, **hypers, **per_model}
        for b in range(array.num_models):
            row = {"epoch": epoch, "model": b}
            for key in self.keys:
                value = values.get(key, "NA")
                if isinstance(value, list):
                    value = value[b]
                row[key] = _plain(value)
            self.writer.writerow(row)
        self.csv_file.flush()

    def on_train_end(self, logs=None):
        self._close()
        self.writer = None

    def _close(self):
        if self.csv_file is not None:
            self.csv_file.close()
            self.csv_file = None


def _plain(value):
    """A log value as CSV writes it: numbers as Python numbers."""
    if isinstance(value, str):
        return value
    array = np.asarray(value)
    if array.ndim == 0 and array.dtype.kind in "fiub":
        return array.item()
    return f'"[{", ".join(map(str, array.ravel()))}]"'


