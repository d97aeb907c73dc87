"""Activations with the models first: `[B, batch, ...]` between the
convolutions of an array (`hftatf.fuse(..., layout="models_first")`, the
default on a CPU), against stock layers and the `[batch, B, ...]` layout."""

import collections

import keras
import numpy as np
import pytest
from keras import ops
from testing import (
    BATCHED_MATMULS,
    assert_close,
    compare_layer_with_stock,
    stacked_weights,
)

import hftatf
from hftatf import layers as fused_layers
from hftatf import passes

B = 3

# A layer call traced by `tf.function` (as a graph, compiled by XLA, or with
# an unknown batch size): how the TensorFlow backend runs a step.
TF_FUNCTION = pytest.mark.backends(
    "tensorflow", reason="traces the layer with tf.function")


class ModelsFirst(keras.layers.Layer):
    """Runs a fused layer built with `models_first=True` on `[batch, B,
    ...]` inputs, so the stock oracle can feed it as it feeds any other."""

    def __init__(self, layer, **kwargs):
        super().__init__(**kwargs)
        self.layer = layer

    def build(self, input_shape):
        self.layer.build((input_shape[1], input_shape[0], *input_shape[2:]))

    def call(self, inputs, **kwargs):
        return ops.swapaxes(self.layer(ops.swapaxes(inputs, 0, 1), **kwargs),
                            0, 1)


def _stock_and_fused(stock_class, shape, rng, num_models=B, **config):
    stock = [stock_class(**config) for _ in range(num_models)]
    for layer in stock:
        layer.build(shape)
        layer.set_weights([rng.standard_normal(w.shape).astype("float32")
                           if "variance" not in w.path else
                           rng.uniform(0.5, 2.0, w.shape).astype("float32")
                           for w in layer.weights])
    form = fused_layers.resolve.fused_form(stock[0])
    fused = form.from_stock(stock[0], num_models, models_first=True)
    wrapped = ModelsFirst(fused)
    wrapped.build((shape[0], num_models, *shape[1:]))
    fused.set_weights(stacked_weights(stock))
    return stock, wrapped


def registry_fused(layer, models_first):
    return fused_layers.resolve.fuse_layer(layer, B,
                                            models_first=models_first)


@pytest.mark.parametrize("stock_class, shape, config", [
    (keras.layers.Conv2D, (4, 6, 6, 3), dict(filters=5, kernel_size=3)),
    (keras.layers.Conv2D, (4, 6, 6, 4),
     dict(filters=4, kernel_size=3, groups=2, strides=2, padding="same")),
    (keras.layers.Conv1D, (4, 7, 3),
     dict(filters=2, kernel_size=3, padding="causal", activation="relu")),
    (keras.layers.DepthwiseConv2D, (4, 6, 6, 3),
     dict(kernel_size=3, depth_multiplier=2)),
    (keras.layers.SeparableConv2D, (4, 6, 6, 3),
     dict(filters=4, kernel_size=3, padding="same")),
    (keras.layers.Conv2DTranspose, (4, 5, 5, 3),
     dict(filters=2, kernel_size=3, strides=2)),
])
@pytest.mark.parametrize("implementation", ["per_model", "grouped"])
def test_convolutions_with_models_first_compute_as_stock(
        stock_class, shape, config, implementation):
    rng = np.random.default_rng(0)
    if implementation == "grouped":
        if stock_class in (keras.layers.DepthwiseConv2D,
                           keras.layers.SeparableConv2D):
            pytest.skip("depthwise kernels follow the device, not an "
                        "argument")
    stock, wrapped = _stock_and_fused(stock_class, shape, rng, **config)
    if hasattr(wrapped.layer, "implementation"):
        wrapped.layer.implementation = implementation
    x = rng.standard_normal((shape[0], B, *shape[1:])).astype("float32")
    compare_layer_with_stock(stock, wrapped, [x], rng)


@pytest.mark.parametrize("shape", [(4, 6), (4, 5, 6)])
@pytest.mark.parametrize("num_models", [B, 1])
@pytest.mark.parametrize("config", [
    dict(units=3, activation="relu"), dict(units=2, use_bias=False)])
def test_dense_with_models_first_computes_as_stock(shape, num_models,
                                                   config):
    rng = np.random.default_rng(6)
    stock, wrapped = _stock_and_fused(keras.layers.Dense, shape, rng,
                                      num_models=num_models, **config)
    assert wrapped.layer.models_first
    x = rng.standard_normal((shape[0], num_models, *shape[1:])).astype(
        "float32")
    compare_layer_with_stock(stock, wrapped, [x], rng)


