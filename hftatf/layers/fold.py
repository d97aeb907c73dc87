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

import contextlib
import random

import keras
import numpy as np
import tensorflow as tf
from keras import ops
from keras.src import utils
from keras.src.backend.common import global_state
from keras.src.backend.tensorflow.random import _cast_seed
from keras.src.random.seed_generator import GLOBAL_SEED_GENERATOR, draw_seed

from hftatf.api import hftatf_export
from hftatf.core.axis import (
    fold_models,
    model_axis_of,
    pieces_if_stacked,
    rearranged,
    repeat_models,
    split_models,
    stack_models,
    swap_model_axis,
    unfold_models,
)
from hftatf.core.validation import check_model_axis, check_num_models
from hftatf.layers import registry
from hftatf.layers.base import ModelActivityRegularization

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
    unknown.

    Keras's TensorFlow `add` takes an operand that squeezes to a vector of
    known length for a bias (`tf.nn.bias_add`) where that length equals
    dimension 1 or the last of the other operand. A `[batch * B, 1]`
    column of per-sample values (a `Dense(1)` output, a mean with
    `keepdims`) would then be added along the wrong axis where
    `batch * B` equals that dimension, though the stock model, at
    `batch`, adds it right. An unknown batch never takes the shortcut.
    (Run eagerly, every shape is known: the shortcut stays, as it does in
    stock Keras where `batch` equals that dimension.)
    """
    folded = fold_models(x)
    if (isinstance(folded, tf.Tensor) and not tf.executing_eagerly()
            and folded.shape.rank and folded.shape[0] is not None):
        return tf.compat.v1.placeholder_with_default(
            folded, [None, *folded.shape[1:]])
    return folded


# What to tell a user whose operation or `Lambda` mixes the samples.
PER_SAMPLE_ADVICE = (
    "Folded over the models, it would mix the models' samples. Compute it "
    "per sample, or in a layer of its own (hftatf runs a layer without a "
    "fused form once per model, on that model's batch: "
    "hftatf.layers.FusedPerModel).")

# The shape probe's batch sizes: two, so that a size taken from the batch
# shows as one that changes.
_SHAPE_PROBE_BATCHES = (7, 11)
# The size the value probe gives axes of unknown size, and the most values
# it draws (beyond, it cannot tell cheaply).
_VALUE_PROBE_SIZE = 5
_VALUE_PROBE_LIMIT = 2**24


def sample_mixing(call, output_spec, arguments):
    """How `call` reaches across the batch axis, in words, or None where it
    treats every sample on its own, as a computation folded over the models
    must (a raw `keras.ops` node, a `Lambda`'s function).

    Two probes, each refusing nothing where it cannot tell:

    * shapes: `output_spec` (the call's `compute_output_spec`) at two batch
      sizes; every output must keep that batch size first and its other
      axes (a transpose, an `einsum` or an index of the batch axis, a
      reshape of the whole batch fail). A spec that fails tells nothing.
    * values: `call` on a batch of two random float samples, then with
      either sample drawn anew; the other sample's result must not
      change. Inputs that are not float (indices, masks), a call that
      fails and a call that draws random numbers (two calls differ:
      dropout, noise) tell nothing.

    Args:
        call: the computation, called as `call(*args, **kwargs)`.
        output_spec: its `compute_output_spec`, called alike.
        arguments: `(args, kwargs)` of the stock call, with a
            `keras.KerasTensor` of the stock shape (batch first) for every
            tensor.
    """
    return (_shape_mixing(output_spec, arguments)
            or _value_mixing(call, arguments))


def _with_batch(arguments, batch):
    """`arguments` with every `keras.KerasTensor` given the batch size
    `batch`."""
    def resize(x):
        if isinstance(x, keras.KerasTensor) and x.shape:
            return keras.KerasTensor((batch, *x.shape[1:]), dtype=x.dtype,
                                     sparse=x.sparse)
        return x

    return keras.tree.map_structure(resize, arguments)


def _shape_mixing(output_spec, arguments):
    """The shape probe of `sample_mixing`."""
    found = []
    for batch in _SHAPE_PROBE_BATCHES:
        args, kwargs = _with_batch(arguments, batch)
        try:
            spec = output_spec(*args, **kwargs)
        except Exception:
            # A spec that cannot take the probe tells nothing.
            return None
        shapes = [tuple(t.shape) for t in keras.tree.flatten(spec)
                  if isinstance(t, keras.KerasTensor)]
        for shape in shapes:
            if not shape or shape[0] not in (batch, None):
                return (f"does not keep the batch axis first: on a batch of "
                        f"{batch} it returns shape {shape}")
        found.append(shapes)
    small, large = found
    if [s[1:] for s in small] != [s[1:] for s in large]:
        return (f"sizes other axes of its output by the batch: it returns "
                f"shape {small[0] if len(small) == 1 else small} on a batch "
                f"of {_SHAPE_PROBE_BATCHES[0]} and "
                f"{large[0] if len(large) == 1 else large} on a batch of "
                f"{_SHAPE_PROBE_BATCHES[1]}")
    return None


def _value_mixing(call, arguments):
    """The value probe of `sample_mixing`: on a batch of two random
    samples, then with either sample drawn anew, the other sample's result
    must stay (a batch of one size throughout, so that a `squeeze` of axes
    of size one does what it does in the stock model)."""
    tensors = [x for x in keras.tree.flatten(arguments)
               if isinstance(x, keras.KerasTensor)]
    if not tensors or not tf.executing_eagerly() or any(
            not x.shape or x.sparse or not keras.backend.is_float_dtype(
                x.dtype) for x in tensors):
        return None
    # Three random samples of each input, of both signs.
    shapes = [(3, *(_VALUE_PROBE_SIZE if d is None else d
                    for d in x.shape[1:])) for x in tensors]
    if sum(int(np.prod(shape)) for shape in shapes) > _VALUE_PROBE_LIMIT:
        return None
    rng = np.random.default_rng(0)
    draws = [rng.random(shape, dtype=np.float32) * 4 - 2 for shape in shapes]

    def run(samples):
        """`call` on the batch of the drawn `samples` of every input."""
        values = iter([ops.convert_to_tensor(draw[samples], dtype=x.dtype)
                       for x, draw in zip(tensors, draws)])
        args, kwargs = keras.tree.map_structure(
            lambda x: next(values) if isinstance(x, keras.KerasTensor)
            else x, arguments)
        return [ops.convert_to_numpy(y if keras.backend.standardize_dtype(
            y.dtype) == "float64" else ops.cast(y, "float32"))
                for y in keras.tree.flatten(call(*args, **kwargs))
                if ops.is_tensor(y)]

    # Sample 0 with sample 1 drawn anew, and sample 1 with sample 0.
    kept = {0: [0, 2], 1: [2, 1]}
    with _random_state_kept():
        try:
            outputs = run([0, 1])
            if not _all_close(outputs, run([0, 1]), tensors):
                # It draws random numbers: nothing to compare.
                return None
            changed = {i: run(samples) for i, samples in kept.items()}
        except Exception:
            # A call that cannot take random inputs tells nothing.
            return None
    for output in outputs:
        if output.ndim == 0 or output.shape[0] != 2:
            return (f"does not keep the batch axis first: on a batch of 2 "
                    f"it returns shape {tuple(output.shape)}")
    for i, others in changed.items():
        if not _all_close([y[i] for y in others], [y[i] for y in outputs],
                          tensors):
            return (f"computes a sample's result from the other samples of "
                    f"its batch too (on random inputs, sample {i}'s result "
                    f"changes where the other sample of its batch of 2 "
                    f"changes)")
    return None


def _all_close(ours, theirs, tensors):
    """Whether the outputs `ours` and `theirs` agree to the precision of
    the inputs `tensors`, relative to each output's largest value."""
    half = any(keras.backend.standardize_dtype(x.dtype) in (
        "float16", "bfloat16") for x in tensors)
    rtol = 1e-2 if half else 1e-5
    if len(ours) != len(theirs):
        return False
    for a, b in zip(ours, theirs):
        if a.shape != b.shape:
            return False
        if np.array_equal(a, b, equal_nan=True):
            continue
        finite = np.abs(b[np.isfinite(b)])
        scale = finite.max() if finite.size and finite.max() > 0 else 1.0
        if not np.allclose(a, b, rtol=0, atol=rtol * scale, equal_nan=True):
            return False
    return True


@contextlib.contextmanager
def _random_state_kept():
    """Leaves the random state that a probe's calls may draw from (Python's,
    and Keras's global seed generator, which unseeded draws advance) as it
    was: probing must not change what the layers fused after it draw."""
    python_state = random.getstate()
    generator = global_state.get_global_attribute(GLOBAL_SEED_GENERATOR)
    seed_state = None if generator is None else ops.convert_to_numpy(
        generator.state)
    try:
        yield
    finally:
        random.setstate(python_state)
        if generator is None:
            global_state.set_global_attribute(GLOBAL_SEED_GENERATOR, None)
        else:
            generator.state.assign(seed_state)


def check_lambda_acts_per_sample(layer):
    """Refuses the stock `Lambda` `layer` where its function reaches across
    the batch axis (`sample_mixing`, at every call of the layer in a
    graph): folded over the models, it would mix their samples."""
    for node in layer._inbound_nodes:
        mixing = sample_mixing(
            layer.call, layer.compute_output_spec,
            (node.arguments.args, node.arguments.kwargs))
        if mixing:
            raise ValueError(
                f"hftatf cannot fuse layer '{layer.name}' (Lambda): its "
                f"function {mixing}. A Lambda, like a raw operation, runs "
                "on the samples of all models folded into one batch, so its "
                "function must treat every sample on its own. "
                f"{PER_SAMPLE_ADVICE}")


def _stochastic_depth():
    from keras.src.applications import convnext

    return convnext.StochasticDepth


# Per-sample random layers that draw without a SeedGenerator of their own.
UNSEEDED_RANDOM_LAYERS = (_stochastic_depth(),)


def _dropout_models_first(layer, inputs, num_models, training):
    """The stock `Dropout` `layer` on `inputs` with the models first, `[B,
    batch, ...]`, drawing exactly the masks it draws with the models second.

    The stock layer on the folded batch `[batch * B, ...]` draws its
    uniform noise in that order; here the same draw (same seed, shape and
    algorithm) is compared with the rate, and only the boolean mask moves
    the models first: one copy of a quarter of the activations' bytes, where
    swapping the activations for the stock layer would move them twice
    (and their gradients twice more). The output is TensorFlow's
    `stateless_dropout`'s, `where(keep, x * (1 / (1 - rate)), 0)`.
    """
    if not training or layer.rate == 0:
        return inputs
    if layer.rate == 1.0:
        return tf.zeros_like(inputs)
    seed = _cast_seed(draw_seed(layer.seed_generator))
    shape = ops.shape(inputs)
    # The noise shape of the folded batch with the models second.
    folded = [shape[1] * num_models, *shape[2:]]
    noise_shape = folded if layer.noise_shape is None else [
        size if dim is None else dim
        for size, dim in zip(folded, layer.noise_shape)]
    keep = tf.random.stateless_uniform(
        noise_shape, seed=seed, dtype=inputs.dtype, alg=None) >= layer.rate
    keep = ops.reshape(keep, (shape[1], num_models, *noise_shape[1:]))
    keep = ops.swapaxes(keep, 0, 1)
    scale = tf.convert_to_tensor(1 / (1 - layer.rate), dtype=inputs.dtype)
    zero = tf.zeros((), inputs.dtype)
    pieces = pieces_if_stacked(inputs, num_models, 0)
    if pieces is None:
        return tf.where(keep, inputs * scale, zero)
    return stack_models([tf.where(k, piece * scale, zero) for k, piece in
                         zip(split_models(keep, num_models, 0), pieces)], 0)


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
    rebuilt from its function."""
    if isinstance(layer, keras.layers.Lambda):
        if layer.activity_regularizer is None:
            return layer
        return keras.layers.Lambda(
            layer.function, output_shape=layer._output_shape,
            mask=layer.mask, arguments=layer.arguments, name=layer.name,
            dtype=layer.dtype_policy,
            activity_regularizer=layer.activity_regularizer)
    return type(layer).from_config(layer.get_config())


def has_random_state(layer):
    """Whether `layer` draws random numbers (dropout, noise, ...)."""
    return isinstance(layer, UNSEEDED_RANDOM_LAYERS) or any(
        isinstance(value, keras.random.SeedGenerator)
        for value in vars(layer).values())


@hftatf_export
@registry.register(*PER_SAMPLE_LAYERS, *UNSEEDED_RANDOM_LAYERS)
class FusedFold(ModelActivityRegularization, keras.layers.Wrapper):
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
        `Dot`), or draws one mask for the whole batch (a `noise_shape`
        of batch size 1), which folding would share between the
        models."""
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
        if not self.layer.built and utils.is_default(self.layer.build):
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
            return _dropout_models_first(self.layer, inputs, self.num_models,
                                         training)
        kwargs = _fold_tensors(arguments, self.name, self.num_models,
                               self.models_first)
        if self.layer._call_has_training_arg and training is not None:
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
        if mask is not None and self.layer._call_has_mask_arg:
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
        seed = layer._get_seed_generator(layer.backend._backend)
        images = ops.cast(inputs, layer.compute_dtype)
        rank = len(shape)
        leading = tf.shape(images)[:2]
        for axis, size, target in ((layer.height_axis, height, layer.height),
                                   (layer.width_axis, width, layer.width)):
            # As the stock draw, with one start per model.
            starts = ops.cast(keras.random.uniform(
                (self.num_models,), 0, maxval=float(size - target + 1),
                seed=seed), "int32")
            index = starts[:, None] + ops.arange(target, dtype="int32")
            index = index[:, None] if self.models_first else index[None]
            # Model b's window along `axis`, for every sample of model b.
            images = tf.gather(
                images, tf.broadcast_to(index, tf.concat(
                    [leading, [target]], 0)),
                axis=rank + axis, batch_dims=2)
        return images


@hftatf_export
class BroadcastToModels(keras.layers.Layer):
    """Gives every model of the array the same input batch.

    Layout: input `[batch, ...]` (shared by all models) -> output
    `[batch, B, ...]` (`[B, batch, ...]` with `models_first=True`). No
    weights. `hftatf.fuse` inserts it where a shared input first meets a
    layer that needs per-model activations; in the backward pass the models'
    gradients are summed, as they should be for a shared input.
    """

    def __init__(self, num_models, models_first=False, **kwargs):
        # It moves values and never casts them: a float32 tensor of a
        # mixed-precision model stays float32.
        super().__init__(autocast=False, **kwargs)
        self.num_models = check_num_models(num_models)
        self.models_first = bool(models_first)
        self.supports_masking = True

    def _repeat(self, tensor):
        return repeat_models(tensor, self.num_models,
                             model_axis_of(self.models_first))

    def call(self, inputs):
        return self._repeat(inputs)

    def compute_mask(self, inputs, mask=None):
        if mask is None:
            return None
        return self._repeat(mask)

    def compute_output_shape(self, input_shape):
        if self.models_first:
            return (self.num_models, *input_shape)
        return (input_shape[0], self.num_models, *input_shape[1:])

    def get_config(self):
        config = super().get_config()
        config["num_models"] = self.num_models
        if self.models_first:
            config["models_first"] = True
        return config


@hftatf_export
class FoldModelAxis(keras.layers.Layer):
    """`[batch, B, ...]` -> `[batch * B, ...]`: the models' samples side by
    side in one batch, for an operation that treats every sample alike.

    `hftatf.fuse` puts raw `keras.ops` nodes of a functional model (e.g.
    `ops.tanh(x)`, `ops.concatenate([a, b], axis=-1)`) between a
    `FoldModelAxis` and an `UnfoldModelAxis`, so the operation runs once for
    all models with its axis arguments unchanged. An operation that reduces
    or indexes the batch axis would mix the models; write it as a layer.
    """

    def __init__(self, num_models, **kwargs):
        # It moves values and never casts them: a float32 tensor of a
        # mixed-precision model stays float32.
        super().__init__(autocast=False, **kwargs)
        self.num_models = check_num_models(num_models)
        self.supports_masking = True

    def call(self, inputs):
        check_model_axis(self.name, self.num_models, tuple(inputs.shape))
        return rearranged(fold_for_stock, inputs)

    def compute_mask(self, inputs, mask=None):
        return None if mask is None else fold_models(mask)

    def compute_output_shape(self, input_shape):
        batch = input_shape[0]
        return (None if batch is None else batch * self.num_models,
                *input_shape[2:])

    def get_config(self):
        config = super().get_config()
        config["num_models"] = self.num_models
        return config


@hftatf_export
class UnfoldModelAxis(keras.layers.Layer):
    """`[batch * B, ...]` -> `[batch, B, ...]`, the inverse of
    `FoldModelAxis`."""

    def __init__(self, num_models, **kwargs):
        # It moves values and never casts them: a float32 tensor of a
        # mixed-precision model stays float32.
        super().__init__(autocast=False, **kwargs)
        self.num_models = check_num_models(num_models)
        self.supports_masking = True

    def call(self, inputs):
        return unfold_models(inputs, self.num_models)

    def compute_mask(self, inputs, mask=None):
        return None if mask is None else unfold_models(
            mask, self.num_models)

    def compute_output_shape(self, input_shape):
        batch = input_shape[0]
        return (None if batch is None else batch // self.num_models,
                self.num_models, *input_shape[1:])

    def get_config(self):
        config = super().get_config()
        config["num_models"] = self.num_models
        return config


@hftatf_export
class SwapModelAxis(keras.layers.Layer):
    """`[batch, B, ...]` <-> `[B, batch, ...]`: swaps the batch and model
    axes (and those of a mask), moving activations into or out of the
    models-first layout.

    `hftatf.fuse` inserts it where a tensor with the models first meets a
    layer that computes with them second (a layer normalization,
    an output of the array), or the reverse. No weights.

    Args:
        models_first: the layout of the output: True for `[B, batch, ...]`
            (moving into the models-first layout), False for `[batch, B,
            ...]`, None where not known (the swap is the same either way;
            `hftatf.passes` reads it to size one model's activations).
    """

    def __init__(self, models_first=None, **kwargs):
        # It moves values and never casts them: a float32 tensor of a
        # mixed-precision model stays float32.
        super().__init__(autocast=False, **kwargs)
        self.supports_masking = True
        self.models_first = None if models_first is None else bool(
            models_first)

    def call(self, inputs):
        return swap_model_axis(inputs)

    def compute_mask(self, inputs, mask=None):
        return None if mask is None else swap_model_axis(mask)

    def compute_output_shape(self, input_shape):
        return (input_shape[1], input_shape[0], *input_shape[2:])

    def get_config(self):
        config = super().get_config()
        if self.models_first is not None:
            config["models_first"] = self.models_first
        return config
