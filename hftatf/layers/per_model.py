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
from keras import ops

from hftatf.api import hftatf_export
from hftatf.core import compat
from hftatf.core.axis import split_models, stack_models, take_model
from hftatf.core.validation import check_model_axis
from hftatf.layers import backends, objects, registry
from hftatf.layers.base import FusedLayer, Modelwise
from hftatf.layers.call_arguments import filled_arguments, split_arguments
from hftatf.layers.layer_state import (
    derives_state,
    derives_state_by_ops,
    inner_trainable_flags,
    outside_state,
    set_trainable,
    set_trainable_flags,
    set_weight_state,
    state_derived_in_calls,
    weight_state,
)

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
# model would not have: lookup tables (folded where they can be:
# `FusedFold`), and layers that wrap another framework's module or a
# SavedModel.
_STATE_OUTSIDE_VARIABLES = tuple(
    getattr(keras.layers, name) for name in (
        "StringLookup", "IntegerLookup", "TextVectorization",
        "TFSMLayer", "JaxLayer", "FlaxLayer",
        "TorchModuleWrapper")
    if hasattr(keras.layers, name))

_warned = set()


def refusal(layer):
    """Why `FusedPerModel` cannot run `layer` once per model, or None."""
    if isinstance(layer, keras.layers.InputLayer):
        return "an input layer is no computation to fuse."
    if isinstance(layer, _STATE_OUTSIDE_VARIABLES):
        return (
            "it keeps state outside Keras variables (another framework's "
            "module, or a lookup table that cannot be folded here), which a "
            "copy of the layer per model would not hold. Apply it to the "
            "data before the array (in tf.data, or in a model of its own in "
            "front of the array).")
    return None


def layers_inside(layers):
    """The layers run per model among `layers`, and every layer inside
    them (stock layers, not fused forms)."""
    return [inner for layer in layers if isinstance(layer, FusedPerModel)
            for inner in compat.inner_layers(layer.layer, include_self=True)]


