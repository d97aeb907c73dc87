"""hftatf.fuse on the graphs real Keras models have: nested models, raw
`keras.ops` nodes, shared layers, several inputs and outputs, frozen layers,
masks and mixed-precision policies. The oracle: each model of the array
computes what the stock model with the same weights computes."""

import keras
import numpy as np
import pytest
from keras import ops
from testing import assert_close, compiled_call, trains_like_stock

import hftatf
from hftatf.graph import weighted_layers
from hftatf.layers import FoldModelAxis, UnfoldModelAxis


def randomized(model, seed):
    """`model`'s architecture with random weights, as if trained."""
    copy = keras.models.clone_model(model)
    rng = np.random.default_rng(seed)
    copy.set_weights([rng.normal(size=w.shape).astype(w.dtype)
                      for w in copy.get_weights()])
    return copy


def assert_array_matches(models, array, inputs, atol=1e-5, rtol=1e-5):
    """Array output `[:, b]` equals model b's output, for every output."""
    outputs = keras.tree.flatten(array(inputs, training=False))
    for b, model in enumerate(models):
        expected = keras.tree.flatten(model(inputs, training=False))
        assert len(outputs) == len(expected)
        for i, (ours, theirs) in enumerate(zip(outputs, expected)):
            assert_close(np.asarray(ours)[:, b], theirs, atol, rtol,
                         err_msg=f"output {i} of model {b}")


def assert_round_trip(models, array):
    for model, unfused in zip(models, array.unfuse()):
        ours, theirs = unfused.get_weights(), model.get_weights()
        assert len(ours) == len(theirs)
        for a, b in zip(ours, theirs):
            np.testing.assert_array_equal(a, b)


def nested_model():
    block = keras.Sequential([
        keras.Input((6,)),
        keras.layers.Dense(5, activation="relu"),
        keras.layers.Dense(4),
    ], name="block")
    x = keras.Input((6,), name="x")
    h = block(x)
    h = keras.layers.Dense(4, name="head_in")(h)
    inner_in = keras.Input((4,))
    inner = keras.Model(inner_in, keras.layers.Dense(3)(inner_in),
                        name="inner")
    return keras.Model(x, inner(h) + block(x)[:, :3], name="outer")


def test_nested_models_fuse_and_round_trip():
    models = [randomized(nested_model(), seed) for seed in range(3)]
    array = hftatf.fuse_models(models)
    # The nested models stay nested, with their names.
    assert {"block", "inner"} <= {layer.name for layer in array.layers}
    x = np.random.default_rng(0).normal(size=(4, 6)).astype("float32")
    assert_array_matches(models, array, x)
    assert_round_trip(models, array)


def test_nested_model_called_twice_stays_one_set_of_weights():
    array = hftatf.fuse(nested_model(), 2)
    block = array.get_layer("block")
    # Two Dense layers, kernel and bias each.
    assert len(block.weights) == 4
    stock_weights = len(nested_model().weights)
    assert len(array.weights) == stock_weights


def raw_ops_model():
    x = keras.Input((3, 4), name="x")
    h = keras.layers.Dense(5)(x)
    h = ops.concatenate([ops.tanh(h), h * 2.0], axis=-1)
    h = ops.mean(h, axis=1) + ops.max(h, axis=1)
    h = ops.transpose(ops.reshape(h, (-1, 2, 5)), (0, 2, 1))
    return keras.Model(x, keras.layers.Dense(2)(ops.reshape(h, (-1, 10))))


def test_raw_operations_act_per_model():
    models = [randomized(raw_ops_model(), seed) for seed in range(3)]
    array = hftatf.fuse_models(models)
    x = np.random.default_rng(1).normal(size=(5, 3, 4)).astype("float32")
    assert_array_matches(models, array, x)
    # Consecutive operations share one fold of the model axis.
    folds = [layer for layer in array.layers
             if isinstance(layer, FoldModelAxis)]
    unfolds = [layer for layer in array.layers
               if isinstance(layer, UnfoldModelAxis)]
    assert len(folds) < len(unfolds) + 2


def test_raw_operations_on_a_shared_input_run_once():
    x = keras.Input((4,))
    y = keras.layers.Dense(2)(ops.square(x) - 1.0)
    model = keras.Model(x, y)
    array = hftatf.fuse(model, 3)
    assert not any(isinstance(layer, FoldModelAxis) for layer in array.layers)
    models = array.unfuse()
    data = np.random.default_rng(2).normal(size=(5, 4)).astype("float32")
    assert_array_matches(models, array, data)


