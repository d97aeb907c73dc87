"""The training step of an array on the TensorFlow backend.

`FusedModel` mixes in one backend trainer, chosen once by
`keras.backend.backend()` (`hftatf.training.trainer`), as `keras.Model`
mixes in `keras/src/backend/<backend>/trainer.py`. The rest of the array
(label routing, per-model losses and metrics, divergence, surgery) is
written in `keras.ops` and serves every backend.

A backend trainer provides:

* `make_train_function(force=False)` and `train_step(data)`,
  `test_step(data)`: Keras's, for an array. Here they are stateful, under
  a `tf.GradientTape`, traced by `tf.function` (with XLA where compiled)
  inside the strategy's replicas. A JAX trainer's steps are stateless,
  `train_step(state, data) -> (logs, state)` over Keras's four state lists
  `(trainable_variables, non_trainable_variables, optimizer_variables,
  metrics_variables)`, as `keras/src/backend/jax/trainer.py`: it runs
  `stateless_call`, the per-model losses, then `apply_model_gradients`
  and the metric tracking inside `keras.StatelessScope`s.
* `_forward_and_gradients(x, y, sample_weight) -> (y_pred, losses,
  gradients)`: the predictions, the `[B]` per-model losses and the
  gradients of their (scaled) sum, in passes of `models_per_pass` models
  where the array trains so (`hftatf.passes`; here the passes of equal
  size run as one `tf.while_loop` under XLA).
* the step ends with `apply_model_gradients` (`hftatf.training.divergence`,
  backend-independent), which applies the fused optimizer to the models
  that may take the step.
* `_built_pass_model(count)`: a new array of `count` models for passes
  (`passes.PassPlanning._pass_model` keeps it); `_distributed()`,
  `_training_value(variable)`, `_model_values(vector)`,
  `_traced(tensor)` and `_batch_for_building(iterator)`: where the
  backends differ in reading state and data; `AUTO_PASSES`: whether
  `models_per_pass="auto"` may pick passes.
* `_uses_replica_jit(jit_compile, run_eagerly)`: whether each replica's
  forward and backward pass is compiled on its own (see `compile`).
* `_vectorized_map(function, elements)`: one model's compiled loss or
  metrics mapped over the models (`hftatf.training.losses`), or None
  where the backend cannot vectorize them.

Sparse gradients (`tf.IndexedSlices` of embeddings, `hftatf.sparse`) are
TensorFlow's; a JAX trainer has dense ones only.
"""

import logging
import warnings

import keras
import tensorflow as tf
from keras import ops

from hftatf import passes, seeds, sparse
from hftatf.core import compat, tensorflow_compat
from hftatf.core.axis import (
    concat_models,
    mask_has_model_axis,
    select_models,
    swap_model_axis,
    take_models,
)
from hftatf.core.compat import (
    get_keras_mask,
    keep_logits,
    model_supports_jit,
    set_keras_mask,
)
from hftatf.core.devices import has_accelerator
from hftatf.core.logs import expand_model_logs, host_values
from hftatf.layers import objects

# Stock layers that XLA cannot compile on a CPU (TensorFlow 2.21), though
# they set `supports_jit`: `FusedModel._has_layers_without_xla`.
_LAYERS_WITHOUT_XLA = frozenset(
    ("AugMix", "CutMix", "MixUp", "RandAugment", "RandomElasticTransform"))


def _with_output_attributes(forward):
    """`forward` (returning `(y_pred, ...)`), returning the masks and the
    logits Keras keeps on the outputs as results of their own: a
    `tf.function` returns tensors without them."""
    def function(*args):
        y_pred, *rest = forward(*args)
        flat = keras.tree.flatten(y_pred)
        return (y_pred, [get_keras_mask(t) for t in flat],
                [compat.keras_logits(t) for t in flat], *rest)
    return function


