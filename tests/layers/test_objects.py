"""Functions and classes of a script's own, not registered with Keras, in
the layers of a fused model: fuse, train, unfuse, select, export and reload
find them in the process that holds them."""

import keras
import numpy as np
import pytest
from keras import ops
from testing import assert_close

import hftatf
from hftatf.layers import objects

NUM_MODELS = 2


def scaled_tanh(x):
    return 2.0 * ops.tanh(x)


def cube(x):
    return x * x * x


def same_shape(shape):
    return shape


class ScaledNormal(keras.initializers.Initializer):
    def __init__(self, scale=0.1):
        self.scale = scale

    def __call__(self, shape, dtype=None):
        return keras.random.normal(shape, stddev=self.scale, dtype=dtype)

    def get_config(self):
        return {"scale": self.scale}


class AbsSum(keras.regularizers.Regularizer):
    def __init__(self, factor=0.01):
        self.factor = factor

    def __call__(self, weights):
        return self.factor * ops.sum(ops.abs(weights))

    def get_config(self):
        return {"factor": self.factor}


class Clip(keras.constraints.Constraint):
    def __init__(self, limit=0.3):
        self.limit = limit

    def __call__(self, weights):
        return ops.clip(weights, -self.limit, self.limit)

    def get_config(self):
        return {"limit": self.limit}


def custom_model():
    inputs = keras.Input((3,))
    hidden = keras.layers.Dense(
        4, activation=scaled_tanh, kernel_initializer=ScaledNormal(),
        kernel_regularizer=AbsSum(), kernel_constraint=Clip())(inputs)
    hidden = keras.layers.Lambda(cube, output_shape=same_shape)(hidden)
    hidden = keras.layers.Activation(scaled_tanh)(hidden)
    return keras.Model(inputs, keras.layers.Dense(2)(hidden))


CUSTOM = {"scaled_tanh": scaled_tanh, "cube": cube,
          "same_shape": same_shape, "ScaledNormal": ScaledNormal,
          "AbsSum": AbsSum, "Clip": Clip}


def data():
    rng = np.random.default_rng(0)
    return (rng.standard_normal((8, 3)).astype("float32"),
            rng.standard_normal((8, 2)).astype("float32"))


def test_live_objects_finds_what_the_configs_name():
    found = objects.live_objects(custom_model().layers)
    assert found == CUSTOM
    # Keras's own are found by Keras.
    assert "relu" not in objects.live_objects(
        [keras.layers.Dense(2, activation="relu")])


def test_a_name_two_objects_share_is_left_out():
    def twin():  # another function named `cube`
        return None

    twin.__name__ = "cube"
    layers = [keras.layers.Lambda(cube), keras.layers.Lambda(twin)]
    assert "cube" not in objects.live_objects(layers)


def test_custom_objects_fuse_train_and_unfuse_like_stock():
    x, y = data()
    array = hftatf.fuse(custom_model(), NUM_MODELS)
    stock = array.unfuse()
    prediction = array.predict(x, verbose=0)
    for b, twin in enumerate(stock):
        assert twin.layers[1].activation is scaled_tanh
        assert isinstance(twin.layers[1].kernel_constraint, Clip)
        assert_close(prediction[:, b], twin.predict(x, verbose=0))
    array.compile(hftatf.optimizers.SGD(0.1), loss="mse",
                  models_per_pass=1)
    array.fit(x, y, batch_size=4, shuffle=False, verbose=0)
    for b, twin in enumerate(stock):
        twin.compile(keras.optimizers.SGD(0.1), loss="mse")
        twin.fit(x, y, batch_size=4, shuffle=False, verbose=0)
        for got, want in zip(array.unfuse()[b].get_weights(),
                             twin.get_weights()):
            assert_close(got, want, err_msg=f"model {b}")
    assert array.select([1]).num_models == 1


def test_custom_objects_export_and_reload(tmp_path):
    x, _ = data()
    array = hftatf.fuse(custom_model(), NUM_MODELS)
    array.export_models(tmp_path / "export")
    model = keras.models.load_model(
        tmp_path / "export" / "model_1" / "model.keras",
        custom_objects=CUSTOM)
    assert_close(model.predict(x, verbose=0),
                 array.predict(x, verbose=0)[:, 1])
    array.save(tmp_path / "array.keras")
    with pytest.raises(TypeError, match="scaled_tanh|could not be"):
        keras.models.load_model(tmp_path / "array.keras")
    loaded = keras.models.load_model(tmp_path / "array.keras",
                                     custom_objects=CUSTOM)
    assert_close(loaded.predict(x, verbose=0), array.predict(x, verbose=0))


def test_python_lambdas_keep_their_globals(tmp_path):
    # Rebuilt from its code, this lambda would lose the module's `keras`
    # (stock `clone_model` fails on it); unfuse and select use the live one.
    inputs = keras.Input((3,))
    hidden = keras.layers.Lambda(lambda t: keras.ops.sin(t))(
        keras.layers.Dense(4)(inputs))
    array = hftatf.fuse(keras.Model(inputs, keras.layers.Dense(2)(hidden)),
                        NUM_MODELS)
    x, _ = data()
    prediction = array.predict(x, verbose=0)
    for b, twin in enumerate(array.unfuse()):
        assert_close(prediction[:, b], twin.predict(x, verbose=0))
    assert_close(array.select([1]).predict(x, verbose=0)[:, 0],
                 prediction[:, 1])
    array.export_models(tmp_path / "export")
    assert (tmp_path / "export" / "model_0" / "model.keras").exists()
