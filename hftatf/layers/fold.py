"""Fusing per-sample layers without weights, and sharing one input batch.

A layer without weights that treats every sample on its own (activations,
dropout, pooling, reshapes, merges, ...) needs no fused implementation: the
model axis is folded into the batch axis, the stock layer runs once on
`[batch * B, ...]`, and the result is unfolded to `[batch, B, ...]`. Axis
arguments of the stock layer keep their meaning, since the folded tensor has
the stock rank. Activations with the models first, `[B, batch, ...]` (the
layout `hftatf.fuse` keeps between per-model convolutions on a CPU), fold
to `[B * batch, ...]` just as well; `SwapModelAxis` moves between the two
layouts. A weightless layer that treats a batch as a whole (`MixUp`,
`RandAugment`) runs once per model instead (`FusedPerModel`).
"""

import keras
from keras import ops

from hftatf.api import hftatf_export
from hftatf.core import compat
from hftatf.core.axis import (
    fold_models,
    model_axis_of,
    pieces_if_stacked,
    split_models,
    stack_models,
    unfold_models,
)
from hftatf.core.validation import check_model_axis, check_num_models
from hftatf.layers import registry
from hftatf.layers.backends import dropout_models_first, with_unknown_batch
from hftatf.layers.base import FusedForm, ModelActivityRegularization
from hftatf.layers.layer_state import keeps_assets
from hftatf.layers.sample_mixing import check_lambda_acts_per_sample

# Stock layers without weights that treat every sample on its own.
PER_SAMPLE_LAYERS = tuple(getattr(keras.layers, name) for name in (
    # Activations.
    "Activation", "ReLU", "LeakyReLU", "ELU", "Softmax",
    # Regularisation by noise: each model draws its own mask.
    "Dropout", "SpatialDropout1D", "SpatialDropout2D", "SpatialDropout3D",
    "GaussianNoise", "GaussianDropout", "AlphaDropout",
    # Shapes.
    "Flatten", "Reshape", "Permute", "RepeatVector", "Identity",
    "Cropping1D", "Cropping2D", "Cropping3D",
    "ZeroPadding1D", "ZeroPadding2D", "ZeroPadding3D",
    "UpSampling1D", "UpSampling2D", "UpSampling3D",
    # Pooling.
    "MaxPooling1D", "MaxPooling2D", "MaxPooling3D",
    "AveragePooling1D", "AveragePooling2D", "AveragePooling3D",
    "GlobalMaxPooling1D", "GlobalMaxPooling2D", "GlobalMaxPooling3D",
    "GlobalAveragePooling1D", "GlobalAveragePooling2D",
    "GlobalAveragePooling3D",
    "AdaptiveAveragePooling1D", "AdaptiveAveragePooling2D",
    "AdaptiveAveragePooling3D", "AdaptiveMaxPooling1D",
    "AdaptiveMaxPooling2D", "AdaptiveMaxPooling3D",
    # Merges.
    "Add", "Subtract", "Multiply", "Average", "Maximum", "Minimum",
    "Concatenate", "Dot",
    # Preprocessing and masking.
    "Rescaling", "Resizing", "CenterCrop", "Masking", "UnitNormalization",
    "CategoryEncoding", "Discretization", "Hashing", "HashedCrossing",
    # Lookups: one for all models, with its vocabulary (`copy_layer`).
    "StringLookup", "IntegerLookup", "TextVectorization",
    # Data augmentation that draws its transformation per image: each
    # model draws its own transformations.
    "RandomFlip", "RandomRotation", "RandomTranslation", "RandomZoom",
    "RandomContrast", "RandomBrightness", "RandomColorDegeneration",
    "RandomColorJitter", "RandomGrayscale", "RandomHue", "RandomSaturation",
    "RandomSharpness", "RandomShear", "RandomPerspective", "RandomInvert",
    "RandomPosterization", "RandomErasing", "Solarization",
    # Per-image contrast adjustments and audio features.
    "AutoContrast", "ContrastLimitedAdaptiveHistogramEqualization",
    "MelSpectrogram",
    # A user function: folded like a raw operation, so it must act on each
    # sample on its own (no reduction over the batch axis).
    "Lambda",
))


def fold_for_stock(x):
    """`fold_models` for a stock layer or a raw operation to compute
    on: in a traced step, with the folded batch's static size left
    unknown where the backend needs it (`with_unknown_batch`)."""
    return with_unknown_batch(fold_models(x))


UNSEEDED_RANDOM_LAYERS = (compat.StochasticDepth,)


