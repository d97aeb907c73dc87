"""Which models of an array still train, and what stops one.

A model is frozen when a callback stops it or when it diverges: its loss
or gradients turn non-finite. A frozen model keeps its weights, optimizer
state and moving statistics; the others train on, untouched by it.
"""

import logging
import threading
import time

import keras
import numpy as np
from keras import ops

from hftatf import sparse
from hftatf.core import compat
from hftatf.core.axis import select_models
from hftatf.core.logs import listed


class ModelStatus(keras.metrics.Metric):
    """Which models of an array still train.

    `active[b]` is 1 while model `b` is updated; 0 once it is frozen (it
    diverged, or a callback stopped it). `diverged[b]` is 1 once model `b`
    produced a non-finite loss or gradient, or an update that made its
    weights non-finite (then `diverged_in_update[b]` is 1 too), at the
    optimizer step `diverged_at[b]`. Saved with the array's weights
    (so a resumed run keeps them), and never reset between epochs.
    """

    def __init__(self, num_models, name="model_status", **kwargs):
        super().__init__(name=name, **kwargs)
        self.num_models = num_models
        self.active = self.add_variable(
            (num_models,), "ones", name="active",
            aggregation="only_first_replica")
        self.diverged = self.add_variable(
            (num_models,), "zeros", name="diverged",
            aggregation="only_first_replica")
        self.diverged_at = self.add_variable(
            (num_models,), "zeros", name="diverged_at",
            aggregation="only_first_replica")
        self.diverged_in_update = self.add_variable(
            (num_models,), "zeros", name="diverged_in_update",
            aggregation="only_first_replica")

    def update_state(self, diverging, step, in_update=None):
        """Freezes the `diverging` models (`[B]` booleans) at `step`;
        `in_update`: those of them whose update, not their loss or
        gradients, turned non-finite."""
        diverging = ops.cast(diverging, self.dtype)
        self.diverged_at.assign(ops.where(
            diverging > 0, ops.cast(step, self.dtype), self.diverged_at.value))
        self.diverged.assign(ops.maximum(self.diverged, diverging))
        self.active.assign(self.active * (1.0 - diverging))
        if in_update is not None:
            self.diverged_in_update.assign(ops.maximum(
                self.diverged_in_update, ops.cast(in_update, self.dtype)))

    def reset_state(self):
        # Epoch boundaries must not revive frozen models.
        pass

    def result(self):
        return self.active

    def get_config(self):
        return {**super().get_config(), "num_models": self.num_models}


# What `BatchProblems` records of a training batch, in order.
_PROBLEMS = (
    "every model of the array that trains turned non-finite on it at once",
    "its inputs hold NaN or infinite values",
    "its labels hold NaN or infinite values",
    ("its labels hold class ids outside [0, classes) for a sparse loss, "
     "which stock Keras refuses too"),
    "its sample weights hold NaN or infinite values",
)


class BatchProblems(keras.metrics.Metric):
    """What was found wrong with a training batch, one flag per entry of
    `_PROBLEMS`: such a batch trains no model (`apply_model_gradients`),
    and `fit` raises on it (`DivergenceReport`).

    While `holding` (inside `fit`), a refused batch also refuses every
    later one until it is reported: `fit` checks batches after later steps
    were dispatched, and they must not train on past it. `refused` counts
    the refused steps, which names the first of them: the last step
    checked, less `refused`, plus one."""

    def __init__(self, name="batch_problems", **kwargs):
        super().__init__(name=name, **kwargs)
        self.found = self.add_variable(
            (len(_PROBLEMS),), "zeros", name="found",
            aggregation="only_first_replica")
        self.holding = self.add_variable(
            (), "zeros", name="holding", aggregation="only_first_replica")
        self.refused = self.add_variable(
            (), "zeros", name="refused", aggregation="only_first_replica")

    def update_state(self, found, refused):
        """Records the `[len(_PROBLEMS)]` booleans `found` of a step, and
        whether it was `refused` (for them, or held)."""
        self.found.assign(ops.maximum(self.found,
                                      ops.cast(found, self.dtype)))
        self.refused.assign(self.refused + ops.cast(refused, self.dtype))

    def held(self):
        """A scalar boolean: whether batches are refused because an
        earlier one was (see the class docstring)."""
        return ops.logical_and(self.holding > 0, ops.any(self.found > 0))

    def hold(self, holding):
        """Makes a refused batch refuse the later ones (`holding`), or
        not."""
        self.holding.assign(1.0 if holding else 0.0)

    def reset_state(self):
        self.found.assign(ops.zeros(self.found.shape, self.found.dtype))
        self.holding.assign(0.0)
        self.refused.assign(0.0)

    def result(self):
        return self.found


