"""The base class of fused layers with weights, and per-model weight helpers.

A fused layer is its stock Keras layer vectorised over the model axis:
activations are `[batch, B, ...]`, and every weight is `[B, *stock shape]`, in
the order of the stock layer's `get_weights()`. Model `b` computes what the
stock layer computes with weights `w[b]` on input `x[:, b]`.
"""

import keras
from keras import ops

from hftatf.core.axis import model_axis_of, stack_values
from hftatf.core.validation import check_num_models


def model_initializers(initializer, num_models):
    """Returns one initializer per model slice, each drawing its own values.

    Stock initializers seeded with an integer (or unseeded, which Keras turns
    into a fixed default seed) draw the same values on every call, so the
    slices get distinct seeds: `seed + b` for an integer seed (model 0 starts
    exactly as the stock layer with that seed would), a fresh default seed
    per slice when unseeded. Initializers without a seed are called per slice
    as they are; so is one seeded with a `SeedGenerator`, which advances.
    """
    initializer = keras.initializers.get(initializer)
    get_config = getattr(initializer, "get_config", None)
    config = get_config() if get_config is not None else {}
    if "seed" not in config or isinstance(config["seed"], dict):
        return [initializer] * num_models
    seed = config["seed"]
    cls = type(initializer)
    return [
        cls.from_config({**config, "seed": None if seed is None else seed + b})
        for b in range(num_models)
    ]


def keep_stock_initializers(fused, layer):
    """Gives the `fused` form built from the stock `layer`'s config the
    stock layer's initializer objects (its cell's too), and returns it.

    Keras serializes some initializers without their arguments
    (`Identity`'s `gain`), so a layer rebuilt from a config could draw
    other initial values than its stock twin."""
    pairs = [(layer, fused),
             (getattr(layer, "cell", None), getattr(fused, "cell", None))]
    for source, target in pairs:
        if source is None or target is None:
            continue
        for name, value in vars(source).items():
            if (isinstance(value, keras.initializers.Initializer)
                    and isinstance(vars(target).get(name),
                                   keras.initializers.Initializer)):
                setattr(target, name, value)
    return fused


# Initializers that draw nothing: one call fills every model's slice with
# the values each slice's own call would give.
_CONSTANT_INITIALIZERS = (keras.initializers.Zeros, keras.initializers.Ones,
                          keras.initializers.Constant)


class StackedInitializer:
    """Initializes a `[B, *shape]` weight slice by slice.

    Each slice is initialised as a stock layer would initialise its own
    weight of shape `shape`, so fan-in and fan-out never count `B`. A
    constant initializer (zeros, ones, `Constant`) is called once for the
    whole weight: the same values, without B calls.
    """

    def __init__(self, initializer, num_models):
        initializer = keras.initializers.get(initializer)
        self.constant = (initializer if type(initializer) in
                         _CONSTANT_INITIALIZERS else None)
        self.initializers = (None if self.constant is not None else
                             model_initializers(initializer, num_models))

    def __call__(self, shape, dtype=None):
        if self.constant is not None:
            return self.constant(tuple(shape), dtype=dtype)
        per_model = tuple(shape[1:])
        return stack_values(init(per_model, dtype=dtype)
                            for init in self.initializers)


class Modelwise:
    """Applies a stock per-weight function to each model slice and stacks.

    A stock regularizer gives a `[B]` loss (the array's training step adds
    entry `b` to model `b`'s loss, so each model is penalised exactly as its
    stock twin); a stock constraint (e.g. `MaxNorm(axis=0)`) gives the
    `[B, ...]` constrained weight, each slice constrained on its own axes.
    """

    def __init__(self, function, num_models):
        self.function = function
        self.num_models = num_models

    def __call__(self, weight):
        return ops.stack([self.function(weight[b])
                          for b in range(self.num_models)])


class ModelActivityRegularization:
    """Mixin of fused layers: the stock layer's activity regularizer,
    applied to each model's slice of every output.

    Keras applies a layer's `activity_regularizer` to its whole output and
    divides by the batch size: on a fused output that would be one loss
    for all models, shared out evenly. Here model `b`'s output slice is
    penalised on its own and divided by the batch size, as its stock twin
    does, and the layer adds a `[B]` loss (entry `b` model `b`'s). The
    class sets `model_activity_regularizer` (never the stock
    `activity_regularizer`), `num_models` and `model_axis`.
    """

    model_activity_regularizer = None

    def with_activity_config(self, config):
        """`config` with the activity regularizer, where there is one."""
        if self.model_activity_regularizer is not None:
            config["activity_regularizer"] = keras.regularizers.serialize(
                self.model_activity_regularizer)
        return config

    def __call__(self, *args, **kwargs):
        outputs = super().__call__(*args, **kwargs)
        if self.model_activity_regularizer is not None:
            for output in keras.tree.flatten(outputs):
                if ops.is_tensor(output):
                    self.add_loss(self._activity_loss(output))
        return outputs

    def _activity_loss(self, output):
        regularizer = self.model_activity_regularizer
        losses = ops.stack([
            regularizer(ops.take(output, b, axis=self.model_axis))
            for b in range(self.num_models)])
        batch_size = ops.cast(ops.shape(output)[1 - self.model_axis],
                              losses.dtype)
        return ops.divide_no_nan(losses, batch_size)


