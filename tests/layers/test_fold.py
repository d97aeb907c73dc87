"""FusedFold and BroadcastToModels against stock Keras.

The oracle of `FusedFold(layer, B)` on `[batch, B, ...]` inputs is the stock
layer applied to every model slice `x[:, b]`, stacked on axis 1.
"""

import copy
import random

import keras
import numpy as np
import pytest
from keras.src.applications.convnext import StochasticDepth
from keras.src.applications.inception_resnet_v2 import CustomScaleLayer
from testing import assert_close, trains_like_stock, value_and_gradients

import hftatf
from hftatf.layers import (
    PER_BATCH_LAYERS,
    PER_SAMPLE_LAYERS,
    BroadcastToModels,
    FusedDense,
    FusedFold,
    FusedPerModel,
    FusedRandomCrop,
    registry,
    resolve,
)
from hftatf.layers.fold import UNSEEDED_RANDOM_LAYERS
from hftatf.layers.sample_mixing import sample_mixing

NUM_MODELS = 3
BATCH = 2

class IntShape(tuple):
    """A per-model input shape whose values are integers in [0, high)."""

    def __new__(cls, shape, high):
        instance = super().__new__(cls, (shape, high))
        instance.shape, instance.high = shape, high
        return instance


class Texts(tuple):
    """A per-model input shape of short texts (TensorFlow strings)."""

    def __new__(cls, shape):
        instance = super().__new__(cls, (shape,))
        instance.shape = shape
        return instance


WORDS = ["a", "b", "c b", "zz", "a c d"]
# Stock Keras runs its string layers in `tf.data` on other backends.
TEXT_ONLY_ON_TENSORFLOW = pytest.mark.backends(
    "tensorflow", reason="Keras takes text inside a model on TensorFlow "
    "only (on JAX, in tf.data)")


# One row per case: id, stock layer factory, per-model input shape(s) (a list
# of shapes for merge layers). Every class of PER_SAMPLE_LAYERS has at least
# one row (test_table_covers_every_per_sample_layer); random layers are
# compared here in inference mode, and in training mode further down.
CASES = [
    ("Activation_relu", lambda: keras.layers.Activation("relu"), (4, 5)),
    ("Activation_sigmoid", lambda: keras.layers.Activation("sigmoid"),
     (5,)),
    ("ReLU", lambda: keras.layers.ReLU(), (4, 5)),
    ("ReLU_args", lambda: keras.layers.ReLU(
        max_value=1.0, negative_slope=0.1, threshold=0.2), (4, 5)),
    ("LeakyReLU", lambda: keras.layers.LeakyReLU(negative_slope=0.2), (5,)),
    ("ELU", lambda: keras.layers.ELU(alpha=0.5), (5,)),
    ("Softmax", lambda: keras.layers.Softmax(), (4, 5)),
    ("Softmax_axis1", lambda: keras.layers.Softmax(axis=1), (4, 5)),
    ("Dropout", lambda: keras.layers.Dropout(0.5), (4, 5)),
    ("SpatialDropout1D", lambda: keras.layers.SpatialDropout1D(0.5),
     (4, 5)),
    ("SpatialDropout2D", lambda: keras.layers.SpatialDropout2D(0.5),
     (3, 3, 2)),
    ("SpatialDropout3D", lambda: keras.layers.SpatialDropout3D(0.5),
     (2, 2, 2, 2)),
    ("GaussianNoise", lambda: keras.layers.GaussianNoise(0.3), (5,)),
    ("GaussianDropout", lambda: keras.layers.GaussianDropout(0.3), (5,)),
    ("AlphaDropout", lambda: keras.layers.AlphaDropout(0.3), (5,)),
    ("Flatten", lambda: keras.layers.Flatten(), (2, 3, 2)),
    ("Reshape", lambda: keras.layers.Reshape((5, 4)), (4, 5)),
    ("Reshape_infer", lambda: keras.layers.Reshape((-1, 2)), (4, 3)),
    ("Permute", lambda: keras.layers.Permute((2, 1)), (4, 5)),
    ("Permute_3d", lambda: keras.layers.Permute((3, 1, 2)), (2, 3, 4)),
    ("RepeatVector", lambda: keras.layers.RepeatVector(3), (5,)),
    ("Identity", lambda: keras.layers.Identity(), (4, 5)),
    ("Cropping1D", lambda: keras.layers.Cropping1D((1, 2)), (6, 2)),
    ("Cropping2D", lambda: keras.layers.Cropping2D(((1, 0), (0, 2))),
     (4, 5, 2)),
    ("Cropping3D", lambda: keras.layers.Cropping3D(1), (3, 4, 4, 1)),
    ("ZeroPadding1D", lambda: keras.layers.ZeroPadding1D((2, 1)), (3, 2)),
    ("ZeroPadding2D", lambda: keras.layers.ZeroPadding2D(((1, 0), (2, 1))),
     (3, 3, 2)),
    ("ZeroPadding3D", lambda: keras.layers.ZeroPadding3D(1), (2, 2, 2, 1)),
    ("UpSampling1D", lambda: keras.layers.UpSampling1D(2), (3, 2)),
    ("UpSampling2D", lambda: keras.layers.UpSampling2D(2), (2, 3, 2)),
    ("UpSampling2D_bilinear", lambda: keras.layers.UpSampling2D(
        2, interpolation="bilinear"), (2, 3, 2)),
    ("UpSampling3D", lambda: keras.layers.UpSampling3D(2), (2, 2, 2, 1)),
    ("MaxPooling1D", lambda: keras.layers.MaxPooling1D(2), (6, 2)),
    ("MaxPooling2D", lambda: keras.layers.MaxPooling2D(2), (4, 4, 2)),
    ("MaxPooling2D_same", lambda: keras.layers.MaxPooling2D(
        3, strides=1, padding="same"), (4, 4, 2)),
    ("MaxPooling3D", lambda: keras.layers.MaxPooling3D(2), (4, 4, 4, 1)),
    ("AveragePooling1D", lambda: keras.layers.AveragePooling1D(2), (6, 2)),
    ("AveragePooling2D", lambda: keras.layers.AveragePooling2D(2),
     (4, 4, 2)),
    ("AveragePooling3D", lambda: keras.layers.AveragePooling3D(2),
     (4, 4, 4, 1)),
    ("GlobalMaxPooling1D", lambda: keras.layers.GlobalMaxPooling1D(),
     (5, 3)),
    ("GlobalMaxPooling2D", lambda: keras.layers.GlobalMaxPooling2D(),
     (4, 4, 3)),
    ("GlobalMaxPooling3D", lambda: keras.layers.GlobalMaxPooling3D(),
     (2, 2, 2, 3)),
    ("GlobalAveragePooling1D", lambda: keras.layers.GlobalAveragePooling1D(),
     (5, 3)),
    ("GlobalAveragePooling1D_keepdims",
     lambda: keras.layers.GlobalAveragePooling1D(keepdims=True), (5, 3)),
    ("GlobalAveragePooling2D", lambda: keras.layers.GlobalAveragePooling2D(),
     (4, 4, 3)),
    ("GlobalAveragePooling3D", lambda: keras.layers.GlobalAveragePooling3D(),
     (2, 2, 2, 3)),
    ("Add", lambda: keras.layers.Add(), [(4,), (4,)]),
    ("Add_three", lambda: keras.layers.Add(), [(2, 4), (2, 4), (2, 4)]),
    ("Subtract", lambda: keras.layers.Subtract(), [(4,), (4,)]),
    ("Multiply", lambda: keras.layers.Multiply(), [(2, 4), (2, 4)]),
    ("Average", lambda: keras.layers.Average(), [(4,), (4,)]),
    ("Maximum", lambda: keras.layers.Maximum(), [(4,), (4,)]),
    ("Minimum", lambda: keras.layers.Minimum(), [(4,), (4,)]),
    ("Concatenate_axis1", lambda: keras.layers.Concatenate(axis=1),
     [(2, 3), (4, 3)]),
    ("Concatenate_axis-1", lambda: keras.layers.Concatenate(axis=-1),
     [(2, 3), (2, 5)]),
    ("Dot_axes1", lambda: keras.layers.Dot(axes=1), [(5,), (5,)]),
    ("Dot_axes1_normalize", lambda: keras.layers.Dot(axes=1, normalize=True),
     [(5,), (5,)]),
    ("Dot_axes_2_1", lambda: keras.layers.Dot(axes=(2, 1)),
     [(3, 4), (4, 2)]),
    ("Rescaling", lambda: keras.layers.Rescaling(scale=0.5, offset=1.0),
     (4,)),
    ("Resizing", lambda: keras.layers.Resizing(3, 5), (4, 4, 2)),
    ("CenterCrop", lambda: keras.layers.CenterCrop(2, 3), (4, 5, 2)),
    ("Masking", lambda: keras.layers.Masking(), (4, 3)),
    ("UnitNormalization", lambda: keras.layers.UnitNormalization(), (4, 3)),
    ("UnitNormalization_axes", lambda: keras.layers.UnitNormalization(
        axis=[1, 2]), (4, 3)),
    ("StochasticDepth", lambda: StochasticDepth(0.3), (4, 3)),
    ("CustomScaleLayer", lambda: CustomScaleLayer(0.17), [(4, 3), (4, 3)]),
    ("AdaptiveAveragePooling1D",
     lambda: keras.layers.AdaptiveAveragePooling1D(2), (5, 3)),
    ("AdaptiveAveragePooling2D",
     lambda: keras.layers.AdaptiveAveragePooling2D((2, 3)), (4, 5, 2)),
    ("AdaptiveAveragePooling3D",
     lambda: keras.layers.AdaptiveAveragePooling3D(2), (4, 4, 4, 2)),
    ("AdaptiveMaxPooling1D", lambda: keras.layers.AdaptiveMaxPooling1D(2),
     (5, 3)),
    ("AdaptiveMaxPooling2D",
     lambda: keras.layers.AdaptiveMaxPooling2D((3, 2)), (5, 4, 2)),
    ("AdaptiveMaxPooling3D", lambda: keras.layers.AdaptiveMaxPooling3D(2),
     (4, 4, 4, 2)),
    ("CategoryEncoding", lambda: keras.layers.CategoryEncoding(
        6, output_mode="count"), IntShape((4,), 6)),
    ("Discretization", lambda: keras.layers.Discretization(
        bin_boundaries=[-0.5, 0.0, 0.5]), (4, 3)),
    ("Hashing", lambda: keras.layers.Hashing(7), IntShape((3,), 100)),
    ("HashedCrossing", lambda: keras.layers.HashedCrossing(
        9, output_mode="one_hot"), [IntShape((1,), 20), IntShape((1,), 20)]),
    ("IntegerLookup", lambda: keras.layers.IntegerLookup(
        vocabulary=[1, 2, 3, 5, 8]), IntShape((3,), 10)),
    ("StringLookup", lambda: keras.layers.StringLookup(
        vocabulary=["a", "b", "zz"], output_mode="multi_hot"), Texts((2,))),
    ("TextVectorization", lambda: keras.layers.TextVectorization(
        vocabulary=["a", "b", "c"], output_sequence_length=3), Texts((1,))),
    # Random augmentation, compared in inference mode here.
    ("RandomFlip", lambda: keras.layers.RandomFlip(), (4, 4, 2)),
    ("RandomRotation", lambda: keras.layers.RandomRotation(0.2), (4, 4, 2)),
    ("RandomTranslation",
     lambda: keras.layers.RandomTranslation(0.2, 0.2), (4, 4, 2)),
    ("RandomZoom", lambda: keras.layers.RandomZoom(0.2), (4, 4, 2)),
    ("RandomContrast", lambda: keras.layers.RandomContrast(0.3), (4, 4, 2)),
    ("RandomBrightness", lambda: keras.layers.RandomBrightness(
        0.2, value_range=(-3.0, 3.0)), (4, 4, 2)),
    ("RandomColorDegeneration",
     lambda: keras.layers.RandomColorDegeneration(0.5), (4, 4, 3)),
    ("RandomColorJitter", lambda: keras.layers.RandomColorJitter(
        brightness_factor=0.2, hue_factor=0.2), (4, 4, 3)),
    ("RandomGrayscale", lambda: keras.layers.RandomGrayscale(), (4, 4, 3)),
    ("RandomHue", lambda: keras.layers.RandomHue(0.3), (4, 4, 3)),
    ("RandomSaturation", lambda: keras.layers.RandomSaturation(0.3),
     (4, 4, 3)),
    ("RandomSharpness", lambda: keras.layers.RandomSharpness(0.3),
     (4, 4, 3)),
    ("RandomShear", lambda: keras.layers.RandomShear(0.3, 0.3), (4, 4, 2)),
    ("RandomPerspective", lambda: keras.layers.RandomPerspective(),
     (4, 4, 2)),
    ("RandomInvert", lambda: keras.layers.RandomInvert(), (4, 4, 2)),
    ("RandomPosterization", lambda: keras.layers.RandomPosterization(4),
     (4, 4, 3)),
    ("RandomErasing", lambda: keras.layers.RandomErasing(), (4, 4, 2)),
    ("Solarization", lambda: keras.layers.Solarization(0.2, 0.2),
     (4, 4, 2)),
    # Deterministic per-image adjustments, which apply in inference too.
    ("AutoContrast", lambda: keras.layers.AutoContrast(
        value_range=(-3.0, 3.0)), (4, 4, 2)),
    ("ContrastLimitedAdaptiveHistogramEqualization",
     lambda: keras.layers.ContrastLimitedAdaptiveHistogramEqualization(
         value_range=(-3.0, 3.0), tile_grid_size=(2, 2)), (4, 4, 2)),
    ("MelSpectrogram", lambda: keras.layers.MelSpectrogram(
        fft_length=16, sequence_stride=8, num_mel_bins=4,
        sampling_rate=100), (40,)),
    ("Lambda", lambda: keras.layers.Lambda(lambda t: t * 2.0 + 1.0), (4, 3)),
]
CASE_IDS = [pytest.param(case[0], marks=TEXT_ONLY_ON_TENSORFLOW)
            if isinstance(case[2], Texts) else case[0] for case in CASES]