def _draws_models_first(layer):
    """Whether `FusedFold` draws the random `layer`'s numbers with the
    models first as it would with them second: the stock `Dropout` (not
    its subclasses, which shape their noise otherwise) with a mask per
    sample (one for the whole batch runs per model: `FusedFold.refusal`)."""
    if type(layer) is not keras.layers.Dropout:
        return False
    return layer.noise_shape is None or layer.noise_shape[0] is None


def _fold_tensors(structure, name, num_models, models_first=False):
    """Folds every tensor of `structure` (checking its model axis: a wrong
    one would fold samples of different models together silently)."""
    def fold(x):
        if not _is_tensor(x):
            return x
        check_model_axis(name, num_models, tuple(x.shape),
                         model_axis_of(models_first))
        return fold_for_stock(x)

    return keras.tree.map_structure(fold, structure)


def _unfold_tensors(structure, num_models, models_first=False):
    return keras.tree.map_structure(
        lambda y: unfold_models(y, num_models, models_first)
        if _is_tensor(y) else y, structure)


def _no_mask(mask):
    """Whether `mask` masks nothing (a merge gets one None per input)."""
    return mask is None or (isinstance(mask, (list, tuple))
                            and all(m is None for m in mask))


def _is_tensor(x):
    return isinstance(x, keras.KerasTensor) or ops.is_tensor(x)


def copy_layer(layer):
    """A fresh copy of a stock weightless layer (its own random state). A
    `Lambda` is stateless and its function may not survive a config round
    trip (Python lambdas need unsafe deserialization): it is shared, or,
    with an activity regularizer (which its fused form takes over),
    rebuilt from its function. A layer that keeps what Keras saves as
    assets (a lookup's vocabulary: `layer_state.keeps_assets`) is
    deterministic and shared too: its config leaves that state out, and
    the size of its output can depend on it."""
    if isinstance(layer, keras.layers.Lambda):
        if layer.activity_regularizer is None:
            return layer
        return keras.layers.Lambda(
            layer.function, output_shape=compat.lambda_output_shape(layer),
            mask=layer.mask, arguments=layer.arguments, name=layer.name,
            dtype=layer.dtype_policy,
            activity_regularizer=layer.activity_regularizer)
    if keeps_assets(layer) and layer.activity_regularizer is None:
        return layer
    return type(layer).from_config(layer.get_config())


def has_random_state(layer):
    """Whether `layer` draws random numbers (dropout, noise, ...)."""
    return isinstance(layer, UNSEEDED_RANDOM_LAYERS) or any(
        isinstance(value, keras.random.SeedGenerator)
        for value in vars(layer).values())


