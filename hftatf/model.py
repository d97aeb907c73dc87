"""FusedModel: an array of B models trained, evaluated and served as one."""

import copy
import json
import logging
import warnings

import keras
import numpy as np
import tensorflow as tf
from keras import ops
from keras.src import backend
from keras.src.backend import get_keras_mask, set_keras_mask

# CompileLoss and CompileMetrics are what stock `Model.compile` builds; one
# per model gives every model exactly the stock loss and metric semantics
# (string names, nested outputs, loss weights, "accuracy" resolution).
from keras.src.losses.loss import (
    scale_loss_for_distribution,
    unscale_loss_for_distribution,
)
from keras.src.trainers.compile_utils import CompileLoss, CompileMetrics
from keras.src.trainers.trainer import model_supports_jit
from keras.src.utils import tracking

from hftatf import backup, passes, progress, report, seeds, sparse
from hftatf import optimizers as fused_optimizers
from hftatf import summary as array_summary
from hftatf.api import hftatf_export
from hftatf.core import hooks
from hftatf.graph import config_layers, graph_layers, is_graph_model
from hftatf.layers import convolutional, objects, per_model
from hftatf.layers.base import (
    broadcast_to_models,
    has_accelerator,
    keep_logits,
    mask_has_model_axis,
    model_pieces,
    runs_on_accelerator,
)
from hftatf.validation import check_num_models


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


