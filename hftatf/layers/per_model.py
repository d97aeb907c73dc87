"""Any layer, run once per model on that model's inputs and weights.

Most stock layers have a fused form that computes all B models in one op.
Every other layer (a layer of your own made of stock layers and `keras.ops`,
a subclass of a stock layer, a subclassed model used as a layer, a stock
layer that treats a batch as a whole) still fuses: `FusedPerModel` holds its
weights with the model axis, `[B, *stock shape]`, and runs the layer B
times in the array's step, model `b` on `x[:, b]` with the weights `w[b]`,
through Keras's stateless call (`keras.StatelessScope`). That is exactly
what B copies of the layer compute, whatever the layer's `call` does, at the
speed of B separate calls inside one compiled step rather than that of one
fused op.
"""

import warnings

import keras
import numpy as np
import tensorflow as tf
from keras import ops
from keras.src.backend import get_keras_mask, set_keras_mask
from tensorflow.python.trackable.resource import CapturableResource

from hftatf.api import hftatf_export
from hftatf.layers import registry
from hftatf.layers.base import FusedLayer, Modelwise, model_pieces, stack_models
from hftatf.validation import check_model_axis

# Stock layers without weights that treat a batch as a whole: they mix its
# samples (`MixUp`, `CutMix`), draw one transformation for all of them
# (`RandAugment`'s operations, `AugMix`'s chain, `RandomGaussianBlur`'s
# sigma, `RandomElasticTransform`'s distortion), or take statistics over it
# (`Equalization`'s histograms); and `Pipeline`, which may hold such layers.
PER_BATCH_LAYERS = tuple(getattr(keras.layers, name) for name in (
    "MixUp", "CutMix", "RandAugment", "AugMix", "RandomGaussianBlur",
    "RandomElasticTransform", "Equalization", "Pipeline",
))

# Stock layers that keep state outside Keras variables, which a copy per
# model would not have: lookup tables (whose vocabulary `adapt` fills),
# and layers that wrap another framework's module or a SavedModel.
_STATE_OUTSIDE_VARIABLES = tuple(
    getattr(keras.layers, name) for name in (
        "StringLookup", "IntegerLookup", "TextVectorization",
        "HashedCrossing", "TFSMLayer", "JaxLayer", "FlaxLayer",
        "TorchModuleWrapper")
    if hasattr(keras.layers, name))

# Marks where a tensor argument of the stock call sits in `stock_arguments`.
_TENSOR = "__hftatf_tensor__"

_warned = set()


def refusal(layer):
    """Why `FusedPerModel` cannot run `layer` once per model, or None."""
    if isinstance(layer, keras.layers.InputLayer):
        return "an input layer is no computation to fuse."
    if isinstance(layer, _STATE_OUTSIDE_VARIABLES):
        return (
            "it keeps state outside Keras variables (a lookup table or "
            "another framework's module), which a copy of the layer per "
            "model would not hold. Apply it to the data before the array "
            "(in tf.data, or in a model of its own in front of the array).")
    return None


def _outside_state(layer):
    """A TensorFlow variable or resource that `layer` (or a layer inside
    it) holds outside Keras variables, or None."""
    for inner in layer._flatten_layers(include_self=True):
        for name, value in vars(inner).items():
            if isinstance(value, (tf.Variable, CapturableResource)):
                return f"'{inner.name}.{name}' ({type(value).__name__})"
    return None


def classes_inside(layers):
    """`{name: class}` of the layers run per model among `layers` and of
    every layer inside them: what deserializing their configs needs where
    the classes are not registered with Keras (a layer class of a script's
    own)."""
    classes = {}
    for layer in layers:
        if isinstance(layer, FusedPerModel):
            for inner in layer.layer._flatten_layers(include_self=True):
                classes[type(inner).__name__] = type(inner)
    return classes


def copy_layer(layer):
    """A new, unbuilt copy of `layer` from its config."""
    try:
        with keras.saving.CustomObjectScope({
                type(inner).__name__: type(inner)
                for inner in layer._flatten_layers(include_self=True)}):
            return type(layer).from_config(layer.get_config())
    except (NotImplementedError, TypeError, ValueError) as error:
        raise ValueError(
            f"hftatf runs layer '{layer.name}' ({type(layer).__name__}) once "
            "per model, from copies of it made from its config, and could "
            f"not copy it: {error}. Give the layer a `get_config` that "
            "returns its constructor's arguments (and a `from_config`, "
            "where they need deserializing).") from None


