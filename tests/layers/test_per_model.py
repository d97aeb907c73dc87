"""Layers without a fused form of their own, run once per model
(`FusedPerModel`): layers of one's own, subclasses of stock layers,
subclassed models inside functional ones, `RNN`s of other cells."""

import warnings

import keras
import numpy as np
import pytest
from keras import layers, ops
from testing import assert_close, trains_like_stock

import hftatf
from benchmarks.per_model import TokenAndPositionEmbedding, TransformerBlock
from hftatf.layers import BroadcastToModels, FusedPerModel, resolve
from hftatf.layers import per_model as per_model_module

NUM_MODELS = 3


# -- Layers of one's own, as keras.io examples write them ---------------------
# (keras.io's text classifier's, from the benchmark: no `get_config` of their
# own, the config Keras makes from their constructors' arguments.)


def text_classifier(rate=0.0):
    inputs = keras.Input((6,), dtype="int32")
    hidden = TokenAndPositionEmbedding(6, 20, 8, name="embedding")(inputs)
    hidden = TransformerBlock(8, 2, 12, rate=rate, name="block")(hidden)
    hidden = layers.GlobalAveragePooling1D()(hidden)
    return keras.Model(inputs, layers.Dense(2)(hidden))


def tokens(rng, batch=8):
    return rng.integers(0, 20, (batch, 6)).astype("int32")


@keras.saving.register_keras_serializable(package="test_per_model")
class NormalizedBlock(layers.Layer):
    """State of every kind: moving statistics, a regularized kernel, an
    added loss and dropout."""

    def __init__(self, units, rate=0.0, **kwargs):
        super().__init__(**kwargs)
        self.units, self.rate = units, rate
        self.norm = layers.BatchNormalization()
        self.dense = layers.Dense(
            units, kernel_regularizer=keras.regularizers.L2(0.05),
            kernel_constraint=keras.constraints.MaxNorm(1.5))
        self.dropout = layers.Dropout(rate)

    def call(self, x, training=None):
        hidden = self.dense(self.norm(x, training=training))
        self.add_loss(0.01 * ops.mean(ops.square(hidden)))
        return self.dropout(hidden, training=training)

    def get_config(self):
        return {**super().get_config(), "units": self.units,
                "rate": self.rate}


@keras.saving.register_keras_serializable(package="test_per_model")
class TwiceDense(layers.Dense):
    """A subclass of a stock layer that computes something else."""

    def call(self, inputs):
        return 2.0 * super().call(inputs)


@keras.saving.register_keras_serializable(package="test_per_model")
class Residual(keras.Model):
    """A subclassed model, used as a layer of a functional model."""

    def __init__(self, units=4, **kwargs):
        super().__init__(**kwargs)
        self.units = units
        self.inner = layers.Dense(units, activation="tanh")

    def call(self, x):
        return x + self.inner(x)

    def get_config(self):
        return {**super().get_config(), "units": self.units}


def stateful_model(rate=0.0):
    inputs = keras.Input((5,))
    hidden = layers.Dense(4)(inputs)
    hidden = NormalizedBlock(4, rate=rate, name="normalized")(hidden)
    hidden = Residual(4, name="residual")(hidden)
    return keras.Model(inputs, TwiceDense(2, name="twice")(hidden))


def per_model_layers(array):
    return [layer for layer in array._flatten_layers()
            if isinstance(layer, FusedPerModel)]


def assert_unfused_models_predict_alike(array, x):
    y = array.predict(x, verbose=0)
    for b, stock in enumerate(array.unfuse()):
        assert_close(y[:, b], stock.predict(x, verbose=0),
                     err_msg=f"model {b}")


# -- Tests --------------------------------------------------------------------


def test_keras_io_text_transformer_trains_like_its_stock_twins():
    rng = np.random.default_rng(0)
    model = text_classifier()
    array = hftatf.fuse(model, NUM_MODELS)
    assert [layer.name for layer in per_model_layers(array)] == [
        "embedding", "block"]
    # The token ids are shared: every model embeds them itself, no copy of
    # the batch per model is made.
    assert not any(isinstance(layer, BroadcastToModels)
                   for layer in array.layers)
    # Each model starts from its own initialisation, in the stock order of
    # weights.
    embedding = array.get_layer("embedding").get_weights()[0]
    assert not np.allclose(embedding[0], embedding[1])
    assert [w.shape[1:] for w in array.get_layer("block").weights] == [
        w.shape for w in model.get_layer("block").weights]
    assert_unfused_models_predict_alike(array, tokens(rng))
    trains_like_stock(model, tokens(rng),
                      rng.standard_normal((8, 2)).astype("float32"),
                      NUM_MODELS)