@hftatf_export
@registry.register(*PER_SAMPLE_LAYERS, *UNSEEDED_RANDOM_LAYERS)
class FusedFold(FusedForm, ModelActivityRegularization,
                keras.layers.Wrapper):
    """Applies a stock per-sample layer without weights to every model.

    Layout: each input `[batch, B, ...]` (the stock layer's input with a
    model axis at 1) -> output `[batch, B, ...]`; masks likewise. No weights.

    Random layers (`Dropout`, `GaussianNoise`, ...) draw over the folded batch,
    so every model gets its own independent mask, as B separate jobs would.
    With the models first, `Dropout` draws over the batch folded with the
    models second and moves its mask: each model draws the same mask in
    either layout.

    The stock layer's activity regularizer penalises each model's output
    slice, as in its stock twin (`ModelActivityRegularization`); the
    wrapper takes it over from the layer.

    Args:
        layer: the stock Keras layer. It must have no weights and must treat
            every sample independently.
        num_models: the number of models `B` in the array.
        models_first: whether inputs, outputs and masks have the models
            first, `[B, batch, ...]`, instead of `[batch, B, ...]`.
        activity_regularizer: the regularizer of each model's output;
            defaults to the stock layer's.
    """

    kind = "fold"
    prefers_models_first = False

    def __init__(self, layer, num_models, models_first=False,
                 activity_regularizer=None, **kwargs):
        stock_regularizer = getattr(layer, "activity_regularizer", None)
        if stock_regularizer is not None:
            # Applied to the folded output it would be one loss for all.
            layer.activity_regularizer = None
        # The stock layer's dtype policy (a float32 layer of a mixed model
        # stays float32), not the global one.
        kwargs.setdefault("dtype", layer.dtype_policy)
        super().__init__(layer, **kwargs)
        self.num_models = check_num_models(num_models)
        self.models_first = bool(models_first)
        self.supports_masking = getattr(layer, "supports_masking", False)
        self.model_activity_regularizer = (
            keras.regularizers.get(activity_regularizer) or stock_regularizer)

    @property
    def model_axis(self):
        return model_axis_of(self.models_first)

    @classmethod
    def from_stock(cls, layer, num_models, models_first=False):
        if isinstance(layer, keras.layers.Lambda):
            # Its function is the user's: the one layer here that may mix
            # samples.
            check_lambda_acts_per_sample(layer)
        return cls(copy_layer(layer), num_models, models_first=models_first,
                   name=layer.name)

    @classmethod
    def refusal(cls, layer):
        """Why the stock `layer` cannot be folded, or None (it then runs
        once per model): it computes along the batch axis (`axis=0` of a
        `Softmax`, `UnitNormalization` or `Concatenate`, `axes=0` of a
        `Dot`), draws one mask for the whole batch (a `noise_shape`
        of batch size 1), which folding would share between the models,
        or pads its output to the batch's longest text (a
        `TextVectorization` without `output_sequence_length`)."""
        config = (layer.get_config()
                  if isinstance(layer, keras.layers.TextVectorization)
                  else {})
        if (config.get("output_mode") == "int"
                and config.get("output_sequence_length", 0) is None):
            return ("it pads each batch to the batch's longest text, so "
                    "folded, one model's sequences would take another's "
                    "length. Give it `output_sequence_length`, or apply it "
                    "to an input all models share")
        noise_shape = getattr(layer, "noise_shape", None)
        if noise_shape is not None and noise_shape[0] == 1:
            return (f"it draws one mask for the whole batch (`noise_shape="
                    f"{tuple(noise_shape)!r}`), which each model must draw "
                    "for itself")
        for name in ("axis", "axes"):
            value = getattr(layer, name, None)
            values = value if isinstance(value, (list, tuple)) else [value]
            if any(isinstance(v, int) and not isinstance(v, bool) and v == 0
                   for v in values):
                return (f"it computes along the batch axis (`{name}="
                        f"{value!r}`), which the models must not share")
        return None

    @classmethod
    def takes_models_first(cls, layer):
        """Whether `hftatf.fuse` runs the stock `layer` with the models
        first: deterministic layers that make no mask of their own, and
        `Dropout`, which draws its masks with the models second and moves
        them. Other random layers keep the models second, so that each
        model draws what it draws in an array of the other layout."""
        if _draws_models_first(layer):
            return True
        return not (has_random_state(layer) or isinstance(
            layer, (keras.layers.Lambda, keras.layers.Masking)))

    def build(self, input_shape):
        if not self.layer.built and compat.has_default_build(self.layer):
            # What the stock default `build` does, without its warning about
            # the sublayers a `Pipeline` builds on its first call.
            self.layer.built = True
        elif not self.layer.built:
            self.layer.build(keras.tree.map_shape_structure(
                self._fold_shape, input_shape))
        if self.layer.weights:
            raise ValueError(
                f"FusedFold can only wrap layers without weights; layer "
                f"'{self.layer.name}' has {len(self.layer.weights)}. Use the "
                "layer's fused form from hftatf.layers instead."
            )
        self.built = True

    def _fold_shape(self, shape):
        axis = model_axis_of(self.models_first)
        check_model_axis(self.name, self.num_models, shape, axis)
        batch = shape[1 - axis]
        batch = None if batch is None else batch * self.num_models
        return (batch, *shape[2:])

    def _unfold_shape(self, shape):
        batch = None if shape[0] is None else shape[0] // self.num_models
        if self.models_first:
            return (self.num_models, batch, *shape[1:])
        return (batch, self.num_models, *shape[1:])

    def _unfold(self, structure):
        return _unfold_tensors(structure, self.num_models, self.models_first)

    def call(self, inputs, training=None, mask=None, **arguments):
        # `arguments`: the stock layer's other call arguments
        # (CategoryEncoding's `count_weights`), folded like its inputs.
        if self.models_first and _draws_models_first(self.layer):
            check_model_axis(self.name, self.num_models, tuple(inputs.shape),
                             model_axis_of(True))
            return dropout_models_first(self.layer, inputs, self.num_models,
                                        training)
        kwargs = _fold_tensors(arguments, self.name, self.num_models,
                               self.models_first)
        if compat.call_takes_training(self.layer) and training is not None:
            kwargs["training"] = training
        if _no_mask(mask) and not has_random_state(self.layer) and (
                not arguments):
            per_model = self._per_model_inputs(inputs)
            if per_model is not None:
                # Stacked by a per-model layer: the stock layer on each
                # model's pieces, which a next per-model layer takes.
                return keras.tree.map_structure(
                    lambda *pieces: stack_models(
                        list(pieces), model_axis_of(self.models_first)),
                    *[self.layer(x, **kwargs) for x in per_model])
        if mask is not None and compat.call_takes_mask(self.layer):
            kwargs["mask"] = keras.tree.map_structure(
                lambda m: None if m is None else fold_models(m), mask)
        outputs = self.layer(_fold_tensors(
            inputs, self.name, self.num_models, self.models_first), **kwargs)
        return self._unfold(outputs)

    def _per_model_inputs(self, inputs):
        """Model `b`'s inputs for every `b`, where an input was stacked by a
        per-model layer (`pieces_if_stacked`) and the others can be sliced
        without a copy (the models first, or stacked too); None
        otherwise."""
        axis = model_axis_of(self.models_first)
        tensors = keras.tree.flatten(inputs)
        stacked = [pieces_if_stacked(t, self.num_models, axis) for t in tensors]
        if all(p is None for p in stacked) or (
                axis != 0 and any(p is None for p in stacked)):
            return None
        pieces = [split_models(t, self.num_models, axis) if p is None else p
                  for t, p in zip(tensors, stacked)]
        return [keras.tree.pack_sequence_as(inputs, [p[b] for p in pieces])
                for b in range(self.num_models)]

    def compute_mask(self, inputs, mask=None):
        if not self.supports_masking and mask is None:
            return None
        folded_mask = None if mask is None else keras.tree.map_structure(
            lambda m: None if m is None else fold_models(m), mask)
        folded = self.layer.compute_mask(
            keras.tree.map_structure(fold_models, inputs), folded_mask)
        if folded is None:
            return None
        return self._unfold(folded)

    def compute_output_shape(self, input_shape):
        folded_input = keras.tree.map_shape_structure(
            self._fold_shape, input_shape)
        try:
            folded = self.layer.compute_output_shape(folded_input)
        except NotImplementedError:
            # Layers without the method (e.g. keras.applications' own) are
            # traced symbolically instead.
            spec = self.layer.compute_output_spec(
                keras.tree.map_shape_structure(
                    lambda shape: keras.KerasTensor(shape), folded_input))
            folded = keras.tree.map_structure(lambda t: t.shape, spec)
        return keras.tree.map_shape_structure(self._unfold_shape, folded)

    def get_config(self):
        config = super().get_config()
        config["num_models"] = self.num_models
        if self.models_first:
            config["models_first"] = True
        return self.with_activity_config(config)

    @classmethod
    def from_config(cls, config, custom_objects=None):
        # The stock Wrapper pops the layer out of the caller's dict.
        return super().from_config(dict(config), custom_objects)