def copy_layer(layer):
    """A new, unbuilt copy of `layer` from its config."""
    try:
        with objects.scope([layer]):
            return type(layer).from_config(layer.get_config())
    except (AttributeError, KeyError, NotImplementedError, TypeError,
            ValueError) as error:
        raise ValueError(
            f"hftatf runs layer '{layer.name}' ({type(layer).__name__}) once "
            "per model, from copies of it made from its config, and could "
            f"not copy it: {error}. Give the layer a constructor that "
            "takes Keras's keyword arguments (`**kwargs`, handed to "
            "`super().__init__`) and a `get_config` that returns its "
            "constructor's arguments (and a `from_config`, where they need "
            "deserializing), as saving it with Keras needs.") from None


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
      and alike whether the array computes in one pass or in several; the
      same for any variable outside the layer that its call assigns (Keras's
      global seed generator, which unseeded `keras.random` calls draw from);
    * `trainable` flags: the layer's own and those of the layers inside it
      (`inner_trainable`, which a config does not carry), so a frozen
      `BatchNormalization` inside computes in inference as in the stock
      layer; setting the wrapper's flag sets them all, as Keras does;
    * losses the layer adds (`add_loss`, activity regularizers of the
      layers inside it): a `[B]` loss, entry `b` model `b`'s;
    * masks: model `b`'s slice of each input's mask reaches the layer as
      it would reach the stock layer, and the masks it gives its outputs
      are stacked.

    A layer that keeps state outside Keras variables (a `tf.Variable` or
    lookup table of its own) is refused: a copy per model would not hold it.

    Layout: every tensor argument `[batch, B, ...]` (`[B, batch, ...]` with
    `models_first`), or, with `shared_input`, the stock shapes, every model
    calling the layer on the same tensors; outputs with the model axis. A
    constant given where the model is built (a NumPy array) is the same
    for all models.

    Args:
        layer: the stock layer (unbuilt, or built: its copies are made
            from its config).
        num_models: the number of models `B`.
        shared_input: whether the tensor arguments are shared by all models
            (no model axis).
        models_first: whether activations have the models first.
        inner_trainable: the `trainable` flags of the layers inside
            `layer`, outer layers first, where some differ from `layer`'s
            own (`from_stock` reads them from the stock layer).
        weight_state: LoRA inside `layer` and the `trainable` flags of its
            weights (`layer_state.weight_state` of the stock layer, which
            its config leaves out), given to every copy once built.
        **kwargs: the stock `keras.layers.Layer` arguments.
    """

    kind = "per_model"
    supports_models_first = True

    def __init__(self, layer, num_models, shared_input=False,
                 models_first=False, inner_trainable=None,
                 weight_state=None, **kwargs):
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
        # The `trainable` flags of the layers inside the layer, where some
        # differ from the layer's own (`inner_trainable_flags`).
        self.inner_trainable = (None if inner_trainable is None
                                else [bool(f) for f in inner_trainable])
        self.weight_state = weight_state
        self._stacked = []  # [B, ...] variable per weight of the layer
        self._seeds = []  # seed generator per random state of the layer
        self._specs = None  # the per-model call's arguments, once built
        self._assigned = []  # see `assigns_weights_in_training`
        self._derived = []  # layers with state derived from their weights
        # Keras compiles a model's step with XLA under `jit_compile="auto"`
        # only where every layer supports it; the layer held out of
        # tracking is invisible to that check, so the wrapper answers for
        # it (a `RandAugment`, whose rotations and shears do not).
        self.supports_jit = all(inner.supports_jit for inner in
                                objects.all_layers([layer]))

    @property
    def assigns_weights_in_training(self):
        """Whether the layer's forward pass in training assigns trainable
        weights (a `SpectralNormalization` inside it, or a `call` of your
        own that normalizes its kernel): the array then trains in one pass.
        Found by tracing one model's call in training, once built."""
        if not self.built:
            return any(isinstance(inner, keras.layers.SpectralNormalization)
                       for inner in compat.inner_layers(self.layer))
        return any(self._stacked[i].trainable for i in self._assigned)

    def _weights_assigned_in_training(self):
        """The indices of the layer's weights that its call in training
        assigns, from a trace of the call (never run). A layer without
        weights assigns none, and is not traced: some stock layers run in
        training only on concrete values on JAX (`RandomElasticTransform`
        sizes its blur kernel from a random draw; `MixUp`'s permutation
        needs the batch size), as the stock layer does in a stock model."""
        layer = self.layer
        if not layer.weights:
            return []
        specs, arguments = self._specs
        found = []

        def trace(*tensors):
            args, kwargs = filled_arguments(arguments, list(tensors))
            with keras.StatelessScope() as scope:
                layer(*args, training=True, **kwargs)
            found.extend(i for i, w in enumerate(layer.weights)
                         if scope.get_current_value(w) is not None)

        try:
            backends.trace(trace, specs)
        except Exception:  # noqa: BLE001
            # JAX traces an unknown size as a symbolic dimension, which a
            # call that compares sizes cannot take (a table sliced to the
            # sequence length): the weights a call assigns are the same
            # at any size, so the call is traced again at size 2.
            found.clear()
            backends.trace(trace, [keras.KerasTensor(
                [2 if size is None else size for size in spec.shape],
                dtype=spec.dtype) for spec in specs])
        return found

    @property
    def trainable(self):
        return keras.layers.Layer.trainable.fget(self)

    @trainable.setter
    def trainable(self, value):
        # As for the stock layer: the flag goes to every layer inside it,
        # and each weight keeps the flag of the layer that holds it.
        keras.layers.Layer.trainable.fset(self, value)
        if not hasattr(self, "_holder"):
            return  # Keras's constructor sets it first
        set_trainable(self.layer, value)
        self.inner_trainable = None
        self.weight_state = weight_state(self.layer)
        for variable, weight in zip(self._stacked, self.layer.weights):
            variable.trainable = weight.trainable

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
                   models_first=models_first,
                   inner_trainable=inner_trainable_flags(layer),
                   weight_state=weight_state(layer),
                   name=layer.name, trainable=layer.trainable)

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
            # Set past Keras's tracking, which would turn the arguments'
            # lists into `TrackedList`s, which JAX cannot trace.
            object.__setattr__(self, "_specs", (
                [self._model_spec(t) for t in args[0]],
                kwargs["stock_arguments"]))
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
        specs, arguments = self._specs
        args, kwargs = filled_arguments(arguments, specs)
        copies = [self.layer] + [copy_layer(self.layer)
                                 for _ in range(self.num_models - 1)]
        with backends.init_scope():
            for copy in copies:
                if not copy.built or copy is not self.layer:
                    copy(*args, **kwargs)
                self._set_trainable_flags(copy)
                if self.weight_state is not None:
                    set_weight_state(copy, self.weight_state)
            template = self.layer
            outside = outside_state(template)
            if outside:
                raise ValueError(
                    f"hftatf cannot fuse layer '{template.name}' "
                    f"({type(template).__name__}) per model: it holds "
                    f"{outside} outside Keras variables, which would be one "
                    "state for all models. Create its state with "
                    "`add_weight`.")
            self._derived = [inner for inner in compat.inner_layers(template)
                             if derives_state(inner)]
            underived = [inner.name for inner in self._derived
                         if not derives_state_by_ops(inner)]
            if underived:
                raise ValueError(
                    f"hftatf cannot fuse layer '{template.name}' "
                    f"({type(template).__name__}) per model: layer "
                    f"'{underived[0]}' derives state from its weights in a "
                    "`finalize_state` of its own, which cannot be derived "
                    "again from each model's weights within a call. "
                    "Compute that state from the weights in `call`.")
            for index, weight in enumerate(template.weights):
                self._stacked.append(self._stack_weight(
                    weight, [copy.weights[index] for copy in copies]))
            stateful = [inner.name for inner in compat.inner_layers(template)
                        if getattr(inner, "stateful", False)]
            if stateful:
                # Its states are variables outside the layer's weights,
                # which the call would carry from one model to the next.
                raise ValueError(
                    f"hftatf cannot fuse layer '{template.name}' "
                    f"({type(template).__name__}) per model: it holds the "
                    f"stateful layer '{stateful[0]}', whose state the "
                    "models would share. Use the stateful RNN in the model "
                    "itself, where the array keeps a state per model.")
            for state in _random_states(template):
                generator = keras.random.SeedGenerator(
                    0, name="seed_generator")
                generator.state.assign(state)
                self._seeds.append(generator)
            self._assigned = self._weights_assigned_in_training()
        self.built = True

    def _set_trainable_flags(self, copy):
        """Gives the built `copy` of the layer the stock layer's
        `trainable` flags, its own and those of the layers inside it (a
        config holds only the layer's own)."""
        if self.inner_trainable is None:
            set_trainable(copy, self.trainable)
        else:
            set_trainable_flags(copy, [self.trainable]
                                + self.inner_trainable)

    def _stack_weight(self, weight, copies):
        """The `[B, ...]` variable of the layer's `weight`, holding the
        values of its `copies` (one per model)."""
        stacked = np.stack([c.numpy() for c in copies])
        regularizer = getattr(weight, "regularizer", None)
        constraint = getattr(weight, "constraint", None)
        stacked_weight = self.add_weight(
            shape=(self.num_models, *weight.shape), name=weight.name,
            initializer=lambda shape, dtype: ops.cast(stacked, dtype),
            regularizer=(None if regularizer is None
                         else Modelwise(regularizer, self.num_models)),
            constraint=(None if constraint is None
                        else Modelwise(constraint, self.num_models)),
            trainable=weight.trainable, dtype=weight.dtype, autocast=False)
        # Keras makes a weight added to a frozen layer frozen too.
        stacked_weight.trainable = weight.trainable
        return stacked_weight

    @property
    def weights(self):
        # In the layer's order (`get_weights()`: each inner layer's
        # trainable weights, then its others, inner layer by inner layer),
        # where Keras's own order would put every trainable weight first.
        return list(self._stacked)

    def call(self, inputs, stock_arguments=None, training=None):
        layer = self.layer
        axis = self.model_axis
        pieces = [self._pieces(tensor) for tensor in inputs]
        weights = layer.weights
        values = [v.value for v in self._stacked]
        trainable = {id(w) for w in weights if w.trainable}
        # A trainable weight's slice keeps a sparse gradient (an inner
        # Embedding's) sparse, as it is in the stock model. Not for a layer
        # called more than once (a tied embedding, looked up in one call
        # and multiplied in another), whose calls' gradients TensorFlow
        # adds: a dense one of `[B, ...]` to a sparse one of the rows; nor
        # for a regularized weight, whose penalty's gradient is dense.
        sparse_slices = set() if len(compat.inbound_nodes(self)) > 1 else {
            id(w) for w in weights if w.trainable and len(w.shape) > 0
            and getattr(w, "regularizer", None) is None}
        states = _random_states(layer)
        carried = [g.state.value for g in self._seeds]
        own = {id(v) for v in weights + states}
        outside = {}
        outputs, losses, updates = [], [], []
        # (The layer keeps the state derived from its own weights.)
        with state_derived_in_calls(self._derived):
            for b in range(self.num_models):
                args, kwargs = filled_arguments(stock_arguments,
                                                [p[b] for p in pieces])
                if training is not None and compat.call_takes_training(layer):
                    kwargs["training"] = training
                mapping = ([(w, take_model(v, b)
                             if id(w) in sparse_slices else v[b])
                            for w, v in zip(weights, values)]
                           + list(zip(states, carried)))
                mapping += [(v, value) for v, value in outside.values()]
                with _ModelScope(mapping, trainable) as scope:
                    # Model b's derived state, from its weights.
                    for inner in self._derived:
                        inner.finalize_state()
                    read = [scope.get_current_value(w) for w in weights]
                    outputs.append(layer(*args, **kwargs))
                losses.append(list(scope.losses))
                updates.append([(scope.get_current_value(w), r)
                                for w, r in zip(weights, read)])
                carried = [scope.get_current_value(s) for s in states]
                # Variables outside the layer that its call assigns (the
                # global seed generator of unseeded `keras.random` calls): the
                # next model reads what this one assigned, as it would after
                # a stock call.
                for variable in scope.assigned:
                    if id(variable) not in own:
                        outside[id(variable)] = (
                            variable, scope.get_current_value(variable))
        for index, variable in enumerate(self._stacked):
            # A weight the calls assign (moving statistics): every model's
            # new value.
            pairs = [u[index] for u in updates]
            if any(new is not old for new, old in pairs):
                variable.assign(ops.stack([new for new, _ in pairs]))
        for generator, state in zip(self._seeds, carried):
            generator.state.assign(state)
        for variable, value in outside.values():
            variable.assign(value)
        if any(losses):
            self.add_loss(ops.stack([_total(found) for found in losses]))
        return keras.tree.map_structure(
            lambda *ys: stack_models(list(ys), axis), *outputs)

    def _pieces(self, tensor):
        """Each model's `tensor` (with its slice of the tensor's mask)."""
        if self.shared_input:
            return [tensor] * self.num_models
        check_model_axis(self.name, self.num_models, tuple(tensor.shape),
                         self.model_axis)
        return split_models(tensor, self.num_models, self.model_axis)

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
        if training is not None and compat.call_takes_training(self.layer):
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
        if self.inner_trainable is not None:
            config["inner_trainable"] = list(self.inner_trainable)
        if self.weight_state is not None:
            config["weight_state"] = self.weight_state
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
    # Each summed, as Keras sums every added loss, whatever its shape.
    return sum(ops.sum(ops.cast(x, "float32")) for x in losses)


class _ModelScope(keras.StatelessScope):
    """The stateless scope of one model's call: the layer's variables read
    the model's values, and what it assigns stays in the scope.

    A trainable weight the call assigns (a spectral normalization's kernel)
    is differentiated as stock Keras on the backend differentiates it:
    reads after the assignment return the new value, and their gradient is
    the weight's on TensorFlow, the gradient through the computation of
    the new value on JAX (`backends.read_after_assignment`)."""

    def __init__(self, mapping, trainable):
        super().__init__(state_mapping=mapping, collect_losses=True)
        self._trainable = trainable
        self.assigned = []  # the variables the call assigned, in order

    def add_update(self, update):
        variable, value = update
        if all(v is not variable for v in self.assigned):
            self.assigned.append(variable)
        if id(variable) in self._trainable:
            read = self.state_mapping[id(variable)]
            value = backends.read_after_assignment(
                ops.cast(value, read.dtype), read)
        super().add_update((variable, value))