CASES_BY_ID = {case[0]: case for case in CASES}


def make_inputs(shapes, rng, num_models=NUM_MODELS, batch=BATCH):
    """One random `[batch, B, *shape]` array per input of the layer (of
    integers in [0, high) for an `IntShape`)."""
    shapes = shapes if isinstance(shapes, list) else [shapes]
    return [_texts(rng.choice(WORDS, (batch, num_models, *s.shape)))
            if isinstance(s, Texts)
            else rng.integers(0, s.high, (batch, num_models, *s.shape))
            if isinstance(s, IntShape)
            else rng.standard_normal((batch, num_models, *s)).astype("float32")
            for s in shapes]


def _texts(words):
    import tensorflow as tf

    return tf.constant(words)


def call(layer, inputs, **kwargs):
    """Calls `layer` on one input or on a list of inputs."""
    return layer(inputs[0] if len(inputs) == 1 else list(inputs), **kwargs)


def stock_per_model(layer, inputs, num_models=NUM_MODELS, **kwargs):
    """The oracle: the stock layer on every model slice, stacked on axis 1."""
    return np.stack([
        keras.ops.convert_to_numpy(
            call(layer, [x[:, b] for x in inputs], **kwargs))
        for b in range(num_models)
    ], axis=1)


def input_shapes(inputs):
    shapes = [tuple(x.shape) for x in inputs]
    return shapes[0] if len(shapes) == 1 else shapes


def test_table_covers_every_per_sample_layer():
    tested = {type(factory()) for _, factory, _ in CASES}
    folded = set(PER_SAMPLE_LAYERS) | set(UNSEEDED_RANDOM_LAYERS)
    assert folded <= set(resolve.folded_layers())
    assert set(resolve.folded_layers()) <= tested, (
        set(resolve.folded_layers()) - tested)