def _restore_output_attributes(y_pred, masks, logits, *rest):
    """The results of a `_with_output_attributes` function, with the
    outputs' masks and logits attached again."""
    for tensor, mask, logit in zip(keras.tree.flatten(y_pred), masks,
                                   logits):
        if mask is not None:
            set_keras_mask(tensor, mask)
        if logit is not None:
            keep_logits(tensor, logit)
    return (y_pred, *rest)


def _joined_sparse(first, arrays, count, num_models):
    """The sparse gradient of `num_models` models, from the joined values
    and indices next in `arrays` (`first`: the first pass's, of `count`
    models)."""
    values, indices = next(arrays), next(arrays)
    rows = first.dense_shape[0] // count
    return tf.IndexedSlices(values, indices, tf.concat(
        [[rows * num_models], first.dense_shape[1:]], 0))


def _sum_gradients(parts):
    """The gradient of a variable every model shares: the sum of the
    passes' (None if none has one)."""
    parts = [tf.convert_to_tensor(g) for g in parts if g is not None]
    return ops.sum(ops.stack(parts), axis=0) if parts else None


def _assign_models(variable, value, models):
    """Assigns `value` to the slices of the TensorFlow `variable` of the
    models where the `[B]` booleans `models` hold (on steps where one
    does)."""
    def select():
        variable.assign(select_models(models, value, variable))

    tf.cond(tf.reduce_any(models), select, lambda: None)


def _label_shapes(data):
    """The shapes, batch axis left out, of the labels and sample weights
    of `data` (a batch, or its specs), which the step routes to the models
    by: None where `data` is None."""
    if data is None:
        return None
    if not isinstance(data, tuple):
        data = tuple(data) if isinstance(data, list) else (data,)
    _, labels, weights = keras.utils.unpack_x_y_sample_weight(data)
    return [None if getattr(t, "shape", None) is None
            or getattr(t.shape, "rank", 0) is None
            else tuple(t.shape)[1:] for t in keras.tree.flatten(
                (labels, weights))]


