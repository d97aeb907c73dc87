"""fuse, unfuse and fuse_models: exact inverses, clear refusals."""

import keras
import numpy as np
import pytest
from testing import assert_close, trains_like_stock

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


def test_unfuse_rebuilds_lambda_layers():
    # Keras's safe mode refuses a Lambda's Python function from a config;
    # the array's own config is no untrusted file.
    inputs = keras.Input((6,))
    hidden = keras.layers.Lambda(lambda t: t * 2.0 + 1.0)(
        keras.layers.Dense(3)(inputs))
    array = hftatf.fuse(keras.Model(inputs, keras.layers.Dense(2)(hidden)),
                        2)
    x = np.random.default_rng(3).standard_normal((5, 6)).astype("float32")
    predictions = array.predict(x, verbose=0)
    for b, model in enumerate(array.unfuse()):
        assert_close(model.predict(x, verbose=0), predictions[:, b])


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
    # Flatten sees the shared batch: no fold; the Dense takes the shared
    # batch as one wide layer, so nothing is broadcast.
    assert kinds == ["InputLayer", "Flatten", "FusedDense"]
    assert array.layers[-1].shared_input


def _first_layer_models():
    def sequential(input_shape, *layers):
        return keras.Sequential([keras.Input(input_shape), *layers])
    return {
        "dense": sequential((5,), keras.layers.Dense(4, activation="relu"),
                            keras.layers.Dense(2)),
        "dense_positions": sequential(
            (4, 3), keras.layers.Dense(4, use_bias=False),
            keras.layers.Flatten(), keras.layers.Dense(2)),
        "conv1d_causal": sequential(
            (9, 2), keras.layers.Conv1D(3, 3, padding="causal",
                                        dilation_rate=2, activation="tanh"),
            keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(2)),
        "conv2d": sequential(
            (7, 7, 2), keras.layers.Rescaling(0.5),
            keras.layers.Conv2D(3, 3, strides=2, padding="same"),
            keras.layers.Flatten(), keras.layers.Dense(2)),
        "conv3d": sequential(
            (4, 4, 4, 1), keras.layers.Conv3D(2, 2, use_bias=False),
            keras.layers.Flatten(), keras.layers.Dense(2)),
    }


@pytest.mark.parametrize("jit_compile", [False, True])
@pytest.mark.parametrize("name", sorted(_first_layer_models()))
def test_first_layer_on_a_shared_input_is_one_wide_layer(name, jit_compile):
    model = _first_layer_models()[name]
    array = hftatf.fuse(model, 3)
    weighted = [layer for layer in array.layers if layer.weights]
    assert weighted[0].shared_input
    assert not any(isinstance(layer, hftatf.layers.BroadcastToModels)
                   for layer in array.layers)
    # Trained side by side with its stock twins, step for step.
    rng = np.random.default_rng(3)
    x = rng.normal(size=(12, *model.input_shape[1:])).astype("float32")
    y = rng.normal(size=(12, 2)).astype("float32")
    stock = array.unfuse()
    rates = [0.05, 0.1, 0.02]
    # With and without XLA: the shared-input layers compute differently
    # for each.
    array.compile(hftatf.optimizers.SGD(rates), loss="mse",
                  jit_compile=jit_compile)
    array.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    for b, twin in enumerate(stock):
        twin.compile(keras.optimizers.SGD(rates[b]), loss="mse")
        twin.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
        for ours, theirs in zip(array.unfuse()[b].weights, twin.weights):
            assert_close(ours, theirs, err_msg=f"model {b} {theirs.path}")
    assert_close(array.predict(x, verbose=0)[:, 1],
                 stock[1].predict(x, verbose=0))


def test_wide_first_layer_survives_saving(tmp_path):
    array = hftatf.fuse(_first_layer_models()["conv2d"], 2)
    x = np.random.default_rng(4).normal(size=(3, 7, 7, 2)).astype("float32")
    path = tmp_path / "array.keras"
    array.save(path)
    loaded = keras.models.load_model(path)
    first = [layer for layer in loaded.layers if layer.weights][0]
    assert first.shared_input
    assert_close(loaded.predict(x, verbose=0), array.predict(x, verbose=0))


def test_shared_input_is_broadcast_where_no_wide_layer_fits():
    grouped = keras.Sequential([
        keras.Input((5, 5, 4)), keras.layers.Conv2D(2, 3, groups=2),
        keras.layers.Flatten(), keras.layers.Dense(2)])
    array = hftatf.fuse(grouped, 2)
    kinds = [type(layer).__name__ for layer in array.layers]
    assert kinds[:3] == ["InputLayer", "BroadcastToModels", "FusedConv2D"]
    assert not array.layers[2].shared_input
    # One layer called on the shared input and on its own output: one
    # layout for its weights, so the input is broadcast.
    x = keras.Input((3,))
    twice = keras.layers.Dense(3)
    array = hftatf.fuse(keras.Model(x, twice(twice(x))), 2)
    assert any(isinstance(layer, hftatf.layers.BroadcastToModels)
               for layer in array.layers)
    # Per-model inputs have the model axis already.
    array = hftatf.fuse(_first_layer_models()["dense"], 2,
                        shared_inputs=False)
    assert not any(getattr(layer, "shared_input", False)
                   for layer in array.layers)


