"""Each model's loss and metrics, and the logs that report them.

Every model of an array gets its own `CompileLoss` and `CompileMetrics`,
what stock `Model.compile` builds, so that its loss and metrics follow the
stock semantics (string names, nested outputs, loss weights, "accuracy"
resolution). The logs carry each model's value as `name_b` and the mean
over the models that have not diverged as `name`.
"""

import keras
from keras import ops

from hftatf.core import compat
from hftatf.core.compat import (
    CompileLoss,
    CompileMetrics,
    scale_loss_for_distribution,
    unscale_loss_for_distribution,
)
from hftatf.core.logs import check_log_names, model_log_name, per_model_mean


class PerModelMean(keras.metrics.Metric):
    """Running mean of a `[B]` vector (one value per model), batch-weighted."""

    def __init__(self, num_models, name="loss", **kwargs):
        super().__init__(name=name, **kwargs)
        self.num_models = num_models
        self.total = self.add_variable((num_models,), "zeros", name="total")
        self.count = self.add_variable((), "zeros", name="count")

    def update_state(self, values, sample_weight=1.0):
        weight = ops.cast(sample_weight, self.dtype)
        self.total.assign_add(ops.cast(values, self.dtype) * weight)
        self.count.assign_add(weight)

    def result(self):
        return ops.divide_no_nan(self.total, self.count)

    def get_config(self):
        return {**super().get_config(), "num_models": self.num_models}


def custom_objects(structure):
    """The functions and the classes of the objects in `structure` (and
    the functions that Keras's wrapping losses and metrics hold), by the
    names their configs give them."""
    found = {}
    pending = [structure]
    while pending:
        value = pending.pop()
        if isinstance(value, dict):
            pending.extend(value.values())
        elif isinstance(value, (list, tuple)):
            pending.extend(value)
        elif callable(value) and hasattr(value, "__name__"):
            found[value.__name__] = value
        elif value is not None and not isinstance(value, (str, int, float)):
            found[type(value).__name__] = type(value)
            pending.extend(getattr(value, name, None)
                           for name in ("fn", "_fn"))
    return found


def clone_metrics(metrics):
    """Returns `metrics` with every Metric object replaced by a fresh copy,
    so that each model of the array keeps its own metric state."""

    def clone(metric):
        if isinstance(metric, keras.metrics.Metric):
            # The metric's function or class, if the user's own, need not
            # be registered with Keras: stock compile takes it as it is.
            with keras.saving.custom_object_scope(custom_objects(metric)):
                return type(metric).from_config(metric.get_config())
        return metric

    return keras.tree.map_structure(clone, metrics, none_is_leaf=True) if (
        metrics is not None) else None


def check_reduced(loss):
    """Refuses a compiled loss that reduces nothing: each model's loss must
    be one number, logged and trained on alike."""
    for value in keras.tree.flatten(loss):
        if isinstance(value, keras.losses.Loss) and value.reduction in (
                None, "none"):
            raise ValueError(
                f"Loss '{value.name}' has reduction={value.reduction!r}, "
                "which an array does not take: each model's loss must be "
                "one number. Stock Keras trains on the sum of the values "
                "and logs their mean; reduction='sum' trains alike (and "
                "logs the sum), 'sum_over_batch_size' logs the mean and "
                "trains on it.")