@pytest.mark.parametrize("case_id", CASE_IDS)
def test_matches_stock_per_model(case_id):
    _, factory, shapes = CASES_BY_ID[case_id]
    rng = np.random.default_rng(0)
    inputs = make_inputs(shapes, rng)
    fused = FusedFold(factory(), NUM_MODELS)
    # Inference mode, which augmentation layers (training=True by default)
    # must be told.
    y = keras.ops.convert_to_numpy(call(fused, inputs, training=False))
    assert not fused.weights
    assert_close(y, stock_per_model(factory(), inputs, training=False))
    expected_shape = fused.compute_output_shape(input_shapes(inputs))
    assert expected_shape[0] in (None, BATCH)
    assert tuple(expected_shape[1:]) == y.shape[1:]


@pytest.mark.parametrize("case_id", CASE_IDS)
def test_symbolic_call_in_a_functional_model(case_id):
    _, factory, shapes = CASES_BY_ID[case_id]
    rng = np.random.default_rng(1)
    inputs = make_inputs(shapes, rng)
    symbolic = [keras.Input(x.shape[1:], dtype=x.dtype) for x in inputs]
    outputs = call(FusedFold(factory(), NUM_MODELS), symbolic)
    model = keras.Model(symbolic, outputs)
    y = keras.ops.convert_to_numpy(model(inputs, training=False))
    assert tuple(outputs.shape[1:]) == y.shape[1:]
    assert_close(y, stock_per_model(factory(), inputs, training=False))


@pytest.mark.parametrize("case_id", [
    "Softmax_axis1", "MaxPooling2D", "AveragePooling1D",
    "UpSampling2D_bilinear", "GlobalAveragePooling1D", "Permute_3d",
    "Concatenate_axis1", "Multiply", "Dot_axes_2_1", "Dot_axes1_normalize",
])
def test_input_gradients_match_stock(case_id):
    _, factory, shapes = CASES_BY_ID[case_id]
    rng = np.random.default_rng(2)
    inputs = make_inputs(shapes, rng)
    fused = FusedFold(factory(), NUM_MODELS)
    stock = factory()
    y = keras.ops.convert_to_numpy(call(fused, inputs))
    cotangent = rng.standard_normal(y.shape).astype("float32")

    def gradients(layer, xs, cot):
        def scalar(*xs):
            outputs = call(layer, list(xs))
            return outputs, keras.ops.sum(outputs * cot)
        return value_and_gradients(scalar, xs)[1]

    fused_grads = gradients(fused, inputs, cotangent)
    for b in range(NUM_MODELS):
        stock_grads = gradients(stock, [x[:, b] for x in inputs],
                                cotangent[:, b])
        for i, (got, expected) in enumerate(zip(fused_grads, stock_grads)):
            assert_close(got[:, b], expected,
                         err_msg=f"input {i}, model {b}")


@pytest.mark.parametrize("merge", ["layer", "raw op"])
def test_a_column_added_at_a_folded_batch_equal_to_the_width(merge):
    # Keras's TensorFlow `add` takes a [batch, 1] operand for a bias
    # (tf.nn.bias_add) where batch equals the width: folded, [4 * 2, 1] +
    # [8, 8] would add the column along the wrong axis, where the stock
    # models, at batch 4, add it right.
    def build(seed):
        keras.utils.set_random_seed(seed)
        x = keras.Input((4,))
        wide = keras.layers.Dense(8)(x)
        column = keras.layers.Dense(1)(x)
        y = (keras.layers.Add()([wide, column]) if merge == "layer"
             else wide + keras.ops.mean(wide, axis=-1, keepdims=True))
        return keras.Model(x, y)

    models = [build(seed) for seed in range(2)]
    array = hftatf.fuse_models(models)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 4)).astype("float32")
    y = rng.normal(size=(8, 8)).astype("float32")
    predicted = array.predict(x, batch_size=4, verbose=0)
    for b, model in enumerate(models):
        assert_close(predicted[:, b], model.predict(x, batch_size=4,
                                                    verbose=0))
    array.compile(hftatf.optimizers.SGD(0.1), loss="mse")
    array.fit(x, y, batch_size=4, shuffle=False, verbose=0)
    for b, model in enumerate(models):
        model.compile(keras.optimizers.SGD(0.1), loss="mse")
        model.fit(x, y, batch_size=4, shuffle=False, verbose=0)
        for ours, theirs in zip(array.get_model_weights(b),
                                model.get_weights()):
            assert_close(ours, theirs)


def test_compute_output_shape_of_a_merge():
    fused = FusedFold(keras.layers.Concatenate(axis=1), NUM_MODELS)
    assert tuple(fused.compute_output_shape(
        [(None, NUM_MODELS, 2, 3), (None, NUM_MODELS, 4, 3)])) == (
        None, NUM_MODELS, 6, 3)


def test_compute_output_shape_keeps_batch_size():
    stock = keras.layers.ReLU()
    assert tuple(stock.compute_output_shape((BATCH, 5))) == (BATCH, 5)
    fused = FusedFold(keras.layers.ReLU(), NUM_MODELS)
    assert tuple(fused.compute_output_shape((BATCH, NUM_MODELS, 5))) == (
        BATCH, NUM_MODELS, 5)


# Masks.


def masked_input(rng, timesteps=5, features=3):
    """`[batch, B, T, C]` with some all-zero time steps, different per model,
    and the stock Masking mask they imply."""
    x = rng.standard_normal(
        (BATCH, NUM_MODELS, timesteps, features)).astype("float32")
    padded = rng.random((BATCH, NUM_MODELS, timesteps)) < 0.4
    padded[..., 0] = False  # Keep a step per sequence: no empty average.
    x[padded] = 0.0
    return x, ~padded


def test_masking_mask_matches_stock():
    rng = np.random.default_rng(3)
    x, not_padded = masked_input(rng)
    fused = FusedFold(keras.layers.Masking(), NUM_MODELS)
    stock = keras.layers.Masking()
    mask = keras.ops.convert_to_numpy(fused.compute_mask(x))
    expected = np.stack([
        keras.ops.convert_to_numpy(stock.compute_mask(x[:, b]))
        for b in range(NUM_MODELS)], axis=1)
    np.testing.assert_array_equal(mask, expected)
    np.testing.assert_array_equal(mask, not_padded)
    assert_close(fused(x), stock_per_model(stock, [x]))


def test_explicit_mask_reaches_the_stock_layer():
    rng = np.random.default_rng(4)
    x, mask = masked_input(rng)
    x = rng.standard_normal(x.shape).astype("float32")  # Mask-only padding.
    fused = FusedFold(keras.layers.GlobalAveragePooling1D(), NUM_MODELS)
    stock = keras.layers.GlobalAveragePooling1D()
    expected = np.stack([stock(x[:, b], mask=mask[:, b])
                         for b in range(NUM_MODELS)], axis=1)
    assert_close(fused(x, mask=mask), expected)
    # The mask must matter, or this test would not test it.
    assert not np.allclose(expected, stock_per_model(stock, [x]))


def test_mask_propagates_between_folded_layers():
    rng = np.random.default_rng(5)
    x, _ = masked_input(rng)
    masking = FusedFold(keras.layers.Masking(), NUM_MODELS)
    pooling = FusedFold(keras.layers.GlobalAveragePooling1D(), NUM_MODELS)
    y = pooling(masking(x))
    stock_masking = keras.layers.Masking()
    stock_pooling = keras.layers.GlobalAveragePooling1D()
    expected = np.stack([stock_pooling(stock_masking(x[:, b]))
                         for b in range(NUM_MODELS)], axis=1)
    assert_close(y, expected)
    assert not np.allclose(expected, stock_per_model(stock_pooling, [x]))


def test_mask_propagates_in_a_functional_model():
    rng = np.random.default_rng(6)
    x, _ = masked_input(rng)
    inputs = keras.Input(x.shape[1:])
    hidden = FusedFold(keras.layers.Masking(), NUM_MODELS)(inputs)
    outputs = FusedFold(keras.layers.GlobalAveragePooling1D(),
                        NUM_MODELS)(hidden)
    model = keras.Model(inputs, outputs)
    stock_inputs = keras.Input(x.shape[2:])
    stock = keras.Model(stock_inputs, keras.layers.GlobalAveragePooling1D()(
        keras.layers.Masking()(stock_inputs)))
    expected = np.stack([stock(x[:, b]) for b in range(NUM_MODELS)], axis=1)
    assert_close(model(x), expected)