@pytest.mark.backends("tensorflow", reason="reads TensorFlow's graph ops")
def test_dense_with_models_first_is_one_product_without_transposes():
    import tensorflow as tf

    layer = fused_layers.FusedDense(B, 4, models_first=True)
    layer.build((B, 8, 5, 6))
    graph = tf.function(layer).get_concrete_function(
        tf.TensorSpec((B, 8, 5, 6))).graph
    op_types = [op.type for op in graph.get_operations()]
    # One batched matmul (oneDNN's, or the Eigen one for small products).
    assert sum(op_types.count(t) for t in BATCHED_MATMULS) == 1
    assert "Transpose" not in op_types


def test_dense_on_a_shared_input_with_models_first_outputs():
    rng = np.random.default_rng(7)
    stock = [keras.layers.Dense(3) for _ in range(B)]
    for layer in stock:
        layer.build((5, 4))
    fused = fused_layers.FusedDense(B, 3, shared_input=True,
                                    models_first=True)
    fused.build((5, 4))
    fused.set_weights(stacked_weights(stock))
    x = rng.standard_normal((5, 4)).astype("float32")
    mask = np.array([True, False, True, True, False])
    outputs = fused(x)
    assert tuple(outputs.shape) == (B, 5, 3)
    assert fused.compute_output_shape((5, 4)) == (B, 5, 3)
    for b, layer in enumerate(stock):
        assert_close(outputs[b], layer(x))
    np.testing.assert_array_equal(fused.compute_mask(x, mask),
                                  np.broadcast_to(mask, (B, 5)))


def _dropouts(layout_first, **config):
    """The fused form of a fresh stock `Dropout(**config)`, with the
    models first or second; the same `config` (seed included) gives the
    same draws."""
    stock = keras.layers.Dropout(**config)
    return registry_fused(stock, models_first=layout_first)


@pytest.mark.parametrize("shape, noise_shape", [
    ((5, 4, 4, 3), None),
    ((5, 4, 4, 3), (None, 1, 1, 3)),
    ((6, 7), (None, 7)),
])
@pytest.mark.parametrize("compiled", [
    None, *(pytest.param(mode, marks=TF_FUNCTION)
            for mode in ("graph", "xla", "unknown_batch"))])
def test_dropout_with_models_first_draws_the_masks_of_the_other_layout(
        shape, noise_shape, compiled):
    # (A dropout with one mask for the whole batch, `noise_shape=(1, ...)`,
    # runs once per model instead: test_fold.)
    config = dict(rate=0.4, noise_shape=noise_shape, seed=11)
    second, first = _dropouts(False, **config), _dropouts(True, **config)
    assert first.models_first and not second.models_first
    x = np.random.default_rng(8).uniform(1.0, 2.0, (shape[0], B, *shape[1:]))
    x = ops.convert_to_tensor(x.astype("float32"))
    if compiled is not None:
        import tensorflow as tf

    def call(layer, inputs):
        return layer(inputs, training=True)

    if compiled == "unknown_batch":
        # As `fit` traces its step: graphs whose batch size is unknown.
        steps = {}

        def call(layer, inputs):
            if layer not in steps:
                shape = list(inputs.shape)
                shape[1 if layer.models_first else 0] = None
                steps[layer] = tf.function(
                    lambda t: layer(t, training=True),
                    input_signature=[tf.TensorSpec(shape, inputs.dtype)])
            return steps[layer](inputs)
    elif compiled is not None:
        call = tf.function(call, jit_compile=compiled == "xla")
    for _ in range(2):  # and the seed generators move on alike
        expected = call(second, x)
        outputs = ops.swapaxes(call(first, ops.swapaxes(x, 0, 1)), 0, 1)
        np.testing.assert_array_equal(outputs, expected)
    # A real draw: kept entries scaled, the rest zero, near the rate, and
    # every model its own mask.
    dropped = np.asarray(outputs) == 0
    kept = ~dropped
    np.testing.assert_allclose(np.asarray(outputs)[kept],
                               np.asarray(x)[kept] / 0.6, rtol=1e-6)
    if noise_shape is None:
        assert 0.3 < dropped.mean() < 0.5
        assert not np.array_equal(dropped[:, 0], dropped[:, 1])


