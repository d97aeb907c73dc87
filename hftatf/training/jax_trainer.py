"""The training step of an array on the JAX backend.

As `keras/src/backend/jax/trainer.py`, the steps are stateless:
`train_step(state, data) -> (logs, state)` over Keras's four state lists
`(trainable_variables, non_trainable_variables, optimizer_variables,
metrics_variables)`, compiled with `jax.jit` where `jit_compile` is on.
The array's own state rides in `metrics_variables`: besides the per-model
loss and metrics, which models still train (`ModelStatus`) and what was
wrong with the last batch (`BatchProblems`).

The step computes the `[B]` per-model losses and their gradients with
`jax.value_and_grad` over a stateless forward pass, in passes of
`models_per_pass` models where the array trains so (`hftatf.passes`; here
each pass is a `stateless_call` of the pass's array on its slices of the
values). Then, inside a `keras.StatelessScope` over the whole state, it
runs what every backend shares: `apply_model_gradients` (divergence,
masks, the fused optimizer) and the per-model metric tracking
(`hftatf.training.losses`).

Gradients are dense: stock Keras on JAX applies embedding gradients
dense too.
"""

import math
import warnings

import jax
import keras
from keras import ops

from hftatf import passes
from hftatf.core.axis import concat_models, take_models
from hftatf.core.logs import expand_model_logs, host_values
from hftatf.distribution import (
    check_batch_split,
    check_distribution,
    sample_count,
)
from hftatf.training.model_metrics import current_values

# A copy of an array that the next step, which takes its state over, does
# not delete: compiled, as an eager copy costs several times more.
_copy = jax.jit(lambda values: [jax.numpy.copy(v) for v in values])

# A step's `[B, ...]` log split into its `B` entries on the device, in one
# program, without waiting for the step: reading it on the host would wait
# for every step (an 8-model MLP's step on this CPU: 0.77 -> 0.62 ms). Up
# to `_DEVICE_SPLIT_LIMIT` entries: the program's outputs cost more than
# the wait past that (B = 8: 0.015 ms, 100: 0.17 ms, 1,000: 2.9 ms; read
# on the host, 0.04 ms at B = 1,000).
_split = jax.jit(list)
_DEVICE_SPLIT_LIMIT = 64