# Random layers: every model draws its own mask or noise.

RANDOM_BATCH = 64
RANDOM_FEATURES = 256


def shared_positive_input(rng, shape):
    """Input in [1, 2), the same for every model (so output differences
    between models come from the randomness alone)."""
    x = rng.uniform(1.0, 2.0, (RANDOM_BATCH, *shape)).astype("float32")
    return np.repeat(x[:, None], NUM_MODELS, axis=1)


def alpha_dropped_value(y):
    """AlphaDropout sends every dropped unit to one value, whatever the input
    (which here is continuous, so kept units take distinct values)."""
    values, counts = np.unique(y, return_counts=True)
    return values[np.argmax(counts)]


def zero(y_stock):
    return 0.0


@pytest.mark.parametrize("factory,shape,unit_axes,dropped_value", [
    pytest.param(lambda: keras.layers.Dropout(0.5), (RANDOM_FEATURES,), (),
                 zero, id="Dropout"),
    pytest.param(lambda: keras.layers.Dropout(0.2), (RANDOM_FEATURES,), (),
                 zero, id="Dropout_0.2"),
    # One draw per (sample, channel): the mask is constant over time.
    pytest.param(lambda: keras.layers.SpatialDropout1D(0.3),
                 (4, RANDOM_FEATURES), (0,), zero, id="SpatialDropout1D"),
    pytest.param(lambda: keras.layers.AlphaDropout(0.2), (RANDOM_FEATURES,),
                 (), alpha_dropped_value, id="AlphaDropout"),
])
def test_dropout_masks_are_independent_per_model(factory, shape, unit_axes,
                                                 dropped_value):
    rng = np.random.default_rng(7)
    x = shared_positive_input(rng, shape)
    layer = factory()
    rate = layer.rate
    y = keras.ops.convert_to_numpy(
        FusedFold(layer, NUM_MODELS)(x, training=True))
    y_stock = keras.ops.convert_to_numpy(factory()(x[:, 0], training=True))
    value = dropped_value(y_stock)
    dropped = y == value
    stock_dropped = y_stock == value

    # Masks drawn once per unit: reduce the per-model axes (`unit_axes`,
    # counted after batch and model) that the mask is constant over.
    axes = tuple(2 + a for a in unit_axes)
    np.testing.assert_array_equal(dropped.all(axis=axes),
                                  dropped.any(axis=axes))
    units = dropped.all(axis=axes)
    n = units[:, 0].size
    sd = np.sqrt(rate * (1 - rate) / n)
    for b in range(NUM_MODELS):
        fraction = units[:, b].mean()
        assert abs(fraction - rate) < 4 * sd, (b, fraction, rate)
    # Independent masks disagree with probability 2 p (1 - p).
    disagree = 2 * rate * (1 - rate)
    sd = np.sqrt(disagree * (1 - disagree) / n)
    for b in range(NUM_MODELS):
        for c in range(b):
            fraction = np.mean(units[:, b] != units[:, c])
            assert abs(fraction - disagree) < 4 * sd, (b, c, fraction)
    # Where model b and the stock layer agree on the mask, they agree on the
    # value: kept units are scaled (and shifted) as by the stock layer.
    for b in range(NUM_MODELS):
        same = dropped[:, b] == stock_dropped
        assert same.mean() > 0.3
        assert_close(y[:, b][same], y_stock[same], err_msg=f"model {b}")


@pytest.mark.parametrize("factory,noise", [
    pytest.param(lambda: keras.layers.GaussianNoise(0.3),
                 lambda y, x: y - x, id="GaussianNoise"),
    pytest.param(lambda: keras.layers.GaussianDropout(0.3),
                 lambda y, x: y / x, id="GaussianDropout"),
])
def test_noise_is_independent_per_model(factory, noise):
    rng = np.random.default_rng(8)
    x = shared_positive_input(rng, (RANDOM_FEATURES,))
    y = keras.ops.convert_to_numpy(
        FusedFold(factory(), NUM_MODELS)(x, training=True))
    fused_noise = noise(y, x)
    stock_noise = noise(
        keras.ops.convert_to_numpy(factory()(x[:, 0], training=True)),
        x[:, 0])
    n = stock_noise.size
    stock_mean, stock_sd = stock_noise.mean(), stock_noise.std()
    assert stock_sd > 0
    for b in range(NUM_MODELS):
        model_noise = fused_noise[:, b]
        # Two independent samples of n: 4 sd of the difference of the means,
        # and of the standard deviations (sd(s) ~ sigma / sqrt(2 n)).
        assert abs(model_noise.mean() - stock_mean) < (
            4 * stock_sd * np.sqrt(2.0 / n)), b
        assert abs(model_noise.std() - stock_sd) < (
            4 * stock_sd * np.sqrt(1.0 / n)), b
    for b in range(NUM_MODELS):
        for c in range(b):
            r = np.corrcoef(fused_noise[:, b].ravel(),
                            fused_noise[:, c].ravel())[0, 1]
            assert abs(r) < 4 / np.sqrt(n), (b, c, r)


@pytest.mark.parametrize("factory", [
    lambda: keras.layers.Dropout(0.5),
    lambda: keras.layers.GaussianDropout(0.3),
    lambda: keras.layers.GaussianNoise(0.3),
    lambda: keras.layers.SpatialDropout1D(0.5),
    lambda: keras.layers.AlphaDropout(0.3),
], ids=["Dropout", "GaussianDropout", "GaussianNoise", "SpatialDropout1D",
        "AlphaDropout"])
def test_random_layers_in_inference_mode_match_stock(factory):
    rng = np.random.default_rng(9)
    x = rng.standard_normal((BATCH, NUM_MODELS, 4, 6)).astype("float32")
    fused = FusedFold(factory(), NUM_MODELS)
    stock = factory()
    expected = stock_per_model(stock, [x], training=False)
    assert_close(fused(x, training=False), expected)
    assert_close(fused(x), expected)  # Inference is the default.
    # And it is the stock inference behaviour: the identity.
    assert_close(expected, x)


def test_masks_change_between_calls():
    x = np.ones((RANDOM_BATCH, NUM_MODELS, RANDOM_FEATURES), "float32")
    fused = FusedFold(keras.layers.Dropout(0.5), NUM_MODELS)
    first = keras.ops.convert_to_numpy(fused(x, training=True))
    second = keras.ops.convert_to_numpy(fused(x, training=True))
    assert not np.array_equal(first == 0, second == 0)


# What FusedFold refuses.


@pytest.mark.parametrize("factory", [
    lambda: keras.layers.Dense(3),
    lambda: keras.layers.BatchNormalization(),
    lambda: keras.layers.Conv1D(2, 3),
], ids=["Dense", "BatchNormalization", "Conv1D"])
def test_refuses_layers_with_weights(factory):
    fused = FusedFold(factory(), NUM_MODELS)
    with pytest.raises(ValueError, match="can only wrap layers without "
                                         "weights"):
        fused(np.ones((BATCH, NUM_MODELS, 5, 4), "float32"))


@pytest.mark.parametrize("num_models,error", [
    (0, ValueError), (-2, ValueError), (1.5, TypeError), (True, TypeError),
])
def test_rejects_bad_num_models(num_models, error):
    with pytest.raises(error, match="num_models"):
        FusedFold(keras.layers.ReLU(), num_models)
    with pytest.raises(error, match="num_models"):
        BroadcastToModels(num_models)


def test_rejects_wrong_model_axis_when_it_builds_the_stock_layer():
    fused = FusedFold(keras.layers.Flatten(), NUM_MODELS)
    with pytest.raises(ValueError, match=f"num_models={NUM_MODELS} on axis"):
        fused(np.ones((NUM_MODELS, NUM_MODELS + 1, 5), "float32"))