@pytest.mark.parametrize("operation, refused", [
    (lambda h: h - ops.mean(h, axis=0, keepdims=True), "axis=\\[0\\]"),
    (lambda h: h * ops.sum(h), "axis=None"),
    (lambda h: ops.concatenate([h, h], axis=-3), "axis=-3"),
    (lambda h: ops.transpose(ops.transpose(h, (1, 0, 2)), (1, 0, 2)),
     "moves the batch axis"),
    (lambda h: ops.reshape(h, (-1, 6)), "into the batch axis"),
    (lambda h: ops.tile(h, (2, 1, 1)), "repeats the batch"),
    (lambda h: ops.sum(ops.tile(h, (1, 1, 1, 1)), axis=1),
     "moves the batch axis"),
    (lambda h: h - ops.mean(h, axis=(1, 2), keepdims=True), None),
    (lambda h: ops.reshape(ops.transpose(h, (0, 2, 1)), (-1, 12)), None),
    (lambda h: ops.expand_dims(ops.sum(h, axis=(1, 2)), -1), None),
    (lambda h: ops.squeeze(h[:, :1]), None),
    (lambda h: ops.tile(h, (1, 2)), None),
], ids=["mean_over_batch", "sum_of_all", "concatenate_batches",
        "transpose_batch", "reshape_into_batch", "tile_batch",
        "tile_to_new_axis", "mean_per_sample",
        "transpose_reshape_per_sample", "expand_last", "squeeze",
        "tile_per_sample"])
def test_raw_operations_across_the_batch_are_refused(operation, refused):
    # Folded over the models, they would mix the models' samples: an
    # operation on per-model tensors must treat each sample on its own.
    inputs = keras.Input((4, 3))
    hidden = operation(keras.layers.Dense(3)(inputs))
    if len(hidden.shape) > 2:
        hidden = keras.layers.Flatten()(hidden)
    model = keras.Model(inputs, keras.layers.Dense(1)(hidden))
    if refused is None:
        hftatf.fuse(model, 2)
    else:
        with pytest.raises(ValueError, match=refused):
            hftatf.fuse(model, 2)
    # On the shared input, an operation runs once for all models: any is
    # fine there.
    shared = operation(inputs)
    if shared.shape[0] is None:  # (A stock model can be built on it.)
        hftatf.fuse(keras.Model(inputs, keras.layers.Dense(1)(
            keras.layers.Flatten()(shared))), 2)


def test_broadcast_to_a_fixed_batch_is_refused():
    # The target names the stock batch size; folded, the batch holds every
    # model's samples.
    inputs = keras.Input((1, 3), batch_size=4)
    hidden = ops.broadcast_to(keras.layers.Dense(3)(inputs), (4, 2, 3))
    model = keras.Model(inputs, keras.layers.Dense(1)(hidden))
    model.predict(np.ones((4, 1, 3), "float32"), verbose=0)
    with pytest.raises(ValueError, match="fixed batch size"):
        hftatf.fuse(model, 2)


def two_branch_model(operation, batch_size=None):
    """A model whose output is `operation(a, b)` of two activations `a` and
    `b` of shape `[batch, 3]`."""
    inputs = keras.Input((5,), batch_size=batch_size)
    a = keras.layers.Dense(3)(inputs)
    b = keras.layers.Dense(3)(inputs)
    return keras.Model(inputs, operation(a, b))


# What the shape probe says of an operation that moves the batch axis.
OFF_THE_BATCH_AXIS = "does not keep the batch axis first"


@pytest.mark.parametrize("operation, named, found", [
    (lambda a, b: ops.transpose(b), "Transpose", OFF_THE_BATCH_AXIS),
    (lambda a, b: ops.swapaxes(b, 0, 1), "Swapaxes", OFF_THE_BATCH_AXIS),
    (lambda a, b: ops.moveaxis(b, 0, 1), "Moveaxis", OFF_THE_BATCH_AXIS),
    (lambda a, b: ops.einsum("bd,cd->bc", a, b), "Einsum",
     "sizes other axes of its output by the batch"),
    (lambda a, b: ops.matmul(a, ops.transpose(b)), "Transpose",
     OFF_THE_BATCH_AXIS),
    (lambda a, b: a - b[0], "GetItem", OFF_THE_BATCH_AXIS),
    (lambda a, b: ops.reshape(b, (1, -1)), "Reshape", OFF_THE_BATCH_AXIS),
    (lambda a, b: ops.top_k(ops.transpose(b), 2)[0], "Transpose",
     OFF_THE_BATCH_AXIS),
], ids=["transpose_all_axes", "swapaxes", "moveaxis", "einsum_across",
        "matmul_transposed", "index_the_batch", "reshape_whole_batch",
        "top_k_transposed"])