def split_arguments(args, kwargs):
    """The tensors (and NumPy arrays) of a call's `args` and `kwargs`, in
    order, and the call's arguments with each replaced by a mark of its
    index."""
    tensors = []

    def mark(value):
        if ops.is_tensor(value) or isinstance(value, (keras.KerasTensor,
                                                      np.ndarray)):
            tensors.append(value)
            return {_TENSOR: len(tensors) - 1}
        return value

    arguments = {"args": keras.tree.map_structure(mark, list(args)),
                 "kwargs": keras.tree.map_structure(mark, dict(kwargs))}
    return tensors, arguments


def _is_mark(value):
    return isinstance(value, dict) and set(value) == {_TENSOR}


def filled_arguments(arguments, tensors):
    """`(args, kwargs)` of a call, from its `arguments` with marks
    (`split_arguments`) and the `tensors` that go in their places."""
    def fill(value):
        if _is_mark(value):
            return tensors[int(value[_TENSOR])]
        if isinstance(value, dict):
            return {key: fill(item) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(fill(item) for item in value)
        return value

    return list(fill(arguments["args"])), fill(arguments["kwargs"])


@hftatf_export
@registry.register(*PER_BATCH_LAYERS)
class FusedPerModel(FusedLayer):
    """Runs a layer once per model, on that model's inputs and weights.

    The fused form of every layer without one of its own: a layer you wrote
    (say a Transformer block of stock layers and `keras.ops`), a subclass
    of a stock layer, a subclassed model inside a functional one, an `RNN`
    of a cell of your own, and the stock layers that treat a batch as a
    whole (`MixUp`, `RandAugment`, ...: folded over the models they would
    mix one model's samples with another's, or give all models one draw).
    `hftatf.fuse` picks it for them by itself, with a warning for layers of
    your own: each model computes exactly what its stock twin computes, but
    in B calls of the layer per step, not one fused op.

    State and the model axis:
    * weights: `[B, *shape]` for each weight of the layer, in the order of
      its `get_weights()`, each model's from a copy of the layer built on
      its own (so initialised as B separate jobs would be); regularizers
      and constraints per model; moving statistics and other weights the
      layer assigns are updated per model;
    * random state (the seed generators of the layer and of the layers
      inside it): one stream, carried from model to model (model `b` draws
      the numbers after model `b - 1`'s), so the models draw independently,
      and alike whether the array computes in one pass or in several;
    * losses the layer adds (`add_loss`, activity regularizers of the
      layers inside it): a `[B]` loss, entry `b` model `b`'s;
    * masks: model `b`'s slice of each input's mask reaches the layer as
      it would reach the stock layer, and the masks it gives its outputs
      are stacked.

    A layer that keeps state outside Keras variables (a `tf.Variable` or
    lookup table of its own) is refused: a copy per model would not hold it.

    Layout: every tensor argument `[batch, B, ...]` (`[B, batch, ...]` with
    `models_first`), or, with `shared_input`, the stock shapes, every model
    calling the layer on the same tensors; outputs with the model axis.

    Args:
        layer: the stock layer (unbuilt, or built: its copies are made
            from its config).
        num_models: the number of models `B`.
        shared_input: whether the tensor arguments are shared by all models
            (no model axis).
        models_first: whether activations have the models first.
        **kwargs: the stock `keras.layers.Layer` arguments.
    """

    supports_models_first = True

    def __init__(self, layer, num_models, shared_input=False,
                 models_first=False, **kwargs):
        kwargs.setdefault("dtype", layer.dtype_policy)
        super().__init__(num_models, models_first=models_first, **kwargs)
        problem = refusal(layer)
        if problem:
            raise ValueError(
                f"hftatf cannot fuse layer '{layer.name}' of class "
                f"{type(layer).__module__}.{type(layer).__name__}: "
                f"{problem}")
        self.shared_input = bool(shared_input)
        # The layer whose call every model runs, with its variables mapped
        # to the model's slices. Held out of Keras's tracking: its own
        # variables are no state of the array.
        self._holder = _Holder(layer)
        self.supports_masking = True
        self._stacked = []  # [B, ...] variable per weight of the layer
        self._seeds = []  # seed generator per random state of the layer

    @property
    def layer(self):
        """The layer each model runs (its variables are not the array's:
        each call maps them to the model's slices)."""
        return self._holder.layer

    @classmethod
    def from_stock(cls, layer, num_models, shared_input=False,
                   models_first=False):
        if type(layer) not in PER_BATCH_LAYERS and (
                type(layer) not in _warned):
            _warned.add(type(layer))
            name = type(layer).__name__
            hint = ""
            if layer.built and not layer.weights:
                hint = (" A layer without weights that computes each sample "
                        "on its own fuses into one op by folding the models "
                        "into the batch: hftatf.layers.registry.register("
                        f"{name})(hftatf.layers.FusedFold).")
            refused = registry.refusal_of_registered_form(layer)
            reason = (f"its fused form does not take it ({refused})"
                      if refused else "hftatf has no fused form for it")
            warnings.warn(
                f"Layer '{layer.name}' ({name}): {reason}, so"
                " the array runs it once per model (each model computes "
                "exactly what the layer computes, in B calls per step "
                "instead of one fused op). Register a fused form with "
                f"hftatf.layers.registry.register where speed matters.{hint}",
                stacklevel=3)
        return cls(copy_layer(layer), num_models, shared_input=shared_input,
                   models_first=models_first, name=layer.name,
                   trainable=layer.trainable)

    @classmethod
    def fuses_shared_input(cls, layer):
        # Every model calls the layer on the shared tensors themselves.
        del layer
        return True

    # -- calls --------------------------------------------------------------

    def __call__(self, *args, **kwargs):
        """Calls the layer as the stock layer is called (any arguments):
        the tensors go to `call` as one list, the other arguments as they
        are (`stock_arguments`)."""
        if "stock_arguments" not in kwargs:
            kwargs = dict(kwargs)
            # `training` is this wrapper's: a functional model sets it at
            # each call (Keras records the value a layer was built with),
            # and the wrapper hands it on. A mask of None is no argument
            # (Keras records that too).
            own = ({"training": kwargs.pop("training")}
                   if "training" in kwargs else {})
            if "mask" in kwargs and kwargs["mask"] is None:
                del kwargs["mask"]
            tensors, arguments = split_arguments(args, kwargs)
            args, kwargs = (tensors,), {"stock_arguments": arguments, **own}
        if not self.built:
            self._pending = ([self._model_spec(t) for t in args[0]],
                             kwargs["stock_arguments"])
        return super().__call__(*args, **kwargs)

    def _model_spec(self, tensor):
        """The symbolic tensor one model's call gets for `tensor`."""
        shape = list(tensor.shape)
        if not self.shared_input:
            check_model_axis(self.name, self.num_models, tuple(shape),
                             self.model_axis)
            del shape[self.model_axis]
        return keras.KerasTensor(shape, dtype=tensor.dtype)

    def build(self, input_shape):
        """Builds one copy of the layer per model on its inputs (their
        shapes and dtypes, from the first call) and stacks their weights."""
        del input_shape
        specs, arguments = self._pending
        del self._pending
        args, kwargs = filled_arguments(arguments, specs)
        copies = [self.layer] + [copy_layer(self.layer)
                                 for _ in range(self.num_models - 1)]
        with tf.init_scope():
            for copy in copies:
                if not copy.built or copy is not self.layer:
                    copy(*args, **kwargs)
            template = self.layer
            outside = _outside_state(template)
            if outside:
                raise ValueError(
                    f"hftatf cannot fuse layer '{template.name}' "
                    f"({type(template).__name__}) per model: it holds "
                    f"{outside} outside Keras variables, which would be one "
                    "state for all models. Create its state with "
                    "`add_weight`.")
            for index, weight in enumerate(template.weights):
                self._stacked.append(self._stack_weight(
                    weight, [copy.weights[index] for copy in copies]))
            for state in _random_states(template):
                generator = keras.random.SeedGenerator(
                    0, name="seed_generator")
                generator.state.assign(state)
                self._seeds.append(generator)
        self.built = True

    def _stack_weight(self, weight, copies):
        """The `[B, ...]` variable of the layer's `weight`, holding the
        values of its `copies` (one per model)."""
        stacked = np.stack([c.numpy() for c in copies])
        regularizer = getattr(weight, "regularizer", None)
        constraint = getattr(weight, "constraint", None)
        return self.add_weight(
            shape=(self.num_models, *weight.shape), name=weight.name,
            initializer=lambda shape, dtype: ops.cast(stacked, dtype),
            regularizer=(None if regularizer is None
                         else Modelwise(regularizer, self.num_models)),
            constraint=(None if constraint is None
                        else Modelwise(constraint, self.num_models)),
            trainable=weight.trainable, dtype=weight.dtype, autocast=False)

    @property
    def weights(self):
        # In the layer's order (`get_weights()`: each inner layer's
        # trainable weights, then its others, inner layer by inner layer),
        # where Keras's own order would put every trainable weight first.
        return list(self._stacked)

    def call(self, inputs, stock_arguments=None, training=None):
        layer = self.layer
        if layer.trainable != self.trainable:
            # A frozen layer computes as frozen (a batch normalization
            # inside it in inference mode), as its stock twin would.
            layer.trainable = self.trainable
        axis = self.model_axis
        pieces = [self._pieces(tensor) for tensor in inputs]
        weights = layer.weights
        values = [v.value for v in self._stacked]
        states = _random_states(layer)
        carried = [g.state.value for g in self._seeds]
        outputs, losses, updates = [], [], []
        for b in range(self.num_models):
            args, kwargs = filled_arguments(stock_arguments,
                                            [p[b] for p in pieces])
            if training is not None and layer._call_has_training_arg:
                kwargs["training"] = training
            mapping = ([(w, v[b]) for w, v in zip(weights, values)]
                       + list(zip(states, carried)))
            with keras.StatelessScope(state_mapping=mapping,
                                      collect_losses=True) as scope:
                read = [scope.get_current_value(w) for w in weights]
                outputs.append(layer(*args, **kwargs))
            losses.append(list(scope.losses))
            updates.append([(scope.get_current_value(w), r)
                            for w, r in zip(weights, read)])
            carried = [scope.get_current_value(s) for s in states]
        for index, variable in enumerate(self._stacked):
            # A weight the calls assign (moving statistics): every model's
            # new value.
            pairs = [u[index] for u in updates]
            if any(new is not old for new, old in pairs):
                variable.assign(ops.stack([new for new, _ in pairs]))
        for generator, state in zip(self._seeds, carried):
            generator.state.assign(state)
        if any(losses):
            self.add_loss(ops.stack([_total(found) for found in losses]))
        return keras.tree.map_structure(
            lambda *ys: _stacked_output(list(ys), axis), *outputs)

    def _pieces(self, tensor):
        """Each model's `tensor` (with its slice of the tensor's mask)."""
        if self.shared_input:
            return [tensor] * self.num_models
        check_model_axis(self.name, self.num_models, tuple(tensor.shape),
                         self.model_axis)
        slices = model_pieces(tensor, self.num_models, self.model_axis)
        mask = get_keras_mask(tensor)
        if mask is not None:
            masks = model_pieces(mask, self.num_models, self.model_axis)
            for piece, piece_mask in zip(slices, masks):
                set_keras_mask(piece, piece_mask)
        return slices

    def compute_output_spec(self, inputs, stock_arguments=None,
                            training=None):
        axis = self.model_axis

        def per_model(tensor):
            shape = list(tensor.shape)
            if not self.shared_input:
                del shape[axis]
            return keras.KerasTensor(shape, dtype=tensor.dtype)

        args, kwargs = filled_arguments(
            stock_arguments, [per_model(t) for t in inputs])
        if training is not None and self.layer._call_has_training_arg:
            kwargs["training"] = training
        spec = self.layer.compute_output_spec(*args, **kwargs)

        def with_models(tensor):
            shape = list(tensor.shape)
            shape.insert(axis, self.num_models)
            return keras.KerasTensor(shape, dtype=tensor.dtype)

        return keras.tree.map_structure(with_models, spec)

    def compute_mask(self, inputs, previous_mask):
        # The calls stack the masks the layer gives its outputs.
        return None

    def get_config(self):
        config = super().get_config()
        config["layer"] = keras.saving.serialize_keras_object(self.layer)
        if self.shared_input:
            config["shared_input"] = True
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        config["layer"] = keras.saving.deserialize_keras_object(
            config["layer"], custom_objects=custom_objects)
        return cls(**config)


class _Holder:
    """Holds a layer out of Keras's tracking (see `FusedPerModel`)."""

    def __init__(self, layer):
        self.layer = layer


def _random_states(layer):
    """The variables of `layer` that are no weights: the states of the
    seed generators of the layer and of the layers inside it."""
    weights = {id(w) for w in layer.weights}
    return [v for v in layer.variables if id(v) not in weights]


def _total(losses):
    """One model's added losses, summed (zero where it added none)."""
    if not losses:
        return ops.zeros((), "float32")
    return ops.sum(ops.stack([ops.cast(x, "float32") for x in losses]))


def _stacked_output(pieces, axis):
    """The models' outputs stacked on the model `axis`, with their masks
    where the layer gave every model's output one."""
    output = stack_models(pieces, axis)
    masks = [get_keras_mask(p) for p in pieces]
    if all(m is not None for m in masks):
        set_keras_mask(output, stack_models(masks, axis))
    return output