@pytest.mark.parametrize("factory,shape", [
    pytest.param(lambda: keras.layers.ReLU(), (5,), id="ReLU"),
    pytest.param(lambda: keras.layers.Dropout(0.5), (5,), id="Dropout"),
    pytest.param(lambda: keras.layers.GlobalMaxPooling1D(), (5, 2),
                 id="GlobalMaxPooling1D"),
])
def test_rejects_wrong_model_axis(factory, shape):
    fused = FusedFold(factory(), NUM_MODELS)
    with pytest.raises(ValueError, match=f"num_models={NUM_MODELS} on axis"):
        fused(np.ones((NUM_MODELS, NUM_MODELS + 1, *shape), "float32"))


def test_built_fold_rejects_wrong_model_axis():
    fused = FusedFold(keras.layers.Flatten(), NUM_MODELS)
    fused(np.ones((BATCH, NUM_MODELS, 5, 2), "float32"))
    with pytest.raises(ValueError, match=f"num_models={NUM_MODELS} on axis"):
        fused(np.ones((NUM_MODELS, NUM_MODELS + 1, 5, 2), "float32"))


# BroadcastToModels.


@pytest.mark.parametrize("shape", [(5,), (4, 3)], ids=["rank2", "rank3"])
def test_broadcast_copies_the_input_to_every_model(shape):
    rng = np.random.default_rng(10)
    x = rng.standard_normal((BATCH, *shape)).astype("float32")
    layer = BroadcastToModels(NUM_MODELS)
    y = keras.ops.convert_to_numpy(layer(x))
    assert y.shape == (BATCH, NUM_MODELS, *shape)
    assert tuple(layer.compute_output_shape(x.shape)) == y.shape
    for b in range(NUM_MODELS):
        np.testing.assert_array_equal(y[:, b], x)


def test_broadcast_gradient_is_the_sum_over_models():
    rng = np.random.default_rng(11)
    x = rng.standard_normal((BATCH, 4, 3)).astype("float32")
    cotangent = rng.standard_normal(
        (BATCH, NUM_MODELS, 4, 3)).astype("float32")

    def scalar(x):
        outputs = BroadcastToModels(NUM_MODELS)(x)
        return outputs, keras.ops.sum(outputs * cotangent)
    _, (gradient,), _ = value_and_gradients(scalar, [x])
    assert_close(gradient, cotangent.sum(axis=1))


def test_broadcast_repeats_the_mask():
    mask = np.arange(BATCH * 4).reshape(BATCH, 4) % 3 > 0
    layer = BroadcastToModels(NUM_MODELS)
    got = keras.ops.convert_to_numpy(
        layer.compute_mask(np.ones((BATCH, 4, 2), "float32"), mask))
    np.testing.assert_array_equal(
        got, np.repeat(mask[:, None], NUM_MODELS, axis=1))


def test_shared_input_through_the_array_matches_stock_models():
    """Broadcast, fused dense, folded layers: model b is stock model b."""
    rng = np.random.default_rng(12)
    x = rng.standard_normal((BATCH, 6)).astype("float32")
    inputs = keras.Input((6,))
    hidden = BroadcastToModels(NUM_MODELS)(inputs)
    fused_dense = FusedDense(NUM_MODELS, 4)
    hidden = fused_dense(hidden)
    hidden = FusedFold(keras.layers.LeakyReLU(0.1), NUM_MODELS)(hidden)
    hidden = FusedFold(keras.layers.Dropout(0.5), NUM_MODELS)(hidden)
    outputs = FusedFold(keras.layers.Softmax(), NUM_MODELS)(hidden)
    array = keras.Model(inputs, outputs)
    fused_dense.set_weights([rng.standard_normal(w.shape).astype("float32")
                             for w in fused_dense.get_weights()])
    y = keras.ops.convert_to_numpy(array(x))

    def first_output(model):
        def scalar(x):
            outputs = model(x)
            return outputs, keras.ops.sum(outputs[..., 0])
        return scalar
    fused_grad = value_and_gradients(first_output(array), [x])[1][0]
    stock_grad = np.zeros_like(x)
    for b in range(NUM_MODELS):
        dense = keras.layers.Dense(4)
        stock = keras.Sequential([
            keras.Input((6,)), dense, keras.layers.LeakyReLU(0.1),
            keras.layers.Dropout(0.5), keras.layers.Softmax()])
        dense.set_weights(fused_dense.get_model_weights(b))
        assert_close(y[:, b], stock(x), err_msg=f"model {b}")
        stock_grad += value_and_gradients(first_output(stock), [x])[1][0]
    assert_close(fused_grad, stock_grad)


def test_other_call_arguments_are_folded_with_the_inputs():
    # CategoryEncoding's `count_weights`, per-model activations here.
    def build(seed):
        keras.utils.set_random_seed(seed)
        ids = keras.Input((4,), dtype="int32")
        weights = keras.Input((4,))
        counts = keras.layers.CategoryEncoding(6, output_mode="count")(
            ids, count_weights=keras.layers.Dense(4)(weights))
        return keras.Model([ids, weights], keras.layers.Dense(2)(counts))

    models = [build(seed) for seed in range(NUM_MODELS)]
    array = hftatf.fuse_models(models)
    rng = np.random.default_rng(4)
    data = [rng.integers(0, 6, (5, 4)).astype("int32"),
            rng.standard_normal((5, 4)).astype("float32")]
    outputs = array.predict(data, verbose=0)
    for b, model in enumerate(models):
        assert_close(outputs[:, b], model.predict(data, verbose=0))


# Serialization.


def test_fold_config_round_trip():
    fused = FusedFold(keras.layers.Concatenate(axis=1), NUM_MODELS,
                      name="fold_under_test")
    config = fused.get_config()
    # Stock Wrapper.from_config pops "layer" from the dict it is given.
    clone = FusedFold.from_config(copy.deepcopy(config))
    assert clone.num_models == NUM_MODELS
    assert type(clone.layer) is keras.layers.Concatenate
    assert clone.get_config() == config
    restored = keras.saving.deserialize_keras_object(
        keras.saving.serialize_keras_object(fused))
    assert type(restored) is FusedFold
    assert restored.get_config() == config


def test_broadcast_config_round_trip():
    layer = BroadcastToModels(NUM_MODELS, name="broadcast_under_test")
    config = layer.get_config()
    assert BroadcastToModels.from_config(config).get_config() == config
    restored = keras.saving.deserialize_keras_object(
        keras.saving.serialize_keras_object(layer))
    assert type(restored) is BroadcastToModels
    assert restored.get_config() == config


def test_saved_model_file_round_trip(tmp_path):
    rng = np.random.default_rng(13)
    inputs = keras.Input((4, 3))
    hidden = BroadcastToModels(NUM_MODELS)(inputs)
    hidden = FusedFold(keras.layers.MaxPooling1D(2), NUM_MODELS)(hidden)
    hidden = FusedFold(keras.layers.Flatten(), NUM_MODELS)(hidden)
    hidden = FusedFold(keras.layers.Dropout(0.5), NUM_MODELS)(hidden)
    hidden = FusedDense(NUM_MODELS, 2)(hidden)
    outputs = FusedFold(keras.layers.Softmax(), NUM_MODELS)(hidden)
    model = keras.Model(inputs, outputs)
    x = rng.standard_normal((BATCH, 4, 3)).astype("float32")
    path = tmp_path / "fold.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert [type(layer) for layer in loaded.layers] == [
        type(layer) for layer in model.layers]
    assert [type(layer.layer) for layer in loaded.layers
            if isinstance(layer, FusedFold)] == [
        type(layer.layer) for layer in model.layers
        if isinstance(layer, FusedFold)]
    np.testing.assert_array_equal(loaded(x), model(x))