def test_raw_operations_off_the_batch_axis_are_refused(operation, named,
                                                        found):
    # Not by name: by the shapes they give batches of two sizes.
    message = f"raw operation '\\w+' \\({named}\\): it {found}"
    with pytest.raises(ValueError, match=message):
        hftatf.fuse(two_branch_model(operation), 2)


def test_raw_operation_that_mixes_samples_is_refused_by_its_values():
    # A 2-D FFT of `[batch, 3]` keeps every shape, but each sample's result
    # takes the other samples in: found on random inputs.
    model = two_branch_model(lambda a, b: ops.fft2((a, b))[0], batch_size=4)
    with pytest.raises(ValueError, match="'fft2' \\(FFT2\\): it computes a "
                       "sample's result from the other samples"):
        hftatf.fuse(model, 2)


@pytest.mark.parametrize("operation", [
    lambda a, b: ops.transpose(ops.stack([a, b], axis=1), (0, 2, 1)),
    lambda a, b: ops.reshape(ops.concatenate([a, b], axis=-1), (-1, 2, 3)),
    lambda a, b: ops.einsum("bd,bd->b", a, b),
    lambda a, b: b[:, 0],
    lambda a, b: ops.squeeze(b[:, None]),
    lambda a, b: ops.matmul(a[:, :, None], b[:, None, :]),
    lambda a, b: ops.argmax(a, axis=-1) + ops.cast(b[:, 0] > 0, "int32"),
], ids=["transpose_per_sample", "reshape_per_sample", "einsum_per_sample",
        "index_per_sample", "squeeze", "outer_product", "integer_results"])
def test_raw_operations_per_sample_fuse(operation):
    models = [randomized(two_branch_model(operation), seed)
              for seed in range(2)]
    array = hftatf.fuse_models(models)
    x = np.random.default_rng(3).normal(size=(4, 5)).astype("float32")
    assert_array_matches(models, array, x)


def test_fold_checks_the_model_axis():
    with pytest.raises(ValueError, match="model"):
        FoldModelAxis(3)(np.zeros((2, 4, 5), "float32"))


def test_fold_layers_serialize():
    for cls in (FoldModelAxis, UnfoldModelAxis):
        layer = cls(4, name="f")
        again = cls.from_config(layer.get_config())
        assert again.num_models == 4 and again.name == "f"


def shared_layer_model():
    a = keras.Input((4,), name="a")
    b = keras.Input((4,), name="b")
    dense = keras.layers.Dense(3, name="shared")
    merged = keras.layers.Concatenate()([dense(a), dense(b)])
    return keras.Model([a, b], [keras.layers.Dense(2, name="y1")(merged),
                                keras.layers.Dense(1, name="y2")(merged)])


def test_shared_layers_and_several_inputs_and_outputs():
    models = [randomized(shared_layer_model(), seed) for seed in range(2)]
    array = hftatf.fuse_models(models, shared_inputs=[True, False])
    assert len(array.get_layer("shared").weights) == 2
    rng = np.random.default_rng(3)
    a = rng.normal(size=(5, 4)).astype("float32")
    b = rng.normal(size=(5, 2, 4)).astype("float32")
    outputs = array([a, b])
    for index, model in enumerate(models):
        expected = model([a, b[:, index]])
        for ours, theirs in zip(outputs, expected):
            assert_close(np.asarray(ours)[:, index], theirs)
    assert_round_trip(models, array)


def test_an_input_no_layer_reads_is_kept(tmp_path):
    # Stock Keras takes a model with an input it does not read (a feature
    # left out of an ablation); so does the array, and its saved file.
    a = keras.Input((4,), name="a")
    unused = keras.Input((2,), name="unused")
    model = keras.Model([a, unused], keras.layers.Dense(3)(a))
    models = [randomized(model, seed) for seed in range(2)]
    array = hftatf.fuse_models(models)
    rng = np.random.default_rng(4)
    inputs = [rng.normal(size=(5, 4)).astype("float32"),
              rng.normal(size=(5, 2)).astype("float32")]
    assert_array_matches(models, array, inputs)
    assert_round_trip(models, array)
    array.save(tmp_path / "array.keras")
    assert_array_matches(
        models, keras.models.load_model(tmp_path / "array.keras"), inputs)


