"""Which labels and sample weights each model of an array trains on.

Labels and sample weights are either shared by the models (`[batch, ...]`,
as for the stock model) or given per model (`[batch, B, ...]`). They are
told apart by their shapes against the array's outputs (and, where both
would fit, by the compiled loss), or as `compile(per_model_labels=...)`
says. Model `b` then gets its slice (`y[:, b]`) or the whole.
"""

import keras
from keras import ops

from hftatf.core.axis import split_models


def same_shape(a, b):
    """Whether shapes `a` and `b` agree, an unknown size agreeing with any."""
    return len(a) == len(b) and all(
        x is None or y is None or x == y for x, y in zip(a, b))


def fits_shared_weight(weight_shape, pred_shape, reduces_last_axis=None):
    """Whether sample weights of `weight_shape` fit the stock model's
    output, the array's `pred_shape` without its model axis, as its loss
    weighs its values: one weight per sample, or per sample and time step
    (`[batch, T]` or `[batch, T, 1]` for `[batch, T, ...]`). Keras's own
    losses (`reduces_last_axis` True) give one value per sample and time
    step, so no weight may run along the output's last axis; a loss of
    the user's own (None) may give one per output value."""
    stock = pred_shape[:1] + pred_shape[2:]
    values = [stock] if len(stock) < 2 else (
        [stock[:-1]] if reduces_last_axis else [stock[:-1], stock])
    rank = len(weight_shape)
    return any(
        1 <= rank <= len(v) and same_shape(weight_shape[1:], v[1:rank])
        or (rank == len(v) + 1 and weight_shape[-1] == 1
            and same_shape(weight_shape[1:-1], v[1:]))
        for v in values)


def takes_class_ids(loss):
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


def class_weight_table(class_weight):
    """`class_weight` (a dict from class ids to weights, or None) as a list
    indexed by class id (1.0 for ids it leaves out), or None."""
    if class_weight is None:
        return None
    if not isinstance(class_weight, dict) or not all(
            isinstance(k, int) and k >= 0 for k in class_weight):
        raise ValueError(
            "`class_weight` must be a dict from class ids (integers >= 0) "
            f"to weights. Received: class_weight={class_weight!r}")
    table = [1.0] * (max(class_weight, default=-1) + 1)
    for class_id, weight in class_weight.items():
        table[class_id] = float(weight)
    return table