def test_stochastic_depth_drops_whole_samples_per_model():
    rate = 0.3
    rng = np.random.default_rng(9)
    x = shared_positive_input(rng, (2, 3))
    y = keras.ops.convert_to_numpy(
        FusedFold(StochasticDepth(rate), NUM_MODELS)(x, training=True))
    dropped = np.all(y == 0.0, axis=(2, 3))
    kept = np.all(y != 0.0, axis=(2, 3))
    # A residual branch is dropped whole, per sample and model.
    np.testing.assert_array_equal(dropped, ~kept)
    assert_close(y[kept], (x / (1 - rate))[kept])
    n = RANDOM_BATCH
    sd = np.sqrt(rate * (1 - rate) / n)
    disagree = 2 * rate * (1 - rate)
    sd_disagree = np.sqrt(disagree * (1 - disagree) / n)
    for b in range(NUM_MODELS):
        assert abs(dropped[:, b].mean() - rate) < 4 * sd, b
        for c in range(b):
            fraction = np.mean(dropped[:, b] != dropped[:, c])
            assert abs(fraction - disagree) < 4 * sd_disagree, (b, c)


# Every folded augmentation layer, with arguments that make its draws
# visible, and the range of its pixel values.
FOLDED_AUGMENTATION = {
    "RandomFlip": (lambda: keras.layers.RandomFlip(), 1.0),
    "RandomRotation": (lambda: keras.layers.RandomRotation(0.3), 1.0),
    "RandomTranslation": (
        lambda: keras.layers.RandomTranslation(0.3, 0.3), 1.0),
    "RandomZoom": (lambda: keras.layers.RandomZoom(0.3), 1.0),
    "RandomContrast": (lambda: keras.layers.RandomContrast(0.5), 1.0),
    "RandomBrightness": (lambda: keras.layers.RandomBrightness(
        0.5, value_range=(0.0, 1.0)), 1.0),
    "RandomColorDegeneration": (
        lambda: keras.layers.RandomColorDegeneration(0.8), 255.0),
    "RandomColorJitter": (lambda: keras.layers.RandomColorJitter(
        brightness_factor=0.5, saturation_factor=0.5), 255.0),
    "RandomGrayscale": (lambda: keras.layers.RandomGrayscale(), 255.0),
    "RandomHue": (lambda: keras.layers.RandomHue(0.5), 255.0),
    "RandomSaturation": (lambda: keras.layers.RandomSaturation(0.5), 255.0),
    "RandomSharpness": (lambda: keras.layers.RandomSharpness(0.8), 255.0),
    "RandomShear": (lambda: keras.layers.RandomShear(0.5, 0.5), 255.0),
    "RandomPerspective": (lambda: keras.layers.RandomPerspective(), 255.0),
    # Each image inverted with probability 1/2: with `factor=0.5`, 1/4,
    # too close to the test's threshold of 0.2 on a batch of 64 (some seeds
    # fall below it, on either backend).
    "RandomInvert": (lambda: keras.layers.RandomInvert(1.0), 255.0),
    "RandomPosterization": (
        lambda: keras.layers.RandomPosterization(7), 255.0),
    "RandomErasing": (lambda: keras.layers.RandomErasing(), 255.0),
    "Solarization": (lambda: keras.layers.Solarization(0.5, 0.5), 255.0),
}


def test_every_folded_random_image_layer_is_checked_below():
    random_images = {
        c.__name__ for c in PER_SAMPLE_LAYERS
        if "image_preprocessing" in c.__module__
        and c.__name__.startswith(("Random", "Solarization"))}
    assert random_images == set(FOLDED_AUGMENTATION)


@pytest.mark.parametrize("name", sorted(FOLDED_AUGMENTATION))
def test_augmentation_draws_per_image_and_model(name):
    factory, high = FOLDED_AUGMENTATION[name]
    rng = np.random.default_rng(10)
    image = rng.uniform(0.0, high, (1, 1, 6, 6, 3)).astype("float32")
    x = np.repeat(np.repeat(image, RANDOM_BATCH, axis=0), NUM_MODELS,
                  axis=1)
    # The stock layer draws per image, so that folding the models into the
    # batch gives every model its own draws: identical images in a stock
    # batch come out differently.
    stock = keras.ops.convert_to_numpy(factory()(x[:, 0], training=True))
    differs = np.any(np.abs(stock - stock[:1]) > 1e-4, axis=(1, 2, 3))
    assert differs.mean() > 0.2, differs.mean()
    y = keras.ops.convert_to_numpy(
        FusedFold(factory(), NUM_MODELS)(x, training=True))
    assert y.shape == x.shape
    # Identical inputs, transformed differently: each model draws its own.
    for b in range(1, NUM_MODELS):
        differs = np.any(np.abs(y[:, b] - y[:, 0]) > 1e-4, axis=(1, 2, 3))
        assert differs.mean() > 0.2, (b, differs.mean())


# -- RandomCrop ---------------------------------------------------------------


def crop_windows(y, x, models_first, data_format):
    """Each model's `(top, left)` window of `x` that `y` is, for the whole
    batch at once (one window per model and call, as the stock layer crops
    a batch), or None for a model whose output is no single window."""
    axis = 0 if models_first else 1
    spatial = (1, 2) if data_format == "channels_last" else (2, 3)
    windows = []
    for b in range(NUM_MODELS):
        got, source = np.take(y, b, axis), np.take(x, b, axis)
        height, width = (got.shape[1 + d - 1] for d in spatial)
        found = [
            (top, left)
            for top in range(source.shape[spatial[0]] - height + 1)
            for left in range(source.shape[spatial[1]] - width + 1)
            if np.array_equal(got, np.take(np.take(
                source, range(top, top + height), spatial[0]),
                range(left, left + width), spatial[1]))]
        windows.append(found[0] if len(found) == 1 else None)
    return windows


@pytest.mark.parametrize("models_first", [False, True],
                         ids=["models_second", "models_first"])
@pytest.mark.parametrize("data_format", ["channels_last", "channels_first"])
def test_random_crop_crops_its_own_window_per_model(models_first,
                                                     data_format):
    rng = np.random.default_rng(11)
    image = (9, 8, 2) if data_format == "channels_last" else (2, 9, 8)
    x = rng.standard_normal(
        (NUM_MODELS, BATCH, *image) if models_first
        else (BATCH, NUM_MODELS, *image)).astype("float32")
    stock = keras.layers.RandomCrop(4, 3, seed=3, data_format=data_format)
    fused = resolve.fuse_layer(stock, NUM_MODELS, models_first=models_first)
    assert type(fused) is FusedRandomCrop
    draws = []
    for _ in range(4):
        y = keras.ops.convert_to_numpy(fused(x, training=True))
        assert tuple(y.shape) == tuple(fused.compute_output_shape(x.shape))
        windows = crop_windows(y, x, models_first, data_format)
        assert None not in windows, windows
        draws.append(windows)
    # The models crop at different places, and each call draws anew.
    assert any(len(set(w)) > 1 for w in draws), draws
    assert len({w[0] for w in draws}) > 1, draws
    # Every start the stock layer can draw is reachable: 6 rows, 6 columns.
    starts = np.array([w for ws in draws for w in ws])
    assert starts.min() >= 0 and starts[:, 0].max() <= 5
    assert starts[:, 1].max() <= 5


def test_random_crop_matches_stock_where_it_does_not_crop_at_random():
    rng = np.random.default_rng(12)
    # Inference: the stock layer returns its input; an image no larger than
    # the target in height is resized to the target, in training too.
    for shape, training in [((9, 8, 2), False), ((4, 8, 2), True),
                            ((3, 8, 2), True)]:
        x = rng.standard_normal((BATCH, NUM_MODELS, *shape)).astype(
            "float32")
        fused = FusedRandomCrop(keras.layers.RandomCrop(4, 3), NUM_MODELS)
        y = keras.ops.convert_to_numpy(fused(x, training=training))
        assert_close(y, stock_per_model(keras.layers.RandomCrop(4, 3), [x],
                                        training=training))