class PerModelLosses:
    """Mixin of `FusedModel`: per-model losses, metrics and logs.

    Reads `num_models`, `_model_losses` and `_model_metrics` (one
    `CompileLoss` and `CompileMetrics` per model, made by `compile`),
    `_model_loss_tracker` (a `PerModelMean`), `_status` (which models
    diverged: their losses log as NaN and their values stay out of the
    means) and `_bad_batch` (kept out of the logs).
    """

    def compile_model_losses(self, loss, loss_weights, metrics,
                             weighted_metrics):
        """Gives every model its own compiled loss and metrics."""
        output_names = getattr(self, "output_names", None)
        self._model_losses = None
        if loss is not None:
            self._model_losses = [
                CompileLoss(loss, loss_weights, output_names=output_names)
                for _ in range(self.num_models)]
        self._model_metrics = None
        if metrics is not None or weighted_metrics is not None:
            self._model_metrics = [
                CompileMetrics(clone_metrics(metrics),
                               clone_metrics(weighted_metrics),
                               output_names=output_names)
                for _ in range(self.num_models)]
        self._model_loss_tracker = PerModelMean(self.num_models, name="loss")

    def compute_model_losses(self, x=None, y=None, y_pred=None,
                             sample_weight=None, training=True):
        """Returns the `[B]` vector of per-model losses.

        Entry `b` is what a stock Keras model would report as its loss for
        model `b`: the compiled loss of its outputs plus its regularization
        losses. A scalar loss added with `add_loss` belongs to no single
        model; it is split evenly between them.
        """
        del x
        return self._losses_of_models(
            range(self.num_models), y, y_pred, sample_weight, self.losses,
            training=training)

    def _losses_of_models(self, indices, y, y_pred, sample_weight, added,
                          training=True):
        """The losses of the models `indices`, whose predictions `y_pred`
        holds (`[batch, len(indices), ...]`), plus their `added` losses (a
        vector of one entry per model, or a scalar split evenly)."""
        losses = self._compiled_losses(indices, y, y_pred, sample_weight,
                                       training)
        count = len(indices)
        for extra in added:
            if not keras.backend.is_float_dtype(extra.dtype):
                extra = ops.cast(extra, keras.backend.floatx())
            # Divided by the number of replicas, like the compiled loss, as
            # Keras does for its models' added losses.
            extra = scale_loss_for_distribution(ops.cast(extra, losses.dtype))
            if tuple(extra.shape) == (count,):
                losses = losses + extra
            else:
                losses = losses + ops.sum(extra) / count
        return losses

    def _compiled_losses(self, indices, y, y_pred, sample_weight, training):
        """The `[len(indices)]` compiled losses of the models `indices`,
        whose predictions `y_pred` holds (zeros without a compiled
        loss)."""
        losses = []
        preds = self._model_predictions(y_pred)
        for index, pred in zip(indices, preds):
            target = self._model_targets(y, y_pred, sample_weight, index,
                                         pred, training=training)
            loss = None
            if self._model_losses is not None:
                # Inside a loop over passes, `index` is a tensor: the
                # models' compiled losses compute alike (they differ only
                # in the per-output trackers that such loops avoid).
                loss = self._model_losses[
                    index if isinstance(index, int) else 0](*target)
            losses.append(ops.zeros(()) if loss is None else loss)
        return ops.stack(losses)

    def _update_model_metrics(self, y, y_pred, sample_weight, training):
        """Updates each model's compiled metrics with its labels,
        predictions and sample weights."""
        preds = self._model_predictions(y_pred)
        for index, (metrics, pred) in enumerate(zip(self._model_metrics,
                                                    preds)):
            metrics.update_state(*self._model_targets(
                y, y_pred, sample_weight, index, pred, training=training))

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None,
                     training=True):
        """The array's objective: the sum of the per-model losses."""
        return ops.sum(self.compute_model_losses(
            x, y, y_pred, sample_weight, training=training))

    def _build_model_state(self, x, y, y_pred, sample_weight):
        """Builds every model's compiled loss and metrics (run on symbolic
        tensors by `_symbolic_build`)."""
        losses = self.compute_model_losses(x, y, y_pred, sample_weight,
                                           training=False)
        if self._model_metrics is not None and y is not None:
            preds = self._model_predictions(y_pred)
            for index, metrics in enumerate(self._model_metrics):
                metrics.update_state(*self._model_targets(
                    y, y_pred, sample_weight, index, preds[index]))
        return losses

    def _track(self, x, y, y_pred, sample_weight, losses, training=False):
        """Updates the per-model loss and metrics; returns the logs."""
        batch_size = ops.shape(keras.tree.flatten(x)[0])[0]
        # A diverged model's loss is reported as NaN from then on.
        losses = ops.where(self._status.diverged > 0,
                           ops.full_like(losses, float("nan")), losses)
        self._model_loss_tracker.update_state(
            unscale_loss_for_distribution(losses), sample_weight=batch_size)
        if self._model_metrics is not None and y is not None:
            self._update_model_metrics(y, y_pred, sample_weight, training)
        return self.get_metrics_result()

    @property
    def metrics(self):
        metrics = []
        if self.compiled and self._model_loss_tracker is not None:
            metrics.append(self._model_loss_tracker)
            for group in (self._model_metrics, self._model_losses):
                for per_model in group or ():
                    metrics.extend(per_model.metrics if isinstance(
                        per_model, CompileLoss) else [per_model])
        metrics.extend(self._user_metrics())
        for layer in compat.inner_layers(self, include_self=False):
            if not isinstance(layer, keras.Model):
                metrics.extend(layer.metrics)
        return metrics

    def get_metrics_result(self):
        """Logs: each per-model value as `name_b`, and their mean as `name`."""
        if self._model_loss_tracker is None:
            return super().get_metrics_result()
        per_model = {"loss": self._model_values(
            self._model_loss_tracker.result())}
        groups = [m for m in self._model_metrics or ()]
        groups += [m for m in self._model_losses or ()]
        for index, group in enumerate(groups):
            index %= self.num_models
            results = {m.name: m.result() for m in group.metrics} if (
                isinstance(group, CompileLoss)) else group.result()
            for name, value in results.items():
                per_model.setdefault(name, [None] * self.num_models)
                # A result may be the metric's own variable (the counts of
                # `TruePositives(thresholds=[...])`).
                if isinstance(value, keras.Variable):
                    value = value.value
                per_model[name][index] = ops.convert_to_tensor(value)
        check_log_names(per_model, self.num_models)
        logs = {}
        for name, values in per_model.items():
            # A metric may give a vector per model (F1Score per class).
            logs[name] = per_model_mean(ops.stack(values),
                                        self._status.diverged)
            for index, value in enumerate(values):
                logs[model_log_name(name, index)] = value
        for metric in self._user_metrics():
            logs[metric.name] = metric.result()
        return logs

    def _flatten_metrics_in_order(self, logs):
        """`logs` as the list `evaluate` and `*_on_batch` return without
        `return_dict`: the list stock Keras returns (its order, each name
        once, though every model has its own copy of each compiled metric;
        then the other logs, sorted), then the per-model entries, by name
        and in model order (`loss_0`, `loss_1`, ..., `loss_10`)."""
        names = []
        for metric in self.metrics:
            for name in ([m.name for m in metric.metrics]
                         if isinstance(metric, CompileMetrics)
                         else [metric.name]):
                if name not in names:
                    names.append(name)
        per_model = [model_log_name(name, b) for name in sorted(logs)
                     for b in range(self.num_models)
                     if model_log_name(name, b) in logs]
        stock = [name for name in names if name in logs]
        stock += sorted(set(logs) - set(stock) - set(per_model))
        results = [logs[key] for key in stock + per_model]
        return results[0] if len(results) == 1 else results

    def _user_metrics(self):
        """Metrics attached to the array by its user (Keras tracks the
        array's own per-model trackers there too; they are left out)."""
        own = {id(self._model_loss_tracker), id(self._status),
               id(self._bad_batch)}
        own.update(id(m) for m in self._model_metrics or ())
        own.update(id(m) for m in self._model_losses or ())
        return [m for m in compat.tracked_metrics(self) if id(m) not in own]