def test_frozen_layers_stay_frozen_per_model():
    x = keras.Input((4,))
    h = keras.layers.Dense(5, name="frozen", trainable=False)(x)
    model = keras.Model(x, keras.layers.Dense(1, name="head")(h))
    array = hftatf.fuse(model, 2)
    assert not array.get_layer("frozen").trainable
    before = array.get_layer("frozen").get_weights()
    head_before = array.get_layer("head").get_weights()
    array.compile(optimizer=hftatf.optimizers.SGD([0.1, 0.2]), loss="mse")
    data = np.random.default_rng(4).normal(size=(8, 4)).astype("float32")
    array.fit(data, np.ones((8, 1)), epochs=2, verbose=0)
    for ours, theirs in zip(array.get_layer("frozen").get_weights(), before):
        np.testing.assert_array_equal(ours, theirs)
    assert not np.allclose(array.get_layer("head").get_weights()[0],
                           head_before[0])


def test_a_frozen_layer_inside_a_trainable_nested_model_stays_frozen():
    inputs = keras.Input((4,))
    inner = keras.Model(inputs, keras.layers.Dense(3, name="frozen")(
        keras.layers.Dense(4, name="free")(inputs)), name="inner")
    inner.get_layer("frozen").trainable = False
    outer_inputs = keras.Input((4,))
    model = keras.Model(outer_inputs, keras.layers.Dense(2)(
        inner(outer_inputs)))
    array = hftatf.fuse(model, 2)
    assert [w.path for w in array.trainable_weights] == [
        w.path for w in model.trainable_weights]


def test_masks_propagate_through_the_array():
    x = keras.Input((5, 3))
    h = keras.layers.Masking(mask_value=0.0)(x)
    h = keras.layers.Dense(4)(h)
    model = keras.Model(x, keras.layers.GlobalAveragePooling1D()(h))
    models = [randomized(model, seed) for seed in range(2)]
    array = hftatf.fuse_models(models)
    data = np.random.default_rng(5).normal(size=(3, 5, 3)).astype("float32")
    data[:, 3:] = 0.0  # masked steps: the pooling must ignore them
    assert_array_matches(models, array, data)
    unmasked = np.asarray(array(data))[:, 0]
    h_all = np.asarray(models[0].layers[2](data))
    assert not np.allclose(unmasked, h_all.mean(axis=1))


@pytest.fixture
def bfloat16_policy():
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    yield
    keras.mixed_precision.set_global_policy("float32")


def test_mixed_precision_policy_is_kept(bfloat16_policy):
    x = keras.Input((6,))
    h = keras.layers.Dense(8, activation="relu")(x)
    y = keras.layers.Activation("linear", dtype="float32")(
        keras.layers.Dense(3)(h))
    models = [randomized(keras.Model(x, y), seed) for seed in range(2)]
    array = hftatf.fuse_models(models)
    dense = [layer for layer in array.layers if "dense" in layer.name]
    assert dense and all(
        layer.dtype_policy.name == "mixed_bfloat16" for layer in dense)
    assert all(w.dtype == "float32" for w in array.weights)
    data = np.random.default_rng(6).normal(size=(4, 6)).astype("float32")
    out = array(data)
    assert out.dtype == "float32"
    # bfloat16 has an 8-bit mantissa: relative error ~4e-3 per rounding,
    # compounded over two layers of 6 and 8 terms.
    assert_array_matches(models, array, data, atol=0.05, rtol=0.02)


def test_unsupported_layer_inside_a_nested_model_is_named():
    block = keras.Sequential([
        keras.Input((1,)),
        keras.layers.JaxLayer(lambda params, inputs: inputs, params={},
                              name="odd")])
    x = keras.Input((1,))
    model = keras.Model(x, keras.layers.Dense(1)(block(x)))
    with pytest.raises(ValueError, match="odd"):
        hftatf.fuse(model, 2)


def _twice_on_one_input(bn):
    x = keras.Input((6,))
    a = keras.layers.Dense(4)(x)
    return x, bn(a) + bn(a * 2.0)