def _ready(value):
    """Whether `value` is computed: a JAX array may still be in flight."""
    is_ready = getattr(value, "is_ready", None)
    return is_ready is None or is_ready()


def _non_finite(structure):
    """A scalar boolean: whether a floating-point tensor of `structure`
    holds a NaN or an infinity."""
    found = ops.zeros((), "bool")
    for tensor in keras.tree.flatten(structure):
        if tensor is not None and keras.backend.is_float_dtype(
                keras.backend.standardize_dtype(tensor.dtype)):
            found = ops.logical_or(found, ops.logical_not(
                ops.all(ops.isfinite(tensor))))
    return found


# How often, at most, `fit` reads whether a batch was refused (seconds): a
# read waits for the step and costs tens of microseconds, as much as a
# small array's step; the steps run between two reads train no model past
# a refused batch (`BatchProblems.hold`).
_CHECK_SECONDS = 0.05


class DivergenceReport(keras.callbacks.Callback):
    """Logs each model of the array that diverged, once; raises on a
    batch that no model could train on (`Divergence.check_batch`).

    Batches are checked as they end, at most every `_CHECK_SECONDS`, and
    at the end of each epoch: the steps in between train no model past a
    refused batch (`BatchProblems.hold`), and the count of refused steps
    names it. Where Keras runs the ends of batches in worker threads beside
    the next steps (a thread-safe backend, JAX, and only async-safe
    callbacks), reading the array's state there would wait for each step,
    and race the next step, which takes the state over: there the flags
    are copied when a later batch begins and read once computed, while
    later steps run."""

    async_safe = True

    def __init__(self):
        super().__init__()
        self._epoch = 0
        self._array = None
        self._thread = None
        self._open = None
        self._copies = []
        self._due = 0.0
        self._in_thread = False

    def set_model(self, model):
        super().set_model(model)
        # Read without `self.model`, which on JAX writes the whole training
        # state back to the variables: `check_batch` reads some of them.
        self._array = model

    def on_train_begin(self, logs=None):
        self.model._bad_batch.reset_state()
        self.model._bad_batch.hold(True)
        self._thread = threading.get_ident()
        self._open, self._copies, self._due = None, [], 0.0
        # Whether the ends of batches run in this thread.
        self._in_thread = False

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if (not self._in_thread and self._open is not None
                and self._open < batch and self._is_due()):
            # Batches whose ends ran in worker threads: the flags they
            # left, copied before the next step takes them over.
            self._copies.append((self._open, batch - 1,
                                 self._array._kept_refusals()))
            self._open = None
        self._check_copies(wait=False)
        if self._open is None:
            self._open = batch

    def on_train_batch_end(self, batch, logs=None):
        if threading.get_ident() != self._thread:
            return
        self._in_thread = True
        if self._is_due():
            first, self._open = self._open, None
            self._check(first, batch)

    def on_epoch_end(self, epoch, logs=None):
        self._check_copies(wait=True)
        if self._open is not None:
            steps = getattr(self._array, "steps_per_execution", 1) or 1
            last = self._open + steps - 1
            epoch_steps = (self.params or {}).get("steps")
            if epoch_steps:
                last = min(last, epoch_steps - 1)
            first, self._open = self._open, None
            self._check(first, last)
        self._report()

    def on_train_end(self, logs=None):
        self.model._bad_batch.hold(False)
        self._report()

    def _is_due(self):
        """Whether `_CHECK_SECONDS` passed since the last check (then the
        next one is counted from now)."""
        now = time.monotonic()
        if now < self._due:
            return False
        self._due = now + _CHECK_SECONDS
        return True

    def _check_copies(self, wait):
        """Checks the copied flags in order, those computed (all of them
        where `wait`)."""
        while self._copies and (wait or all(
                _ready(value) for value in self._copies[0][2])):
            first, last, refusals = self._copies.pop(0)
            self._check(first, last, refusals)

    def _check(self, first, last, refusals=None):
        """Raises if one of batches `first` to `last` of this epoch was
        refused (`refusals`: `_kept_refusals()` taken after them; by
        default, the array's now), naming the first refused."""
        found, refused = (ops.convert_to_numpy(value) for value in (
            refusals or self._array._refusals()))
        if not (found > 0).any():
            return
        batch = min(last, max(first, last - int(refused) + 1))
        self._array.check_batch(
            f"batch {batch} of epoch {self._epoch} (counted from 0)", found)

    def _report(self):
        """Warns once for the models that diverged since the last report:
        one line, however many they are."""
        model = self.model
        new = [int(index) for index in np.flatnonzero(model.diverged_models)
               if index not in model._reported_divergence]
        if not new:
            return
        model._reported_divergence.update(new)
        steps = ops.convert_to_numpy(model._status.diverged_at)
        in_update = ops.convert_to_numpy(model._status.diverged_in_update)
        logging.warning("%s", divergence_report(
            model.name, self._epoch, new,
            [int(steps[index]) for index in new],
            [bool(in_update[index]) for index in new]))