def test_shared_input_layers_refuse_what_they_cannot_compute():
    with pytest.raises(ValueError, match="groups=1"):
        hftatf.layers.FusedConv2D(2, filters=4, kernel_size=3, groups=2,
                                  shared_input=True)
    for stock in (keras.layers.LayerNormalization(), keras.layers.Flatten(),
                  keras.layers.Conv2D(4, 3, groups=2)):
        assert not hftatf.layers.resolve.takes_shared_input(stock)
        with pytest.raises(ValueError, match="shared input"):
            hftatf.layers.resolve.fuse_layer(stock, 2, shared_input=True)
    layer = hftatf.layers.FusedConv2D(2, filters=4, kernel_size=3,
                                      shared_input=True)
    with pytest.raises(ValueError, match="shared by all models"):
        layer.build((None, 2, 5, 5, 3))


def test_wide_dense_passes_a_shared_mask_to_every_model():
    layer = hftatf.layers.FusedDense(3, 2, shared_input=True)
    x = np.ones((2, 4, 5), "float32")
    mask = np.array([[True, True, False, False], [True, False, False, False]])
    assert layer(x).shape == (2, 3, 4, 2)
    fused_mask = np.asarray(layer.compute_mask(x, mask))
    assert fused_mask.shape == (2, 3, 4)
    assert (fused_mask == mask[:, None]).all()


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


def test_an_array_beyond_the_memory_is_refused_before_it_is_built():
    # 10**9 models of 66 parameters: about 1 TB of weights, gradients and
    # Adam's slots, more than any machine that runs these tests (building
    # that many would run for hours).
    with pytest.raises(ValueError, match=(
            r"num_models=1000000000 .*66 parameters.*GiB.*available.*"
            r"Use at most num_models=\d+")):
        hftatf.fuse(mlp(), 10**9)


def test_subclassed_model_is_refused():
    class Subclassed(keras.Model):
        # An argument of its own and no `get_config`.
        def __init__(self, units):
            super().__init__()
            self.dense = keras.layers.Dense(units)

        def call(self, x):
            return self.dense(x)

    model = Subclassed(2)
    model(np.zeros((1, 3), "float32"))
    with pytest.raises(ValueError, match="subclassed.*keras.Input"):
        hftatf.fuse(model, 2)
    # Before Keras's error for its missing `get_config`.
    with pytest.raises(ValueError, match="subclassed.*keras.Input"):
        hftatf.fuse_models([model, model])