@pytest.mark.backends("tensorflow", reason="stock Keras on JAX takes dense "
                      "embedding gradients (`tf.IndexedSlices` on TF)")
@pytest.mark.parametrize("jit_compile,models_per_pass", [
    (False, None), (True, None), (True, 1)], ids=["tf", "xla", "passes"])
def test_an_embedding_inside_keeps_its_sparse_gradient(jit_compile,
                                                       models_per_pass):
    """Adam squares each occurrence of a repeated id's gradient in a stock
    Embedding's sparse gradient; run per model, the table's gradient must
    stay sparse for each model to train as its stock twin."""
    import tensorflow as tf

    rng = np.random.default_rng(0)
    # (Without attention, whose key bias has a zero gradient in exact
    # arithmetic: Adam would scale up its float noise, XLA's or not.)
    inputs = keras.Input((6,), dtype="int32")
    hidden = TokenAndPositionEmbedding(6, 20, 8, name="embedding")(inputs)
    hidden = layers.GlobalAveragePooling1D()(hidden)
    model = keras.Model(inputs, layers.Dense(2)(hidden))
    array = hftatf.fuse(model, NUM_MODELS)
    stock = array.unfuse(compile=False)
    # Few ids, each repeated within and across samples.
    x = rng.integers(0, 3, (8, 6)).astype("int32")
    y = rng.standard_normal((8, 2)).astype("float32")
    table = array.get_layer("embedding").weights[0]
    with tf.GradientTape() as tape:
        loss = ops.sum(ops.square(array(x) - y[:, None]))
    assert isinstance(tape.gradient(loss, table), tf.IndexedSlices)
    array.compile(hftatf.optimizers.Adam(0.05), loss="mse",
                  jit_compile=jit_compile, models_per_pass=models_per_pass)
    array.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    trained = array.unfuse(compile=False)
    for b, twin in enumerate(stock):
        twin.compile(keras.optimizers.Adam(0.05), loss="mse")
        twin.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
        for got, want in zip(trained[b].get_weights(), twin.get_weights()):
            assert_close(got, want, err_msg=f"model {b}")


class TiedEmbedding(layers.Layer):
    """Looks ids up and projects back onto the same table in one call: the
    table's gradient is dense in the stock model."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.table = layers.Embedding(20, 4)

    def call(self, ids):
        return ops.matmul(ops.tanh(self.table(ids)),
                          ops.transpose(self.table.embeddings))


def test_a_table_used_densely_in_the_same_call_trains_like_stock():
    rng = np.random.default_rng(1)
    inputs = keras.Input((5,), dtype="int32")
    model = keras.Model(inputs, TiedEmbedding()(inputs))
    array = hftatf.fuse(model, NUM_MODELS)
    stock = array.unfuse(compile=False)
    x = rng.integers(0, 3, (4, 5)).astype("int32")
    y = rng.standard_normal((4, 5, 20)).astype("float32")
    array.compile(hftatf.optimizers.Adam(0.05), loss="mse")
    array.fit(x, y, batch_size=2, epochs=2, shuffle=False, verbose=0)
    trained = array.unfuse(compile=False)
    for b, twin in enumerate(stock):
        twin.compile(keras.optimizers.Adam(0.05), loss="mse")
        twin.fit(x, y, batch_size=2, epochs=2, shuffle=False, verbose=0)
        assert_close(trained[b].get_weights()[0], twin.get_weights()[0],
                     err_msg=f"model {b}")


class RegularizedTable(layers.Layer):
    """An Embedding whose penalty's gradient (dense) joins the lookup's."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.table = layers.Embedding(
            20, 4, embeddings_regularizer=keras.regularizers.L2(0.01))

    def call(self, ids):
        return ops.mean(self.table(ids), axis=1)


def test_a_regularized_table_inside_trains_like_stock():
    rng = np.random.default_rng(2)
    inputs = keras.Input((5,), dtype="int32")
    model = keras.Model(inputs, layers.Dense(2)(RegularizedTable()(inputs)))
    trains_like_stock(model, rng.integers(0, 20, (8, 5)).astype("int32"),
                      rng.standard_normal((8, 2)).astype("float32"),
                      NUM_MODELS)


def test_moving_statistics_losses_and_subclasses_train_like_stock():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((8, 5)).astype("float32")
    y = rng.standard_normal((8, 2)).astype("float32")
    model = stateful_model()
    array = hftatf.fuse(model, NUM_MODELS)
    assert [layer.name for layer in per_model_layers(array)] == [
        "normalized", "residual", "twice"]
    # The block's kernel regularizer and the loss it adds: one entry per
    # model.
    array(x, training=True)
    assert [tuple(loss.shape) for loss in array.losses] == [
        (NUM_MODELS,), (NUM_MODELS,)]
    trains_like_stock(model, x, y, NUM_MODELS)


