"""The registry: which stock layer classes have a fused form, and what it is."""

import keras
import numpy as np
import pytest
from testing import assert_close

from hftatf.layers import (
    PER_SAMPLE_LAYERS,
    FusedDense,
    FusedFold,
    FusedPerModel,
    registry,
    resolve,
)


class UserDense(keras.layers.Dense):
    """A user subclass of Dense: it may compute something else entirely."""

    def call(self, inputs):
        return super().call(inputs) * 2.0


class UserReLU(keras.layers.ReLU):
    pass


class UserCell(keras.layers.Layer):
    """A recurrent cell of the user's own."""

    state_size = 4

    def call(self, inputs, states):
        return inputs, states


@pytest.mark.parametrize("layer", [
    pytest.param(keras.layers.RNN(UserCell(), name="my_rnn"), id="RNN"),
    pytest.param(UserDense(4, name="my_dense"), id="UserDense"),
    pytest.param(UserReLU(name="my_relu"), id="UserReLU"),
])
def test_layer_without_a_fused_form_runs_once_per_model(layer):
    # Subclasses of stock layers and RNNs of other cells included: each
    # model runs the layer itself (tests/layers/test_per_model.py).
    assert resolve.is_supported(layer)
    assert resolve.runs_per_model(layer)
    assert not resolve.is_foldable(layer)
    assert resolve.fused_form(layer) is FusedPerModel


def test_layer_that_cannot_run_per_model_is_named_in_the_error():
    # Padded to each batch's longest text: it cannot be folded, and its
    # lookup table cannot be copied per model.
    layer = keras.layers.TextVectorization(vocabulary=["a"], name="my_lookup")
    assert not resolve.is_supported(layer)
    with pytest.raises(ValueError) as error:
        resolve.fused_form(layer)
    message = str(error.value)
    assert "'my_lookup'" in message
    assert ("keras.src.layers.preprocessing.text_vectorization."
            "TextVectorization") in message
    # The reason of the form its class has, which names the fix.
    assert "`output_sequence_length`" in message
    with pytest.raises(ValueError, match="my_lookup"):
        resolve.fuse_layer(layer, 2)


def test_supported_layers():
    supported = resolve.supported_layers()
    assert keras.layers.Dense in supported
    assert keras.layers.Dropout in supported
    assert set(PER_SAMPLE_LAYERS) <= set(supported)
    names = [cls.__name__ for cls in supported]
    assert names == sorted(names)
    assert len(set(supported)) == len(supported)


def test_lookup_is_by_exact_class():
    assert resolve.fused_form(keras.layers.Dense(4)) is FusedDense
    assert resolve.is_supported(keras.layers.Dense(4))
    assert not resolve.is_foldable(keras.layers.Dense(4))
    assert keras.layers.Dense in resolve.supported_layers()
    assert UserDense not in resolve.supported_layers()
    assert resolve.fused_form(UserDense(4)) is FusedPerModel


# Constructor arguments of the per-sample classes that require some.
REQUIRED_ARGS = {
    "Activation": ("relu",), "Dropout": (0.5,), "SpatialDropout1D": (0.5,),
    "SpatialDropout2D": (0.5,), "SpatialDropout3D": (0.5,),
    "GaussianNoise": (0.1,), "GaussianDropout": (0.1,),
    "AlphaDropout": (0.1,), "Reshape": ((2, 2),), "Permute": ((2, 1),),
    "RepeatVector": (2,), "Resizing": (2, 3), "CenterCrop": (2, 3),
    "AveragePooling1D": (2,), "AveragePooling2D": (2,),
    "AveragePooling3D": (2,), "Dot": (1,), "Rescaling": (0.5,),
    "AdaptiveAveragePooling1D": (2,), "AdaptiveAveragePooling2D": (2,),
    "AdaptiveAveragePooling3D": (2,), "AdaptiveMaxPooling1D": (2,),
    "AdaptiveMaxPooling2D": (2,), "AdaptiveMaxPooling3D": (2,),
    "CategoryEncoding": (4,), "Discretization": ([0.0],), "Hashing": (4,),
    "HashedCrossing": (4,),
    "RandomRotation": (0.1,), "RandomTranslation": (0.1, 0.1),
    "RandomZoom": (0.1,), "RandomContrast": (0.1,),
    "RandomBrightness": (0.1,), "Lambda": (abs,),
    "RandomColorDegeneration": (0.1,), "RandomHue": (0.1,),
    "RandomSaturation": (0.1,), "RandomSharpness": (0.1,),
    "RandomPosterization": (4,),
}
# Keyword arguments where the defaults make a layer that does not fold.
FOLDING_KWARGS = {"TextVectorization": {"output_sequence_length": 4}}