def test_dropout_with_models_first_outside_training_and_at_rate_one():
    x = np.ones((B, 4, 3), "float32")
    first = _dropouts(True, rate=0.5, seed=1)
    np.testing.assert_array_equal(first(x, training=False), x)
    np.testing.assert_array_equal(first(x), x)
    never = _dropouts(True, rate=0.0)
    np.testing.assert_array_equal(never(x, training=True), x)
    always = _dropouts(True, rate=1.0)
    np.testing.assert_array_equal(always(x, training=True), np.zeros_like(x))


def test_only_dropouts_that_draw_per_sample_or_batch_take_the_models_first():
    takes = fused_layers.resolve.takes_models_first
    assert takes(keras.layers.Dropout(0.5))
    assert takes(keras.layers.Dropout(0.5, noise_shape=(1, None)))
    assert not takes(keras.layers.Dropout(0.5, noise_shape=(4, None)))
    assert not takes(keras.layers.SpatialDropout1D(0.5))
    assert not takes(keras.layers.GaussianNoise(0.1))


@pytest.mark.parametrize("stock_class, config, implementation", [
    (keras.layers.Conv2D, dict(filters=5, kernel_size=3, padding="same"),
     "per_model"),
    (keras.layers.Conv2D, dict(filters=5, kernel_size=3, padding="same"),
     "grouped"),
    (keras.layers.BatchNormalization, dict(momentum=0.9), None),
])
def test_one_model_with_models_first_computes_as_stock(stock_class, config,
                                                       implementation):
    # [1, batch, ...]: the model axis squeezed and restored on axis 0.
    rng = np.random.default_rng(3)
    shape = (4, 6, 6, 3)
    stock, wrapped = _stock_and_fused(stock_class, shape, rng, num_models=1,
                                      **config)
    if implementation is not None:
        wrapped.layer.implementation = implementation
    x = rng.standard_normal((shape[0], 1, *shape[1:])).astype("float32")
    compare_layer_with_stock(stock, wrapped, [x], rng, training=True)


@pytest.mark.parametrize("shape", [(6, 5, 5, 4), (6, 7, 4), (4, 3, 3, 3, 2)])
@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("jit", [False, pytest.param(True,
                                                      marks=TF_FUNCTION)])
def test_batch_normalization_with_models_first_computes_as_stock(
        shape, training, jit):
    rng = np.random.default_rng(1)
    stock, wrapped = _stock_and_fused(
        keras.layers.BatchNormalization, shape, rng, momentum=0.9,
        epsilon=1e-3)
    x = (rng.standard_normal((shape[0], B, *shape[1:])) * 3 + 1).astype(
        "float32")
    if not jit:
        compare_layer_with_stock(stock, wrapped, [x], rng, training=training)
        return
    # Under XLA the moments are plain sums, not the fused kernels.
    import tensorflow as tf

    before = wrapped.get_weights()
    compiled = tf.function(lambda v: wrapped(v, training=training),
                           jit_compile=True)
    outputs = compiled(tf.constant(x)).numpy()
    after = wrapped.get_weights()
    wrapped.set_weights(before)
    eager = wrapped(x, training=training).numpy()
    assert_close(outputs, eager)
    for value, value_eager in zip(after, wrapped.get_weights()):
        assert_close(value, value_eager)


def test_batch_normalization_over_another_axis_and_with_a_mask():
    rng = np.random.default_rng(2)
    # Axis 1 of [batch, 4, 3]: the general path, with the models first.
    stock, wrapped = _stock_and_fused(
        keras.layers.BatchNormalization, (5, 4, 3), rng, axis=1)
    x = rng.standard_normal((5, B, 4, 3)).astype("float32")
    compare_layer_with_stock(stock, wrapped, [x], rng, training=True)
    stock, wrapped = _stock_and_fused(
        keras.layers.BatchNormalization, (5, 4, 3), rng)
    mask = rng.uniform(size=(5, B, 4)) > 0.3
    before = wrapped.layer.get_weights()
    masked = wrapped.layer(ops.swapaxes(x, 0, 1), training=True,
                           mask=ops.swapaxes(mask, 0, 1))
    for b, layer in enumerate(stock):
        assert_close(ops.swapaxes(masked, 0, 1)[:, b],
                     layer(x[:, b], training=True, mask=mask[:, b]))
        for value, value_b in zip(wrapped.layer.get_weights(),
                                  layer.get_weights()):
            assert_close(value[b], value_b)
    assert not all(np.array_equal(u, v) for u, v in zip(
        before, wrapped.layer.get_weights()))