def _twice_in_reverse(bn):
    x = keras.Input((6,))
    a = keras.layers.Dense(4)(x)
    return x, bn(a * 2.0) + bn(a)


def _twice_at_two_depths(bn):
    # The stock graph runs `bn(x)` first: it is deeper. In the array, the
    # raw operations after the other call run between model-axis folds,
    # which make that call as deep.
    x = keras.Input((4,))
    dense = [keras.layers.Dense(4) for _ in range(4)]
    deep = dense[2](dense[1](dense[0](bn(x))))
    late = ops.tanh(ops.relu(bn(dense[3](x))))
    return x, keras.layers.Concatenate()([deep, late])


def _nested_twice(bn):
    inner_input = keras.Input((6,))
    inner = keras.Model(inner_input, bn(keras.layers.Dense(4)(inner_input)))
    x = keras.Input((6,))
    return x, inner(x) + inner(x * 2.0)


def _sequential_twice(bn):
    inner = keras.Sequential([keras.layers.Dense(4), bn])
    x = keras.Input((6,))
    return x, inner(x) + inner(x * 2.0)


@pytest.mark.parametrize("graph", [
    _twice_on_one_input, _twice_in_reverse, _twice_at_two_depths,
    _nested_twice, _sequential_twice],
    ids=["one_input", "reverse", "two_depths", "nested", "sequential"])
def test_a_layer_called_twice_updates_its_state_in_the_stock_order(graph):
    # Each call of a shared BatchNormalization in training moves its
    # statistics: the second call starts from the first call's. A fast
    # momentum makes the order show far above float32 rounding.
    keras.utils.set_random_seed(0)
    inputs, outputs = graph(keras.layers.BatchNormalization(momentum=0.5))
    array = hftatf.fuse(keras.Model(inputs, keras.layers.Dense(2)(outputs)),
                        2)
    stock = array.unfuse(compile=False)
    x = np.random.default_rng(0).normal(
        1.0, 1.0, size=(8, *inputs.shape[1:])).astype("float32")
    for _ in range(2):
        outputs = compiled_call(array, x, training=True)
        for b, model in enumerate(stock):
            assert_close(outputs[:, b], compiled_call(model, x, training=True))
    for b, (ours, model) in enumerate(zip(array.unfuse(compile=False), stock)):
        for got, want, weight in zip(ours.get_weights(), model.get_weights(),
                                     model.weights):
            assert_close(got, want, err_msg=f"{weight.path} of model {b}")


@keras.saving.register_keras_serializable("hftatf_tests")
class ConfiguredModel(keras.Model):
    """A functional model of a class of its own whose config holds its
    constructor's arguments, as keras-hub's backbones and tasks."""

    def __init__(self, units=4, **kwargs):
        inputs = keras.Input((3,))
        hidden = keras.layers.Dense(units, activation="tanh",
                                    name="hidden")(inputs)
        super().__init__(inputs, keras.layers.Dense(2, name="head")(hidden),
                         **kwargs)
        self.units = units

    def get_config(self):
        return {"units": self.units, "name": self.name,
                "trainable": self.trainable}


@pytest.mark.parametrize("nested", [False, True])
def test_a_model_whose_config_holds_its_arguments_fuses(nested, tmp_path):
    model = ConfiguredModel(units=5)
    if nested:
        inputs = keras.Input((3,))
        model = keras.Model(inputs, keras.layers.Dense(1)(model(inputs)))
    x = np.random.default_rng(0).normal(size=(8, 3)).astype("float32")
    trains_like_stock(model, x, np.ones((8, 1 if nested else 2), "float32"))
    array = hftatf.fuse(model, 2)
    twins = array.unfuse()
    assert all(type(twin) is type(model) for twin in twins)
    array.save(tmp_path / "array.keras")
    assert_close(keras.models.load_model(tmp_path / "array.keras").predict(
        x, verbose=0), array.predict(x, verbose=0))


def tied_model():
    """A layer called inside a nested model and outside it: the two share
    its weights, as a causal language model's head shares its nested
    backbone's embedding."""
    shared = keras.layers.Dense(
        4, kernel_initializer=keras.initializers.GlorotUniform(seed=1),
        bias_initializer="ones", name="tied")
    inner_inputs = keras.Input((4,))
    inner = keras.Model(inner_inputs, keras.layers.Dense(
        4, activation="tanh", kernel_initializer=keras.initializers.Ones())(
            shared(inner_inputs)), name="inner")
    inputs = keras.Input((4,))
    return keras.Model(inputs, shared(inner(inputs)))