@pytest.mark.parametrize("stock_class", PER_SAMPLE_LAYERS,
                         ids=lambda c: c.__name__)
def test_per_sample_layers_are_folded(stock_class):
    stock = stock_class(*REQUIRED_ARGS.get(stock_class.__name__, ()),
                        **FOLDING_KWARGS.get(stock_class.__name__, {}))
    assert stock_class in resolve.supported_layers()
    assert resolve.fused_form(stock) is FusedFold
    assert resolve.is_foldable(stock)
    fused = resolve.fuse_layer(stock, 3)
    assert type(fused) is FusedFold
    assert fused.num_models == 3
    assert type(fused.layer) is stock_class
    # A copy with its own random state; a Lambda (stateless, and its
    # function may not survive a config round trip) and a lookup (whose
    # vocabulary its config may not hold) are shared.
    assert (fused.layer is stock) == (stock_class in (
        keras.layers.Lambda, keras.layers.StringLookup,
        keras.layers.IntegerLookup, keras.layers.TextVectorization))
    assert fused.layer.get_config() == stock.get_config()


def test_fuse_dense_keeps_the_stock_arguments():
    stock = keras.layers.Dense(
        4, activation="tanh", use_bias=False,
        kernel_initializer=keras.initializers.HeNormal(seed=3),
        kernel_regularizer=keras.regularizers.L2(0.01),
        kernel_constraint=keras.constraints.MaxNorm(2.0, axis=0),
        name="stock_dense")
    fused = resolve.fuse_layer(stock, 3)
    assert type(fused) is FusedDense
    assert fused.num_models == 3
    assert fused.name == "stock_dense"
    stock_config = stock.get_config()
    fused_config = fused.get_config()
    for key, value in stock_config.items():
        if key == "quantization_config":
            continue  # Accepted for parity, never stored (must be None).
        assert fused_config[key] == value, key


def test_fused_dense_from_stock_computes_like_the_stock_layers():
    rng = np.random.default_rng(0)
    stock = [keras.layers.Dense(3, activation="relu") for _ in range(2)]
    for layer in stock:
        layer.build((None, 5))
        layer.set_weights([rng.standard_normal(w.shape).astype("float32")
                           for w in layer.get_weights()])
    fused = resolve.fuse_layer(stock[0], 2)
    fused.build((None, 2, 5))
    for b, layer in enumerate(stock):
        fused.set_model_weights(b, layer.get_weights())
    x = rng.standard_normal((4, 2, 5)).astype("float32")
    y = fused(x)
    for b, layer in enumerate(stock):
        assert_close(y[:, b], layer(x[:, b]))


def test_fuse_foldable_layer_wraps_a_copy():
    stock = keras.layers.Dropout(0.3, noise_shape=(None, 1), seed=5,
                                 name="stock_dropout")
    fused = resolve.fuse_layer(stock, 3)
    assert type(fused) is FusedFold
    assert fused.num_models == 3
    assert fused.name == "stock_dropout"
    assert type(fused.layer) is keras.layers.Dropout
    assert fused.layer is not stock
    assert fused.layer.get_config() == stock.get_config()


def test_register_a_user_class(monkeypatch):
    # Registering mutates the process-wide map: give this test its own copy.
    monkeypatch.setattr(registry, "_FUSED_FORMS",
                        dict(registry._FUSED_FORMS))
    registry.register(UserReLU)(FusedFold)
    layer = UserReLU(name="registered_relu")
    assert resolve.is_supported(layer)
    assert resolve.is_foldable(layer)
    fused = resolve.fuse_layer(layer, 2)
    assert type(fused.layer) is UserReLU
    x = np.random.default_rng(1).standard_normal((3, 2, 4)).astype("float32")
    assert_close(fused(x), np.stack([layer(x[:, b]) for b in range(2)],
                                    axis=1))


@pytest.mark.parametrize("factory, shape, index", [
    (lambda: keras.layers.Dense(
        6, kernel_initializer=keras.initializers.Identity(2.0)), (None, 4),
     0),
    (lambda: keras.layers.SimpleRNN(
        4, recurrent_initializer=keras.initializers.Identity(0.5)),
     (None, 3, 2), 1),
])
def test_fused_layers_initialize_like_stock_where_configs_lose_arguments(
        factory, shape, index):
    # Keras serializes Identity without its gain: a fused layer built from
    # the stock config alone would start at gain 1.
    stock = factory()
    stock.build(shape)
    fused = resolve.fuse_layer(stock, 2)
    fused.build((shape[0], 2, *shape[1:]))
    expected = stock.get_weights()[index]
    for b in range(2):
        np.testing.assert_array_equal(fused.get_weights()[index][b],
                                      expected)
