"""`ModelCheckpoint`: each model of an array saved as a plain Keras model
at its best."""

import os
import re
import string
import uuid

from hftatf.callbacks.base import PerModelMonitorCallback, per_model_arg
from hftatf.core import files
from hftatf.core.compat import print_msg
from hftatf.core.logs import split_logs
from hftatf.fuse import compile_stock_model, compiles_stock_models
from hftatf.graph import set_layer_weights, weighted_layers


class ModelCheckpoint(PerModelMonitorCallback):
    """Saves each model of an array as a plain Keras model, at its best.

    Model `b` is judged on `logs[f"{monitor}_{b}"]` as stock
    `keras.callbacks.ModelCheckpoint` judges a single model; when it
    improves (or every epoch, with `save_best_only=False`) its slice of the
    array's weights is saved in the stock architecture the array was fused
    from, so the file loads with `keras.models.load_model` without hftatf.
    As stock Keras saves a model, it is saved compiled (but with
    `save_weights_only`): with the array's loss and metrics and model `b`'s
    own stock optimizer and its state (`hftatf.fuse.unfuse`), so training
    the loaded model goes on as model `b` would have in the array.
    Files are written atomically (to a temporary file in the same directory,
    then renamed), so a crash never leaves a truncated checkpoint behind.

    `filepath` is formatted per model with `model` (its index), `epoch`
    (1-based, as in Keras) and any log entry, model `b`'s own values under
    the names without suffix, e.g. `"ckpt/model_{model}.keras"` or
    `"ckpt/m{model}-{epoch:02d}-{val_loss:.3f}.keras"`.

    Needs an array made by `hftatf.fuse` or `hftatf.fuse_models` (which
    know their stock architecture).

    Args:
        filepath: the path pattern of the files; it must end in `.keras` (or
            `.weights.h5` with `save_weights_only=True`).
        monitor: the quantity to watch, without the model suffix.
        verbose: 0 (silent) or 1 (a message per save).
        save_best_only: whether a model is saved only when its monitored
            value improves. Defaults to True (stock Keras: False): the point
            of checkpointing an array is usually each model's best.
        save_weights_only: whether to save only the weights
            (`model.save_weights`) rather than the whole model.
        mode: `"auto"`, `"min"` or `"max"`.
        save_freq: `"epoch"`, the only frequency supported: per-model values
            are epoch results.
        initial_value_threshold: a float, or one float per model: the value
            a model must beat to be saved at all.

    Attributes:
        best: per model, the best monitored value so far.
    """

    def __init__(self, filepath, monitor="val_loss", verbose=0,
                 save_best_only=True, save_weights_only=False, mode="auto",
                 save_freq="epoch", initial_value_threshold=None):
        super().__init__(monitor, mode)
        self.filepath = os.fspath(filepath)
        self.save_best_only = save_best_only
        self.save_weights_only = save_weights_only
        self.initial_value_threshold = initial_value_threshold
        self.verbose = verbose
        if save_freq != "epoch":
            raise ValueError(
                "hftatf.callbacks.ModelCheckpoint compares each model's "
                "epoch results: pass save_freq='epoch'. Received: save_freq="
                f"{save_freq!r}.")
        self.save_freq = save_freq
        if save_weights_only:
            if not self.filepath.endswith(".weights.h5"):
                raise ValueError(
                    "When using `save_weights_only=True` in `ModelCheckpoint`"
                    ", the filepath provided must end in `.weights.h5` "
                    "(Keras weights format). Received: "
                    f"filepath={self.filepath}")
        elif not self.filepath.endswith((".keras", ".h5")):
            raise ValueError(
                "The filepath provided must end in `.keras` (Keras model "
                f"format). Received: filepath={self.filepath}")
        self.best = []
        self._stock = None

    # What `hftatf.backup.BackupAndRestore` saves and restores.
    backup_state = ("best",)

    def on_train_begin(self, logs=None):
        array = self.array
        if array.source_config is None:
            raise ValueError(
                f"ModelCheckpoint saves each model of array '{array.name}' "
                "in its stock architecture, but the array was not made by "
                "hftatf.fuse or hftatf.fuse_models and has none. Fuse the "
                "stock model with hftatf.fuse to checkpoint its models.")
        if array.num_models > 1 and "model" not in {
                re.split(r"[.\[]", field)[0] for _, field, _, _
                in string.Formatter().parse(self.filepath) if field}:
            raise ValueError(
                f"ModelCheckpoint saves each of the {array.num_models} "
                "models of the array to its own file, so `filepath` must "
                "name the model with a `{model}` field (e.g. "
                "'ckpt/model_{model}.keras'); the models would overwrite "
                f"each other's files. Received: filepath={self.filepath!r}.")
        if len(self.best) != array.num_models:
            self.best = per_model_arg(
                "initial_value_threshold", self.initial_value_threshold,
                array.num_models)

    def on_epoch_end(self, epoch, logs=None):
        if self.save_best_only and self.monitor_op is None:
            # Delay setup until the model's metrics are all built.
            self._set_monitor_op()
        array = self.array
        if len(self.best) != array.num_models:
            self.on_train_begin()
        logs = logs or {}
        per_model, _ = split_logs(logs, array.num_models)
        values = (self._model_values(logs, "Saving the best models")
                  if self.save_best_only else [None] * array.num_models)
        stacked = None
        for b in range(array.num_models):
            model_logs = {**logs, **{
                name: v[b] for name, v in per_model.items()}}
            try:
                filepath = self.filepath.format(
                    epoch=epoch + 1, model=b, **model_logs)
            except KeyError as e:
                raise KeyError(
                    "Failed to format this callback filepath: "
                    f'"{self.filepath}". Reason: {e}') from e
            if not self._should_save(b, values[b], epoch, filepath):
                continue
            if stacked is None:
                stacked = _stacked_layer_weights(array)
            self._save(b, stacked, filepath)
            if self.verbose > 0:
                print_msg(
                    f"\nEpoch {epoch + 1}: finished saving model {b} to "
                    f"{filepath}")

    def _should_save(self, b, current, epoch, filepath):
        if not self.save_best_only:
            if self.verbose > 0:
                print_msg(
                    f"\nEpoch {epoch + 1}: saving model {b} to {filepath}")
            return True
        if current is None:
            # Stock Keras saves when it cannot judge (and warns).
            return True
        best_str = "None" if self.best[b] is None else f"{self.best[b]:.5f}"
        if self._is_improvement(current, self.best[b]):
            if self.verbose > 0:
                print_msg(
                    f"\nEpoch {epoch + 1}: {self.monitor} of model {b} "
                    f"improved from {best_str} to {current:.5f}, saving it "
                    f"to {filepath}")
            self.best[b] = current
            return True
        if self.verbose > 0:
            print_msg(
                f"\nEpoch {epoch + 1}: {self.monitor} of model {b} did not "
                f"improve from {best_str}")
        return False

    def _stock_model(self):
        """One stock model of the array's architecture, built once; each
        save loads a model's slice into it. Also whether the model is saved
        compiled (`hftatf.fuse.compiles_stock_models`)."""
        array = self.array
        if self._stock is None or self._stock[0] is not array or (
                self._stock[1] is not array.optimizer):
            model = array.stock_model()
            compiles = (not self.save_weights_only
                        and compiles_stock_models(array))
            self._stock = (array, array.optimizer, model,
                           weighted_layers(model), compiles)
        return self._stock[2:]

    def _save(self, b, stacked, filepath):
        model, layers, compiles = self._stock_model()
        for path, layer in layers:
            set_layer_weights(layer, [w[b] for w in stacked[path]])
        if compiles:
            # Saved as stock ModelCheckpoint saves a model: compiled, with
            # model b's optimizer and its state.
            compile_stock_model(self.array, b, model)
        directory = os.path.dirname(filepath)
        if directory and not files.exists(directory):
            files.makedirs(directory)
        # Same directory and extension, so the rename is atomic and Keras
        # accepts the name.
        temporary = os.path.join(
            directory, f".tmp-{uuid.uuid4().hex}-{os.path.basename(filepath)}")
        try:
            if self.save_weights_only:
                model.save_weights(temporary, overwrite=True)
            else:
                model.save(temporary, overwrite=True)
            files.replace(temporary, filepath)
        except IsADirectoryError as e:
            raise OSError(
                "Please specify a non-directory filepath for "
                "ModelCheckpoint. Filepath used is an existing directory: "
                f"{filepath}") from e
        finally:
            if files.exists(temporary):
                files.remove(temporary)


def _stacked_layer_weights(array):
    """`{layer path: [B, ...] weights}` for every layer of `array` with
    weights, keyed as the stock model's layers are."""
    return {path: layer.get_weights()
            for path, layer in weighted_layers(array)}