def test_each_model_updates_its_own_moving_statistics():
    rng = np.random.default_rng(2)
    array = hftatf.fuse(stateful_model(), NUM_MODELS)
    array.compile(hftatf.optimizers.SGD(0.1), loss="mse")
    x = rng.standard_normal((8, 5)).astype("float32")
    array.fit(x, np.zeros((8, 2)), batch_size=4, epochs=1, verbose=0)
    block = array.get_layer("normalized")
    names = [w.name for w in block.weights]
    mean = ops.convert_to_numpy(block.weights[names.index("moving_mean")])
    assert np.abs(mean).min() > 0
    assert not np.allclose(mean[0], mean[1])


def test_random_layers_draw_per_model_and_alike_in_passes():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((8, 5)).astype("float32")
    y = rng.standard_normal((8, 2)).astype("float32")
    model = stateful_model(rate=0.5)
    array = hftatf.fuse(model, NUM_MODELS)
    same = hftatf.fuse_models([array.unfuse()[0]] * NUM_MODELS)
    outputs = ops.convert_to_numpy(same(x, training=True))
    assert np.abs(outputs[:, 0] - outputs[:, 1]).max() > 1e-3
    assert_close(ops.convert_to_numpy(same(x, training=False))[:, 0],
                 ops.convert_to_numpy(same(x, training=False))[:, 1])

    def trained(models_per_pass):
        keras.utils.set_random_seed(7)
        copy = hftatf.fuse_models(array.unfuse())
        copy.compile(hftatf.optimizers.SGD(0.1), loss="mse",
                     models_per_pass=models_per_pass)
        copy.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
        return copy.get_weights()

    # Model b draws after model b - 1 in one pass and in passes of one
    # alike: the same masks, the same training.
    for one, passes in zip(trained(None), trained(1)):
        assert_close(one, passes)


@keras.saving.register_keras_serializable(package="test_per_model")
class Context(layers.Layer):
    """Two tensor arguments and a number."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = layers.Dense(3)

    def call(self, x, context, scale=1.0):
        return self.dense(x) * scale + context


@keras.saving.register_keras_serializable(package="test_per_model")
class Embed(layers.Layer):
    """Its output carries the mask its embedding makes."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.embedding = layers.Embedding(20, 3, mask_zero=True)

    def call(self, x):
        return self.embedding(x)


@keras.saving.register_keras_serializable(package="test_per_model")
class MaskedScale(layers.Layer):
    """Reads the mask Keras hands it, and passes it on."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.supports_masking = True

    def call(self, x, mask=None):
        if mask is None:
            return -x
        return 2.0 * x * ops.cast(mask, x.dtype)[..., None]


@pytest.mark.parametrize("layout", ["batch_first", "models_first"])
def test_any_call_arguments_masks_and_layouts(layout):
    rng = np.random.default_rng(4)
    ids = keras.Input((6,), dtype="int32")
    context = keras.Input((6, 3))
    # The mask reaches MaskedScale, then the LSTM, as in the stock model.
    hidden = MaskedScale()(Embed()(ids))
    hidden = layers.LSTM(3, return_sequences=True)(hidden)
    # Between convolutions (a CPU array keeps the models first there).
    hidden = Context()(layers.Conv1D(3, 1)(hidden), context=context,
                       scale=3.0)
    model = keras.Model([ids, context],
                        layers.Flatten()(layers.Conv1D(2, 1)(hidden)))
    array = hftatf.fuse(model, NUM_MODELS, layout=layout)
    data = [tokens(rng, 4), rng.standard_normal((4, 6, 3)).astype(
        "float32")]
    data[0][:, 4:] = 0  # padding, masked
    assert_unfused_models_predict_alike(array, data)


@keras.saving.register_keras_serializable(package="test_per_model")
class GatedPair(layers.Layer):
    """Called on a list of two tensors, as keras.io's VAE calls its
    sampling layer."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.gate = layers.Dense(3, activation="sigmoid")

    def call(self, inputs):
        first, second = inputs
        return self.gate(first) * second


def test_a_layer_called_on_a_list_trains_like_stock():
    inputs = keras.Input((4,))
    pair = [layers.Dense(3)(inputs), layers.Dense(3)(inputs)]
    model = keras.Model(inputs, layers.Dense(2)(GatedPair()(pair)))
    rng = np.random.default_rng(8)
    _trains_like_the_original(
        model, rng.standard_normal((8, 4)).astype("float32"),
        rng.standard_normal((8, 2)).astype("float32"))