class JAXTrainer:
    """Mixin of `FusedModel`: its steps on the JAX backend (see the
    module docstring, and `hftatf.training.tensorflow_trainer` for what a
    backend trainer provides)."""

    # `models_per_pass="auto"` keeps one pass: passes were measured to pay
    # on TensorFlow's CPU kernels only.
    AUTO_PASSES = False

    @property
    def metrics_variables(self):
        return (super().metrics_variables + self._status.variables
                + self._bad_batch.variables)

    def _distributed(self):
        """Whether a `keras.distribution` lays the array out over
        devices."""
        return keras.distribution.distribution() is not None

    # Batches that a distribution cannot split are refused before any
    # step (positions of Keras's arguments: x, y, batch_size, ...).
    def fit(self, *args, **kwargs):
        size = sample_count(_argument(args, kwargs, 0, "x"))
        batch_size = _argument(args, kwargs, 2, "batch_size")
        validation_batch_size = kwargs.get(
            "validation_batch_size") or batch_size
        split = _argument(args, kwargs, 6, "validation_split", 0.0) or 0.0
        trained = size if size is None or not split else int(
            math.floor(size * (1.0 - split)))  # As Keras splits arrays.
        check_batch_split("fit", trained, batch_size)
        if trained != size:
            check_batch_split("fit's validation_split", size - trained,
                              validation_batch_size)
        validation = _argument(args, kwargs, 7, "validation_data")
        if isinstance(validation, (tuple, list)) and validation:
            check_batch_split("fit's validation_data",
                              sample_count(validation[0]),
                              validation_batch_size)
        return super().fit(*args, **kwargs)

    def evaluate(self, *args, **kwargs):
        check_batch_split("evaluate",
                          sample_count(_argument(args, kwargs, 0, "x")),
                          _argument(args, kwargs, 2, "batch_size"))
        return super().evaluate(*args, **kwargs)

    def predict(self, *args, **kwargs):
        check_batch_split("predict",
                          sample_count(_argument(args, kwargs, 0, "x")),
                          _argument(args, kwargs, 1, "batch_size"))
        return super().predict(*args, **kwargs)

    def make_train_function(self, force=False):
        check_distribution(self.num_models)
        # The arrays of the passes are built before the step is traced:
        # building creates variables.
        per_pass = self._models_per_pass_for(None)
        for size in {stop - start for start, stop in passes.bounds(
                self.num_models, per_pass)} - {self.num_models}:
            self._pass_model(size)
        super().make_train_function(force=force)
        self.train_function = self._keeping_variables(
            self.train_function, ("trainable_variables",
                                  "non_trainable_variables",
                                  "optimizer_variables", "metrics_variables"))
        return self.train_function

    def make_test_function(self, force=False):
        super().make_test_function(force=force)
        self.test_function = self._keeping_variables(
            self.test_function, ("trainable_variables",
                                 "non_trainable_variables",
                                 "metrics_variables"))
        return self.test_function

    def make_predict_function(self, force=False):
        super().make_predict_function(force=force)
        self.predict_function = self._keeping_variables(
            self.predict_function, ("trainable_variables",
                                    "non_trainable_variables"))
        return self.predict_function

    def _keeping_variables(self, function, names):
        """`function` (Keras's step over an iterator), which, where it
        raises (a batch the array refuses), first gives the variables
        their values back: Keras takes them out of the variables while
        steps run, and `evaluate`, or a step that fails before the first
        returns, would leave them empty. Its logs give each model's value
        of a per-model quantity as `name_b`: the traced step returns them
        as one `[B]` entry (`get_metrics_result`)."""
        if getattr(function, "keeps_variables", False):
            return function

        def step(state, iterator):
            try:
                outputs, state = function(state, iterator)
            except Exception:
                # The state this step was given is the latest: a state
                # Keras kept is the last step's, or a failed call's before.
                self._jax_state = dict(zip(names, state))
                self._jax_state_synced = False
                self.jax_state_sync()
                self._jax_state = None
                raise
            return expand_model_logs(outputs, self._model_values), state

        step.keeps_variables = True
        return step

    def _batch_for_building(self, iterator):
        """A batch of `iterator` (None if none is given), as Keras's
        `_symbolic_build` takes one: the per-model metrics are built
        before their variables are gathered into the step's state."""
        for _, _, data in iterator or ():
            return data[0] if isinstance(data, (list, tuple)) else next(data)
        return None

    def _model_values(self, vector):
        """The `B` entries of `vector`: outside a traced step, split on the
        device in one program (`_split`), or, for many models, read as
        NumPy values (eager slices would each compile a program)."""
        if self._traced(vector):
            return list(ops.unstack(vector))
        if isinstance(vector, jax.Array) and (
                vector.shape[0] <= _DEVICE_SPLIT_LIMIT):
            return _split(vector)
        return host_values(vector)

    def _traced(self, tensor):
        """Whether `tensor` is a value of a step being traced."""
        return isinstance(tensor, jax.core.Tracer)

    def _training_value(self, variable):
        """The value of the metric variable `variable`: inside `fit`, where
        the variables are written back at the end of each epoch only, the
        value of the last step's state."""
        state = getattr(self, "_jax_state", None)
        if state and not self._jax_state_synced:
            values = state.get("metrics_variables", ())
            positions = getattr(self, "_metric_positions", None)
            if positions is None or len(positions) != len(values):
                positions = {id(v): number for number, v
                             in enumerate(self.metrics_variables)}
                self._metric_positions = positions
            if id(variable) in positions:
                return values[positions[id(variable)]]
        return variable.value

    def _kept_training_values(self, variables):
        """`_training_value` of each of `variables`, kept from the next
        step, which takes the state over: copied in one program, without
        waiting for the step."""
        return _copy([self._training_value(v) for v in variables])

    def __setattr__(self, name, value):
        if name == "_jax_state":
            # Keras sets the state after every step; a layer's attribute
            # would walk its lists for variables to track, which it holds
            # none of.
            object.__setattr__(self, name, value)
            return
        super().__setattr__(name, value)

    def _restore_models(self, variables, values, models):
        """`Divergence._restore_models`, computed only on steps that
        restore a model (the branches of `ops.cond` give values: on JAX a
        branch may not assign variables)."""
        for variable, value in zip(variables, ops.cond(
                ops.any(models),
                lambda: self._restored_values(variables, values, models),
                lambda: [v.value for v in variables])):
            variable.assign(value)

    def _uses_replica_jit(self, jit_compile, run_eagerly):
        # `jax.jit` compiles the whole step, distributed or not.
        return False

    def _state_variables(self):
        """The variables of Keras's four state lists, list by list."""
        return (self.trainable_variables, self.non_trainable_variables,
                self.optimizer.variables if self.optimizer else [],
                self.metrics_variables)

    def stateless_scope(self, state):
        """A `keras.StatelessScope` in which the array's variables read
        their values in `state` (Keras's four state lists): the stateful
        building blocks of a step (`model_state`, `apply_model_gradients`,
        metric updates) run inside it in a custom JAX `train_step`, which
        then returns `state_after(scope, state)`."""
        return keras.StatelessScope(state_mapping=[
            pair for variables, values in zip(self._state_variables(), state)
            for pair in zip(variables, values)])

    def state_after(self, scope, state):
        """The four state lists at the end of `scope`
        (`stateless_scope(state)`)."""
        return tuple(current_values(scope, variables, values)
                     for variables, values
                     in zip(self._state_variables(), state))

    def train_step(self, state, data):
        (trainable, non_trainable, optimizer_values,
         metrics_values) = state
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        if not self.trainable_weights:
            warnings.warn("The array does not have any trainable weights.",
                          stacklevel=2)
        grad_fn = jax.value_and_grad(self.compute_loss_and_updates,
                                     has_aux=True)
        (_, (losses, y_pred, updated, metrics_values)), gradients = grad_fn(
            trainable, non_trainable, metrics_values, x, y, sample_weight,
            training=True, optimizer_variables=optimizer_values)
        state = (trainable, non_trainable, optimizer_values, metrics_values)
        with self.stateless_scope(state) as scope:
            # What the forward pass updated, given back to the models that
            # do not take the step.
            model_state = self.model_state()
            for variable, value in zip(self.non_trainable_variables,
                                       updated):
                variable.assign(value)
            self.apply_model_gradients(
                [(self.optimizer, gradients, self.trainable_variables)],
                losses, state=model_state,
                data=(x, y, y_pred, sample_weight))
            logs = self._track(x, y, y_pred, sample_weight, losses,
                               training=True)
        return logs, self.state_after(scope, state)

    def test_step(self, state, data):
        trainable, non_trainable, metrics_values = state
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        mapping = (list(zip(self.trainable_variables, trainable))
                   + list(zip(self.non_trainable_variables, non_trainable))
                   + list(zip(self.metrics_variables, metrics_values)))
        # Collecting the losses the forward pass adds (activity
        # regularizers, `add_loss`), which `self.losses` reads, as Keras's
        # `test_step` does: outside a collecting scope they are dropped.
        with keras.StatelessScope(state_mapping=mapping,
                                  collect_losses=True) as scope:
            y_pred = self(x, training=False)
            losses = self.compute_model_losses(
                x, y, y_pred, sample_weight, training=False)
            logs = self._track(x, y, y_pred, sample_weight, losses)
        return logs, (
            trainable,
            current_values(scope, self.non_trainable_variables, non_trainable),
            current_values(scope, self.metrics_variables, metrics_values))

    def compute_loss_and_updates(self, trainable_variables,
                                 non_trainable_variables, metrics_variables,
                                 x, y, sample_weight, training=False,
                                 optimizer_variables=None):
        """As Keras's (for `jax.grad` over `trainable_variables`), for an
        array: returns the (scaled) sum of the per-model losses, and
        `(losses, y_pred, non_trainable_variables, metrics_variables)`:
        the `[B]` per-model losses, the predictions and the state the
        forward pass and the compiled losses' trackers updated. A custom
        JAX `train_step` then applies the gradients with
        `apply_model_gradients` inside `stateless_scope(state)`."""
        trainable, non_trainable = trainable_variables, non_trainable_variables
        metrics_values = metrics_variables
        mapping = (list(zip(self.non_trainable_variables, non_trainable))
                   + list(zip(self.metrics_variables, metrics_values)))
        if optimizer_variables is not None:
            # The loss scales of a loss-scaling optimizer.
            mapping += list(zip(self.optimizer.variables,
                                optimizer_variables))
        with keras.StatelessScope(state_mapping=mapping) as scope:
            per_pass = (self._models_per_pass_for(x) if training
                        else self.num_models)
            if per_pass < self.num_models:
                y_pred, losses, non_trainable = self._losses_in_passes(
                    trainable, non_trainable, x, y, sample_weight, per_pass)
            else:
                y_pred, non_trainable, added = self.stateless_call(
                    trainable, non_trainable, x, training=training,
                    return_losses=True)
                losses = self._losses_of_models(
                    range(self.num_models), y, y_pred, sample_weight, added,
                    training=training)
            loss = (self.optimizer.scale_model_losses(losses) if training
                    else ops.sum(losses))
        metrics_values = current_values(scope, self.metrics_variables,
                                  metrics_values)
        return loss, (losses, y_pred, non_trainable, metrics_values)

    def _built_pass_model(self, count):
        """An array of `count` models for passes (built before the step
        is traced: see `make_train_function`)."""
        return self._rebuilt(count)

    def _losses_in_passes(self, trainable, non_trainable, x, y,
                          sample_weight, per_pass):
        """The predictions, `[B]` losses and updated state of the forward
        pass, computed `per_pass` models at a time (see `hftatf.passes`):
        each pass runs its array on its slices of the weights and state;
        the state without a model axis (seed generators) is carried from
        pass to pass."""
        carried = list(non_trainable)
        parts = []
        for start, stop in passes.bounds(self.num_models, per_pass):
            count = stop - start
            model, (trainable_roles, state_roles) = self._pass_model(count)
            inputs = keras.tree.pack_sequence_as(x, [
                t if shared else take_models(t, start, count, axis=1)
                for t, shared in zip(keras.tree.flatten(x),
                                     self._shared_inputs)])
            y_pred, state, added = model.stateless_call(
                passes.pass_values(trainable, trainable_roles, start, count),
                passes.pass_values(carried, state_roles, start, count), inputs,
                training=True, return_losses=True)
            losses = self._losses_of_models(
                range(start, stop), y, y_pred, sample_weight, added,
                training=True)
            parts.append((y_pred, losses, [
                value if role else None
                for value, role in zip(state, state_roles)]))
            carried = [old if role else new for old, new, role in zip(
                carried, state, state_roles)]
        preds, losses, states = zip(*parts)
        updated = [ops.concatenate([s[number] for s in states], axis=0)
                   if states[0][number] is not None else value
                   for number, value in enumerate(carried)]
        y_pred = keras.tree.map_structure(
            lambda *p: concat_models(list(p)), *preds)
        return y_pred, ops.concatenate(losses, axis=0), updated


def _argument(args, kwargs, position, name, default=None):
    """Argument `name` of a Keras `fit`, `evaluate` or `predict` call, at
    `position` where given positionally."""
    return args[position] if len(args) > position else kwargs.get(
        name, default)