def test_subclassed_model_with_its_own_step_is_told_where_the_step_goes():
    # keras.io's VAE: sub-models, its own `train_step`, no `call`.
    class VAE(keras.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.encoder = keras.Sequential([keras.Input((3,)),
                                             keras.layers.Dense(2)])

        def train_step(self, data):
            return {}

    with pytest.raises(ValueError) as error:
        hftatf.fuse(VAE(), 2)
    message = " ".join(str(error.value).split())
    assert "subclassed VAE" in message
    assert "own `train_step` would not run in the array" in message
    assert "`model_class=`" in message


def test_layer_that_cannot_run_per_model_is_refused_by_name():
    x = keras.Input((1,))
    y = keras.layers.JaxLayer(lambda params, inputs: inputs, params={},
                              name="my_layer")(x)
    with pytest.raises(ValueError, match="my_layer.*JaxLayer"):
        hftatf.fuse(keras.Model(x, y), 2)


def test_fuse_models_refuses_other_architectures():
    with pytest.raises(ValueError, match=r"model 1 .*layer 1 .*units"):
        hftatf.fuse_models([mlp(hidden=8), mlp(hidden=9)])
    other = keras.Sequential([keras.Input((5,)), keras.layers.Dense(2)])
    with pytest.raises(ValueError, match="model 1"):
        hftatf.fuse_models([mlp(), other])
    with pytest.raises(ValueError, match="at least one"):
        hftatf.fuse_models([])


def test_fuse_models_refuses_other_dtype_policies():
    def model(dtype):
        inputs = keras.Input((5,))
        hidden = keras.layers.Dense(4, activation="relu")(inputs)
        return keras.Model(inputs, keras.layers.Dense(2, dtype=dtype)(hidden))

    for dtype in ("mixed_float16", "float64"):
        with pytest.raises(ValueError,
                           match=f"dtype.*'{dtype}' instead of 'float32'"):
            hftatf.fuse_models([model("float32"), model(dtype)])


def test_fuse_models_names_the_difference_inside_a_nested_model():
    def model(activation):
        block = keras.Sequential([keras.layers.Dense(4, activation=activation),
                                  keras.layers.Dense(3)])
        inputs = keras.Input((5,))
        return keras.Model(inputs, block(inputs))

    with pytest.raises(ValueError) as error:
        hftatf.fuse_models([model("relu"), model("sigmoid")])
    message = str(error.value)
    assert "activation is 'sigmoid' instead of 'relu'" in message
    assert len(message) < 400, message


def raw_op_model(scale=2.0, activation="softmax"):
    """A functional model with a raw `keras.ops` call and a nested model:
    its config lists the raw operation, `model.layers` does not."""
    inner_input = keras.Input((5,))
    inner = keras.Model(
        inner_input, keras.layers.Dense(4, activation="tanh")(inner_input),
        name="inner")
    inputs = keras.Input((5,))
    hidden = keras.layers.Concatenate()([inner(inputs), inner(inputs * scale)])
    return keras.Model(inputs,
                       keras.layers.Dense(3, activation=activation)(hidden))


def test_fuse_models_compares_graphs_with_raw_operations():
    models = [raw_op_model() for _ in range(2)]
    array = hftatf.fuse_models(models)
    x = np.random.default_rng(0).normal(size=(4, 5)).astype("float32")
    y = array.predict(x, verbose=0)
    for b, model in enumerate(models):
        np.testing.assert_allclose(y[:, b], model.predict(x, verbose=0),
                                   rtol=1e-6, atol=1e-7)
    # The last layer's arguments and the raw operation's are compared too.
    with pytest.raises(ValueError, match=r"model 1 .*layer 4 .*activation"):
        hftatf.fuse_models([raw_op_model(),
                            raw_op_model(activation="linear")])
    with pytest.raises(ValueError, match=r"model 1 .*layer 1 "):
        hftatf.fuse_models([raw_op_model(), raw_op_model(scale=3.0)])


class StepModel(keras.Model):
    """A functional model with a training step of its own."""

    def train_step(self, data):
        return super().train_step(data)


class StepSequential(keras.Sequential):
    def compute_loss(self, *args, **kwargs):
        return super().compute_loss(*args, **kwargs)


class OwnStepArray(hftatf.FusedModel):
    """Where the array's own training step would go."""


class NamedModel(keras.Model):
    """A functional subclass that adds nothing the array would drop."""

    def describe(self):
        return self.name


def test_models_with_custom_steps_are_refused_naming_them():
    inputs = keras.Input((4,))
    outputs = keras.layers.Dense(2)(inputs)
    with pytest.raises(ValueError, match=r"`train_step`.*model_class="):
        hftatf.fuse(StepModel(inputs, outputs), 2)
    sequential = StepSequential([keras.Input((4,)), keras.layers.Dense(2)])
    with pytest.raises(ValueError, match="`compute_loss`"):
        hftatf.fuse(sequential, 2)
    # With a FusedModel subclass given for the step, and for subclasses
    # that override nothing the array would drop, the model fuses.
    assert hftatf.fuse(StepModel(inputs, outputs), 2,
                       model_class=OwnStepArray).num_models == 2
    assert hftatf.fuse(NamedModel(inputs, outputs), 2).num_models == 2


def test_shared_inputs_by_name_and_refused_when_not_bools():
    a = keras.Input((3,), name="a")
    b = keras.Input((3,), name="b")
    model = keras.Model([a, b], keras.layers.Dense(2)(
        keras.layers.Concatenate()([a, b])))
    array = hftatf.fuse(model, 2, shared_inputs={"b": False, "a": True})
    assert list(array.shared_inputs) == [True, False]
    with pytest.raises(ValueError, match=r"input name.*\['a', 'b'\]"):
        hftatf.fuse(model, 2, shared_inputs={"a": True})
    with pytest.raises(TypeError, match="takes bools"):
        hftatf.fuse(model, 2, shared_inputs=["False", "False"])


@pytest.mark.parametrize("swap", ["inputs", "merge"])
def test_fuse_models_refuses_models_wired_in_another_order(swap):
    # Alike layer for layer, but computing Dense(i1) - Dense(i2) against
    # Dense(i2) - Dense(i1).
    def model(swapped):
        i1 = keras.Input((4,), name="i1")
        i2 = keras.Input((4,), name="i2")
        a, b = keras.layers.Dense(3)(i1), keras.layers.Dense(3)(i2)
        merged = [b, a] if swapped and swap == "merge" else [a, b]
        inputs = [i2, i1] if swapped and swap == "inputs" else [i1, i2]
        return keras.Model(inputs, keras.layers.Subtract()(merged))

    hftatf.fuse_models([model(False), model(False)])
    with pytest.raises(ValueError, match="order of the inputs and outputs"):
        hftatf.fuse_models([model(False), model(True)])


def test_a_layer_set_back_to_trainable_inside_a_frozen_nested_model():
    inner = keras.Input((4,))
    sub = keras.Model(inner, keras.layers.Dense(3, name="thaw")(
        keras.layers.Dense(4, name="frozen")(inner)), name="sub")
    sub.trainable = False
    sub.get_layer("thaw").trainable = True
    x = keras.Input((4,))
    model = keras.Model(x, keras.layers.Dense(2)(sub(x)))
    array = hftatf.fuse(model, 2)
    assert len(array.trainable_weights) == len(model.trainable_weights) == 4
    rng = np.random.default_rng(5)
    trains_like_stock(model, rng.normal(size=(8, 4)).astype("float32"),
                      rng.normal(size=(8, 2)).astype("float32"))


def test_trainable_flags_set_after_fusing_are_kept(tmp_path):
    # Frozen and thawed on the array, after `fuse`: the stock config the
    # array was made from says otherwise, and every copy of the array
    # (saved and loaded, selected, unfused) must follow the array.
    inner = keras.Input((4,))
    sub = keras.Model(inner, keras.layers.Dense(3, name="thaw")(inner),
                      name="sub")
    sub.trainable = False
    x = keras.Input((4,))
    hidden = keras.layers.Dense(4, name="freeze")(sub(x))
    model = keras.Model(x, keras.layers.Dense(2, name="head")(hidden))
    array = hftatf.fuse(model, 2)
    array.get_layer("freeze").trainable = False
    array.get_layer("sub").trainable = True

    def trainable(m):
        return sorted(w.path.split("/")[-2] + "/" + w.name
                      for w in m.trainable_weights)

    expected = ["head/bias", "head/kernel", "thaw/bias", "thaw/kernel"]
    assert trainable(array) == expected
    array.save(tmp_path / "array.keras")
    copies = [keras.models.load_model(tmp_path / "array.keras"),
              array.select([1]), *array.unfuse()]
    for copy in copies:
        assert trainable(copy) == expected


# -- dtype policies ------------------------------------------------------------


@pytest.fixture
def mixed_float16():
    keras.mixed_precision.set_global_policy("mixed_float16")
    yield
    keras.mixed_precision.set_global_policy("float32")


@pytest.mark.parametrize("layout", ["models_first", "batch_first"])
def test_float32_layers_under_a_mixed_policy_compute_in_float32(
        mixed_float16, layout):
    # Every layer float32 under a global mixed_float16 policy: stock Keras
    # computes all in float32, and so must the layers that `fuse` adds
    # (the broadcast of the shared input, the swaps between layouts, the
    # folds of weightless layers and of raw operations).
    x = keras.Input((6, 6, 2))
    h = keras.layers.LayerNormalization(dtype="float32")(x)
    h = keras.layers.Conv2D(4, 3, padding="same", dtype="float32")(h)
    h = keras.layers.Activation("tanh", dtype="float32")(h)
    h = keras.ops.sin(h)
    h = keras.layers.GlobalAveragePooling2D(dtype="float32")(h)
    h = keras.layers.LayerNormalization(dtype="float32")(h)
    model = keras.Model(x, keras.layers.Dense(3, dtype="float32")(h))
    array = hftatf.fuse(model, 2, layout=layout)
    assert array.outputs[0].dtype == "float32"
    # Values float16 would round (its spacing at 100 is 1/16).
    rng = np.random.default_rng(0)
    data = (100 + 0.05 * rng.normal(size=(4, 6, 6, 2))).astype("float32")
    outputs = keras.ops.convert_to_numpy(array(data))
    assert outputs.dtype == np.float32
    for b, stock in enumerate(array.unfuse()):
        expected = keras.ops.convert_to_numpy(stock(data))
        assert_close(outputs[:, b], expected, atol=1e-5, rtol=1e-5)


def test_the_array_keeps_the_policy_its_model_was_built_with():
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = mlp()
    finally:
        keras.mixed_precision.set_global_policy("float32")
    for array in (hftatf.fuse(model, 2), hftatf.fuse_models([model] * 2)):
        assert array.dtype_policy.name == "mixed_float16"
        # As stock `compile` does for a mixed_float16 model.
        array.compile(hftatf.optimizers.SGD(0.1), loss="mse")
        assert isinstance(array.optimizer,
                          hftatf.optimizers.LossScaleOptimizer)