def divergence_report(name, epoch, models, steps, in_update):
    """The warning for `models` of array `name` that diverged in `epoch`
    (counted from 0), at `steps`, where `in_update` their optimizer's
    update made their weights non-finite."""
    update = ("its optimizer's update made its weights non-finite, though "
              "its loss and gradients were finite (a hyper-parameter out of "
              "range?): frozen with the weights it had before that update")
    if len(models) == 1:
        how = update if in_update[0] else (
            "non-finite loss or gradient: frozen with its last finite "
            "weights")
        return (f"Model {models[0]} of array '{name}' diverged at step "
                f"{steps[0]}, in epoch {epoch + 1} ({how}). Its loss is "
                "logged as NaN; the other models train on.")
    named = listed([f"{b} (step {step}{', *' if flag else ''})"
                    for b, step, flag in zip(models, steps, in_update)],
                   more=" (`diverged_models` lists them all)")
    text = (f"{len(models)} models of array '{name}' diverged in epoch "
            f"{epoch + 1}: {named}. Each is frozen with its last finite "
            "weights (non-finite loss or gradient)")
    if any(in_update):
        text += f"; where marked *, {update}"
    return text + ". Their losses are logged as NaN; the other models train on."


def finite_per_model(tensors, num_models):
    """`[B]` booleans: whether model `b`'s slice of every tensor is finite.

    Tested first by one sum per tensor and model, which reads each tensor
    once and stores nothing of its size: a non-finite element makes its
    model's sum non-finite. Only where some sum is not finite (a diverging
    model, or finite values whose sum overflows) does the element-wise
    test run."""
    tensors = [t for t in tensors if t is not None]
    total = ops.zeros((num_models,), "float32")
    for tensor in tensors:
        total = total + ops.cast(
            sparse.total_per_model(tensor, num_models), "float32")
    return ops.cond(ops.all(ops.isfinite(total)),
                    lambda: ops.ones((num_models,), "bool"),
                    lambda: _finite_elements_per_model(tensors, num_models))


def _finite_elements_per_model(tensors, num_models):
    """`finite_per_model`, element by element."""
    finite = ops.ones((num_models,), "bool")
    for tensor in tensors:
        finite = ops.logical_and(
            finite, sparse.finite_per_model(tensor, num_models))
    return finite


class _StoreWithout:
    """A variable store seen without the given keys (those an override of
    `load_own_variables` reads itself)."""

    def __init__(self, store, keys):
        self._store = store
        self._keys = set(keys)

    def keys(self):
        return [key for key in self._store.keys() if key not in self._keys]

    def __getitem__(self, key):
        return self._store[key]


