"""Every model's compiled metrics, held as one metric of the array.

Each model of an array has the metrics stock `Model.compile` gives a model
(`CompileMetrics`: string names resolved, nested outputs, weighted
metrics). They are held once, whatever `B`: one model's `CompileMetrics`
(the template) computes, and each of its variables is one `[B, *shape]`
variable of the array, model `b`'s value at index `b`. The array maps the
template's update and result over the model axis (`PerModelLosses`), so
that neither the variables nor the step's program grow with `B`.

A metric that makes some or all of its variables at its first update
(`F1Score`, `R2Score`) makes them when the metrics are built, as stock
Keras makes them: by one update on symbolic tensors.
"""

import keras
from keras import ops

from hftatf.core import compat
from hftatf.core.compat import CompileMetrics


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
    so that the array's metrics never share state with the user's."""

    def clone(metric):
        if isinstance(metric, keras.metrics.Metric):
            # The metric's function or class, if the user's own, need not
            # be registered with Keras: stock compile takes it as it is.
            with keras.saving.custom_object_scope(custom_objects(metric)):
                return type(metric).from_config(metric.get_config())
        return metric

    return keras.tree.map_structure(clone, metrics, none_is_leaf=True) if (
        metrics is not None) else None


def current_values(scope, variables, values):
    """The values of `variables` at the end of the `keras.StatelessScope`
    `scope` (those it did not assign keep `values`)."""
    new = []
    for variable, value in zip(variables, values):
        current = scope.get_current_value(variable)
        new.append(value if current is None else current)
    return new


class ModelMetrics(CompileMetrics):
    """The compiled metrics of the `num_models` models of an array.

    Built (`build`, on one model's labels and predictions), it holds one
    `[B, *shape]` variable per variable of one model's `CompileMetrics`
    (`variables`). The pure functions `updated` and `results` compute one
    model's metrics from its values of the stacked variables, for the
    array to map over the models. A `CompileMetrics` itself, which Keras's
    callbacks look for among a model's metrics (the direction of a
    monitored metric).

    Args:
        num_models: the number of models `B`.
        metrics, weighted_metrics, output_names: as stock `compile` gives
            them to `CompileMetrics`; every model gets a copy of each
            metric object.
    """

    @compat.no_automatic_dependency_tracking
    def __init__(self, num_models, metrics, weighted_metrics,
                 output_names=None):
        super().__init__(metrics, weighted_metrics, output_names=output_names)
        self.num_models = num_models
        self.template = CompileMetrics(clone_metrics(metrics),
                                       clone_metrics(weighted_metrics),
                                       output_names=output_names)
        self.built = False

    @compat.no_automatic_dependency_tracking
    def build(self, y_true, y_pred):
        """Builds the metrics on one model's labels and predictions (their
        shapes and dtypes, which every model shares)."""
        self.template.build(y_true, y_pred)
        # What a metric makes at its first update (all of `F1Score`'s
        # variables, all but one of `R2Score`'s) must be there to stack.
        compat.compute_output_spec(self.template.update_state, y_true,
                                   y_pred)
        for variable in self.template.variables:
            self._add_stacked(variable)
        self.built = True

    def _add_stacked(self, variable):
        """The `[B, *shape]` variable of the template's `variable`, every
        model starting at its initial value. Read when the variable is
        initialized: built inside a symbolic run, both are initialized
        after it, in the order they were made."""
        self.add_variable(
            (self.num_models, *variable.shape),
            lambda shape, dtype: ops.broadcast_to(
                ops.cast(ops.convert_to_tensor(variable.value), dtype),
                shape),
            dtype=variable.dtype, aggregation=variable.aggregation,
            name=variable.name)

    @property
    def metrics(self):
        """One model's metric objects (their names and directions)."""
        return self.template.metrics

    @property
    def variables(self):
        """The stacked `[B, *shape]` variables (empty where unbuilt)."""
        return list(self._variables)

    def values(self):
        """The current values of the stacked variables."""
        return [variable.value for variable in self.variables]

    def assign(self, values):
        """Sets the stacked variables to `values` (`[B, *shape]` each)."""
        for variable, value in zip(self.variables, values):
            variable.assign(value)

    def updated(self, y_true, y_pred, sample_weight, values):
        """One model's values of the stacked variables after updating, from
        `values`, with its labels, predictions and sample weights."""
        variables = self.template.variables
        with keras.StatelessScope(
                state_mapping=list(zip(variables, values))) as scope:
            self.template.update_state(y_true, y_pred, sample_weight)
        return current_values(scope, variables, values)

    def results(self, values):
        """One model's results (a dict by name) from its values of the
        stacked variables."""
        with keras.StatelessScope(
                state_mapping=list(zip(self.template.variables, values))):
            return {name: metric_tensor(value)
                    for name, value in self.template.result().items()}

    def update_state(self, y_true, y_pred, sample_weight=None):
        raise NotImplementedError(
            "The models' metrics are updated by their array, which gives "
            "each model its own labels and predictions.")

    def model_results(self):
        """Each model's results (a dict by name per model), model by
        model."""
        values = self.values()
        return [self.results([value[index] for value in values])
                for index in range(self.num_models)]

    def result(self):
        """Each result stacked over the models (`{name: [B, ...]}`)."""
        results = self.model_results()
        return {name: ops.stack([metric_tensor(r[name]) for r in results])
                for name in results[0]} if results else {}

    def reset_state(self):
        variables = self.template.variables
        values = [variable.value for variable in variables]
        with keras.StatelessScope(
                state_mapping=list(zip(variables, values))) as scope:
            self.template.reset_state()
        for variable, value in zip(
                self.variables, current_values(scope, variables, values)):
            variable.assign(ops.broadcast_to(value, variable.shape))


def metric_tensor(value):
    """A metric's result as a tensor: a result may be the metric's own
    variable (the counts of `TruePositives(thresholds=[...])`)."""
    if isinstance(value, keras.Variable):
        value = value.value
    return ops.convert_to_tensor(value)