def resnet_block_model():
    inputs = keras.Input((8, 8, 3))
    x = keras.layers.Conv2D(4, 3, padding="same", use_bias=False)(inputs)
    x = keras.layers.BatchNormalization()(x)
    x = keras.layers.ReLU()(x)
    shortcut = x
    x = keras.layers.Conv2D(4, 3, padding="same")(x)
    x = keras.layers.BatchNormalization()(x)
    x = keras.layers.Add()([x, shortcut])
    x = keras.layers.Activation("relu")(x)
    x = keras.layers.DepthwiseConv2D(3, padding="same")(x)
    x = keras.layers.ZeroPadding2D(1)(x)
    x = keras.layers.MaxPooling2D()(x)
    x = keras.layers.Dropout(0.25, seed=1)(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    outputs = keras.layers.Dense(3, activation="softmax")(x)
    return keras.Model(inputs, outputs)


def _layouts(array):
    return collections.Counter(
        (type(layer).__name__, getattr(layer, "models_first", False))
        for layer in array.layers)


def test_fuse_keeps_the_models_first_from_convolution_to_the_output():
    array = hftatf.fuse(resnet_block_model(), B, layout="models_first")
    layouts = _layouts(array)
    assert layouts[("FusedConv2D", True)] == 2
    assert layouts[("FusedBatchNormalization", True)] == 2
    assert layouts[("FusedDepthwiseConv2D", True)] == 1
    # ReLU, Add, Activation, ZeroPadding2D, MaxPooling2D, Dropout (its
    # masks drawn with the models second, then moved) and pooling.
    assert layouts[("FusedFold", True)] == 7
    assert layouts[("FusedFold", False)] == 0
    assert layouts[("FusedDense", True)] == 1
    # One swap back, for the array's output; none anywhere else.
    assert layouts[("SwapModelAxis", False)] == 1
    assert isinstance(array.layers[-1], fused_layers.SwapModelAxis)
    batch_first = hftatf.fuse(resnet_block_model(), B, layout="batch_first")
    assert not any(getattr(layer, "models_first", False)
                   for layer in batch_first.layers)
    assert "SwapModelAxis" not in {type(layer).__name__
                                   for layer in batch_first.layers}


def generator_model():
    inputs = keras.Input((6,))
    x = keras.layers.Dense(4 * 4 * 3, use_bias=False)(inputs)
    x = keras.layers.BatchNormalization()(x)
    x = keras.layers.ReLU()(x)
    x = keras.layers.Reshape((4, 4, 3))(x)
    x = keras.layers.Conv2DTranspose(2, 3, strides=2, padding="same")(x)
    x = keras.layers.ReLU()(x)
    outputs = keras.layers.Conv2D(1, 3, padding="same")(x)
    return keras.Model(inputs, outputs)


@pytest.mark.parametrize("shared", [True, False])
def test_layers_in_front_of_a_convolution_take_the_models_first(shared):
    model = generator_model()
    array = hftatf.fuse(model, B, shared_inputs=shared,
                        layout="models_first")
    layouts = _layouts(array)
    assert layouts[("FusedDense", True)] == 1
    assert layouts[("FusedBatchNormalization", True)] == 1
    assert layouts[("FusedFold", True)] == 3     # ReLU, Reshape, ReLU
    assert layouts[("FusedFold", False)] == 0
    assert layouts[("FusedConv2DTranspose", True)] == 1
    assert layouts[("FusedConv2D", True)] == 1
    # The models go first once, in front of the Dense (a shared input needs
    # no move), and back once, for the array's output.
    assert layouts[("SwapModelAxis", True)] == (0 if shared else 1)
    assert layouts[("SwapModelAxis", False)] == 1
    rng = np.random.default_rng(6)
    x = rng.standard_normal((5, 6) if shared else (5, B, 6)).astype(
        "float32")
    predictions = array.predict(x, verbose=0)
    for b, stock in enumerate(array.unfuse()):
        assert_close(stock.predict(x if shared else x[:, b], verbose=0),
                     predictions[:, b])


def test_layers_that_also_feed_the_output_keep_the_models_second():
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(4 * 4 * 3)(inputs)
    images = keras.layers.Conv2D(2, 3, padding="same")(
        keras.layers.Reshape((4, 4, 3))(hidden))
    images = keras.layers.ReLU()(images)
    array = hftatf.fuse(keras.Model(inputs, [hidden, images]), B,
                        shared_inputs=False, layout="models_first")
    layouts = _layouts(array)
    # The Dense's output is the array's too: it stays `[batch, B, ...]`,
    # and what follows it moves the models first.
    assert layouts[("FusedDense", False)] == 1
    assert layouts[("FusedFold", True)] == 2     # Reshape, ReLU
    assert layouts[("FusedConv2D", True)] == 1


def test_models_first_array_trains_saves_and_unfuses_as_batch_first():
    model = resnet_block_model()
    first = hftatf.fuse(model, B, layout="models_first")
    second = hftatf.fuse(model, B, layout="batch_first")
    second.set_weights(first.get_weights())
    rng = np.random.default_rng(4)
    # 20 samples in batches of 8: the last batch is smaller, so the step
    # is traced with an unknown batch size.
    x = rng.standard_normal((20, 8, 8, 3)).astype("float32")
    y = rng.integers(0, 3, 20)
    assert_close(first.predict(x, verbose=0), second.predict(x, verbose=0))
    for array in (first, second):
        array.compile(optimizer=hftatf.optimizers.SGD(learning_rate=0.1),
                      loss="sparse_categorical_crossentropy")
        # The dropout draws its masks with the models second in both
        # layouts, from the same seed: the same masks.
        array.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False)
    for ours, theirs in zip(first.get_weights(), second.get_weights()):
        assert_close(ours, theirs)
    predictions = first.predict(x, verbose=0)
    unfused = first.unfuse()
    for b in range(B):
        assert_close(unfused[b].predict(x, verbose=0), predictions[:, b])