@hftatf_export
@registry.register(keras.layers.RandomCrop)
class FusedRandomCrop(FusedFold):
    """`keras.layers.RandomCrop` for every model: each model crops its own
    window.

    The stock layer crops every image of a batch at one random location,
    drawn anew at each call; folded over the models, all B models would
    crop at the same location. Here each model draws its own location (B
    numbers from the stock layer's seed generator for each axis), as B
    separate jobs would, and the windows are gathered in one op per axis.
    Where the stock layer crops nothing at random (in inference, or an
    image no larger than the target in height or width, which it resizes),
    the stock layer runs on the folded batch, so each model gets exactly
    the stock layer's output.

    Layout and arguments: as `FusedFold`, wrapping a stock `RandomCrop`.
    """

    # Each model crops its own window: a computation of its own, not the
    # stock layer folded.
    kind = "fused"

    @classmethod
    def takes_models_first(cls, layer):
        # Each model draws the same window in either layout.
        return True

    def call(self, inputs, training=None, mask=None):
        layer = self.layer
        # The stock layer crops at random unless told it is not training.
        training = True if training is None else training
        shape = tuple(inputs.shape)
        height = shape[layer.height_axis]
        width = shape[layer.width_axis]
        if not (training and height is not None and width is not None
                and height > layer.height and width > layer.width):
            return super().call(inputs, training=training, mask=mask)
        check_model_axis(self.name, self.num_models, shape,
                         model_axis_of(self.models_first))
        seed = compat.random_crop_seed_generator(layer)
        images = ops.cast(inputs, layer.compute_dtype)
        rank = len(shape)
        leading = ops.shape(images)[:2]
        for axis, size, target in ((layer.height_axis, height, layer.height),
                                   (layer.width_axis, width, layer.width)):
            # As the stock draw, with one start per model.
            starts = ops.cast(keras.random.uniform(
                (self.num_models,), 0, maxval=float(size - target + 1),
                seed=seed), "int32")
            index = starts[:, None] + ops.arange(target, dtype="int32")
            index = index[:, None] if self.models_first else index[None]
            # Model b's window along `axis`, for every sample of model b.
            index = ops.broadcast_to(index, (*leading, target))
            index = ops.reshape(index, (*leading, *(1,) * (
                rank + axis - 2), target, *(1,) * (-axis - 1)))
            images = ops.take_along_axis(images, index, axis=rank + axis)
        return images
