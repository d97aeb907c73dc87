"""fuse, unfuse and fuse_models: exact inverses, clear refusals."""

import keras
import numpy as np
import pytest
from testing import assert_close

import hftatf


def mlp(name="mlp", hidden=8):
    x = keras.Input((5,), name="x")
    h = keras.layers.Dense(hidden, activation="relu")(x)
    h = keras.layers.Dropout(0.2)(h)
    y = keras.layers.Dense(2)(h)
    return keras.Model(x, y, name=name)


def trained_like(model, seed):
    """A copy of `model`'s architecture with random (trained-like) weights."""
    copy = keras.models.clone_model(model)
    rng = np.random.default_rng(seed)
    copy.set_weights([rng.normal(size=w.shape).astype("float32")
                      for w in copy.get_weights()])
    return copy


def test_unfuse_of_fuse_models_returns_the_weights_exactly():
    models = [trained_like(mlp(), seed) for seed in range(3)]
    array = hftatf.fuse_models(models)
    assert array.num_models == 3
    for model, unfused in zip(models, array.unfuse()):
        assert type(unfused) is type(model)
        for ours, theirs in zip(unfused.get_weights(), model.get_weights()):
            np.testing.assert_array_equal(ours, theirs)


def test_fuse_models_of_unfuse_returns_the_array_exactly():
    array = hftatf.fuse(mlp(), 3)
    again = hftatf.fuse_models(array.unfuse())
    for ours, theirs in zip(again.get_weights(), array.get_weights()):
        np.testing.assert_array_equal(ours, theirs)


def test_array_outputs_equal_each_model():
    models = [trained_like(mlp(), seed) for seed in range(3)]
    array = hftatf.fuse_models(models)
    x = np.random.default_rng(0).normal(size=(7, 5)).astype("float32")
    outputs = array.predict(x, verbose=0)
    for b, model in enumerate(models):
        assert_close(outputs[:, b], model.predict(x, verbose=0))


def test_fuse_sequential_model():
    model = keras.Sequential([
        keras.Input((4, 3)),
        keras.layers.Flatten(),
        keras.layers.Dense(6, activation="relu"),
        keras.layers.Dense(2, activation="softmax"),
    ])
    array = hftatf.fuse(model, 2)
    x = np.random.default_rng(1).normal(size=(5, 4, 3)).astype("float32")
    outputs = array.predict(x, verbose=0)
    assert outputs.shape == (5, 2, 2)
    for b, unfused in enumerate(array.unfuse()):
        assert isinstance(unfused, keras.Sequential)
        assert_close(outputs[:, b], unfused.predict(x, verbose=0))


def test_weightless_layers_on_shared_inputs_run_once():
    model = keras.Sequential([keras.Input((4, 3)), keras.layers.Flatten(),
                              keras.layers.Dense(2)])
    array = hftatf.fuse(model, 3)
    kinds = [type(layer).__name__ for layer in array.layers]
    # Flatten sees the shared batch: no fold, broadcast just before Dense.
    assert kinds == ["InputLayer", "Flatten", "BroadcastToModels",
                     "FusedDense"]


def test_initial_models_differ():
    array = hftatf.fuse(mlp(), 3)
    kernels = [m.get_weights()[0] for m in array.unfuse()]
    assert not np.allclose(kernels[0], kernels[1])
    assert not np.allclose(kernels[1], kernels[2])


def test_shared_layer_stays_one_fused_layer():
    x = keras.Input((3,))
    shared = keras.layers.Dense(3, name="shared")
    y = shared(shared(x))
    array = hftatf.fuse(keras.Model(x, y), 2)
    assert sum(isinstance(layer, hftatf.layers.FusedDense)
               for layer in array.layers) == 1
    inputs = np.ones((2, 3), "float32")
    outputs = array.predict(inputs, verbose=0)
    for b, model in enumerate(array.unfuse()):
        assert_close(outputs[:, b], model.predict(inputs, verbose=0))


def test_frozen_layer_stays_frozen():
    model = mlp()
    model.layers[1].trainable = False
    array = hftatf.fuse(model, 2)
    assert not array.get_layer(model.layers[1].name).trainable
    assert len(array.trainable_weights) == 2


@pytest.mark.parametrize("num_models", [0, -2])
def test_num_models_below_one_is_refused(num_models):
    with pytest.raises(ValueError, match="num_models"):
        hftatf.fuse(mlp(), num_models)


def test_num_models_not_an_integer_is_refused():
    with pytest.raises(TypeError, match="num_models"):
        hftatf.fuse(mlp(), 2.0)


def test_subclassed_model_is_refused():
    class Subclassed(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(2)

        def call(self, x):
            return self.dense(x)

    model = Subclassed()
    model(np.zeros((1, 3), "float32"))
    with pytest.raises(ValueError, match="subclassed"):
        hftatf.fuse(model, 2)


def test_unsupported_layer_is_refused_by_name():
    class Unknown(keras.layers.Layer):
        def call(self, x):
            return x

    x = keras.Input((4, 3))
    y = Unknown(name="my_layer")(x)
    with pytest.raises(ValueError, match="my_layer.*Unknown"):
        hftatf.fuse(keras.Model(x, y), 2)


def test_fuse_models_refuses_other_architectures():
    with pytest.raises(ValueError, match=r"model 1 .*layer 1 .*units"):
        hftatf.fuse_models([mlp(hidden=8), mlp(hidden=9)])
    other = keras.Sequential([keras.Input((5,)), keras.layers.Dense(2)])
    with pytest.raises(ValueError, match="model 1"):
        hftatf.fuse_models([mlp(), other])
    with pytest.raises(ValueError, match="at least one"):
        hftatf.fuse_models([])