def test_models_first_array_round_trips_through_keras_files(tmp_path):
    array = hftatf.fuse(resnet_block_model(), B, layout="models_first")
    x = np.random.default_rng(5).standard_normal((4, 8, 8, 3)).astype(
        "float32")
    path = tmp_path / "array.keras"
    array.save(path)
    loaded = keras.models.load_model(path)
    assert _layouts(loaded) == _layouts(array)
    np.testing.assert_array_equal(loaded.predict(x, verbose=0),
                                  array.predict(x, verbose=0))


def test_fuse_refuses_an_unknown_layout():
    with pytest.raises(ValueError, match="layout"):
        hftatf.fuse(resnet_block_model(), B, layout="channels_first")


def test_layers_refuse_models_first_where_they_cannot():
    with pytest.raises(ValueError, match="models_first"):
        fused_layers.FusedLayerNormalization(B, models_first=True)
    with pytest.raises(ValueError, match="models first"):
        registry_fused(keras.layers.LayerNormalization(), models_first=True)
    with pytest.raises(ValueError, match="models first"):
        registry_fused(keras.layers.SpatialDropout2D(0.5),
                       models_first=True)


def test_auto_layout_has_the_models_first_on_a_cpu_for_two_models_or_more():
    # This suite runs on a CPU.
    def models_first(array):
        return any(getattr(layer, "models_first", False)
                   for layer in array.layers)

    assert models_first(hftatf.fuse(resnet_block_model(), 2))
    # One model's activations are laid out alike either way: no swaps.
    single = hftatf.fuse(resnet_block_model(), 1)
    assert not models_first(single)
    assert not any(isinstance(layer, hftatf.layers.SwapModelAxis)
                   for layer in single.layers)


def test_activation_bytes_count_one_model_in_either_layout():
    inputs = keras.Input((6, 6, 2))
    x = keras.layers.Conv2D(4, 3, padding="same")(inputs)
    x = keras.layers.GlobalAveragePooling2D()(x)
    outputs = keras.layers.Dense(3)(x)
    model = keras.Model(inputs, outputs)
    batch_first = hftatf.fuse(model, B, layout="batch_first")
    first = hftatf.fuse(model, B, layout="models_first")
    # Per sample and model: the shared input, the convolution's and the
    # pooling's outputs and the logits; with the models first, also the
    # logits swapped back for the array's output.
    per_sample = 4 * (6 * 6 * 2 + 6 * 6 * 4 + 4 + 3)
    assert passes.activation_bytes_per_model(batch_first, 10) == (
        10 * per_sample)
    assert passes.activation_bytes_per_model(first, 10) == (
        10 * (per_sample + 4 * 3))