class LabelRouting:
    """Mixin of `FusedModel`: each model's slice of the labels, sample
    weights and class weights.

    Reads `num_models`, `_per_model_labels` (the `compile` argument),
    `_user_loss` (the compiled loss), `_class_weight` (the table `fit`
    applies).
    """

    def _is_per_model(self, label, prediction, loss=None):
        """Whether `label` is `[batch, B, ...]` (per model) rather than
        `[batch, ...]` (shared), judged against the array's prediction
        (and, where both would fit, the output's compiled `loss`). Labels
        that fit neither for this B are refused, naming the shapes that
        would."""
        if self._per_model_labels is not None:
            label_shape = (None, None) if getattr(
                label.shape, "rank", 0) is None else tuple(label.shape)
            if self._per_model_labels and (len(label_shape) < 2 or (
                    label_shape[1] not in (None, self.num_models))):
                raise ValueError(
                    "This array is compiled with per_model_labels=True, "
                    f"so its labels need a model axis of {self.num_models} "
                    f"(`[batch, {self.num_models}, ...]`, one label per "
                    f"model). Received labels of shape {label_shape}. Give "
                    "each model its labels, or compile with "
                    "per_model_labels=False (or None) for labels shared by "
                    "all models.")
            return bool(self._per_model_labels)
        label_shape, pred_shape = tuple(label.shape), tuple(prediction.shape)
        takes_ids = takes_class_ids(loss)
        if len(label_shape) == len(pred_shape):
            self._check_per_model_label(label_shape, pred_shape, takes_ids)
            return True
        if len(label_shape) != len(pred_shape) - 1:
            if takes_ids is not None and len(label_shape) > len(pred_shape):
                raise self._label_shape_error(label_shape, pred_shape,
                                              takes_ids)
            return False
        # Class ids per model, `[batch, B, ...]` for predictions `[batch, B,
        # ..., classes]` (none for a `[batch]` label: one value per sample).
        per_model_sparse = len(label_shape) > 1 and label_shape[1] in (
            None, self.num_models) and same_shape(
                label_shape[2:], pred_shape[2:-1])
        shared_ids = same_shape(label_shape[1:], (*pred_shape[2:-1], 1))
        # Keras's sparse losses take class ids only.
        shared = shared_ids or (not takes_ids and same_shape(
            label_shape[1:], pred_shape[2:]))
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
            if takes_ids is not None:
                return takes_ids
            return "int" in str(label.dtype)
        if not (per_model_sparse or shared):
            raise self._label_shape_error(label_shape, pred_shape, takes_ids)
        return per_model_sparse

    def _check_per_model_label(self, label_shape, pred_shape, takes_ids):
        """Refuses per-model labels (`[batch, B, ...]`, of the rank of the
        array's output) whose model axis is not B, or, for a loss of
        Keras's, whose other axes do not fit its output's."""
        B = self.num_models
        rest, pred_rest = label_shape[2:], pred_shape[2:]
        if takes_ids:
            # Class ids with a trailing axis of 1, as Keras takes them.
            pred_rest = (*pred_shape[2:-1], 1)
        fits = label_shape[1] in (None, B) and (
            takes_ids is None or len(rest) == len(pred_rest) and all(
                a is None or b is None or a == b or a == 1
                for a, b in zip(rest, pred_rest)))
        if not fits:
            raise self._label_shape_error(label_shape, pred_shape, takes_ids)

    def _label_shape_error(self, label_shape, pred_shape, takes_ids):
        """The error for labels of `label_shape` that fit the array's
        output of `pred_shape` neither shared nor per model."""
        B = self.num_models
        if takes_ids:
            per_sample = pred_shape[2:-1]
            kind = "class ids (its loss is one of Keras's sparse losses)"
        else:
            per_sample = pred_shape[2:]
            kind = ("one label per output value" if takes_ids is False
                    else "labels")
        axes = ", ".join(str(d) for d in per_sample)
        shared = f"(batch{', ' if axes else ''}{axes})"
        per_model = f"(batch, {B}{', ' if axes else ''}{axes})"
        return ValueError(
            f"Cannot match labels of shape {label_shape} to the array's "
            f"output of shape {pred_shape} ([batch, num_models={B}, ...]). "
            f"This output takes {kind}: give labels shared by all {B} "
            f"models as {shared} (as for the stock model) or per model as "
            f"{per_model}. Check that the labels hold one column per model "
            "of this array and the classes of its output; for a loss that "
            "takes labels of another shape than its output's, say which "
            "with compile(per_model_labels=True or False).")

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

    def _is_per_model_weight(self, weight, prediction, loss=None):
        """Whether a sample weight is `[batch, B, ...]` (per model: model
        `b`'s `weight[:, b]` fits the stock output as a stock weight does)
        rather than shared (`[batch, ...]`, as for the stock model), judged
        against the array's prediction and the output's compiled `loss`."""
        if getattr(weight.shape, "rank", 0) is None:
            # A step traced again for weights of another rank than before
            # (TensorFlow then relaxes their shape to an unknown rank).
            raise ValueError(
                "Cannot tell whether sample weights of unknown rank are "
                "shared by the models or per model: this array's step was "
                "traced for sample weights of another rank before. Give "
                "them one rank in every call, or compile the array again.")
        weight_shape, pred_shape = tuple(weight.shape), tuple(prediction.shape)
        reduces = takes_class_ids(loss) is not None  # one of Keras's losses
        shared = fits_shared_weight(weight_shape, pred_shape, reduces)
        per_model = len(weight_shape) >= 2 and weight_shape[1] in (
            None, self.num_models) and fits_shared_weight(
                weight_shape[:1] + weight_shape[2:], pred_shape, reduces)
        if per_model != shared:
            return per_model
        if not shared:
            raise self._weight_shape_error(weight_shape, pred_shape)
        if weight_shape[1] is None and self._per_model_labels is None:
            # An axis 1 of unknown size (a `tf.data` pipeline of sequences
            # of any length) is no sign of B models: the weights are read
            # as the stock model reads them.
            return False
        if self.num_models == 1:
            return True  # Both readings give the one model the same weights.
        if self._per_model_labels is None:
            raise ValueError(
                f"Cannot tell whether sample weights of shape {weight_shape} "
                f"are per model ([batch, num_models, ...]) or shared, e.g. "
                f"per time step ([batch, timesteps]), for an output of shape "
                f"{pred_shape}. Pass per_model_labels=True or False to "
                "compile() to say.")
        return bool(self._per_model_labels)

    def _weight_shape_error(self, weight_shape, pred_shape):
        """The error for sample weights of `weight_shape` that fit the
        array's output of `pred_shape` neither shared nor per model."""
        B = self.num_models
        steps = "".join(f", {d}" for d in pred_shape[2:-1])
        return ValueError(
            f"Cannot match sample weights of shape {weight_shape} to the "
            f"array's output of shape {pred_shape} ([batch, num_models={B}, "
            f"...]). Give one weight per sample, shared by all {B} models, "
            f"as (batch{steps}) (as for the stock model), or one per sample "
            f"and model as (batch, {B}{steps}). Check that the weights hold "
            "one column per model of this array.")

    def _model_predictions(self, y_pred):
        """Each model's predictions (`y_pred[:, b]` of every output), from
        one `split_models` per output."""
        flat = keras.tree.flatten(y_pred)
        count = flat[0].shape[1]
        flat = [split_models(t, count) for t in flat]
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

    def _labels_per_model(self, y, y_pred):
        """For each of `keras.tree.flatten(y)`: whether it is per model
        (False for a None label: an output without a loss)."""
        flat_y = keras.tree.flatten(y)
        preds, losses = self._aligned(
            y, y_pred, keras.tree.flatten(y_pred), self._output_losses(y_pred))
        if len(flat_y) != len(preds):
            preds = losses = [None] * len(flat_y)
        return [t is not None and (
            self._is_per_model(t, p, loss) if p is not None
            else bool(self._per_model_labels))
            for t, p, loss in zip(flat_y, preds, losses)]

    def _weights_per_model(self, sample_weight, y_pred):
        """For each of `keras.tree.flatten(sample_weight)`: whether it is
        per model (False for None)."""
        flat_pred = keras.tree.flatten(y_pred)
        flat_w = keras.tree.flatten(sample_weight)
        references, losses = self._aligned(
            sample_weight, y_pred, flat_pred, self._output_losses(y_pred))
        if len(flat_w) != len(references):
            references = [flat_pred[0]] * len(flat_w)
            losses = [None] * len(flat_w)
        return [w is not None and self._is_per_model_weight(w, p, loss)
                for w, p, loss in zip(flat_w, references, losses)]

    def _class_ids_outside(self, y, y_pred):
        """A scalar boolean: whether a label of an output whose loss is
        one of Keras's sparse losses holds a class id outside `[0,
        classes)` (NaN included; the loss's `ignore_class` left out),
        which stock Keras refuses (TensorFlow's kernel raises; XLA's
        returns NaN)."""
        outside = ops.zeros((), "bool")
        if y is None:
            return outside
        flat_y = keras.tree.flatten(y)
        preds, losses = self._aligned(
            y, y_pred, keras.tree.flatten(y_pred), self._output_losses(y_pred))
        if len(flat_y) != len(preds):
            return outside
        for label, pred, loss in zip(flat_y, preds, losses):
            classes = pred.shape[-1]
            if label is None or classes is None or not takes_class_ids(loss):
                continue
            ids = ops.convert_to_tensor(label)
            bad = ops.logical_or(ids < 0, ids >= classes)
            if keras.backend.is_float_dtype(ids.dtype):
                bad = ops.logical_or(bad, ops.isnan(ids))
            ignored = getattr(loss, "ignore_class", None)
            if ignored is not None:
                bad = ops.logical_and(bad, ops.not_equal(ids, ignored))
            outside = ops.logical_or(outside, ops.any(bad))
        return outside

    def _model_targets(self, y, y_pred, sample_weight, index, pred,
                       training=False):
        """Model `index`'s predictions `pred` (its slice of `y_pred`), with
        its slice of the labels and sample weights (times its class weights
        while `fit` applies them)."""
        labels = None
        if y is not None:
            labels = keras.tree.pack_sequence_as(y, [
                t[:, index] if slice_it else t for t, slice_it in zip(
                    keras.tree.flatten(y), self._labels_per_model(y, y_pred))])
        if sample_weight is not None:
            sample_weight = keras.tree.pack_sequence_as(sample_weight, [
                w[:, index] if slice_it else w for w, slice_it in zip(
                    keras.tree.flatten(sample_weight),
                    self._weights_per_model(sample_weight, y_pred))])
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

    def _use_class_weight(self, class_weight):
        """Makes the training step weigh samples by `class_weight` (None
        for none), retracing it where that changes."""
        table = class_weight_table(class_weight)
        if table != self._class_weight:
            # The weights are constants of the traced step: trace anew.
            self._class_weight = table
            self.train_function = None