class Divergence:
    """Mixin of `FusedModel`: which models train, and the step's update of
    those that may.

    Reads `num_models`, `optimizer`, `_status` (a `ModelStatus`, saved
    with the array's own variables), `_bad_batch` (a `BatchProblems`) and
    the label routing's `_class_ids_outside`.
    """

    def _status_variables(self):
        """`(key, variable)` for each variable of which models still train:
        saved with the array's own variables (Keras saves no metric's)."""
        return [(f"model_status_{variable.name}", variable)
                for variable in self._status.variables]

    def save_own_variables(self, store):
        super().save_own_variables(store)
        for key, variable in self._status_variables():
            store[key] = variable

    def load_own_variables(self, store):
        status = dict(self._status_variables())
        keys = list(store.keys())
        super().load_own_variables(_StoreWithout(store, status))
        # A file written before the status was saved leaves it as it is.
        for key, variable in status.items():
            if key in keys:
                variable.assign(store[key])

    @property
    def active_models(self):
        """`[B]` booleans: the models still being trained."""
        return ops.convert_to_numpy(
            self._training_value(self._status.active)) > 0

    @property
    def diverged_models(self):
        """`[B]` booleans: the models frozen because they diverged (a
        non-finite loss or gradient)."""
        return ops.convert_to_numpy(
            self._training_value(self._status.diverged)) > 0

    def model_state(self):
        """A snapshot of the per-model state the forward pass updates
        (moving statistics), for `apply_model_gradients` to give frozen and
        diverging models theirs back. Take it before the forward pass."""
        # Not the seed generators' states (shape [2], B's shape when B is
        # 2): random streams go on for frozen models too.
        seeds = {id(g.state) for layer in compat.inner_layers(self)
                 for g in compat.seed_generators(layer)}
        variables = [v for v in self.non_trainable_variables
                     if len(v.shape) and v.shape[0] == self.num_models
                     and id(v) not in seeds]
        variables += self._weights_assigned_in_training()
        return variables, [ops.copy(v) for v in variables]

    def _restore_models(self, variables, values, models):
        """Gives the models where the `[B]` booleans `models` hold their
        slices of `values` back in `variables` (the backend trainer may
        skip the work on steps that restore none)."""
        for variable, value in zip(variables, self._restored_values(
                variables, values, models)):
            variable.assign(value)

    def _restored_values(self, variables, values, models):
        """The values of `variables` with the slices of the models where
        the `[B]` booleans `models` hold taken from `values`."""
        return [select_models(models, value, variable.value)
                for variable, value in zip(variables, values)]

    def _refusal_variables(self):
        """The flags of `BatchProblems`: `found`, `refused`."""
        return [self._bad_batch.found, self._bad_batch.refused]

    def _refusals(self):
        """`_refusal_variables()` as the training state holds them now."""
        return [self._training_value(v) for v in self._refusal_variables()]

    def _kept_refusals(self):
        """`_refusals()`, kept from the steps that follow."""
        return self._kept_training_values(self._refusal_variables())

    def check_batch(self, where, found=None):
        """Raises if the last training batch was refused (what
        `BatchProblems` found wrong with it), naming it as `where`;
        `found`: its flags where they were taken earlier (by default, the
        array's now)."""
        if found is None:
            found = self._training_value(self._bad_batch.found)
        found = ops.convert_to_numpy(found) > 0
        if not found.any():
            return
        self._bad_batch.reset_state()
        what = [text for text, hit in zip(_PROBLEMS, found) if hit]
        if not found[1:].any():
            what.append(
                "its inputs, labels and sample weights are finite and its "
                "class ids in range, so either every model's "
                "hyper-parameters make it diverge at once (learning rates "
                "too large?) or the batch holds values no model can train "
                "on (huge inputs?)")
        raise ValueError(
            f"Array '{self.name}' refused the training data in {where}: "
            f"{'; '.join(what)}. No model took a step on that batch and "
            "none was frozen: fix the data (or the hyper-parameters) and "
            "train again.")

    def _batch_problems(self, diverging, active, data):
        """`[len(_PROBLEMS)]` booleans: what is wrong with the batch `data`
        (`(x, y, y_pred, sample_weight)`, or None where a step of a
        subclass does not give it). Class ids are checked on every
        batch, the rest only where every model that trains (two or more)
        turned non-finite on it (`diverging`), as a bad batch makes them."""
        count = ops.sum(ops.cast(diverging, "int32"))
        every = ops.logical_and(count >= 2, ops.all(
            ops.equal(diverging, active)))
        unknown = ops.zeros((), "bool")
        if data is None:
            return ops.stack([every] + [unknown] * (len(_PROBLEMS) - 1))
        x, y, y_pred, sample_weight = data
        outside = self._class_ids_outside(y, y_pred)
        return ops.cond(
            ops.logical_or(every, outside),
            lambda: ops.stack([every, _non_finite(x), _non_finite(y),
                               outside, _non_finite(sample_weight)]),
            lambda: ops.stack([every, unknown, unknown, outside, unknown]))

    def apply_model_gradients(self, updates, losses, state=None, data=None):
        """Applies one training step to the models that may take it.

        The step every `train_step` ends with, custom ones included (a
        GAN's applies two optimizers): a model is updated only while it is
        active (not frozen, not diverged) and its losses and gradients are
        finite; a model whose loss or gradient turns non-finite, or whose
        update turns its weights non-finite, is frozen with its last finite
        weights, those from before that step (its moving statistics too,
        given the `state` from `model_state()`), and logged once. (Its
        optimizer's slots keep that step's update.) Under loss-scaling
        optimizers (`skips_nonfinite_steps`), which skip a model's
        non-finite step and halve its scale themselves as stock Keras does,
        a model is frozen only once its loss scale is below 1
        (`rescales_models()`).

        Args:
            updates: `(optimizer, gradients, variables)` triples, each a
                fused optimizer and the `[B, ...]` gradients of its
                variables.
            losses: the `[B]` per-model losses (a tuple of them for several
                objectives).
            state: the `model_state()` taken before the forward pass.
            data: the batch, `(x, y, y_pred, sample_weight)`: where given,
                a batch with class ids outside a sparse loss's classes, or
                one on which every model turns non-finite at once, trains
                no model, freezes none, and makes `fit` raise, naming what
                is wrong with it (`check_batch`).

        Returns:
            The `[B]` booleans of the models that took the step.
        """
        checked = list(keras.tree.flatten(losses))
        scaling = [optimizer for optimizer, _, _ in updates
                   if getattr(optimizer, "skips_nonfinite_steps", False)]
        for optimizer, gradients, _ in updates:
            # A loss-scaling optimizer skips non-finite gradients itself,
            # per model: they are no sign of divergence there.
            if optimizer not in scaling:
                checked.extend(gradients)
        finite = finite_per_model(checked, self.num_models)
        if updates and len(scaling) == len(updates):
            # Under loss scaling alone a non-finite loss is a float16
            # overflow too, which the optimizers skip and rescale as stock
            # Keras does; a model diverged where a scale fell below 1.
            rescaled = scaling[0].rescales_models()
            for optimizer in scaling[1:]:
                rescaled = ops.logical_and(rescaled,
                                           optimizer.rescales_models())
            finite = ops.logical_or(finite, rescaled)
        active = self._status.active > 0
        problems = self._batch_problems(
            ops.logical_and(active, ops.logical_not(finite)), active, data)
        refused = ops.logical_or(ops.any(problems), self._bad_batch.held())
        self._bad_batch.update_state(problems, refused)
        training = ops.logical_and(ops.logical_and(active, finite),
                                   ops.logical_not(refused))
        updated = [v for _, _, variables in updates for v in variables
                   if len(v.shape) and v.shape[0] == self.num_models]
        # Read before the update: a model whose update turns its weights
        # non-finite gets these back.
        before = [ops.copy(v) for v in updated]
        for optimizer, gradients, variables in updates:
            if variables:
                optimizer.apply(gradients, variables, model_mask=training)
        broken = ops.logical_and(training, ops.logical_not(
            finite_per_model([ops.convert_to_tensor(v) for v in updated],
                             self.num_models)))
        self._restore_models(updated, before, broken)
        training = ops.logical_and(training, ops.logical_not(broken))
        if state is not None:
            for variable, before in zip(*state):
                variable.assign(select_models(training, variable.value,
                                              before))
        self._status.update_state(
            ops.logical_and(ops.logical_and(active, ops.logical_not(
                training)), ops.logical_not(refused)),
            self.optimizer.iterations, in_update=broken)
        return training