def test_a_functional_model_sets_training_at_each_call():
    # Keras records `training=True` for an augmentation pipeline (its
    # default) where the model is built; `predict` runs it in inference.
    rng = np.random.default_rng(10)
    inputs = keras.Input((6, 6, 3))
    hidden = layers.Pipeline([layers.RandomFlip(seed=1),
                              layers.RandomHue(0.3, seed=2)])(inputs)
    model = keras.Model(inputs, NormalizedBlock(2, rate=0.5)(hidden))
    array = hftatf.fuse(model, NUM_MODELS)
    x = rng.uniform(0.0, 1.0, (4, 6, 6, 3)).astype("float32")
    assert_unfused_models_predict_alike(array, x)
    trained = ops.convert_to_numpy(array(x, training=True))
    assert np.abs(trained - array.predict(x, verbose=0)).max() > 1e-3


def test_save_load_select_and_fuse_models_round_trip(tmp_path):
    rng = np.random.default_rng(5)
    x = rng.standard_normal((6, 5)).astype("float32")
    array = hftatf.fuse(stateful_model(), NUM_MODELS)
    expected = array.predict(x, verbose=0)
    path = str(tmp_path / "array.keras")
    array.save(path)
    loaded = keras.models.load_model(path)
    assert_close(loaded.predict(x, verbose=0), expected)
    assert_close(array.select([2, 0]).predict(x, verbose=0),
                 expected[:, [2, 0]])
    again = hftatf.fuse_models(array.unfuse())
    for got, want in zip(again.get_weights(), array.get_weights()):
        assert_close(got, want, atol=0, rtol=0)


def test_classes_not_registered_with_keras_fuse_in_process():
    class Scaled(layers.Layer):  # Neither registered nor importable.
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.dense = layers.Dense(2)

        def call(self, x):
            return 3.0 * self.dense(x)

    class OwnCell(layers.Layer):
        state_size = 2

        def build(self, input_shape):
            self.kernel = self.add_weight(shape=(input_shape[-1], 2))

        def call(self, inputs, states):
            output = ops.matmul(inputs, self.kernel) + states[0]
            return output, [output]

    rng = np.random.default_rng(6)
    inputs = keras.Input((4, 3))
    hidden = layers.RNN(OwnCell(), return_sequences=True)(inputs)
    model = keras.Model(inputs, layers.Flatten()(Scaled()(hidden)))
    x = rng.standard_normal((6, 4, 3)).astype("float32")
    trains_like_stock(model, x, rng.standard_normal((6, 8)).astype(
        "float32"), NUM_MODELS)
    array = hftatf.fuse(model, NUM_MODELS)
    assert len(per_model_layers(array)) == 2
    assert_close(array.select([1]).predict(x, verbose=0)[:, 0],
                 array.predict(x, verbose=0)[:, 1])


@pytest.mark.parametrize("factory,data", [
    pytest.param(lambda: layers.RNN([layers.LSTMCell(3), layers.GRUCell(2)]),
                 lambda rng: rng.standard_normal((4, 5, 2)).astype(
                     "float32"), id="stacked_cells"),
    pytest.param(lambda: layers.STFTSpectrogram(
        frame_length=16, frame_step=8, fft_length=16, trainable=True),
        lambda rng: rng.standard_normal((2, 64, 1)).astype("float32"),
        id="STFTSpectrogram"),
])
def test_stock_layers_without_a_fused_form_run_per_model(factory, data):
    rng = np.random.default_rng(7)
    x = data(rng)
    inputs = keras.Input(x.shape[1:])
    model = keras.Model(inputs, factory()(inputs))
    array = hftatf.fuse(model, NUM_MODELS)
    assert len(per_model_layers(array)) == 1
    assert_unfused_models_predict_alike(array, x)


def test_reversible_embedding_ties_its_weights_per_model():
    rng = np.random.default_rng(8)
    inputs = keras.Input((5,), dtype="int32")
    embedding = layers.ReversibleEmbedding(20, 4)
    model = keras.Model(inputs, embedding(embedding(inputs), reverse=True))
    array = hftatf.fuse(model, NUM_MODELS)
    assert_unfused_models_predict_alike(array, tokens(rng, 4)[:, :5])
    trains_like_stock(model, tokens(rng, 4)[:, :5],
                      rng.standard_normal((4, 5, 20)).astype("float32"),
                      NUM_MODELS)


def test_mixed_precision_computes_like_the_stock_layer():
    rng = np.random.default_rng(9)
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        inputs = keras.Input((5,))
        hidden = NormalizedBlock(4, name="normalized")(
            layers.Dense(4)(inputs))
        model = keras.Model(inputs, layers.Dense(2, dtype="float32")(hidden))
        array = hftatf.fuse(model, NUM_MODELS)
        block = array.get_layer("normalized")
        assert block.compute_dtype == "float16"
        assert {w.dtype for w in block.weights} == {"float32"}
        x = rng.standard_normal((4, 5)).astype("float32")
        y = array.predict(x, verbose=0)
        for b, stock in enumerate(array.unfuse()):
            # Both compute in float16: the same rounding.
            assert_close(y[:, b], stock.predict(x, verbose=0), atol=1e-3,
                         rtol=1e-3)
    finally:
        keras.mixed_precision.set_global_policy("float32")