def test_random_crop_trains_in_a_fused_model_and_unfuses():
    rng = np.random.default_rng(13)
    inputs = keras.Input((10, 10, 1))
    hidden = keras.layers.RandomCrop(8, 8, seed=1)(inputs)
    hidden = keras.layers.Conv2D(2, 3, activation="relu")(hidden)
    outputs = keras.layers.Dense(1)(
        keras.layers.GlobalAveragePooling2D()(hidden))
    model = keras.Model(inputs, outputs)
    array = hftatf.fuse(model, NUM_MODELS)
    assert any(isinstance(layer, FusedRandomCrop)
               for layer in array._flatten_layers())
    array.compile("sgd", loss="mse")
    x = rng.standard_normal((8, 10, 10, 1)).astype("float32")
    history = array.fit(x, np.zeros((8, 1)), epochs=2, batch_size=4,
                        verbose=0)
    assert np.all(np.isfinite(history.history["loss"]))
    # In inference the crop layer passes its input through, as the stock
    # layer does: the unfused models predict what the array does.
    x_eval = rng.standard_normal((4, 10, 10, 1)).astype("float32")
    y = array.predict(x_eval, verbose=0)
    for b, stock in enumerate(array.unfuse()):
        assert isinstance(stock.layers[1], keras.layers.RandomCrop)
        assert_close(y[:, b], stock.predict(x_eval, verbose=0))


# -- Layers that treat a batch as a whole ------------------------------------

PER_BATCH_CASES = {
    "MixUp": lambda: keras.layers.MixUp(seed=1),
    "CutMix": lambda: keras.layers.CutMix(seed=2),
    "RandAugment": lambda: keras.layers.RandAugment(seed=3),
    "RandomGaussianBlur": lambda: keras.layers.RandomGaussianBlur(seed=4),
    "RandomElasticTransform":
        lambda: keras.layers.RandomElasticTransform(seed=5),
    "Equalization": lambda: keras.layers.Equalization(bins=16),
    "Pipeline": lambda: keras.layers.Pipeline([
        keras.layers.RandomFlip(seed=6), keras.layers.MixUp(seed=7)]),
}


def test_every_per_batch_layer_is_checked():
    tested = {type(factory()) for factory in PER_BATCH_CASES.values()}
    assert set(PER_BATCH_LAYERS) == tested | {keras.layers.AugMix}
    for stock_class in PER_BATCH_LAYERS:
        assert resolve.fused_form(stock_class.__new__(stock_class)) is (
            FusedPerModel)


@pytest.mark.parametrize("models_first", [False, True],
                         ids=["models_second", "models_first"])
@pytest.mark.parametrize("name", sorted(PER_BATCH_CASES))
def test_per_batch_layer_treats_each_models_batch_as_one_job(name,
                                                             models_first):
    factory = PER_BATCH_CASES[name]
    rng = np.random.default_rng(14)
    x = rng.uniform(0.0, 255.0, (4, NUM_MODELS, 6, 6, 3)).astype("float32")
    fused = resolve.fuse_layer(factory(), NUM_MODELS,
                                models_first=models_first)
    assert type(fused) is FusedPerModel
    stock = factory()
    for _ in range(2):
        y = keras.ops.convert_to_numpy(fused(
            np.swapaxes(x, 0, 1) if models_first else x, training=True))
        y = np.swapaxes(y, 0, 1) if models_first else y
        # B jobs, one after another, with the same seed: model b gets the
        # stock layer's output on its own batch, with the b-th draws.
        expected = np.stack([keras.ops.convert_to_numpy(
            stock(x[:, b], training=True)) for b in range(NUM_MODELS)], 1)
        assert_close(y, expected)
    if name != "Equalization":
        # Random: the models draw differently on identical batches.
        same = np.repeat(x[:, :1], NUM_MODELS, axis=1)
        y = keras.ops.convert_to_numpy(
            resolve.fuse_layer(factory(), NUM_MODELS)(same, training=True))
        assert np.abs(y[:, 1] - y[:, 0]).max() > 1.0


def test_mix_up_mixes_only_the_models_own_images():
    # Model b's images are in [1000 b, 1000 b + 7] (image i of its batch is
    # 1000 b + i): a mix within a model's batch stays there, a mix across
    # models would not.
    x = (1000.0 * np.arange(NUM_MODELS)[None, :] + np.arange(8)[:, None])
    x = np.broadcast_to(x[:, :, None, None, None].astype("float32"),
                        (8, NUM_MODELS, 8, 8, 3))
    for stock in (keras.layers.MixUp(alpha=1.0), keras.layers.CutMix()):
        fused = resolve.fuse_layer(stock, NUM_MODELS)
        mixed = False
        for _ in range(3):
            y = keras.ops.convert_to_numpy(fused(x, training=True))
            low = 1000.0 * np.arange(NUM_MODELS)[None, :, None, None, None]
            assert np.all((y >= low - 1e-3) & (y <= low + 7 + 1e-3))
            mixed = mixed or not np.allclose(y, x)
        assert mixed, type(stock).__name__


def test_aug_mix_draws_per_model_and_passes_inference_through():
    rng = np.random.default_rng(15)
    x = np.repeat(rng.uniform(0.0, 255.0, (4, 1, 6, 6, 3)).astype(
        "float32"), NUM_MODELS, axis=1)
    fused = resolve.fuse_layer(keras.layers.AugMix(seed=8), NUM_MODELS)
    y = keras.ops.convert_to_numpy(fused(x, training=True))
    assert y.shape == x.shape
    assert np.abs(y[:, 1] - y[:, 0]).max() > 1.0
    assert_close(keras.ops.convert_to_numpy(fused(x, training=False)), x)


def augmented_model():
    """A small convolutional model behind per-batch augmentation layers,
    each with its own seed."""
    inputs = keras.Input((8, 8, 3))
    hidden = keras.layers.Rescaling(255.0)(inputs)
    hidden = keras.layers.Pipeline([
        keras.layers.RandomFlip(seed=1),
        keras.layers.RandomHue(0.2, seed=4)])(hidden)
    hidden = keras.layers.CutMix(seed=2)(hidden)
    hidden = keras.layers.MixUp(seed=3)(hidden)
    hidden = keras.layers.Rescaling(1 / 255.0)(hidden)
    hidden = keras.layers.Conv2D(2, 3, activation="relu")(hidden)
    outputs = keras.layers.Dense(1)(
        keras.layers.GlobalAveragePooling2D()(hidden))
    return keras.Model(inputs, outputs)


def test_per_batch_layers_train_in_a_fused_model_and_unfuse():
    rng = np.random.default_rng(16)
    x = rng.uniform(0.0, 1.0, (8, 8, 8, 3)).astype("float32")
    y = rng.normal(size=(8, 1)).astype("float32")
    model = augmented_model()
    # Every model starts from the stock model's weights.
    start = [np.stack([w] * NUM_MODELS) for w in model.get_weights()]

    def fit(run_eagerly):
        array = hftatf.fuse(model, NUM_MODELS)
        assert sum(isinstance(layer, FusedPerModel)
                   for layer in array._flatten_layers()) == 3
        # Built, stock layers without a build of their own included
        # (Keras's fit would otherwise call the array on the data to
        # build it).
        assert all(layer.built for layer in array._flatten_layers())
        array.set_weights(start)
        array.compile("sgd", loss="mse", run_eagerly=run_eagerly)
        history = array.fit(x, y, epochs=2, batch_size=4, shuffle=False,
                            verbose=0)
        return array, history.history

    compiled, compiled_logs = fit(run_eagerly=False)
    eager, eager_logs = fit(run_eagerly=True)
    # Run op by op, the step draws what the compiled step draws, and the
    # models train alike.
    for b in range(NUM_MODELS):
        assert_close(eager_logs[f"loss_{b}"], compiled_logs[f"loss_{b}"])
    for got, want in zip(eager.get_weights(), compiled.get_weights()):
        assert_close(got, want)
    # From one start, the models trained apart: each drew its own
    # augmentation.
    kernel = compiled.get_weights()[-2]
    assert not np.allclose(kernel[0], kernel[1])
    # In inference the augmentation passes its input through, as the
    # stock layers do: the unfused models predict what the array does.
    predicted = compiled.predict(x, verbose=0)
    for b, stock in enumerate(compiled.unfuse()):
        assert [type(layer) for layer in stock.layers] == [
            type(layer) for layer in model.layers]
        assert_close(predicted[:, b], stock.predict(x, verbose=0))


# -- Activity regularizers of weightless layers -------------------------------