class ModelStatus(keras.metrics.Metric):
    """Which models of an array still train.

    `active[b]` is 1 while model `b` is updated; 0 once it is frozen (it
    diverged, or a callback stopped it). `diverged[b]` is 1 once model `b`
    produced a non-finite loss or gradient. Saved with the array's weights
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

    def update_state(self, diverging, step):
        """Freezes the `diverging` models (`[B]` booleans) at `step`."""
        diverging = ops.cast(diverging, self.dtype)
        self.diverged_at.assign(ops.where(
            diverging > 0, ops.cast(step, self.dtype), self.diverged_at))
        self.diverged.assign(ops.maximum(self.diverged, diverging))
        self.active.assign(self.active * (1.0 - diverging))

    def reset_state(self):
        # Epoch boundaries must not revive frozen models.
        pass

    def result(self):
        return self.active

    def get_config(self):
        return {**super().get_config(), "num_models": self.num_models}


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


class _DivergenceReport(keras.callbacks.Callback):
    """Logs each model of the array that diverged, once."""

    def on_epoch_end(self, epoch, logs=None):
        self._report()

    def on_train_end(self, logs=None):
        self._report()

    def _report(self):
        model = self.model
        steps = ops.convert_to_numpy(model._status.diverged_at)
        for index in np.flatnonzero(model.diverged_models):
            if index not in model._reported_divergence:
                model._reported_divergence.add(int(index))
                if all(np.all(np.isfinite(w))
                       for w in model.get_model_weights(index)):
                    how = (" (non-finite loss or gradient). It is frozen "
                           "with its last finite weights")
                else:
                    # Only the losses and gradients are checked each step:
                    # an update that turned finite ones into non-finite
                    # weights shows at the next step's loss.
                    how = (": its weights are not finite, though its loss "
                           "and gradients were until then, so its "
                           "optimizer's update made them so (a "
                           "hyper-parameter out of range?). It is frozen "
                           "as it is")
                logging.warning(
                    "Model %d of array '%s' diverged at step %d%s and its "
                    "loss is logged as NaN; the other models train on.",
                    index, model.name, int(steps[index]), how)


# Stock callbacks that read (or set) one learning rate, where an array's
# optimizer holds one per model, and what does their work for an array.
_SINGLE_RATE_CALLBACKS = {
    keras.callbacks.ReduceLROnPlateau: (
        "hftatf.callbacks.ReduceLROnPlateau, which lowers each model's rate "
        "when that model's own metric stops improving"),
    keras.callbacks.LearningRateScheduler: (
        "hftatf.callbacks.LearningRateScheduler, which applies the schedule "
        "to each model's own rate every epoch, or a schedule per model in "
        "the optimizer, e.g. hftatf.optimizers.Adam(learning_rate="
        "[schedule_0, schedule_1, ...]) with keras.optimizers.schedules, "
        "which each model follows by its own step count"),
    # (It writes the rate with each epoch's logs.)
    keras.callbacks.TensorBoard: (
        "hftatf.callbacks.TensorBoard, which writes each model's results "
        "and hyper-parameters as a TensorBoard run of its own"),
}


def _check_callbacks(callbacks):
    """Rejects the stock callbacks that cannot drive an array (they would
    fail mid-training on the array's `[B]` learning rates)."""
    if isinstance(callbacks, keras.callbacks.CallbackList):
        callbacks = callbacks.callbacks
    for callback in callbacks or ():
        for stock, alternative in _SINGLE_RATE_CALLBACKS.items():
            if isinstance(callback, stock):
                raise ValueError(
                    f"keras.callbacks.{stock.__name__} reads one learning "
                    "rate; an array's optimizer holds one per model. Use "
                    f"{alternative}.")


def _backups_last(callbacks):
    """`callbacks` with the backups (stock and `hftatf.backup`) last, so
    that each saves what the others did at an epoch's end (a model that
    early stopping froze); each `hftatf.backup.BackupAndRestore` is given
    the others, whose state it backs up."""
    is_backup = (keras.callbacks.BackupAndRestore, backup.BackupAndRestore)
    others = [c for c in callbacks if not isinstance(c, is_backup)]
    backups = [c for c in callbacks if isinstance(c, is_backup)]
    for callback in backups:
        if isinstance(callback, backup.BackupAndRestore):
            callback.callbacks = others
    return others + backups


def _finite_per_model(tensors, num_models):
    """`[B]` booleans: whether model `b`'s slice of every tensor is finite.

    Tested first by one sum per tensor and model, which reads each tensor
    once and stores nothing of its size: a non-finite element makes its
    model's sum non-finite. Only where some sum is not finite (a diverging
    model, or finite values whose sum overflows) does the element-wise
    test run."""
    tensors = [t for t in tensors if t is not None]
    total = ops.zeros((num_models,), "float32")
    for tensor in tensors:
        total = total + ops.cast(sparse.reduce_per_model(
            tensor, num_models, lambda rows: ops.sum(rows, axis=1),
            tf.math.unsorted_segment_sum), "float32")
    return ops.cond(ops.all(ops.isfinite(total)),
                    lambda: ops.ones((num_models,), "bool"),
                    lambda: _finite_elements_per_model(tensors, num_models))


def _finite_elements_per_model(tensors, num_models):
    """`_finite_per_model`, element by element."""
    finite = ops.ones((num_models,), "bool")
    for tensor in tensors:
        finite = ops.logical_and(
            finite, sparse.finite_per_model(tensor, num_models))
    return finite


def _unstack_models(tensor, num_models):
    """`[tensor[:, b] for b in range(num_models)]`, without copies where
    they can be avoided.

    One model's slice is a reshape (no copy, nor in its gradient). Several
    are one `unstack` (whose gradient is one `stack`: B separate slices
    would cost B gradients of the size of the whole tensor). Where the
    tensor was just transposed from models first (the last product of the
    array, `dense.per_model_matmul`), it is transposed back and unstacked
    on its first axis: TensorFlow's optimizers cancel the two transposes,
    and an unstack of the first axis shares its input's memory. Where
    it was stacked from per-model results (`model_pieces`), they are the
    slices."""
    swap = (1, 0, *range(2, len(tensor.shape)))
    if num_models > 1 and _transposed_by(tensor, swap):
        return ops.unstack(ops.transpose(tensor, swap), num_models, axis=0)
    return model_pieces(tensor, num_models, 1)


def _takes_class_ids(loss):
    """Whether the compiled `loss` (a name, function or `Loss`) takes
    integer class ids, labels one axis short of the predictions: True for
    Keras's sparse losses, False for its others, None for a loss of the
    user's own (or none)."""
    if isinstance(loss, str):
        try:
            loss = keras.losses.get(loss)
        except ValueError:
            return None
    if isinstance(loss, keras.losses.Loss):
        # A stock loss class wraps its function (`fn`); one of the user's
        # own computes in `call`.
        loss = getattr(loss, "fn", type(loss))
    if not callable(loss):
        return None
    module = getattr(loss, "__module__", None) or ""
    if not module.startswith("keras."):
        return None
    return "sparse" in getattr(loss, "__name__", "").lower()


def _transposed_by(tensor, order):
    """Whether `tensor` is, in a traced graph, the output of a transpose
    by `order`."""
    op = None if tf.executing_eagerly() else getattr(tensor, "op", None)
    if op is None or op.type != "Transpose":
        return False
    perm = tf.get_static_value(op.inputs[1])
    return perm is not None and tuple(perm.tolist()) == order


def _model_slices(tensor, num_models):
    """Each model's slice of `tensor` (`_unstack_models`), keeping the
    logits Keras caches on softmax and sigmoid outputs (its crossentropy
    reads them for exactness) and the output's mask (its losses and
    metrics leave masked steps out)."""
    slices = _unstack_models(tensor, num_models)
    logits = getattr(tensor, "_keras_logits", None)
    if logits is not None:
        for sliced, sliced_logits in zip(
                slices, _unstack_models(logits, num_models)):
            keep_logits(sliced, sliced_logits)
    mask = get_keras_mask(tensor)
    if mask is not None:
        if mask_has_model_axis(tensor, mask):
            masks = _unstack_models(mask, num_models)
        elif len(mask.shape) == len(tensor.shape) - 2:  # shared
            masks = [mask] * num_models
        else:
            masks = [None] * num_models
        for sliced, sliced_mask in zip(slices, masks):
            if sliced_mask is not None:
                set_keras_mask(sliced, sliced_mask)
    return slices


def _with_num_models(config, old, new):
    """`config` with every `num_models` equal to `old` set to `new`."""
    if isinstance(config, dict):
        return {key: (new if key == "num_models" and value == old
                      else _with_num_models(value, old, new))
                for key, value in config.items()}
    if isinstance(config, (list, tuple)):
        return type(config)(_with_num_models(v, old, new) for v in config)
    return config


def _copy_model_slices(sources, targets, indices, num_models):
    """Copies each source variable into its target: the model slices
    `indices` of `[B, ...]` variables, whole for variables without a model
    axis (e.g. a step counter)."""
    for source, target in zip(sources, targets):
        value = ops.convert_to_numpy(source)
        if value.ndim and value.shape[0] == num_models:
            value = value[indices]
        if tuple(target.shape) != value.shape:
            raise ValueError(
                f"Cannot copy '{source.path}' of shape "
                f"{tuple(source.shape)} into '{target.path}' of shape "
                f"{tuple(target.shape)}.")
        target.assign(value)


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


def _check_reduced(loss):
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


def _check_log_names(per_model, num_models):
    """Refuses logs whose per-model names (`name_b`) would overwrite
    another log: Keras names a second `AUC()` `auc_1`, model 1's `auc`."""
    clashes = sorted(f"{name}_{b}" for name in per_model
                     for b in range(num_models)
                     if f"{name}_{b}" in per_model)
    if clashes:
        clash = clashes[0]
        raise ValueError(
            f"The array logs model b's `{clash.rpartition('_')[0]}` as "
            f"`{clash.rpartition('_')[0]}_b`, which would overwrite the "
            f"log named `{clash}`. Give that metric a name of its own, e.g. "
            "`keras.metrics.AUC(curve='PR', name='pr_auc')`.")


def _with_output_attributes(forward):
    """`forward` (returning `(y_pred, ...)`), returning the masks and the
    logits Keras keeps on the outputs as results of their own: a
    `tf.function` returns tensors without them."""
    def function(*args):
        y_pred, *rest = forward(*args)
        flat = keras.tree.flatten(y_pred)
        return (y_pred, [get_keras_mask(t) for t in flat],
                [getattr(t, "_keras_logits", None) for t in flat], *rest)
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


def _restore_layer_names(model, config):
    """Gives the layers of the graph `model`, deserialized from `config`,
    the names the config lists them under (nested models too): a layer of
    your own whose config leaves its name out, or whose constructor does
    not hand it to Keras, comes back under another name, which its weights
    could not be matched by (`hftatf.graph.weighted_layers`)."""
    entries = config["config"]["layers"]
    layers = config_layers(model)
    if [type(layer).__name__ for layer in layers] != [
            entry["class_name"] for entry in entries]:
        return
    for layer, entry in zip(layers, entries):
        name = entry.get("name", entry["config"].get("name"))
        if name is not None and layer.name != name:
            layer.name = name
        if is_graph_model(layer):
            _restore_layer_names(layer, entry)


def trainable_flags(model):
    """`{path: flags}` of the graph `model` (an array or a stock model):
    for each nested functional or Sequential model its own `[trainable]`
    flag, and for each layer with weights its `trainable` flags and those
    of the layers inside it (`per_model.trainable_flags`; of the stock
    layer that a layer run per model holds). Paths are those of
    `hftatf.graph.graph_layers`."""
    found = {}
    for path, layer in graph_layers(model):
        if is_graph_model(layer):
            found[path] = [layer.trainable]
        elif layer.weights:
            found[path] = per_model.trainable_flags(
                layer.layer if isinstance(layer, per_model.FusedPerModel)
                else layer)
    return found


def set_trainable_flags(model, flags):
    """Gives the layers of the graph `model` the `trainable_flags` of
    another of its architecture (those at paths `flags` lacks are left
    alone). A nested model's flag is set before those of the layers inside
    it, which it hands down to. A layer whose inner layers differ in number
    from those its flags came from (a fused layer's own) takes its own flag
    only."""
    for path, layer in graph_layers(model):
        given = flags.get(path)
        if given is None:
            continue
        if len(given) == len(layer._flatten_layers()):
            per_model.set_trainable_flags(layer, given)
        else:
            per_model.set_trainable(layer, given[0])


# Stock layers that XLA cannot compile on a CPU (TensorFlow 2.21), though
# they set `supports_jit`: `FusedModel._has_layers_without_xla`.
_LAYERS_WITHOUT_XLA = frozenset(
    ("AugMix", "CutMix", "MixUp", "RandAugment", "RandomElasticTransform"))


def _pass_values(values, roles, start, count):
    """Values for the pass of models `start:start + count`: the slices of
    those that carry the model axis, the others whole."""
    return [passes.take_models(value, start, count) if sliced else value
            for value, sliced in zip(values, roles)]


def _same_shape(a, b):
    return len(a) == len(b) and all(
        x is None or y is None or x == y for x, y in zip(a, b))


def _fits_shared_weight(weight_shape, pred_shape):
    """Whether sample weights of `weight_shape` fit the stock model's
    output, the array's `pred_shape` without its model axis: one weight
    per sample, or per sample and time step (`[batch, T]` or `[batch, T,
    1]` for `[batch, T, ...]`)."""
    stock = pred_shape[:1] + pred_shape[2:]
    rank = len(weight_shape)
    return 1 <= rank <= len(stock) and _same_shape(
        weight_shape[1:], stock[1:rank]) or (
            rank == len(stock) and weight_shape[-1] == 1
            and _same_shape(weight_shape[1:-1], stock[1:-1]))


@hftatf_export
class FusedModel(keras.Model):
    """An array of `num_models` same-architecture models trained as one.

    Layout: every output is `[batch, B, ...]` (model `b`'s output is
    `y[:, b]`). Each input is either shared by all models (`[batch, ...]`)
    or given per model (`[batch, B, ...]`). Labels may be shared
    (`[batch, ...]`) or per model (`[batch, B, ...]`), and so may sample
    weights (`[batch, B, ...]` is per model when the labels are).

    Training: each model's loss is exactly the loss a stock Keras model would
    compute on its own outputs (its mean over the batch, its regularization
    losses); the array minimises their sum, so each model's gradient is its
    own. Logs carry `loss` (the mean over models) and `loss_0` ...
    `loss_{B-1}`, and likewise every metric (`accuracy`, `accuracy_0`, ...),
    so stock callbacks and the progress bar read them.

    Build one with `hftatf.fuse(model, num_models)` or
    `hftatf.fuse_models(models)`; or construct it like a functional model
    from `hftatf.layers`: `FusedModel(inputs, outputs, num_models=B)`.

    Args:
        inputs, outputs: as for a functional `keras.Model`.
        num_models: the number of models `B`.
        shared_inputs: one bool per input (or one for all): whether that
            input is shared by all models. Defaults to True for inputs of
            rank one less than the model's per-model inputs would have.
        source: the serialized stock model this array was fused from (set by
            `hftatf.fuse`); lets `unfuse` and saving rebuild it.
        **kwargs: `name`, `trainable`, as for `keras.Model`.
    """

    def __init__(self, inputs, outputs, num_models, shared_inputs=True,
                 source=None, **kwargs):
        super().__init__(inputs=inputs, outputs=outputs, **kwargs)
        self.num_models = check_num_models(num_models)
        if isinstance(shared_inputs, bool):
            shared_inputs = [shared_inputs] * len(self.inputs)
        if len(shared_inputs) != len(self.inputs):
            raise ValueError(
                f"`shared_inputs` needs one bool per input ({len(self.inputs)}"
                f" inputs). Received: shared_inputs={shared_inputs!r}."
            )
        self._shared_inputs = tuple(bool(s) for s in shared_inputs)
        # Kept as text so that Keras' attribute tracking leaves it alone.
        self._source_json = None if source is None else json.dumps(source)
        self._per_model_labels = None
        self._model_losses = None
        self._model_metrics = None
        self._model_loss_tracker = None
        self._class_weight = None
        self._replica_jit_compile = False
        self._compiled_forward = None
        self._models_per_pass = None
        self._resolved_models_per_pass = None
        self._pass_models = passes.PassModels()
        self._status = ModelStatus(self.num_models)
        self._reported_divergence = set()
        # The `layout` given to `hftatf.fuse`.
        self._layout = "auto"

    # -- saving -------------------------------------------------------------

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
    def shared_inputs(self):
        """One bool per input: whether all models share that input."""
        return self._shared_inputs

    @property
    def source_config(self):
        """The serialized stock model this array was fused from, or None."""
        return None if self._source_json is None else json.loads(
            self._source_json)

    def stock_model(self, safe_mode=True):
        """A new stock model of the architecture this array was fused from
        (fresh weights). The functions and classes of a script's own that
        its layers hold are found even where they are not registered with
        Keras (`hftatf.layers.objects`)."""
        return self._stock_models(1, safe_mode=safe_mode)[0]

    def _stock_models(self, count, safe_mode=True):
        """`count` new stock models, as `stock_model`: the array's layers
        are searched for the objects they hold once for all of them."""
        if self._source_json is None:
            raise ValueError(
                f"Array '{self.name}' was not made by hftatf.fuse or "
                "hftatf.fuse_models, so it has no stock architecture.")
        # Two copies: `_stock_classes` rewrites `source`'s lambdas.
        source, names = self.source_config, self.source_config
        flags = trainable_flags(self)
        models = []
        with self._stock_classes(source):
            for _ in range(count):
                # Deserializing consumes the config: each model gets a copy.
                model = keras.saving.deserialize_keras_object(
                    copy.deepcopy(source), safe_mode=safe_mode)
                _restore_layer_names(model, names)
                set_trainable_flags(model, flags)
                models.append(model)
        return models

    def _stock_classes(self, config):
        """A scope in which the functions and classes of a script's own
        that this array's layers hold deserialize from `config` (a
        serialized model, whose Python lambdas it rewrites to be found
        too: `hftatf.layers.objects`)."""
        layers = list(self._flatten_layers())
        return keras.saving.CustomObjectScope({
            **objects.live_objects(layers),
            **objects.live_lambdas(config, layers)})

    # -- calling ------------------------------------------------------------

    @property
    def input_spec(self):
        # Inputs are checked in `call`, with messages about the model axis.
        return None

    @input_spec.setter
    def input_spec(self, value):
        pass

    def call(self, inputs, training=None, mask=None):
        for tensor, reference, shared in zip(
                self._flat_inputs(inputs), self.inputs, self._shared_inputs):
            self._check_input(tensor, reference, shared)
        return super().call(inputs, training=training, mask=mask)

    def _flat_inputs(self, inputs):
        """The input tensors in the order of `self.inputs`: a dict given
        to a model of listed inputs is matched by input names, as Keras
        matches it."""
        if isinstance(inputs, dict) and not isinstance(
                self._inputs_struct, dict):
            names = [tensor.name for tensor in self.inputs]
            if set(names) <= set(inputs):
                return [inputs[name] for name in names]
        return keras.tree.flatten(inputs)

    def _check_input(self, tensor, reference, shared):
        shape, expected = tuple(tensor.shape), tuple(reference.shape)
        if len(shape) == len(expected) and _same_shape(shape[1:],
                                                       expected[1:]):
            return
        name = reference.name
        B = self.num_models
        if shared:
            hint = (
                " It looks like one batch per model; fuse with "
                "shared_inputs=False to give each model its own input."
                if len(shape) == len(expected) + 1 and shape[1] == B else "")
            raise ValueError(
                f"Input '{name}' is shared by the {B} models of the array and "
                f"must have shape {expected} ([batch, ...] as for the stock "
                f"model). Received shape {shape}.{hint}")
        hint = (
            " It looks like one batch for all models; fuse with "
            "shared_inputs=True to share an input."
            if len(shape) == len(expected) - 1 else "")
        raise ValueError(
            f"Input '{name}' takes one batch per model: it must have shape "
            f"{expected}, i.e. [batch, num_models={B}, ...] with the model "
            f"axis at 1. Received shape {shape}.{hint}")

    # -- compiling ----------------------------------------------------------

    # As Keras's own `compile`: the trackers it makes replace the previous
    # compile's, instead of joining them in the tracked `_metrics`.
    @tracking.no_automatic_dependency_tracking
    def compile(self, optimizer="rmsprop", loss=None, loss_weights=None,
                metrics=None, weighted_metrics=None, run_eagerly=False,
                steps_per_execution=1, jit_compile="auto",
                per_model_labels=None, auto_scale_loss=True,
                models_per_pass="auto"):
        """Configures the array for training, as `keras.Model.compile`.

        Args:
            optimizer: a fused optimizer (`hftatf.optimizers.Adam(...)`), its
                name, or a stock Keras optimizer of the same name (converted:
                every model gets its hyper-parameters).
            loss, loss_weights, metrics, weighted_metrics: as in Keras; every
                model gets its own loss and its own copy of every metric.
            run_eagerly, steps_per_execution: as in Keras.
            jit_compile: as in Keras, except that `"auto"` turns XLA on
                wherever the model supports it, CPU included (fused arrays
                gain from it there too), but for models with convolutions
                on a CPU (XLA's CPU convolutions are slower than
                TensorFlow's and slow to compile). Under a distribution
                strategy, where
                Keras compiles no step with XLA, `"auto"` and True compile
                each replica's forward and backward pass (on TPU the whole
                replica step is compiled anyway).
            per_model_labels: None to tell shared labels (`[batch, ...]`)
                from per-model labels (`[batch, B, ...]`) by their shape;
                True or False to say which.
            auto_scale_loss: as in Keras.
            models_per_pass: how many models one forward and backward pass
                of the training step computes; the step runs
                `ceil(B / models_per_pass)` passes one after the other and
                then one optimizer step, and every model trains exactly as
                in one pass (see `hftatf.passes`). None: all models in one
                pass. `"auto"`: one pass, except on a CPU in a step compiled
                with XLA or for an array without convolutions, where a pass
                holds as many models as fit their activations in the
                cache share of the cores it runs on (at most 4 MiB per
                core; at least one model): there arrays of large
                models train faster one model at a time
                (benchmarks/README.md). Evaluation and prediction always
                run in one pass.
        """
        models_per_pass = passes.check_models_per_pass(
            models_per_pass, self.num_models)
        _check_reduced(loss)
        optimizer = fused_optimizers.get(optimizer)
        if (auto_scale_loss and self.dtype_policy.name == "mixed_float16"
                and not isinstance(optimizer,
                                   keras.optimizers.LossScaleOptimizer)):
            # What stock compile does, with per-model scales: a stock
            # LossScaleOptimizer would skip every model when one overflows.
            optimizer = fused_optimizers.LossScaleOptimizer(
                optimizer, name="loss_scale_optimizer")
        optimizer.num_models = self.num_models
        super().compile(
            optimizer=optimizer, loss=loss, loss_weights=loss_weights,
            metrics=None, weighted_metrics=None, run_eagerly=run_eagerly,
            steps_per_execution=steps_per_execution, jit_compile=jit_compile,
            auto_scale_loss=auto_scale_loss)
        self._per_model_labels = per_model_labels
        self._user_loss = loss
        if (models_per_pass not in (None, "auto")
                and models_per_pass < self.num_models
                and self._weights_assigned_in_training()):
            layer = next(layer for layer in self._flatten_layers()
                         if getattr(layer, "assigns_weights_in_training",
                                    False))
            raise ValueError(
                f"Array '{self.name}' trains in one pass: its layer "
                f"'{layer.name}' ({type(layer).__name__}) assigns trainable "
                "weights in its forward pass, which passes of fewer models "
                "cannot carry. Received: "
                f"models_per_pass={models_per_pass!r}; use None or 'auto'.")
        self._models_per_pass = models_per_pass
        self._resolved_models_per_pass = None
        strategy = self._distribute_strategy
        self._replica_jit_compile = bool(
            strategy is not None and jit_compile in ("auto", True)
            and not run_eagerly
            and not isinstance(strategy, tf.distribute.TPUStrategy)
            and model_supports_jit(self))
        self._compiled_forward = None
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
        self._compile_config.config.update(
            metrics=metrics, weighted_metrics=weighted_metrics,
            per_model_labels=per_model_labels)
        if models_per_pass != "auto":
            # Only where set: subclasses with training steps of their own
            # (and compile signatures without it) reload their configs.
            self._compile_config.config["models_per_pass"] = models_per_pass

    def _symbolic_build(self, iterator=None, data_batch=None):
        super()._symbolic_build(iterator=iterator, data_batch=data_batch)
        # Under a strategy, state must exist before the step is traced (not
        # inside its conditionals): build the per-model losses and metrics
        # as Keras builds its own.
        unbuilt = [m for m in (self._model_metrics or []) + (
            self._model_losses or []) if not m.built]
        if not unbuilt or data_batch is None:
            return

        def symbolic(value):
            if value is None:
                return None
            return keras.KerasTensor(
                value.shape, keras.backend.standardize_dtype(value.dtype))

        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(
            keras.tree.map_structure(symbolic, data_batch))
        y_pred = backend.compute_output_spec(self, x, training=False)
        backend.compute_output_spec(
            self._build_model_state, x, y, y_pred, sample_weight)

    def _build_model_state(self, x, y, y_pred, sample_weight):
        losses = self.compute_model_losses(x, y, y_pred, sample_weight,
                                           training=False)
        if self._model_metrics is not None and y is not None:
            preds = self._model_predictions(y_pred)
            for index, metrics in enumerate(self._model_metrics):
                metrics.update_state(*self._model_targets(
                    y, y_pred, sample_weight, index, preds[index]))
        return losses

    def compile_from_config(self, config):
        config = keras.saving.deserialize_keras_object(config)
        self.compile(**config)
        if self.built and not self.optimizer.built:
            self.optimizer.build(self.trainable_variables)

    def _resolve_auto_jit_compile(self):
        if self._distribute_strategy:
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

    def _weights_assigned_in_training(self):
        """The trainable weights that a forward pass in training assigns
        (a spectral normalization's kernel), in no particular order."""
        return [variable for layer in self._flatten_layers()
                if getattr(layer, "assigns_weights_in_training", False)
                for variable in layer.trainable_weights]

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
            for layer in objects.all_layers(self._flatten_layers()))

    def _has_convolutions(self):
        layers = list(self._flatten_layers())
        return any(convolutional.is_convolution(layer) for layer in layers) or (
            any(per_model.is_stock_convolution(inner)
                for inner in per_model.layers_inside(layers)))

    # -- losses -------------------------------------------------------------

    def _is_per_model(self, label, prediction, loss=None):
        """Whether `label` is `[batch, B, ...]` (per model) rather than
        `[batch, ...]` (shared), judged against the array's prediction
        (and, where both would fit, the output's compiled `loss`)."""
        if self._per_model_labels is not None:
            return bool(self._per_model_labels)
        label_shape, pred_shape = tuple(label.shape), tuple(prediction.shape)
        if len(label_shape) == len(pred_shape):
            return True
        if len(label_shape) != len(pred_shape) - 1:
            return False
        # Class ids per model, `[batch, B, ...]` for predictions `[batch, B,
        # ..., classes]` (none for a `[batch]` label: one value per sample).
        per_model_sparse = len(label_shape) > 1 and label_shape[1] in (
            None, self.num_models) and _same_shape(
                label_shape[2:], pred_shape[2:-1])
        shared = _same_shape(label_shape[1:], pred_shape[2:]) or (
            _same_shape(label_shape[1:], (*pred_shape[2:-1], 1)))
        if per_model_sparse and shared and label_shape[1] is None:
            # An axis 1 of unknown size (a `tf.data` pipeline of sequences
            # of any length) is no sign of B models: the labels are read as
            # the stock model reads them.
            return False
        if per_model_sparse and shared:
            # E.g. shared one-hot or multi-hot labels of B classes, or
            # per-model class ids: the loss tells where it is one of Keras's
            # (only its sparse losses take class ids); for a loss of the
            # user's own, class ids are integers.
            takes_ids = _takes_class_ids(loss)
            if takes_ids is not None:
                return takes_ids
            return "int" in str(label.dtype)
        if not (per_model_sparse or shared):
            raise ValueError(
                f"Cannot match labels of shape {label_shape} to the array's "
                f"output of shape {pred_shape} ([batch, num_models, ...]). "
                "Give labels shared by all models as [batch, ...] (as for "
                "the stock model) or per model as [batch, num_models, ...]; "
                "for a loss that takes labels of another shape than its "
                "output's, say which with compile(per_model_labels=True or "
                "False).")
        return per_model_sparse

    def _output_losses(self, y_pred):
        """The compiled loss of each output, in `keras.tree.flatten(y_pred)`
        order (None where none was given)."""
        loss = getattr(self, "_user_loss", None)
        count = len(keras.tree.flatten(y_pred))
        if isinstance(loss, dict):
            if isinstance(y_pred, dict):
                names = sorted(y_pred)  # the order tree.flatten gives
            else:
                names = list(getattr(self, "output_names", None) or ())
            return [loss.get(name) for name in names] + [None] * (
                count - len(names))
        if isinstance(loss, (list, tuple)):
            return list(loss[:count]) + [None] * (count - len(loss))
        return [loss] * count

    def _is_per_model_weight(self, weight, prediction):
        """Whether a sample weight is `[batch, B, ...]` (per model) rather
        than shared (`[batch, ...]`, as for the stock model)."""
        if isinstance(weight.shape, tf.TensorShape) and (
                weight.shape.rank is None):
            # A step traced again for weights of another rank than before
            # (TensorFlow then relaxes their shape to an unknown rank).
            raise ValueError(
                "Cannot tell whether sample weights of unknown rank are "
                "shared by the models or per model: this array's step was "
                "traced for sample weights of another rank before. Give "
                "them one rank in every call, or compile the array again.")
        weight_shape, pred_shape = tuple(weight.shape), tuple(prediction.shape)
        if len(weight_shape) < 2 or weight_shape[1] not in (
                None, self.num_models):
            return False
        if weight_shape[1] is None and self._per_model_labels is None and (
                _fits_shared_weight(weight_shape, pred_shape)):
            # An axis 1 of unknown size (a `tf.data` pipeline of sequences
            # of any length) is no sign of B models: the weights are read
            # as the stock model reads them.
            return False
        if len(weight_shape) == len(pred_shape) - 1:
            return True  # [batch, B, *per-sample axes]
        if len(weight_shape) != 2:
            return False
        if len(pred_shape) < 3:
            return True  # [batch, B] for an output of one value per sample
        # [batch, B] (per model, one weight per sample) or [batch, T] (shared,
        # one weight per time step) for a sequence output.
        if pred_shape[2] != self.num_models:
            return True
        if self._per_model_labels is None:
            raise ValueError(
                f"Cannot tell whether sample weights of shape {weight_shape} "
                f"are per model ([batch, num_models]) or per time step "
                f"([batch, timesteps]) for an output of shape {pred_shape}. "
                "Pass per_model_labels=True or False to compile() to say.")
        return bool(self._per_model_labels)

    def _model_predictions(self, y_pred):
        """Each model's predictions (`y_pred[:, b]` of every output), from
        one `unstack` per output."""
        flat = keras.tree.flatten(y_pred)
        count = flat[0].shape[1]
        flat = [_model_slices(t, count) for t in flat]
        return [keras.tree.pack_sequence_as(y_pred, [s[b] for s in flat])
                for b in range(count)]

    def _aligned(self, structure, y_pred, flat_pred, losses=None):
        """`flat_pred` (and the outputs' `losses`) in the order of
        `keras.tree.flatten(structure)`: a dict of labels or sample weights
        by output name flattens in sorted-name order, the outputs of a
        list model in the model's order."""
        if isinstance(structure, dict) and not isinstance(y_pred, dict):
            names = list(getattr(self, "output_names", None) or ())
            if len(names) == len(flat_pred) and set(structure) <= set(names):
                order = [names.index(key) for key in sorted(structure)]
                return ([flat_pred[i] for i in order],
                        None if losses is None else [losses[i] for i in order])
        return flat_pred, losses

    def _model_targets(self, y, y_pred, sample_weight, index, pred,
                       training=False):
        """Model `index`'s predictions `pred` (its slice of `y_pred`), with
        its slice of the labels and sample weights (times its class weights
        while `fit` applies them)."""
        flat_pred = keras.tree.flatten(y_pred)
        labels = None
        if y is not None:
            flat_y = keras.tree.flatten(y)
            preds, losses = self._aligned(
                y, y_pred, flat_pred, self._output_losses(y_pred))
            pairs = (zip(flat_y, preds, losses)
                     if len(flat_y) == len(preds)
                     else ((t, None, None) for t in flat_y))
            # A None label (an output without a loss) stays None.
            per_model = [t is not None and (
                p is not None and self._is_per_model(t, p, loss)
                if self._per_model_labels is None
                else bool(self._per_model_labels))
                for t, p, loss in pairs]
            labels = keras.tree.pack_sequence_as(y, [
                t[:, index] if slice_it else t
                for t, slice_it in zip(flat_y, per_model)])
        if sample_weight is not None:
            flat_w = keras.tree.flatten(sample_weight)
            references, _ = self._aligned(sample_weight, y_pred, flat_pred)
            if len(flat_w) != len(references):
                references = [flat_pred[0]] * len(flat_w)
            sample_weight = keras.tree.pack_sequence_as(sample_weight, [
                None if w is None else w[:, index]
                if self._is_per_model_weight(w, p) else w
                for w, p in zip(flat_w, references)])
        if training and self._class_weight is not None and labels is not None:
            sample_weight = self._with_class_weights(labels, sample_weight)
        return labels, pred, sample_weight

    def _with_class_weights(self, labels, sample_weight):
        """Multiplies in the class weight of each sample's label, read as
        stock Keras reads it (class ids, or the argmax of one-hot rows)."""
        flat = keras.tree.flatten(labels)
        if len(flat) != 1:
            raise ValueError(
                "`class_weight` is only supported for arrays with a single "
                "output, as in Keras. Use sample weights per output instead.")
        ids = flat[0]
        if len(ids.shape) > 1:
            ids = (ops.squeeze(ids, -1) if ids.shape[-1] == 1
                   else ops.argmax(ids, axis=-1))
        ids = ops.cast(ops.round(ops.cast(ids, "float32")), "int32")
        table = ops.convert_to_tensor(self._class_weight, "float32")
        inside = (ids >= 0) & (ids < len(self._class_weight))
        weights = ops.where(inside, ops.take(
            table, ops.clip(ids, 0, len(self._class_weight) - 1)), 1.0)
        if sample_weight is not None:
            # `fit` refuses both keywords; sample weights may also come
            # inside the data (`(x, y, sample_weight)` from a dataset, a
            # generator or a PyDataset), which stock Keras refuses too.
            raise ValueError(
                "`class_weight` and sample weights cannot both be given, as "
                "in Keras: the data yields sample weights (x, y, "
                "sample_weight). Fold the class weights into them.")
        return weights

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
        losses = []
        preds = self._model_predictions(y_pred)
        for index, pred in zip(indices, preds):
            labels, pred, weights = self._model_targets(
                y, y_pred, sample_weight, index, pred, training=training)
            loss = None
            if self._model_losses is not None:
                # Inside a loop over passes, `index` is a tensor: the
                # models' compiled losses compute alike (they differ only
                # in the per-output trackers that such loops avoid).
                loss = self._model_losses[
                    index if isinstance(index, int) else 0](
                        labels, pred, weights)
            losses.append(ops.zeros(()) if loss is None else loss)
        losses = ops.stack(losses)
        count = len(preds)
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

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None,
                     training=True):
        """The array's objective: the sum of the per-model losses."""
        return ops.sum(self.compute_model_losses(
            x, y, y_pred, sample_weight, training=training))

    # -- steps --------------------------------------------------------------

    def make_train_function(self, force=False):
        """As Keras's, but the step (this class's `train_step`, or a
        subclass's) is traced with its random draws taking their keys
        straight from their seeds (`hftatf.seeds`)."""
        if self.train_function is not None and not force:
            return self.train_function
        self.train_function = self._make_function(self._train_step_keyed)
        return self.train_function

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
            state=state)
        return self._track(x, y, y_pred, sample_weight, losses, training=True)

    # -- building blocks of training steps -----------------------------------

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

    @property
    def models_per_pass(self):
        """Models per forward and backward pass of the training step: the
        `compile` setting, resolved (`"auto"` to a number) once a training
        step has been traced."""
        if self._resolved_models_per_pass is not None:
            return self._resolved_models_per_pass
        if self._models_per_pass is None:
            return self.num_models
        return self._models_per_pass

    def _models_per_pass_for(self, x):
        """The resolved `models_per_pass` (decided once per `compile`)."""
        if self._resolved_models_per_pass is None:
            setting = self._models_per_pass
            if setting is None:
                count = self.num_models
            elif setting != "auto":
                count = setting
            elif (self._distribute_strategy is not None
                  or runs_on_accelerator()
                  or self._weights_assigned_in_training()
                  # Convolutional arrays without XLA: passes measured no
                  # faster (benchmarks/README.md).
                  or (not self.jit_compile and self._has_convolutions())):
                count = self.num_models
            else:
                count = self._checked_auto_models_per_pass(
                    passes.auto_models_per_pass(
                        self, keras.tree.flatten(x)[0].shape[0]))
            self._resolved_models_per_pass = count
        return self._resolved_models_per_pass

    def _checked_auto_models_per_pass(self, count):
        """`count`, or all models if an array of `count` models cannot be
        built from this array's config (e.g. a subclass whose constructor
        takes more than its config holds): `"auto"` only speeds up."""
        if count >= self.num_models:
            return count
        try:
            for size in {stop - start for start, stop in passes.bounds(
                    self.num_models, count)}:
                self._pass_model(size)
        except (ValueError, TypeError, NotImplementedError) as error:
            logging.info(
                "Array '%s' trains in one pass: an array of %d of its models "
                "cannot be built for passes (%s).", self.name, count, error)
            return self.num_models
        return count

    def _pass_model(self, count):
        """The array of `count` models whose layers run a pass, and the
        role of each variable (`passes.variable_roles`)."""
        if count not in self._pass_models.models:
            # Built outside the traced step: it creates variables.
            with tf.init_scope():
                self._pass_models.models[count] = self._rebuilt(count)
        model = self._pass_models.models[count]
        for layer, twin in zip(self._flatten_layers(include_self=False),
                               model._flatten_layers(include_self=False)):
            twin.trainable = layer.trainable
        roles = (passes.variable_roles(self.trainable_variables,
                                       model.trainable_variables, count),
                 passes.variable_roles(self.non_trainable_variables,
                                       model.non_trainable_variables, count))
        return model, roles

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
            lambda *p: passes.concat_models(list(p)), *preds)
        return y_pred, ops.concatenate(losses, axis=0), gradients

    def _loops_passes(self):
        """Whether the step runs its passes of equal size as a loop
        (`passes.looped_passes`): where it is compiled with XLA, which then
        compiles one pass instead of each. Not for arrays of several
        outputs: a loop's passes share one compiled loss, so they cannot
        update each model's own per-output loss trackers."""
        return bool((self.jit_compile is True or self._replica_jit_compile)
                    and len(keras.tree.flatten(self.outputs)) == 1)

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
                      passes.take_models(t, start, count, axis=1)
                      for t, shared in zip(keras.tree.flatten(x),
                                           self._shared_inputs)]
        inputs = keras.tree.pack_sequence_as(x, inputs)
        weights = _pass_values(values, trainable_roles, start, count)
        state = _pass_values(carried, state_roles, start, count)
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
        logits = [getattr(t, "_keras_logits", None) is not None
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
            return ([passes.models_first(t) for t in flat]
                    + [passes.models_first(t._keras_logits)
                       for t, has in zip(flat, logits) if has]
                    + [passes.models_first(get_keras_mask(t))
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
        flat = [passes.batch_first(next(arrays))
                for _ in logits]  # one entry per output
        for t, has in zip(flat, logits):
            if has:
                keep_logits(t, passes.batch_first(next(arrays)))
        for t, has, mask in zip(flat, masked, first_masks):
            if has:
                set_keras_mask(t, passes.batch_first(next(arrays)))
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

    def model_state(self):
        """A snapshot of the per-model state the forward pass updates
        (moving statistics), for `apply_model_gradients` to give frozen and
        diverging models theirs back. Take it before the forward pass."""
        # Not the seed generators' states (shape [2], B's shape when B is
        # 2): random streams go on for frozen models too.
        seeds = {id(g.state) for layer in self._flatten_layers()
                 for g in getattr(layer, "_seed_generators", ())}
        variables = [v for v in self.non_trainable_variables
                     if len(v.shape) and v.shape[0] == self.num_models
                     and id(v) not in seeds]
        variables += self._weights_assigned_in_training()
        return variables, [ops.copy(v) for v in variables]

    def apply_model_gradients(self, updates, losses, state=None):
        """Applies one training step to the models that may take it.

        The step every `train_step` ends with, custom ones included (a
        GAN's applies two optimizers): a model is updated only while it is
        active (not frozen, not diverged) and its losses and gradients are
        finite; a model whose loss or gradient turns non-finite is frozen
        with its last finite weights (its moving statistics too, given the
        `state` from `model_state()`), and logged once. Under loss-scaling
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
        finite = _finite_per_model(checked, self.num_models)
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
        training = ops.logical_and(active, finite)
        for optimizer, gradients, variables in updates:
            if variables:
                optimizer.apply(gradients, variables, model_mask=training)
        if state is not None:
            for variable, before in zip(*state):
                variable.assign(ops.where(
                    broadcast_to_models(training, len(variable.shape)),
                    variable, before))
        self._status.update_state(
            ops.logical_and(active, ops.logical_not(finite)),
            self.optimizer.iterations)
        return training

    def fit(self, *args, class_weight=None, **kwargs):
        """As `keras.Model.fit`. `class_weight` weighs each model's samples
        by the class of that model's own label (shared or per model)."""
        if class_weight is not None and kwargs.get("sample_weight") is not None:
            raise ValueError(
                "`class_weight` and `sample_weight` cannot both be given, as "
                "in Keras: fold the class weights into the sample weights.")
        self._use_class_weight(class_weight)
        callbacks = progress.with_progress_bar(
            kwargs.pop("callbacks", None), kwargs.get("verbose", "auto"))
        _check_callbacks(callbacks)
        if isinstance(callbacks, keras.callbacks.CallbackList):
            callbacks.append(_DivergenceReport())
            callbacks.callbacks[:] = _backups_last(callbacks.callbacks)
        else:
            callbacks = _backups_last([*(callbacks or []),
                                       _DivergenceReport()])
        return super().fit(*args, callbacks=callbacks, **kwargs)

    def evaluate(self, *args, callbacks=None, **kwargs):
        """As `keras.Model.evaluate`, with the array's progress bar
        (`hftatf.progress`)."""
        callbacks = progress.with_progress_bar(
            callbacks, kwargs.get("verbose", "auto"))
        return super().evaluate(*args, callbacks=callbacks, **kwargs)

    def train_on_batch(self, x, y=None, sample_weight=None,
                       class_weight=None, return_dict=False):
        """As `keras.Model.train_on_batch`, with `class_weight` as in
        `fit` (read from each model's own labels)."""
        self._use_class_weight(class_weight)
        return super().train_on_batch(x, y, sample_weight=sample_weight,
                                      return_dict=return_dict)

    def _use_class_weight(self, class_weight):
        """Makes the training step weigh samples by `class_weight` (None
        for none), retracing it where that changes."""
        table = None
        if class_weight is not None:
            if not isinstance(class_weight, dict) or not all(
                    isinstance(k, int) and k >= 0 for k in class_weight):
                raise ValueError(
                    "`class_weight` must be a dict from class ids (integers "
                    ">= 0) to weights. Received: "
                    f"class_weight={class_weight!r}")
            table = [1.0] * (max(class_weight, default=-1) + 1)
            for class_id, weight in class_weight.items():
                table[class_id] = float(weight)
        if table != self._class_weight:
            # The weights are constants of the traced step: trace anew.
            self._class_weight = table
            self.train_function = None

    def test_step(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        y_pred = self(x, training=False)
        losses = self.compute_model_losses(
            x, y, y_pred, sample_weight, training=False)
        return self._track(x, y, y_pred, sample_weight, losses)

    def _track(self, x, y, y_pred, sample_weight, losses, training=False):
        batch_size = ops.shape(keras.tree.flatten(x)[0])[0]
        # A diverged model's loss is reported as NaN from then on.
        losses = ops.where(self._status.diverged > 0,
                           ops.full_like(losses, float("nan")), losses)
        self._model_loss_tracker.update_state(
            unscale_loss_for_distribution(losses), sample_weight=batch_size)
        if self._model_metrics is not None and y is not None:
            preds = self._model_predictions(y_pred)
            for index, metrics in enumerate(self._model_metrics):
                labels, pred, weights = self._model_targets(
                    y, y_pred, sample_weight, index, preds[index],
                    training=training)
                metrics.update_state(labels, pred, weights)
        return self.get_metrics_result()

    # -- metrics ------------------------------------------------------------

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
        for layer in self._flatten_layers(include_self=False):
            if not isinstance(layer, keras.Model):
                metrics.extend(layer.metrics)
        return metrics

    def get_metrics_result(self):
        """Logs: each per-model value as `name_b`, and their mean as `name`."""
        if self._model_loss_tracker is None:
            return super().get_metrics_result()
        per_model = {"loss": list(ops.unstack(
            self._model_loss_tracker.result()))}
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
                per_model[name][index] = tf.convert_to_tensor(value)
        _check_log_names(per_model, self.num_models)
        logs = {}
        # The array's mean leaves out diverged models, so one failure does
        # not turn every scalar log (and stock callbacks) into NaN.
        healthy = ops.cast(self._status.diverged <= 0, "float32")
        count = ops.sum(healthy)
        for name, values in per_model.items():
            # A metric may give a vector per model (F1Score per class).
            stacked = ops.cast(ops.stack(values), "float32")
            kept = ops.reshape(healthy, (-1, *[1] * (len(stacked.shape) - 1)))
            logs[name] = ops.where(count > 0, ops.sum(ops.where(
                kept > 0, stacked, 0.0), axis=0) / ops.maximum(count, 1.0),
                float("nan"))
            for index, value in enumerate(values):
                logs[f"{name}_{index}"] = value
        for metric in self._user_metrics():
            logs[metric.name] = metric.result()
        return logs

    def _flatten_metrics_in_order(self, logs):
        """`logs` as the list `evaluate` and `*_on_batch` return without
        `return_dict`: the list stock Keras returns (its order, each name
        once, though every model has its own copy of each compiled metric;
        then the other logs, sorted), then the per-model entries, sorted."""
        names = []
        for metric in self.metrics:
            for name in ([m.name for m in metric.metrics]
                         if isinstance(metric, CompileMetrics)
                         else [metric.name]):
                if name not in names:
                    names.append(name)
        per_model = {f"{name}_{b}" for name in logs
                     for b in range(self.num_models)} & set(logs)
        stock = [name for name in names if name in logs]
        stock += sorted(set(logs) - set(stock) - per_model)
        results = [logs[key] for key in stock + sorted(per_model)]
        return results[0] if len(results) == 1 else results

    def _user_metrics(self):
        """Metrics attached to the array by its user (Keras tracks the
        array's own per-model trackers there too; they are left out)."""
        own = {id(self._model_loss_tracker), id(self._status)}
        own.update(id(m) for m in self._model_metrics or ())
        own.update(id(m) for m in self._model_losses or ())
        return [m for m in self._metrics if id(m) not in own]

    # -- the array's models -------------------------------------------------

    @property
    def active_models(self):
        """`[B]` booleans: the models still being trained."""
        return ops.convert_to_numpy(self._status.active) > 0

    @property
    def diverged_models(self):
        """`[B]` booleans: the models frozen because they diverged (a
        non-finite loss or gradient)."""
        return ops.convert_to_numpy(self._status.diverged) > 0

    def freeze_models(self, indices):
        """Stops training the models `indices`: from the next step their
        weights, optimizer slots and step counts stay as they are."""
        self._set_active(indices, 0.0)

    def unfreeze_models(self, indices):
        """Resumes training the models `indices` (not diverged ones)."""
        indices = self._check_indices(indices)
        diverged = [i for i in indices if self.diverged_models[i]]
        if diverged:
            raise ValueError(
                f"Models {diverged} diverged; their weights hold no useful "
                "state to resume from. Restore weights first with "
                "set_model_weights, then unfreeze.")
        self._set_active(indices, 1.0)

    def _set_active(self, indices, value):
        indices = self._check_indices(indices)
        active = ops.convert_to_numpy(self._status.active).copy()
        active[indices] = value
        self._status.active.assign(active)

    def _check_indices(self, indices):
        # One index (a NumPy one too: `np.argmin(losses)`) or several.
        if np.ndim(indices) == 0:
            indices = [np.asarray(indices).item()]
        indices = list(indices)
        for index in indices:
            if isinstance(index, bool) or not isinstance(
                    index, (int, np.integer)) or not (
                    0 <= index < self.num_models):
                raise ValueError(
                    f"Model indices must be integers in [0, "
                    f"{self.num_models}). Received: {indices!r}.")
        return [int(i) for i in indices]

    def _rebuilt(self, count):
        """A new array of this architecture with `count` models (fresh
        weights)."""
        config = _with_num_models(self.get_config(), self.num_models, count)
        with self._stock_classes(config):
            return type(self).from_config(config)

    def select(self, indices):
        """Returns a smaller array holding only the models `indices`.

        Each kept model keeps everything that makes it what it is: weights
        (moving statistics included), and, if the array is compiled, its
        optimizer state (slots, step count, per-model hyper-parameters and
        schedules) and whether it is frozen or diverged. Training the new
        array continues each kept model exactly as the old array would have,
        so a tuner can drop losers without retraining the winners.

        Args:
            indices: the models to keep, in the new array's order.
        """
        indices = self._check_indices(indices)
        if not indices:
            raise ValueError("select() needs at least one model index.")
        count = len(indices)
        array = self._rebuilt(count)
        old_weights, new_weights = self.weights, array.weights
        if len(old_weights) != len(new_weights):
            raise ValueError(
                f"Cannot select from array '{self.name}': rebuilding it gave "
                f"{len(new_weights)} weights instead of {len(old_weights)}.")
        B = self.num_models
        _copy_model_slices(old_weights, new_weights, indices, B)
        _copy_model_slices(
            [self._status.active, self._status.diverged,
             self._status.diverged_at],
            [array._status.active, array._status.diverged,
             array._status.diverged_at], indices, B)
        if self.compiled and self.optimizer is not None:
            optimizer = fused_optimizers.select(self.optimizer, indices)
            compile_config = dict(self._compile_config.config)
            compile_config["optimizer"] = optimizer
            passes_of = compile_config.get("models_per_pass")
            if isinstance(passes_of, int):
                # A pass holds at most the models the array keeps.
                compile_config["models_per_pass"] = min(passes_of,
                                                        len(indices))
            array.compile(**compile_config)
            if self.optimizer.built:
                optimizer.build(array.trainable_variables)
                _copy_model_slices(self.optimizer.variables,
                                   optimizer.variables, indices, B)
        return array

    def summary(self, *args, fused=False, **kwargs):
        """Prints the layers of the model this array was fused from, with
        one model's shapes and parameter count, and the number of models
        (`hftatf.summary`); `fused=True`: the array's own fused layers,
        `[B, ...]` weights and `[batch, B, ...]` shapes, as
        `keras.Model.summary` prints them. Other arguments are those of
        `keras.Model.summary`."""
        if fused:
            return super().summary(*args, **kwargs)
        return array_summary.print_summary(self, *args, **kwargs)

    @property
    def compiles_with_xla(self):
        """Whether training runs compiled by XLA: the whole step
        (`jit_compile`), or under a strategy each replica's forward and
        backward pass."""
        return bool(self.jit_compile is True or self._replica_jit_compile)

    def rank_models(self, monitor="val_loss", mode="auto", history=None):
        """The models best first by `monitor` in the last `fit`'s history
        (or `history`): `[(model index, value), ...]`, as the launcher's
        table ranks them; see `hftatf.report.rank_models`."""
        return report.rank_models(self, monitor, mode, history)

    def get_model_weights(self, index):
        """Model `index`'s slice of every weight, in `self.weights` order."""
        (index,) = self._check_indices(index)
        return [ops.convert_to_numpy(w)[index] for w in self.weights]

    def set_model_weights(self, index, weights):
        """Sets model `index`'s slice of every weight (as returned by
        `get_model_weights`); the other models are left untouched."""
        (index,) = self._check_indices(index)
        if len(weights) != len(self.weights):
            raise ValueError(
                f"The array holds {len(self.weights)} weights; received "
                f"{len(weights)}.")
        for variable, value in zip(self.weights, weights):
            stacked = ops.convert_to_numpy(variable).copy()
            if tuple(np.shape(value)) != stacked.shape[1:]:
                raise ValueError(
                    f"Weight '{variable.path}' has per-model shape "
                    f"{stacked.shape[1:]}; received {np.shape(value)}.")
            stacked[index] = value
            variable.assign(stacked)

    def unfuse(self, compile=True):
        """Returns the B models as plain Keras models with their weights,
        compiled as they train in the array (optimizer state included);
        see `hftatf.fuse.unfuse`."""
        return hooks.call("unfuse", self, compile=compile)

    def export_models(self, directory, history=None,
                      format=("keras", "saved_model", "checkpoint")):
        """Writes each model as `.keras`, SavedModel, checkpoint and
        metadata; see `hftatf.export.export_models`."""
        return hooks.call("export_models", self, directory, history=history,
                          format=format)

    @classmethod
    def from_exported(cls, directory, **fuse_kwargs):
        """The array written by `export_models`, to resume tuning or to
        serve; see `hftatf.export.from_exported`."""
        return hooks.call("from_exported", directory, model_class=cls,
                          **fuse_kwargs)

    # -- serialization ------------------------------------------------------

    def get_config(self):
        if self._source_json is None:
            config = super().get_config()
        else:
            config = {"name": self.name, "trainable": self.trainable,
                      "source": self.source_config}
            # Flags set since fusing are not in the source's config.
            config["trainable_flags"] = trainable_flags(self)
        config.update(num_models=self.num_models,
                      shared_inputs=list(self._shared_inputs))
        if self._source_json is not None and self._layout != "auto":
            config["layout"] = self._layout
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        num_models = config.pop("num_models")
        shared_inputs = config.pop("shared_inputs", True)
        source = config.pop("source", None)
        layout = config.pop("layout", "auto")
        # `inner_trainable`: the flags inside layers run per model, as
        # files saved before `trainable_flags` hold them.
        flags = config.pop("trainable_flags", None) or config.pop(
            "inner_trainable", {})
        if source is not None:
            from hftatf.fuse import fuse

            stock = keras.saving.deserialize_keras_object(
                source, custom_objects=custom_objects)
            set_trainable_flags(stock, flags)
            array = fuse(stock, num_models, shared_inputs=shared_inputs,
                         name=config.get("name"), model_class=cls,
                         layout=layout)
            array.trainable = config.get("trainable", True)
            return array
        graph = keras.Model.from_config(config, custom_objects=custom_objects)
        return cls(graph.inputs, graph.outputs, num_models=num_models,
                   shared_inputs=shared_inputs, name=graph.name)