def test_a_warning_names_each_layer_class_once(monkeypatch):
    monkeypatch.setattr(per_model_module, "_warned", set())

    class Doubled(layers.Layer):
        def call(self, x):
            return 2.0 * x

    inputs = keras.Input((3,))
    hidden = Doubled(name="first")(layers.Dense(3)(inputs))
    model = keras.Model(inputs, Doubled(name="second")(hidden))
    model(np.zeros((1, 3), "float32"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hftatf.fuse(model, 2)
    messages = [str(w.message) for w in caught
                if "once per model" in str(w.message)]
    assert len(messages) == 1
    assert "'first' (Doubled): hftatf has no fused form" in messages[0]
    # Weightless: folding is the faster way, and the warning says how.
    assert "register(Doubled)(hftatf.layers.FusedFold)" in messages[0]
    # Per-batch stock layers run per model by design: no warning.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resolve.fuse_layer(layers.MixUp(), 2)
    assert not [w for w in caught if "once per model" in str(w.message)]


@pytest.mark.backends("tensorflow", reason="a `tf.Variable` held by a layer")
def test_layers_with_state_outside_keras_variables_are_refused():
    import tensorflow as tf

    class Counter(layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.count = tf.Variable(0.0, trainable=False)

        def call(self, x):
            self.count.assign_add(1.0)
            return x

    inputs = keras.Input((3,))
    block = keras.Sequential([keras.Input((3,)), Counter(name="counter")])
    model = keras.Model(inputs, block(layers.Dense(3)(inputs)))
    with pytest.raises(ValueError, match=r"'counter'.*counter\.count"):
        hftatf.fuse(model, 2)
    # A layer of another framework's holds its state there.
    wrapped = layers.JaxLayer(lambda params, inputs: inputs, params={},
                              name="wrapped")
    assert not resolve.is_supported(wrapped)
    with pytest.raises(ValueError,
                       match="'wrapped'.*outside Keras variables"):
        resolve.fused_form(wrapped)


class StatefulBlock(layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.rnn = layers.SimpleRNN(4, stateful=True)

    def build(self, input_shape):
        self.rnn.build(input_shape)

    def call(self, x):
        return self.rnn(x)


def test_a_stateful_layer_inside_is_refused():
    # Its state is no weight: one model's final state would be the next
    # model's initial one (model 1 was 0.26 off its stock twin).
    inputs = keras.Input((5, 3), batch_size=4)
    model = keras.Model(inputs, StatefulBlock(name="block")(inputs))
    with pytest.raises(ValueError, match="'block'.*stateful layer"):
        hftatf.fuse(model, 2)


class AdaptedNormalization(layers.Normalization):
    """A Normalization of one's own: run per model, it derives its mean
    and variance from its weights in the stock `finalize_state`."""


class NumpyNormalization(layers.Normalization):
    """One whose `finalize_state` reads its weights in NumPy."""

    def finalize_state(self):
        super().finalize_state()
        if self.input_mean is None and self.built:
            self.mean = np.asarray(self.adapt_mean).reshape(
                self._broadcast_shape)


def adapted_model(normalization, data, seed):
    x = keras.Input((5,))
    normalize = normalization()
    normalize.adapt(data + seed)
    return keras.Model(x, layers.Dense(3)(normalize(x)))


def test_state_derived_from_weights_is_each_models_own():
    # An adapted Normalization keeps its mean and variance as tensors
    # derived from its weights; run per model, each model derives them from
    # its own slice, whatever the layer held when it was fused.
    data = np.random.default_rng(0).normal(3.0, 2.0, (16, 5)).astype(
        "float32")
    models = [adapted_model(AdaptedNormalization, data, 4.0 * b)
              for b in range(2)]
    with pytest.warns(UserWarning, match="no fused form"):
        array = hftatf.fuse_models(models)
    assert isinstance(array.layers[1], FusedPerModel)
    outputs = array.predict(data, verbose=0)
    for b, model in enumerate(models):
        assert_close(outputs[:, b], model.predict(data, verbose=0))
    # The layer each model runs keeps its own state.
    template = array.layers[1].layer
    assert_close(template.mean, np.reshape(template.adapt_mean, (1, 5)))


def test_state_derived_from_weights_otherwise_than_by_ops_is_refused():
    data = np.zeros((4, 5), "float32")
    with pytest.warns(UserWarning), pytest.raises(
            ValueError, match="'numpy_normalization' derives state from its "
            "weights in a `finalize_state` of its own"):
        hftatf.fuse(adapted_model(NumpyNormalization, data, 0.0), 2)


def test_fused_per_model_refuses_a_wrong_model_axis():
    fused = resolve.fuse_layer(layers.RNN([layers.LSTMCell(2)] * 2), 3)
    assert type(fused) is FusedPerModel
    with pytest.raises(ValueError, match="num_models=3 on axis 1"):
        fused(np.zeros((2, 4, 5, 1), "float32"))


@keras.saving.register_keras_serializable(package="test_per_model")
class ConvBlock(layers.Layer):
    """A residual convolution block of one's own."""

    def __init__(self, spectral=False, **kwargs):
        super().__init__(**kwargs)
        self.spectral = spectral
        conv = layers.Conv1D(2, 3, padding="same")
        self.conv = layers.SpectralNormalization(conv) if spectral else conv

    def call(self, x):
        return x + self.conv(x)

    def get_config(self):
        return {**super().get_config(), "spectral": self.spectral}


@pytest.mark.backends(
    "tensorflow", reason="TensorFlow's CPU kernels without XLA; on JAX every "
    "step is compiled by XLA, as for stock Keras")
def test_convolutions_inside_keep_xla_off_on_a_cpu():
    # As for the array's own convolutions: TensorFlow's kernels on a CPU.
    inputs = keras.Input((8, 2))
    model = keras.Model(inputs, layers.Flatten()(ConvBlock()(inputs)))
    array = hftatf.fuse(model, 2)
    array.compile("sgd", loss="mse", jit_compile="auto")
    assert array.jit_compile is False


def test_spectral_normalization_inside_trains_in_one_pass():
    rng = np.random.default_rng(11)
    inputs = keras.Input((8, 2))
    model = keras.Model(inputs, layers.Flatten()(
        ConvBlock(spectral=True, name="block")(inputs)))
    array = hftatf.fuse(model, 2)
    with pytest.raises(ValueError, match="'block'.*assigns trainable"):
        array.compile("sgd", loss="mse", models_per_pass=1)
    x = rng.standard_normal((4, 8, 2)).astype("float32")
    trains_like_stock(model, x, rng.standard_normal((4, 16)).astype(
        "float32"), 2)


@keras.saving.register_keras_serializable(package="test_per_model")
class FrozenParts(layers.Layer):
    """Layers inside it that a script freezes after building the model."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.norm = layers.BatchNormalization()
        self.first = layers.Dense(3)
        self.second = layers.Dense(3)

    def call(self, x, training=None):
        return self.second(self.first(self.norm(x, training=training)))


def _trains_like_the_original(model, x, y, num_models=2):
    """The array of `model` trains as `model` itself does from each
    model's weights (the oracle is the original, whose `trainable` flags
    no config round trip has touched)."""
    array = hftatf.fuse(model, num_models)
    start = array.unfuse()
    array.compile(hftatf.optimizers.SGD(0.1), loss="mse")
    array.fit(x, y, batch_size=len(x) // 2, shuffle=False, verbose=0)
    trained = array.unfuse()
    for b in range(num_models):
        model.set_weights(start[b].get_weights())
        model.compile(keras.optimizers.SGD(0.1), loss="mse")
        model.fit(x, y, batch_size=len(x) // 2, shuffle=False, verbose=0)
        for got, want in zip(trained[b].get_weights(), model.get_weights()):
            assert_close(got, want, err_msg=f"model {b}")
    return array, start


@pytest.mark.parametrize("frozen", ["layer", "inside"])
def test_layers_frozen_inside_a_layer_stay_frozen(frozen, tmp_path):
    rng = np.random.default_rng(12)
    inputs = keras.Input((4,))
    parts = FrozenParts(name="parts")
    model = keras.Model(inputs, layers.Dense(2)(parts(
        layers.Dense(4)(inputs))))
    if frozen == "layer":
        parts.trainable = False  # its normalization computes in inference
    else:
        parts.first.trainable = False
    x = (3.0 * rng.standard_normal((8, 4)) + 1.0).astype("float32")
    y = rng.standard_normal((8, 2)).astype("float32")
    array, start = _trains_like_the_original(model, x, y)
    flags = [inner.trainable for inner in parts._flatten_layers()]
    for stock in start:
        assert [inner.trainable for inner in stock.get_layer(
            "parts")._flatten_layers()] == flags
    path = str(tmp_path / "array.keras")
    array.save(path)
    loaded = keras.models.load_model(path)
    assert [inner.trainable for inner in loaded.get_layer(
        "parts").layer._flatten_layers()] == flags
    assert len(loaded.trainable_weights) == len(array.trainable_weights)


@keras.saving.register_keras_serializable(package="test_per_model")
class UnseededNoise(layers.Layer):
    """Draws from `keras.random` without a seed: Keras's global seed
    generator."""

    def call(self, x, training=None):
        if training:
            return x + keras.random.normal(ops.shape(x))
        return x


@pytest.mark.backends("tensorflow", reason="unseeded draws in a traced "
                      "function: JAX's need a seed generator as state")
def test_unseeded_random_calls_draw_per_model_and_per_step():
    inputs = keras.Input((3,))
    model = keras.Model(inputs, UnseededNoise()(layers.Dense(3)(inputs)))
    same = hftatf.fuse_models([model, model])
    x = np.ones((2, 3), "float32")
    step = keras.tree.map_structure(ops.convert_to_numpy, [
        same(x, training=True) for _ in range(2)])
    import tensorflow as tf

    traced = tf.function(lambda x: same(x, training=True))
    step += [np.asarray(traced(x)) for _ in range(2)]
    for first, second in zip(step, step[1:]):
        assert np.abs(first[:, 0] - first[:, 1]).min() > 1e-4
        assert np.abs(first - second).min() > 1e-4


@keras.saving.register_keras_serializable(package="test_per_model")
class MinimalCell(layers.Layer):
    """keras.io's minimal RNN cell."""

    def __init__(self, units, **kwargs):
        super().__init__(**kwargs)
        self.units = self.state_size = units

    def build(self, input_shape):
        self.kernel = self.add_weight(shape=(input_shape[-1], self.units))
        self.recurrent_kernel = self.add_weight(
            shape=(self.units, self.units))

    def call(self, inputs, states):
        output = ops.tanh(ops.matmul(inputs, self.kernel)
                          + ops.matmul(states[0], self.recurrent_kernel))
        return output, [output]

    def get_config(self):
        return {**super().get_config(), "units": self.units}


@pytest.mark.parametrize("wrapper", [
    lambda: layers.TimeDistributed(TwiceDense(3)),
    lambda: layers.Bidirectional(layers.RNN(MinimalCell(3),
                                            return_sequences=True)),
    lambda: layers.SpectralNormalization(TwiceDense(3)),
], ids=["time_distributed", "bidirectional", "spectral_normalization"])
def test_stock_wrappers_of_a_layer_run_per_model_run_per_model(wrapper):
    rng = np.random.default_rng(13)
    inputs = keras.Input((5, 4))
    layer = wrapper()
    model = keras.Model(inputs, layers.Flatten()(layer(inputs)))
    assert resolve.runs_per_model(layer)
    x = rng.standard_normal((4, 5, 4)).astype("float32")
    y = rng.standard_normal((4, model.output_shape[-1])).astype("float32")
    trains_like_stock(model, x, y)


@keras.saving.register_keras_serializable(package="test_per_model")
class ShapedLosses(layers.Layer):
    """Adds a scalar loss and a loss per feature."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = layers.Dense(3)

    def call(self, x):
        y = self.dense(x)
        self.add_loss(0.1 * ops.mean(ops.square(y)))
        self.add_loss(0.01 * ops.mean(ops.abs(y), axis=0))
        return y


def test_added_losses_of_any_shape_are_summed_as_keras_sums_them():
    rng = np.random.default_rng(14)
    inputs = keras.Input((4,))
    model = keras.Model(inputs, ShapedLosses()(inputs))
    x = rng.standard_normal((6, 4)).astype("float32")
    trains_like_stock(model, x, rng.standard_normal((6, 3)).astype(
        "float32"))


@keras.saving.register_keras_serializable(package="test_per_model")
class CappedDense(layers.Layer):
    """Assigns its own trainable kernel in training, as a weight
    normalization of one's own does."""

    def __init__(self, units, **kwargs):
        super().__init__(**kwargs)
        self.units = units

    def build(self, input_shape):
        self.kernel = self.add_weight(shape=(input_shape[-1], self.units))

    def call(self, x, training=None):
        if training:
            self.kernel.assign(0.9 * self.kernel / ops.maximum(
                ops.max(ops.abs(self.kernel)), 1.0))
        return ops.matmul(x, self.kernel)

    def get_config(self):
        return {**super().get_config(), "units": self.units}


def test_a_call_that_assigns_trainable_weights_trains_in_one_pass():
    rng = np.random.default_rng(15)
    inputs = keras.Input((4,))
    model = keras.Model(inputs, layers.Dense(2)(CappedDense(
        3, name="capped")(inputs)))
    array = hftatf.fuse(model, 3)
    with pytest.raises(ValueError, match="'capped'.*assigns trainable"):
        array.compile("sgd", loss="mse", models_per_pass=1)
    array.compile("sgd", loss="mse", models_per_pass="auto")
    x = rng.standard_normal((8, 4)).astype("float32")
    y = rng.standard_normal((8, 2)).astype("float32")
    array.fit(x, y, batch_size=4, verbose=0)
    assert array.models_per_pass == 3
    trains_like_stock(model, x, y)


@keras.saving.register_keras_serializable(package="test_per_model")
class Offset(layers.Layer):
    """Takes a constant as a call argument."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = layers.Dense(3)

    def call(self, x, offset):
        return self.dense(x) + offset


def test_constants_in_a_call_are_shared_by_all_models(tmp_path):
    rng = np.random.default_rng(16)
    inputs = keras.Input((4,))
    offset = np.array([1.0, 2.0, 3.0], "float32")
    model = keras.Model(inputs, Offset(name="offset")(inputs, offset=offset))
    array = hftatf.fuse(model, NUM_MODELS)
    x = rng.standard_normal((5, 4)).astype("float32")
    assert_unfused_models_predict_alike(array, x)
    path = str(tmp_path / "array.keras")
    array.save(path)
    assert_close(keras.models.load_model(path).predict(x, verbose=0),
                 array.predict(x, verbose=0))


@keras.saving.register_keras_serializable(package="test_per_model")
class Nameless(layers.Layer):
    """Its config holds its constructor's arguments and not its name, as
    many scripts write it."""

    def __init__(self, units=3, **kwargs):
        super().__init__(**kwargs)
        self.units = units
        self.dense = layers.Dense(units)

    def call(self, x):
        return 2.0 * self.dense(x)

    def get_config(self):
        return {"units": self.units}


@keras.saving.register_keras_serializable(package="test_per_model")
class Renamed(layers.Layer):
    """Hands its keyword arguments, its name among them, to the layer
    inside it, as keras.io's PixelCNN's `PixelConvLayer` does: a copy
    from its config has a name of Keras's making."""

    def __init__(self, **kwargs):
        super().__init__()
        self.dense = layers.Dense(**kwargs)

    def call(self, x):
        return self.dense(x)


def test_layers_whose_config_does_not_name_them_unfuse_and_export(
        tmp_path):
    rng = np.random.default_rng(17)
    inputs = keras.Input((4,))
    model = keras.Sequential([inputs, Nameless(name="first"),
                              Renamed(units=4)])
    outer = keras.Model(inputs, Nameless(name="second")(model(inputs)))
    array = hftatf.fuse(outer, 2)
    x = rng.standard_normal((3, 4)).astype("float32")
    assert_unfused_models_predict_alike(array, x)
    array.export_models(str(tmp_path / "models"))
    exported = hftatf.from_exported(str(tmp_path / "models"))
    assert_close(exported.predict(x, verbose=0), array.predict(x, verbose=0))


@keras.saving.register_keras_serializable(package="test_per_model")
class TiedOutput(layers.Layer):
    """Projects on the model's token embeddings (tied weights)."""

    def __init__(self, embedding, **kwargs):
        super().__init__(**kwargs)
        self.embedding = embedding

    def call(self, x):
        return ops.matmul(x, ops.transpose(self.embedding.embeddings))


def test_a_weight_shared_into_a_layer_run_per_model_is_refused():
    # Its copies would each hold the embedding of their own: untied.
    ids = keras.Input((5,), dtype="int32")
    embedding = layers.Embedding(10, 4, name="tokens")
    hidden = layers.Dense(4)(embedding(ids))
    model = keras.Model(ids, TiedOutput(embedding, name="head")(hidden))
    with pytest.raises(ValueError, match="'tokens'.*'head'.*share a weight"):
        hftatf.fuse(model, 2)
    # A layer shared by a nested model and the outer one is no tie.
    inner = keras.Sequential([keras.Input((4,)), TwiceDense(4, name="twice")])
    inputs = keras.Input((4,))
    shared = keras.Model(inputs, inner.layers[0](inner(inputs)))
    hftatf.fuse(shared, 2)


def test_a_layer_that_cannot_be_copied_from_its_config_is_named():
    class Rigid(layers.Layer):
        def __init__(self):  # takes no `name`, `trainable`, `dtype`
            super().__init__(name="rigid")
            self.dense = layers.Dense(2)

        def call(self, x):
            return self.dense(x)

    inputs = keras.Input((3,))
    model = keras.Model(inputs, Rigid()(inputs))
    with pytest.raises(ValueError, match="(?s)'rigid'.*could not copy.*kwargs"):
        hftatf.fuse(model, 2)

    class Forgetful(layers.Dense):
        def get_config(self):  # reads an attribute it never set
            return {**super().get_config(), "scale": self.scale}

    model = keras.Model(inputs, Forgetful(2, name="forgetful")(inputs))
    with pytest.raises(ValueError, match="'forgetful'.*could not copy"):
        hftatf.fuse(model, 2)
