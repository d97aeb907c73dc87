"""Each model's loss and metrics, and the logs that report them.

Every model of an array gets its own `CompileLoss`, and the compiled
metrics of `ModelMetrics`: what stock `Model.compile` builds, so that its
loss and metrics follow the stock semantics (string names, nested outputs,
loss weights, "accuracy" resolution). The logs carry each model's value as
`name_b` and the mean over the models that have not diverged as `name`.
"""

import keras
from keras import ops

from hftatf.core import compat
from hftatf.core.axis import stack_values, swap_model_axis, take_models
from hftatf.core.compat import (
    CompileLoss,
    get_keras_mask,
    scale_loss_for_distribution,
    unscale_loss_for_distribution,
)
from hftatf.core.logs import (
    check_log_names,
    model_log_name,
    models_log_name,
    per_model_mean,
)
from hftatf.layers import backends
from hftatf.training.model_metrics import ModelMetrics, metric_tensor


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


def without_masks(y_pred):
    """Whether no output carries a Keras mask (which mapping over the
    model axis would not carry)."""
    return all(get_keras_mask(t) is None for t in keras.tree.flatten(y_pred))


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

    Reads `num_models`, `_model_losses` (one `CompileLoss` per model) and
    `_model_metrics` (a `ModelMetrics`), made by `compile`,
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
            self._model_metrics = ModelMetrics(
                self.num_models, metrics, weighted_metrics,
                output_names=output_names)
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
        loss): one model's compiled loss mapped over the models
        (`_map_models`) where it holds no state (per-output trackers)."""
        template = self._model_losses[0] if self._model_losses else None
        mappable = (template is not None and len(indices) > 1
                    and without_masks(y_pred))
        if mappable and len(keras.tree.flatten(y_pred)) == 1:
            # Built first, so that a first step does not trace each model's
            # (one of several outputs keeps a tracker: not mapped). All are
            # built, though only the template computes: an unbuilt one
            # would make every later `fit` or `train_on_batch` trace the
            # array again to build it (`FusedModel._symbolic_build`).
            self._build_alike(self._model_losses, indices[0], y, y_pred,
                              sample_weight)
        if mappable and template.built and not template.metrics:
            losses = self._map_models(
                lambda labels, pred, weights: template(labels, pred, weights),
                indices, y, y_pred, sample_weight, training)
            if losses is not None:
                return losses
        return self._compiled_losses_one_by_one(indices, y, y_pred,
                                                sample_weight, training)

    def _compiled_losses_one_by_one(self, indices, y, y_pred, sample_weight,
                                    training):
        """`_compiled_losses`, one model after the other."""
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
        predictions and sample weights: one model's metrics mapped over the
        stacked metric variables (`_map_models`), or, where that cannot
        be, model by model."""
        metrics = self._model_metrics
        self._build_alike([metrics], 0, y, y_pred, sample_weight)
        values = metrics.values()
        updated = None
        if self.num_models > 1 and without_masks(y_pred):
            updated = self._map_models(
                metrics.updated, range(self.num_models), y, y_pred,
                sample_weight, training, values)
        if updated is None:
            preds = self._model_predictions(y_pred)
            updated = [ops.stack(model_values) for model_values in zip(*(
                metrics.updated(*self._model_targets(
                    y, y_pred, sample_weight, index, pred, training=training),
                    [value[index] for value in values])
                for index, pred in enumerate(preds)))]
        metrics.assign(updated)

    def _model_metric_results(self):
        """Each model's compiled metric results (a dict by name per
        model)."""
        if self._model_metrics is None:
            return []
        mapped = self._mapped_metric_results()
        if mapped is None:
            return self._model_metrics.model_results()
        mapped = {name: self._model_values(value)
                  for name, value in mapped.items()}
        return [{name: values[index] for name, values in mapped.items()}
                for index in range(self.num_models)]

    def _mapped_metric_results(self):
        """The models' compiled metric results stacked over the models
        (`{name: [B, ...]}`): one model's `result` mapped over the stacked
        variables, so that the step's program does not compute them model
        by model; None where the models' metrics are held per model or the
        backend does not map them."""
        metrics = self._model_metrics
        if metrics is None or not metrics.variables:
            return None
        return self._vectorized_map(metrics.results, metrics.values())

    def _build_alike(self, objects, index, y, y_pred, sample_weight):
        """Builds those of `objects` (the models' `ModelMetrics` or
        `CompileLoss`) not built yet on the shapes and dtypes of the
        targets of the model `index` (the first of `y_pred`), which all
        models share: the first update then need not trace each model's,
        and the metrics' variables are made outside the traced step
        (inside, TensorFlow makes each one a conditional
        initialization)."""
        unbuilt = [o for o in objects if not o.built]
        if not unbuilt:
            return
        pred = keras.tree.map_structure(lambda t: t[:, 0], y_pred)
        labels, pred, _ = self._model_targets(y, y_pred, sample_weight, index,
                                              pred)
        # An output without a loss may have no labels (None).
        labels, pred = keras.tree.map_structure(
            lambda t: None if t is None else keras.KerasTensor(
                t.shape, keras.backend.standardize_dtype(t.dtype)),
            (labels, pred))
        with backends.init_scope():
            for built in unbuilt:
                built.build(labels, pred)

    def _map_models(self, function, indices, y, y_pred, sample_weight,
                    training, *mapped):
        """`function(labels, predictions, sample_weight, *mapped)` of each
        of the models `indices` (a range; `y_pred` holds theirs), mapped
        over the model axis (`_vectorized_map`), so that the step's
        program and its tracing do not grow with `B`: the predictions (and
        the logits Keras keeps on them), per-model labels and weights on
        axis 1, `mapped` on axis 0. Each model gets what `_model_targets`
        gives it. None where the backend cannot map `function`."""
        indices = list(indices)
        start, count = indices[0], len(indices)

        def per_model(structure, flags):
            flat = [] if structure is None else keras.tree.flatten(structure)
            return flat, [swap_model_axis(take_models(t, start, count, axis=1))
                          for t, own in zip(flat, flags) if own]

        flags_y = [] if y is None else self._labels_per_model(y, y_pred)
        flat_y, own_y = per_model(y, flags_y)
        flags_w = ([] if sample_weight is None else
                   self._weights_per_model(sample_weight, y_pred))
        flat_w, own_w = per_model(sample_weight, flags_w)
        flat_pred = keras.tree.flatten(y_pred)
        logits = [compat.keras_logits(t) for t in flat_pred]
        preds = [swap_model_axis(t) for t in flat_pred]
        own_logits = [swap_model_axis(t) for t in logits if t is not None]

        def rebuilt(structure, flat, flags, own):
            if structure is None:
                return None
            own = iter(own)
            return keras.tree.pack_sequence_as(structure, [
                next(own) if flag else t for t, flag in zip(flat, flags)])

        def one(elements):
            preds, own_logits, own_y, own_w, mapped = elements
            own_logits = iter(own_logits)
            for pred, kept in zip(preds, logits):
                if kept is not None:
                    compat.keep_logits(pred, next(own_logits))
            labels = rebuilt(y, flat_y, flags_y, own_y)
            weights = rebuilt(sample_weight, flat_w, flags_w, own_w)
            if (training and self._class_weight is not None
                    and labels is not None):
                weights = self._with_class_weights(labels, weights)
            return function(labels, keras.tree.pack_sequence_as(
                y_pred, preds), weights, *mapped)

        return self._vectorized_map(
            one, (preds, own_logits, own_y, own_w, list(mapped)))

    def _vectorized_map(self, function, elements):
        """`function` of each entry of axis 0 of `elements`, vectorized
        (`keras.ops.vectorized_map`); None where the backend cannot
        vectorize `function`."""
        return ops.vectorized_map(function, elements)

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
            # Built from one model's shapes, which every model shares.
            self._build_alike([self._model_metrics], 0, y, y_pred,
                              sample_weight)
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
            if self._model_metrics is not None:
                metrics.append(self._model_metrics)
            for per_model in self._model_losses or ():
                metrics.extend(per_model.metrics)
        metrics.extend(self._user_metrics())
        for layer in compat.inner_layers(self, include_self=False):
            if not isinstance(layer, keras.Model):
                metrics.extend(layer.metrics)
        return metrics

    def get_metrics_result(self):
        """Logs: each per-model value as `name_b`, and their mean as `name`.
        Inside a traced step, each per-model quantity is one `[B, ...]`
        entry (`models_log_name`) instead of the `name_b`, which the step
        function splits on the host (`expand_model_logs`): TensorFlow's
        graph optimizer walks a step's outputs one by one, for seconds
        at `B` in the hundreds."""
        if self._model_loss_tracker is None:
            return super().get_metrics_result()
        loss = self._model_loss_tracker.result()
        per_model = (self._stacked_results(loss) if self._traced(loss)
                     else self._results_by_model(loss))
        check_log_names(per_model, self.num_models)
        logs = {}
        for name, values in per_model.items():
            if isinstance(values, list):
                # A metric may give a vector per model (F1Score per class).
                logs[name] = per_model_mean(stack_values(values),
                                            self._status.diverged)
                for index, value in enumerate(values):
                    logs[model_log_name(name, index)] = value
            else:
                logs[name] = per_model_mean(values, self._status.diverged)
                logs[models_log_name(name)] = values
        for metric in self._user_metrics():
            logs[metric.name] = metric.result()
        return logs

    def _results_by_model(self, loss):
        """`{name: [each model's value]}` of every per-model log."""
        per_model = {"loss": self._model_values(loss)}
        results = self._model_metric_results() + self._model_loss_results()
        for index, model_results in enumerate(results):
            index %= self.num_models
            for name, value in model_results.items():
                per_model.setdefault(name, [None] * self.num_models)
                per_model[name][index] = metric_tensor(value)
        return per_model

    def _stacked_results(self, loss):
        """`{name: [B, ...] values}` of every per-model log."""
        per_model = {"loss": loss}
        mapped = self._mapped_metric_results()
        results = self._model_loss_results()
        if mapped is None:
            results = self._model_metric_results() + results
        else:
            per_model.update(mapped)
        by_name = {}
        for model_results in results:
            for name, value in model_results.items():
                by_name.setdefault(name, []).append(metric_tensor(value))
        for name, values in by_name.items():
            per_model[name] = ops.stack(values)
        return per_model

    def _model_loss_results(self):
        """The results of each model's compiled loss's trackers (one per
        output of several), a dict by name per model."""
        return [{m.name: m.result() for m in group.metrics}
                for group in self._model_losses or ()]

    def _flatten_metrics_in_order(self, logs):
        """`logs` as the list `evaluate` and `*_on_batch` return without
        `return_dict`: the list stock Keras returns (its order, each name
        once, though every model has its own copy of each compiled metric;
        then the other logs, sorted), then the per-model entries, by name
        and in model order (`loss_0`, `loss_1`, ..., `loss_10`)."""
        names = []
        for metric in self.metrics:
            for name in ([m.name for m in metric.metrics]
                         if isinstance(metric, ModelMetrics)
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
        own.add(id(self._model_metrics))
        own.update(id(m) for m in self._model_losses or ())
        return [m for m in compat.tracked_metrics(self) if id(m) not in own]