def test_a_layer_shared_by_a_nested_model_and_its_outer_one_stays_tied():
    rates = [0.05, 0.1]
    array = hftatf.fuse_models([tied_model(), tied_model()])
    assert len(array.weights) == len(tied_model().weights) == 4
    rng = np.random.default_rng(2)
    x = rng.normal(size=(8, 4)).astype("float32")
    y = rng.normal(size=(8, 4)).astype("float32")
    array.compile(hftatf.optimizers.SGD(rates), loss="mse")
    array.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    for b, rate in enumerate(rates):
        stock = tied_model()
        stock.compile(keras.optimizers.SGD(rate), loss="mse")
        stock.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
        assert_close(array.predict(x, verbose=0)[:, b],
                     stock.predict(x, verbose=0), err_msg=f"model {b}")
        for got, want in zip(array.get_model_weights(b),
                             stock.get_weights()):
            assert_close(got, want, err_msg=f"model {b}")


class TakeRows(keras.layers.Layer):
    """A layer of one's own (run per model) that takes integer positions,
    and slices its table to its input's length, of unknown size in the
    graph (as keras-hub's position embeddings)."""

    def build(self, values_shape, positions_shape):
        self.table = self.add_weight(shape=(16, values_shape[-1]),
                                     initializer="glorot_uniform")

    def call(self, values, positions):
        table = ops.slice(ops.convert_to_tensor(self.table), (0, 0),
                          (ops.shape(values)[1], values.shape[-1]))
        return ops.take_along_axis(values + table, positions[:, :, None],
                                   axis=1)

    def compute_output_shape(self, values_shape, positions_shape):
        return (*positions_shape, values_shape[-1])


def test_a_layer_run_per_model_gets_integer_inputs_and_unknown_sizes():
    values = keras.Input((None, 4))
    positions = keras.Input((3,), dtype="int32")
    hidden = keras.layers.Dense(4)(values)
    model = keras.Model([values, positions], keras.layers.Dense(2)(
        TakeRows()(hidden, positions)))
    rng = np.random.default_rng(1)
    x = [rng.normal(size=(8, 6, 4)).astype("float32"),
         rng.integers(0, 6, (8, 3)).astype("int32")]
    trains_like_stock(model, x, np.ones((8, 3, 2), "float32"))


def test_optimizer_state_reaches_the_stock_models_layer_by_layer():
    # keras.io's deep & cross pattern: raw operations on the cross path
    # count towards the depth by which Keras orders the stock model's
    # layers, so the array lists its layers in another order. The deep
    # path's Dense has the cross path's shapes: a pairing by position
    # would hand one layer's Adam moments to the other without an error.
    width = 5

    def build():
        x0 = keras.Input((width,))
        cross = x0
        for _ in range(2):
            cross = x0 * keras.layers.Dense(width)(cross) + cross
        deep = x0
        for _ in range(2):
            deep = keras.layers.ReLU()(keras.layers.Dense(width)(deep))
        return keras.Model(x0, keras.layers.Dense(1)(
            keras.layers.concatenate([cross, deep])))

    keras.utils.set_random_seed(0)
    array = hftatf.fuse(build(), 2)
    twins = array.unfuse(compile=False)
    assert [layer.name for _, layer in weighted_layers(array)] != [
        layer.name for _, layer in weighted_layers(twins[0])]
    rng = np.random.default_rng(0)
    x = rng.random((32, width)).astype("float32")
    y = rng.random((32, 1)).astype("float32")
    array.compile(hftatf.optimizers.Adam([1e-2, 3e-2]), loss="mse")
    array.fit(x, y, epochs=2, batch_size=8, shuffle=False, verbose=0)
    models = array.unfuse()
    # One more epoch each way: the unfused models go on as in the array.
    array.fit(x, y, epochs=1, batch_size=8, shuffle=False, verbose=0)
    for b, model in enumerate(models):
        model.fit(x, y, epochs=1, batch_size=8, shuffle=False, verbose=0)
        for got, want in zip(model.get_weights(),
                             array.unfuse(compile=False)[b].get_weights()):
            assert_close(got, want, err_msg=f"model {b}")