class TensorFlowTrainer:
    """Mixin of `FusedModel`: its steps on the TensorFlow backend (see the
    module docstring for what a backend trainer provides)."""

    # `models_per_pass="auto"` may pick passes on a CPU (`hftatf.passes`).
    AUTO_PASSES = True

    def _batch_for_building(self, iterator):
        """None: the per-model metrics are built from the data's shapes
        (`_maybe_symbolic_build`; taking a batch of a `PyDataset`'s
        iterator would run its epoch hooks twice)."""
        return None

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        """As Keras's, which builds the model's state before the first step
        only under a strategy. Without one, the array, its optimizer and
        its per-model metrics are built here too, from the shapes of the
        data (`element_spec`: no batch is taken), so that `tf.function`
        traces the step once: a step that creates variables is traced
        twice, which at B in the thousands is most of a first epoch."""
        spec = (data_batch if data_batch is not None
                else compat.epoch_element_spec(iterator))
        self._data_label_shapes = _label_shapes(spec)
        if self._distribute_strategy is not None:
            super()._maybe_symbolic_build(iterator=iterator,
                                          data_batch=data_batch)
            return
        if spec is None:
            return
        try:
            self._symbolic_build(data_batch=spec)
        except Exception:  # noqa: BLE001
            # What cannot be built from shapes alone (a layer that needs
            # values) is built as Keras builds it without a strategy: in
            # the step's first trace, whose errors are the user's.
            pass

    def _model_values(self, vector):
        """The `B` entries of `vector`."""
        return list(ops.unstack(vector))

    def _traced(self, tensor):
        """Whether `tensor` is a value of a step being traced."""
        return not tf.executing_eagerly()

    def _training_value(self, variable):
        """The value of the metric variable `variable` (the JAX trainer's
        may be in the step's state)."""
        return variable.value

    def _kept_training_values(self, variables):
        """`_training_value` of each of `variables`, kept from the steps
        that follow."""
        return [ops.copy(variable.value) for variable in variables]

    def _vectorized_map(self, function, elements):
        """`tf.vectorized_map` (`tensorflow_compat.vectorized_map`: built
        inline, so that XLA compiles the step once), None where an op of
        `function` has no vectorized form: its fallback, a `tf.while_loop`
        over the models, would be slower than the per-model objects. None
        outside a traced step too (the logs at the end of an epoch): there
        each call would trace a function of its own."""
        if tf.executing_eagerly():
            return None
        try:
            return tensorflow_compat.vectorized_map(function, elements)
        except ValueError as error:
            logging.info("Per-model losses and metrics are computed one "
                         "model after the other: %s", error)
            return None

    def _distributed(self):
        """Whether the array trains under a `tf.distribute` strategy."""
        return compat.distribute_strategy(self) is not None

    def _resolve_auto_jit_compile(self):
        if self._distributed():
            return False
        if not model_supports_jit(self) or self._has_layers_without_xla():
            return False
        if has_accelerator():
            return True
        # On CPUs, XLA fuses an array's elementwise work and batched matmuls
        # (faster, Transformers included, since their draws take keys
        # straight from their seeds: `hftatf.seeds`), but its convolutions
        # are slower than TensorFlow's oneDNN kernels, and it takes minutes
        # to compile a deep convolutional network (benchmarks/README.md).
        return not self._has_convolutions()

    def _has_layers_without_xla(self):
        """Whether a layer of the array computes with TensorFlow operations
        that XLA cannot compile, though the layer says it supports XLA
        (`supports_jit`): resizing other than nearest or bilinear, or with
        antialiasing or padding to an aspect ratio, and mixing
        augmentations that draw from a Gamma distribution or transform
        with dynamic shapes. Stock Keras fails on them with
        `jit_compile=True` too; `"auto"` leaves XLA off for them. Also
        `UpSampling2D` other than nearest, which resizes to a size computed
        in the graph: XLA's resize then computes other values than
        TensorFlow's (stock Keras too, off by as much as the values)."""
        return any(
            type(layer).__name__ in _LAYERS_WITHOUT_XLA
            or (isinstance(layer, keras.layers.UpSampling2D)
                and layer.interpolation != "nearest")
            or getattr(layer, "interpolation", "bilinear") not in (
                "nearest", "bilinear")
            or getattr(layer, "antialias", False)
            or getattr(layer, "pad_to_aspect_ratio", False)
            for layer in objects.all_layers(compat.inner_layers(self)))

    def make_train_function(self, force=False):
        """As Keras's, but the step (this class's `train_step`, or a
        subclass's) is traced with its random draws taking their keys
        straight from their seeds (`hftatf.seeds`)."""
        force = self._labels_changed("train") or force
        if self.train_function is not None and not force:
            return self.train_function
        self.train_function = self._expanding_logs(
            compat.make_step_function(self, self._train_step_keyed))
        return self.train_function

    def make_test_function(self, force=False):
        """As Keras's, giving each model's logs (`expand_model_logs`)."""
        force = self._labels_changed("test") or force
        super().make_test_function(force=force)
        self.test_function = self._expanding_logs(self.test_function)
        return self.test_function

    def _labels_changed(self, kind):
        """Whether the data of this call (`_maybe_symbolic_build`) holds
        labels or sample weights of other shapes than the data the `kind`
        step ("train" or "test") was traced for. `tf.function` would trace
        such a step again for shapes relaxed to the sizes they share, where
        an axis of unknown size could not tell per-model labels from
        shared ones: the step is made anew instead, and traced for these
        shapes."""
        shapes = getattr(self, "_data_label_shapes", None)
        if shapes is None:
            return False
        traced = vars(self).setdefault("_step_label_shapes", {})
        changed = traced.get(kind, shapes) != shapes
        traced[kind] = shapes
        return changed

    def _expanding_logs(self, function):
        """`function` (Keras's step over an iterator), whose logs give
        each model's value of a per-model quantity as `name_b`: the traced
        step returns them as one `[B]` entry (`get_metrics_result`)."""
        if getattr(function, "expands_logs", False):
            return function

        def step(iterator):
            return expand_model_logs(function(iterator), host_values)

        step.expands_logs = True
        return step

    def _train_step_keyed(self, data):
        with seeds.keys_from_seeds():
            return self.train_step(data)

    def train_step(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        state = self.model_state()
        if not self.trainable_weights:
            warnings.warn("The array does not have any trainable weights.",
                          stacklevel=2)
        y_pred, losses, gradients = self._replica_forward(x, y, sample_weight)
        self.apply_model_gradients(
            [(self.optimizer, gradients, self.trainable_weights)], losses,
            state=state, data=(x, y, y_pred, sample_weight))
        return self._track(x, y, y_pred, sample_weight, losses, training=True)

    def test_step(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        y_pred = self(x, training=False)
        losses = self.compute_model_losses(
            x, y, y_pred, sample_weight, training=False)
        return self._track(x, y, y_pred, sample_weight, losses)

    def _uses_replica_jit(self, jit_compile, run_eagerly):
        """Whether each replica's forward and backward pass is compiled
        with XLA on its own: under a strategy, where Keras compiles no
        step, but for TPUs (whose replica step is compiled anyway)."""
        strategy = compat.distribute_strategy(self)
        return bool(
            strategy is not None and jit_compile in ("auto", True)
            and not run_eagerly
            and not isinstance(strategy, tf.distribute.TPUStrategy)
            and model_supports_jit(self))

    def _restore_models(self, variables, values, models):
        """`Divergence._restore_models`, skipped on steps that restore no
        model; under a strategy, assigned in a cross-replica context (the
        weights are mirrored variables, which a replica may not assign)."""
        context = tf.distribute.get_replica_context()
        if not tf.distribute.has_strategy() or context is None:
            ops.cond(ops.any(models), lambda: super(
                TensorFlowTrainer, self)._restore_models(
                    variables, values, models), lambda: None)
            return

        def restore(strategy, values, models):
            for variable, value in zip(variables, values):
                strategy.extended.update(
                    variable.value, _assign_models, args=(value, models),
                    group=False)

        context.merge_call(restore, args=(values, models))

    def _replica_forward(self, x, y, sample_weight):
        """`_forward_and_gradients`, compiled with XLA under a strategy
        where Keras compiles no step (see `compile`), unless the pass
        synchronises replicas (e.g. synchronized BatchNormalization)."""
        if self._replica_jit_compile:
            if self._compiled_forward is None:
                self._compiled_forward = tf.function(
                    _with_output_attributes(self._forward_and_gradients),
                    jit_compile=True, reduce_retracing=True)
            try:
                return _restore_output_attributes(
                    *self._compiled_forward(x, y, sample_weight))
            except RuntimeError as error:
                if "merge_call" not in str(error):
                    raise
                logging.info(
                    "Array '%s' synchronises replicas in its forward pass; "
                    "its replica steps run without XLA.", self.name)
                self._replica_jit_compile = False
                self._compiled_forward = None
        return self._forward_and_gradients(x, y, sample_weight)

    def _forward_and_gradients(self, x, y, sample_weight):
        """Predictions, `[B]` losses and the gradients of their (scaled)
        sum with respect to the trainable weights."""
        per_pass = self._models_per_pass_for(x)
        if per_pass < self.num_models:
            return self._forward_and_gradients_in_passes(
                x, y, sample_weight, per_pass)
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            losses = self.compute_model_losses(
                x, y, y_pred, sample_weight, training=True)
            loss = self.optimizer.scale_model_losses(losses)
        gradients = []
        if self.trainable_weights:
            gradients = tape.gradient(loss, self.trainable_weights)
        return y_pred, losses, gradients

    def _built_pass_model(self, count):
        """An array of `count` models for passes, built outside the traced
        step: it creates variables."""
        with tf.init_scope():
            return self._rebuilt(count)

    def _forward_and_gradients_in_passes(self, x, y, sample_weight,
                                         per_pass):
        """`_forward_and_gradients`, computed `per_pass` models at a time,
        one pass after the other (see `hftatf.passes`).

        Where three or more passes have `per_pass` models, the first is
        traced on its own and the others run as one `tf.while_loop` over a
        pass traced once (`passes.looped_passes`), so that the step's graph,
        and its compile time, do not grow with the number of passes."""
        B = self.num_models
        trainable = self.trainable_variables
        states = self.non_trainable_variables
        # Read once; each pass takes its slices.
        values = [v.value for v in trainable]
        carried = [v.value for v in states]
        spans = passes.bounds(B, per_pass)
        _, (trainable_roles, state_roles) = self._pass_model(per_pass)
        looped = passes.looped_passes(spans) if self._loops_passes() else 0
        parts = []  # (start, predictions, losses, gradients, sliced state)
        previous = []
        if looped:
            first, carried = self._one_pass(0, per_pass, x, y, sample_weight,
                                            values, carried)
            part, carried = self._looped_passes(
                looped, per_pass, first, x, y, sample_weight, values,
                carried)
            parts.append(part)
            previous = passes.pass_outputs(part)
        for start, stop in spans[looped:]:
            part, carried = self._one_pass(
                start, stop - start, x, y, sample_weight, values, carried,
                previous)
            parts.append(part)
            # The next pass starts when this one is done, so that one
            # pass's activations are live at a time.
            previous = passes.pass_outputs(part)
        starts, preds, losses, gradients, updates = zip(*parts)
        for number, (variable, value) in enumerate(zip(states, carried)):
            sliced = [u[number] for u in updates]
            variable.assign(ops.concatenate(sliced, axis=0)
                            if state_roles[number] else value)
        gradients = [
            passes.concat_gradients(list(g), starts, variable.shape)
            if sliced else _sum_gradients(g)
            for variable, sliced, g in zip(trainable, trainable_roles,
                                           zip(*gradients))]
        y_pred = keras.tree.map_structure(
            lambda *p: concat_models(list(p)), *preds)
        return y_pred, ops.concatenate(losses, axis=0), gradients

    def _one_pass(self, start, count, x, y, sample_weight, values, carried,
                  previous=()):
        """Forward and backward pass of the models `start:start + count`
        (`start` a Python int, or a tensor inside a loop over passes).

        Returns `(start, predictions, losses, gradients, sliced_state)`,
        where `gradients` holds a `[count, ...]` gradient for each weight
        with the model axis and the whole gradient for the others, and
        `sliced_state` the updated slices of the per-model state (the
        others' entries None); and `carried`, the state with the
        pass's updates of the state without a model axis."""
        model, (trainable_roles, state_roles) = self._pass_model(count)
        with tf.control_dependencies(previous):
            inputs = [tf.identity(t) if shared else
                      take_models(t, start, count, axis=1)
                      for t, shared in zip(keras.tree.flatten(x),
                                           self._shared_inputs)]
        inputs = keras.tree.pack_sequence_as(x, inputs)
        weights = passes.pass_values(values, trainable_roles, start, count)
        state = passes.pass_values(carried, state_roles, start, count)
        with tf.GradientTape() as tape:
            tape.watch(weights)
            y_pred, state, added = model.stateless_call(
                weights, state, inputs, training=True, return_losses=True)
            losses = self._losses_of_models(
                [start + k for k in range(count)], y, y_pred, sample_weight,
                added, training=True)
            loss = self.optimizer.scale_model_losses(
                passes.spread_losses(losses, start, self.num_models))
        gradients = tape.gradient(loss, weights) if weights else []
        sliced = [value if role else None
                  for value, role in zip(state, state_roles)]
        carried = [old if role else new for old, new, role in zip(
            carried, state, state_roles)]
        return (start, y_pred, losses, gradients, sliced), carried

    def _looped_passes(self, num_passes, count, first, x, y,
                       sample_weight, values, carried):
        """The first `num_passes` passes of `count` models each, joined
        into one part as `_one_pass` returns it: `first` (the first pass,
        traced before) and a `tf.while_loop` over the others, one at a time
        (`parallel_iterations` of 1). `first` gives the dtypes and shapes
        that every pass writes at its index of a `tf.TensorArray`: its
        predictions (models first, with their logits where Keras keeps
        them), losses, per-model gradients (dense, or the values and
        indices of sparse ones) and per-model state."""
        _, first_preds, _, first_gradients, first_state = first
        _, (trainable_roles, state_roles) = self._pass_model(count)
        logits = [compat.keras_logits(t) is not None
                  for t in keras.tree.flatten(first_preds)]
        # Each output's mask: per model (written by every pass), shared by
        # the models (the first pass's), or none.
        first_masks = [get_keras_mask(t)
                       for t in keras.tree.flatten(first_preds)]
        masked = [m is not None and mask_has_model_axis(t, m)
                  for m, t in zip(first_masks,
                                  keras.tree.flatten(first_preds))]

        def written(part):
            """What a pass writes, and its gradients of the weights all
            models share (summed over the passes)."""
            start, preds, losses, gradients, sliced = part
            flat = keras.tree.flatten(preds)
            per_model = []
            for g, role in zip(gradients, trainable_roles):
                if role and sparse.is_sparse(g):
                    per_model += [g.values, sparse.offset(g, start, count)]
                elif role and g is not None:
                    per_model.append(g)
            gradients = [(g if g is None else tf.convert_to_tensor(g), role)
                         for g, role in zip(gradients, trainable_roles)]
            shared = [g for g, role in gradients
                      if not role and g is not None]
            return ([swap_model_axis(t) for t in flat]
                    + [swap_model_axis(compat.keras_logits(t))
                       for t, has in zip(flat, logits) if has]
                    + [swap_model_axis(get_keras_mask(t))
                       for t, has in zip(flat, masked) if has]
                    + [losses] + per_model
                    + [s for s in sliced if s is not None]), shared

        def shared_of(state):
            """The entries of `state` without a model axis: the loop
            carries them from pass to pass."""
            return [c for c, role in zip(state, state_roles) if not role]

        def with_shared(state, shared):
            """`state` with its entries without a model axis replaced."""
            shared = iter(shared)
            return [value if role else next(shared)
                    for value, role in zip(state, state_roles)]

        outputs, sums = written(first)
        arrays = [passes.stacked(t, num_passes).write(0, t)
                  for t in outputs]

        def body(i, arrays, sums, shared_state):
            part, now = self._one_pass(
                i * count, count, x, y, sample_weight, values,
                with_shared(carried, shared_state))
            outputs, added = written(part)
            arrays = [a.write(i, t) for a, t in zip(arrays, outputs)]
            sums = [s + a for s, a in zip(sums, added)]
            return i + 1, arrays, sums, shared_of(now)

        # Starts when the first pass is done.
        with tf.control_dependencies(passes.pass_outputs(first)):
            start = tf.identity(tf.constant(1, "int32"))
        _, arrays, sums, shared_state = tf.while_loop(
            lambda i, *_: i < num_passes, body,
            (start, arrays, sums, shared_of(carried)), parallel_iterations=1,
            maximum_iterations=num_passes - 1)
        arrays = iter([passes.joined(a) for a in arrays])
        flat = [swap_model_axis(next(arrays))
                for _ in logits]  # one entry per output
        for t, has in zip(flat, logits):
            if has:
                keep_logits(t, swap_model_axis(next(arrays)))
        for t, has, mask in zip(flat, masked, first_masks):
            if has:
                set_keras_mask(t, swap_model_axis(next(arrays)))
            elif mask is not None:
                set_keras_mask(t, mask)
        losses = next(arrays)
        sums = iter(sums)
        gradients = [None if g is None else _joined_sparse(
                         g, arrays, count, num_passes * count)
                     if role and sparse.is_sparse(g) else next(arrays)
                     if role else next(sums)
                     for g, role in zip(first_gradients, trainable_roles)]
        sliced = [None if s is None else next(arrays) for s in first_state]
        carried = with_shared(carried, shared_state)
        preds = keras.tree.pack_sequence_as(first_preds, flat)
        return (0, preds, losses, gradients, sliced), carried