@pytest.mark.parametrize("factory", [
    pytest.param(lambda: keras.layers.Activation(
        "tanh", activity_regularizer=keras.regularizers.L2(0.5)),
        id="Activation"),
    pytest.param(lambda: keras.layers.Dropout(
        0.0, activity_regularizer=keras.regularizers.L1(0.3)), id="Dropout"),
    pytest.param(lambda: keras.layers.Lambda(
        lambda t: t * 2.0, activity_regularizer=keras.regularizers.L2(0.2)),
        id="Lambda"),
])
@pytest.mark.parametrize("on_input", [False, True],
                         ids=["per_model", "shared_input"])
def test_activity_regularizer_of_a_weightless_layer_is_per_model(
        factory, on_input):
    rng = np.random.default_rng(17)
    inputs = keras.Input((4,))
    layer = factory()
    if on_input:
        # On the shared input the layer runs per model, each penalised.
        hidden = keras.layers.Dense(3)(layer(inputs))
    else:
        hidden = layer(keras.layers.Dense(3)(inputs))
    outputs = keras.layers.Dense(1)(hidden)
    x = rng.standard_normal((8, 4)).astype("float32")
    y = rng.standard_normal((8, 1)).astype("float32")
    trains_like_stock(keras.Model(inputs, outputs), x, y)
    # The user's stock layer keeps its regularizer.
    assert layer.activity_regularizer is not None


def test_activity_regularizer_of_a_per_batch_layer_is_per_model():
    rng = np.random.default_rng(18)
    inputs = keras.Input((4, 4, 3))
    hidden = keras.layers.Equalization(
        activity_regularizer=keras.regularizers.L2(1e-4))(inputs)
    outputs = keras.layers.Dense(1)(keras.layers.Flatten()(hidden))
    x = rng.uniform(0, 255, (8, 4, 4, 3)).astype("float32")
    y = rng.standard_normal((8, 1)).astype("float32")
    trains_like_stock(keras.Model(inputs, outputs), x, y)


@pytest.mark.parametrize("make", [
    lambda: keras.layers.Softmax(axis=0),
    lambda: keras.layers.UnitNormalization(axis=0),
    lambda: keras.layers.UnitNormalization(axis=[0, -1]),
], ids=["softmax", "unit_normalization", "unit_normalization_axes"])
def test_a_layer_along_the_batch_axis_runs_per_model(make):
    # Folded, the models' samples would be one batch: it runs once per
    # model instead, on that model's batch.
    layer = make()
    assert "batch axis" in registry.refusal_of_registered_form(layer)
    assert resolve.runs_per_model(layer)
    inputs = keras.Input((4, 6))
    model = keras.Model(inputs, layer(keras.layers.Dense(3)(inputs)))
    array = hftatf.fuse(model, 2)
    x = np.random.default_rng(0).standard_normal((6, 4, 6)).astype("float32")
    prediction = array.predict(x, verbose=0)
    for b, twin in enumerate(array.unfuse()):
        assert_close(prediction[:, b], twin.predict(x, verbose=0))


@pytest.mark.parametrize("layout", ["auto", "batch_first"])
def test_dropout_of_one_mask_per_batch_draws_one_per_model(layout):
    # Four jobs would draw four masks, each for its whole batch.
    layer = keras.layers.Dropout(0.5, noise_shape=(1, 16))
    assert "whole batch" in registry.refusal_of_registered_form(layer)
    inputs = keras.Input((16,))
    hidden = keras.layers.Dense(16, kernel_initializer="ones",
                                bias_initializer="ones")(inputs)
    array = hftatf.fuse(keras.Model(inputs, layer(hidden)), 4,
                        layout=layout)
    kept = np.asarray(array(np.ones((5, 16), "float32"), training=True)) != 0
    for b in range(4):
        assert (kept[:, b] == kept[:1, b]).all()  # one mask for the batch
        assert 0 < kept[0, b].sum() < 16
    assert len({kept[0, b].tobytes() for b in range(4)}) > 1


# -- Lambda: its function must treat every sample on its own ------------------


def lambda_model(function, name="function", **kwargs):
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(6)(inputs)
    return keras.Model(inputs, keras.layers.Lambda(
        function, name=name, **kwargs)(hidden))


@pytest.mark.parametrize("function, found", [
    (lambda t: t - keras.ops.mean(t, axis=0, keepdims=True),
     "computes a sample's result from the other samples"),
    (lambda t: keras.ops.transpose(t), "does not keep the batch axis first"),
    (lambda t: keras.ops.matmul(t, keras.ops.transpose(t)),
     "sizes other axes of its output by the batch"),
], ids=["centred_on_the_batch", "transposed", "batch_gram_matrix"])
def test_a_lambda_across_the_batch_is_refused(function, found):
    # Folded, it would mix the models' samples.
    with pytest.raises(ValueError, match=f"layer 'across' \\(Lambda\\): its "
                       f"function {found}"):
        hftatf.fuse(lambda_model(function, name="across"), 2)


def test_a_lambda_across_the_batch_of_the_shared_input_runs_once():
    # The models share that batch: once for all models is what each
    # computes.
    inputs = keras.Input((6,))
    centred = keras.layers.Lambda(
        lambda t: t - keras.ops.mean(t, axis=0, keepdims=True))(inputs)
    model = keras.Model(inputs, keras.layers.Dense(2)(centred))
    array = hftatf.fuse(model, 2)
    x = np.random.default_rng(4).standard_normal((5, 6)).astype("float32")
    prediction = array.predict(x, verbose=0)
    for b, twin in enumerate(array.unfuse()):
        assert_close(prediction[:, b], twin.predict(x, verbose=0))


@pytest.mark.parametrize("function", [
    lambda t: t - keras.ops.mean(t, axis=-1, keepdims=True),
    lambda t: keras.ops.reshape(keras.ops.transpose(
        keras.ops.reshape(t, (-1, 3, 2)), (0, 2, 1)), (-1, 6)),
    lambda t: keras.ops.reshape(keras.ops.einsum("bi,bj->bij", t, t),
                                (-1, 36)),
    lambda t: [t[:, :2], keras.ops.sum(t, axis=1, keepdims=True)],
], ids=["centred_per_sample", "transposed_per_sample", "outer_product",
        "several"])
def test_a_lambda_per_sample_fuses_and_matches_stock(function):
    array = hftatf.fuse(lambda_model(function), 2)
    x = np.random.default_rng(5).standard_normal((4, 6)).astype("float32")
    predictions = keras.tree.flatten(array.predict(x, verbose=0))
    for b, twin in enumerate(array.unfuse()):
        for ours, theirs in zip(predictions, keras.tree.flatten(
                twin.predict(x, verbose=0))):
            assert_close(ours[:, b], theirs)


def test_a_random_lambda_fuses_and_draws_per_model():
    # Two calls differ: the probe compares nothing and refuses nothing.
    # Its output shape is given, as stock Keras on JAX needs for a function
    # that draws without a seed: Keras infers a Lambda's output shape by
    # tracing the function, and JAX refuses unseeded draws in a trace.
    model = lambda_model(lambda t: keras.random.dropout(t, 0.5),
                         output_shape=(6,))
    array = hftatf.fuse(model, 2)
    x = np.random.default_rng(6).standard_normal((8, 6)).astype("float32")
    outputs = np.asarray(array(x))
    kept = outputs != 0
    for b, twin in enumerate(array.unfuse()):
        dense = np.asarray(twin.layers[1](x))
        # Each kept value is the stock dropout's: scaled by 1 / (1 - rate).
        assert_close(outputs[:, b][kept[:, b]], 2 * dense[kept[:, b]])
        assert 0 < kept[:, b].mean() < 1
    assert (kept[:, 0] != kept[:, 1]).any()


def test_probing_a_random_function_leaves_the_random_state_alone():
    # What the layers fused after it draw does not depend on the probe.
    def draws():
        return random.random(), float(keras.random.uniform(()))

    keras.utils.set_random_seed(7)
    expected = draws()
    keras.utils.set_random_seed(7)
    assert sample_mixing(
        lambda t: keras.random.dropout(t, 0.5),
        lambda t: keras.KerasTensor(t.shape),
        ((keras.KerasTensor((None, 6)),), {})) is None
    assert draws() == expected