class FusedForm:
    """What `hftatf.layers.resolve` reads from every fused form: its kind
    and the layouts it takes. Defaults of a fused layer of its own that
    computes with the models second only.

    `kind`: `"fused"` (a computation of its own), `"fold"` (the stock layer
    on the models folded into the batch) or `"per_model"` (the stock layer
    once per model).
    """

    kind = "fused"
    supports_models_first = False
    # Whether the layer computes faster with the models first, so that
    # `hftatf.fuse` gives it that layout even from inputs without it.
    prefers_models_first = False

    @classmethod
    def takes_models_first(cls, layer):
        """Whether the fused form of the stock `layer` can compute with the
        models first (`models_first=True`). Fused layers that can
        override `supports_models_first` (and this, where it depends on the
        stock layer's arguments)."""
        del layer
        return cls.supports_models_first

    @classmethod
    def fuses_shared_input(cls, layer):
        """Whether the fused form of the stock `layer` can take one input
        batch shared by all models (`shared_input=True`): the B models are
        then one wide stock layer, and no copy of the input per model is
        made. Fused layers that can override this."""
        del layer
        return False


class FusedLayer(FusedForm, ModelActivityRegularization,
                 keras.layers.Layer):
    """Base class of fused layers that hold weights.

    Subclasses take `num_models` plus exactly the arguments of their stock
    layer, create weights with `add_model_weight`, and compute on activations
    whose axis 1 is the model axis: `[batch, B, ...]`. Those that set
    `supports_models_first` also compute on activations with the models
    first, `[B, batch, ...]`, when built with `models_first=True`: the
    layout `hftatf.fuse` keeps between the per-model convolutions of a CPU
    array, where taking each model's slice of `[batch, B, ...]` is a copy
    and of `[B, batch, ...]` is not.

    State and the model axis: weights and non-trainable statistics always
    carry it (`[B, ...]`); regularizers, constraints and the activity
    regularizer are applied per model slice, and regularization losses are
    `[B]` vectors (entry `b` belongs to model `b`).

    Args:
        num_models: the number of models `B` in the array.
        activity_regularizer: as in the stock layer; applied to each model's
            output slice and divided by the batch size, like Keras does.
        models_first: whether activations have the models first,
            `[B, batch, ...]`, instead of `[batch, B, ...]`; only for layers
            that set `supports_models_first`.
        **kwargs: the stock `keras.layers.Layer` arguments (`name`, `dtype`,
            `trainable`, ...).
    """

    def __init__(self, num_models, activity_regularizer=None,
                 models_first=False, **kwargs):
        super().__init__(**kwargs)
        self.num_models = check_num_models(num_models)
        self.model_activity_regularizer = keras.regularizers.get(
            activity_regularizer
        )
        if models_first and not self.supports_models_first:
            raise ValueError(
                f"{type(self).__name__} computes only on [batch, num_models, "
                "...] activations. Received: models_first=True.")
        self.models_first = bool(models_first)

    @property
    def model_axis(self):
        """The model axis of this layer's activations: 0 with the models
        first, else 1."""
        return model_axis_of(self.models_first)

    @classmethod
    def from_stock(cls, layer, num_models, **kwargs):
        """Builds the fused form of the stock `layer` (weights not copied);
        `kwargs` are arguments of the fused form only (`shared_input`)."""
        try:
            return keep_stock_initializers(cls.from_config(
                {**layer.get_config(), "num_models": num_models, **kwargs}),
                layer)
        except TypeError as error:
            # Keras's `from_config` wraps the fused form's refusal of a
            # stock argument (a ValueError naming it) in a TypeError that
            # prints the whole config first: raise the refusal itself.
            if isinstance(error.__context__, ValueError):
                raise ValueError(
                    f"hftatf cannot fuse layer '{layer.name}' "
                    f"({type(layer).__name__}): {error.__context__}"
                ) from None
            raise

    def add_model_weight(self, shape, name, initializer, regularizer=None,
                         constraint=None, trainable=True, dtype=None,
                         autocast=True):
        """Adds a `[B, *shape]` weight, each slice initialised separately.

        `autocast` as in `add_weight`: False for weights the stock layer
        reads in their own dtype under a mixed precision policy."""
        return self.add_weight(
            shape=(self.num_models, *shape),
            name=name,
            initializer=StackedInitializer(initializer, self.num_models),
            regularizer=(
                Modelwise(keras.regularizers.get(regularizer), self.num_models)
                if regularizer is not None else None
            ),
            constraint=(
                Modelwise(keras.constraints.get(constraint), self.num_models)
                if constraint is not None else None
            ),
            trainable=trainable,
            dtype=dtype,
            autocast=autocast,
        )

    def get_model_weights(self, index):
        """Returns model `index`'s weights, in the stock layer's order."""
        return [w[index] for w in self.get_weights()]

    def set_model_weights(self, index, weights):
        """Sets model `index`'s weights from a stock layer's `get_weights()`."""
        variables = self.weights
        if len(weights) != len(variables):
            raise ValueError(
                f"Layer '{self.name}' holds {len(variables)} weights per "
                f"model; received {len(weights)}."
            )
        for variable, value in zip(variables, weights):
            if tuple(value.shape) != tuple(variable.shape[1:]):
                raise ValueError(
                    f"Weight '{variable.path}' of layer '{self.name}' has "
                    f"per-model shape {tuple(variable.shape[1:])}; received "
                    f"shape {tuple(value.shape)}."
                )
            stacked = keras.ops.convert_to_numpy(variable).copy()
            stacked[index] = value
            variable.assign(stacked)


    def get_config(self):
        config = super().get_config()
        config["num_models"] = self.num_models
        if self.models_first:
            config["models_first"] = True
        config["activity_regularizer"] = keras.regularizers.serialize(
            self.model_activity_regularizer
        )
        return config
