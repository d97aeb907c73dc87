"""Training an array in passes of a few models (`compile(models_per_pass=)`).

The oracle: B stock models trained with stock `fit` on model b's slice of
everything, and the same array trained in one pass."""

import contextlib
import os

import keras
import numpy as np
import pytest
from testing import BACKEND, STEP_JIT, assert_close

import hftatf
from hftatf import passes
from hftatf.core.axis import swap_model_axis, take_models

B = 3
RATES = [0.01, 0.005, 0.02]
N = 24
BATCH = 8


def network(dropout=0.0):
    """Weights, moving statistics, a weight and an activity regularizer,
    and optional dropout: every kind of state a pass slices or carries."""
    x = keras.Input((5,), name="x")
    h = keras.layers.Dense(8, activation="tanh", name="h",
                           kernel_regularizer=keras.regularizers.L2(0.01),
                           activity_regularizer=keras.regularizers.L1(0.01)
                           )(x)
    h = keras.layers.BatchNormalization(name="bn")(h)
    if dropout:
        h = keras.layers.Dropout(dropout, name="drop")(h)
    return keras.Model(x, keras.layers.Dense(3, name="out")(h))


LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def data(per_model_labels=False, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(N, 5)).astype("float32")
    shape = (N, B) if per_model_labels else (N,)
    y = rng.integers(0, 3, shape).astype("int32")
    weights = rng.uniform(0.0, 2.0, (N, B)).astype("float32")
    return x, y, weights


def trained_array(builder, models_per_pass, x, y, weights, jit_compile,
                  initial=None):
    array = hftatf.fuse(builder(), B)
    if initial is not None:
        array.set_weights(initial)
    array.compile(optimizer=hftatf.optimizers.Adam(RATES), loss=LOSS,
                  metrics=["accuracy"], jit_compile=jit_compile,
                  models_per_pass=models_per_pass)
    history = array.fit(x, y, sample_weight=weights, batch_size=BATCH,
                        epochs=2, shuffle=False, verbose=0)
    return array, history.history


@pytest.mark.parametrize("models_per_pass, per_model_labels, jit_compile", [
    (1, False, False), (2, True, False), (1, True, True), (2, False, True)])
def test_passes_train_each_model_as_stock_keras(models_per_pass,
                                                per_model_labels,
                                                jit_compile):
    x, y, weights = data(per_model_labels)
    fresh = hftatf.fuse(network(), B)
    initial = fresh.get_weights()
    array, history = trained_array(network, models_per_pass, x, y, weights,
                                   jit_compile, initial=initial)
    assert array.models_per_pass == models_per_pass
    reference, _ = trained_array(network, None, x, y, weights, jit_compile,
                                 initial=initial)
    for b, (model, twin) in enumerate(zip(fresh.unfuse(), array.unfuse())):
        model.compile(optimizer=keras.optimizers.Adam(RATES[b]), loss=LOSS,
                      metrics=["accuracy"])
        labels = y[:, b] if per_model_labels else y
        stock = model.fit(x, labels, sample_weight=weights[:, b],
                          batch_size=BATCH, epochs=2, shuffle=False,
                          verbose=0).history
        for ours, theirs in zip(twin.weights, model.weights):
            assert_close(ours, theirs, err_msg=f"model {b} {theirs.path}")
        assert_close(history[f"loss_{b}"], stock["loss"])
        assert_close(history[f"accuracy_{b}"], stock["accuracy"])
    # And what one pass computes.
    for ours, theirs in zip(array.weights, reference.weights):
        assert_close(ours, theirs, err_msg=theirs.path)


@pytest.mark.parametrize("jit_compile", [False, True])
def test_passes_draw_independent_randomness(monkeypatch, jit_compile):
    # Three identical models with dropout, one per pass: a pass that drew
    # its predecessor's masks would train its model into the same weights.
    # Under XLA the passes after the first are one loop.
    x, y, weights = data()
    array = hftatf.fuse(network(dropout=0.5), B)
    same = [np.stack([w[0]] * B) for w in array.get_weights()]
    array.set_weights(same)
    array.compile(optimizer=hftatf.optimizers.SGD(0.1), loss=LOSS,
                  models_per_pass=1, jit_compile=jit_compile)
    starts = traced_passes(monkeypatch) if BACKEND == "tensorflow" else None
    array.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    if starts is not None:
        import tensorflow as tf

        assert any(tf.is_tensor(s) for s in starts) == jit_compile, starts
    kernels = np.asarray(array.get_layer("h").kernel)
    for a in range(B):
        for b in range(a):
            assert np.abs(kernels[a] - kernels[b]).max() > 1e-3, (a, b)


def test_diverging_model_in_a_pass_leaves_the_others():
    x, y, weights = data()
    initial = hftatf.fuse(network(), B).get_weights()
    # Model 1's rate is finite (an infinite one is refused) but large
    # enough to overflow its weights.
    rates = [0.05, 1e38, 0.05]

    def train(models_per_pass):
        array = hftatf.fuse(network(), B)
        array.set_weights(initial)
        array.compile(optimizer=hftatf.optimizers.SGD(rates), loss=LOSS,
                      models_per_pass=models_per_pass)
        array.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False,
                  verbose=0)
        return array

    passed, whole = train(1), train(None)
    assert list(passed.diverged_models) == [False, True, False]
    for ours, theirs in zip(passed.weights, whole.weights):
        ours, theirs = np.asarray(ours), np.asarray(theirs)
        np.testing.assert_allclose(ours[[0, 2]], theirs[[0, 2]], atol=1e-6)


def test_models_per_pass_survives_saving(tmp_path):
    x, y, weights = data()
    array, _ = trained_array(network, 2, x, y, weights, jit_compile=STEP_JIT)
    path = tmp_path / "array.keras"
    array.save(path)
    loaded = keras.models.load_model(path)
    assert loaded._models_per_pass == 2
    loaded.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    assert loaded.models_per_pass == 2


@pytest.mark.parametrize("value", [0, B + 1, True, 1.5, "all"])
def test_models_per_pass_rejects_what_it_cannot_run(value):
    array = hftatf.fuse(network(), B)
    with pytest.raises(ValueError, match="models_per_pass"):
        array.compile("sgd", loss=LOSS, models_per_pass=value)


@pytest.mark.backends("tensorflow", reason=(
    "passes on TensorFlow's CPU kernels; auto is one pass elsewhere"))
def test_auto_fits_models_in_the_cache(monkeypatch):
    x, y, weights = data()
    array = hftatf.fuse(network(), B)
    # Per sample and model: the shared input (5 floats) and the outputs of
    # the dense (8), normalization (8) and output (3) layers.
    per_sample = 4 * (5 + 8 + 8 + 3)
    assert passes.activation_bytes_per_model(array, 10) == 10 * per_sample
    monkeypatch.setattr(passes, "last_level_cache_bytes",
                        lambda: 2 * BATCH * per_sample)
    assert passes.auto_models_per_pass(array, BATCH) == 2
    assert passes.auto_models_per_pass(array, 4 * BATCH) == 1
    assert passes.auto_models_per_pass(array, 1) == B
    # XLA on a CPU: as the rule says.
    array.compile("sgd", loss=LOSS, jit_compile=True)
    array.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    assert array.models_per_pass == 2
    # Without XLA, an array without convolutions: as the rule says.
    array.compile("sgd", loss=LOSS, jit_compile=False)
    array.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    assert array.models_per_pass == 2


@pytest.mark.backends("tensorflow", reason=(
    "passes on TensorFlow's CPU kernels; auto is one pass elsewhere"))
def test_auto_keeps_convolutional_arrays_without_xla_in_one_pass(
        monkeypatch):
    # Measured no faster in passes without XLA (benchmarks/README.md);
    # under XLA they follow the cache rule.
    monkeypatch.setattr(passes, "auto_models_per_pass", lambda *args: 1)
    inputs = keras.Input((6, 6, 2))
    x = keras.layers.Conv2D(3, 3)(inputs)
    outputs = keras.layers.Dense(3)(keras.layers.Flatten()(x))
    array = hftatf.fuse(keras.Model(inputs, outputs), B)
    x = np.random.default_rng(0).standard_normal((BATCH, 6, 6, 2))
    y = np.zeros((BATCH,), "int32")
    array.compile("sgd", loss=LOSS, jit_compile=False)
    array.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    assert array.models_per_pass == B
    array.compile("sgd", loss=LOSS, jit_compile=True)
    array.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    assert array.models_per_pass == 1


def test_cache_size_is_read_from_the_system():
    size = passes.last_level_cache_bytes()
    assert isinstance(size, int) and size >= 2**16


@pytest.mark.backends("tensorflow", reason=(
    "tf.IndexedSlices gradients"))
def test_pass_gradients_are_joined_on_the_model_axis():
    import tensorflow as tf

    dense = passes.concat_gradients(
        [np.ones((2, 3), "float32"), 2 * np.ones((1, 3), "float32")],
        [0, 2], (3, 3))
    np.testing.assert_array_equal(np.asarray(dense)[:, 0], [1, 1, 2])
    sparse = passes.concat_gradients(
        [tf.IndexedSlices(tf.ones((1, 3)), tf.constant([1])),
         tf.IndexedSlices(2 * tf.ones((1, 3)), tf.constant([0]))],
        [0, 2], (3, 3))
    np.testing.assert_array_equal(
        tf.convert_to_tensor(sparse).numpy()[:, 0], [0, 1, 2])
    assert passes.concat_gradients([None, None], [0, 1], (2,)) is None


@pytest.mark.backends("tensorflow", reason=(
    "passes on TensorFlow's CPU kernels; auto is one pass elsewhere"))
def test_auto_keeps_one_pass_where_no_pass_array_can_be_built(monkeypatch):
    x, y, _ = data()
    array = hftatf.fuse(network(), B)

    def unbuildable(count):
        raise TypeError("a constructor argument the config does not hold")

    monkeypatch.setattr(passes, "auto_models_per_pass", lambda *args: 1)
    monkeypatch.setattr(array, "_pass_model", unbuildable)
    array.compile("sgd", loss=LOSS, jit_compile=True)
    array.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    assert array.models_per_pass == B
    # Asked for explicitly, the failure is the user's to see.
    array.compile("sgd", loss=LOSS, jit_compile=True, models_per_pass=1)
    with pytest.raises(TypeError, match="constructor argument"):
        array.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)


@pytest.mark.backends("tensorflow", reason=(
    "TensorFlow's intra-op threads"))
def test_cache_is_the_share_of_the_cores_the_process_uses(monkeypatch):
    import tensorflow as tf

    # A virtual machine of 2 cores reporting its host's whole L3 as its own.
    monkeypatch.setattr(passes, "last_level_cache_bytes", lambda: 480 * 2**20)
    monkeypatch.setattr(passes, "usable_cores", lambda: 2)
    assert passes.cache_bytes() == 2 * passes.MAX_CACHE_BYTES_PER_CORE
    monkeypatch.setattr(passes, "last_level_cache_bytes", lambda: 2**20)
    assert passes.cache_bytes() == 2**20
    monkeypatch.undo()
    assert 1 <= passes.usable_cores() <= os.cpu_count()
    # A process told to use one thread for each operation has one core's
    # share.
    monkeypatch.setattr(tf.config.threading,
                        "get_intra_op_parallelism_threads", lambda: 1)
    assert passes.usable_cores() == 1
    monkeypatch.undo()
    assert 0 < passes.cache_bytes() <= passes.last_level_cache_bytes()


def traced_passes(monkeypatch):
    """The first model of each pass a training step traces (a tensor for
    the pass a loop over passes traces once)."""
    starts = []
    original = hftatf.FusedModel._one_pass

    def tracing(self, start, *args, **kwargs):
        starts.append(start)
        return original(self, start, *args, **kwargs)

    monkeypatch.setattr(hftatf.FusedModel, "_one_pass", tracing)
    return starts


def tagger(vocabulary=11):
    """Token ids in, a softmax over 3 classes out: an embedding (whose
    gradient Keras gives as slices of rows), moving statistics, a weight
    regularizer, and the logits Keras keeps on a softmax output."""
    ids = keras.Input((4,), dtype="int32", name="ids")
    h = keras.layers.Embedding(vocabulary, 6, name="embed")(ids)
    h = keras.layers.GlobalAveragePooling1D()(h)
    h = keras.layers.Dense(8, activation="relu", name="h",
                           kernel_regularizer=keras.regularizers.L2(0.01))(h)
    h = keras.layers.BatchNormalization(name="bn")(h)
    outputs = keras.layers.Dense(3, activation="softmax", name="out")(h)
    return keras.Model(ids, outputs)


@pytest.mark.backends("tensorflow", reason=(
    "a tf.while_loop over passes"))
def test_equal_passes_under_xla_run_as_one_loop(monkeypatch):
    import tensorflow as tf

    # 7 models in passes of 2: the first pass traced, the next two as one
    # loop, the last model on its own; every model computes what it
    # computes in one pass.
    num_models, rng = 7, np.random.default_rng(1)
    x = rng.integers(0, 11, (N, 4)).astype("int32")
    y = rng.integers(0, 3, (N, num_models)).astype("int32")
    loss = keras.losses.SparseCategoricalCrossentropy()
    initial = hftatf.fuse(tagger(), num_models).get_weights()

    def train(models_per_pass):
        array = hftatf.fuse(tagger(), num_models)
        array.set_weights(initial)
        array.compile(optimizer=hftatf.optimizers.Adam(0.01), loss=loss,
                      metrics=["sparse_categorical_crossentropy"],
                      jit_compile=True, models_per_pass=models_per_pass)
        history = array.fit(x, y, batch_size=BATCH, epochs=2,
                            shuffle=False, verbose=0).history
        return array, history

    starts = traced_passes(monkeypatch)
    array, history = train(2)
    # Each trace of the step (Keras may trace it more than once) traces
    # three passes for four.
    assert starts and len(starts) % 3 == 0, starts
    for first, looped, last in zip(*[iter(starts)] * 3):
        assert first == 0 and tf.is_tensor(looped) and last == 6, starts
    monkeypatch.undo()
    reference, expected = train(None)
    for ours, theirs in zip(array.weights, reference.weights):
        assert_close(ours, theirs, err_msg=theirs.path)
    for name, values in expected.items():
        assert_close(history[name], values, err_msg=name)


def multi_output():
    x = keras.Input((5,), name="x")
    h = keras.layers.Dense(8, activation="tanh")(x)
    return keras.Model(x, [keras.layers.Dense(3, name="a")(h),
                           keras.layers.Dense(3, name="b")(h)])


@pytest.mark.backends("tensorflow", reason=(
    "passes traced into a TensorFlow graph"))
@pytest.mark.parametrize("builder, jit_compile", [
    (network, False),  # Traced pass by pass without XLA.
    (multi_output, True)])  # Each model's per-output loss trackers.
def test_passes_are_traced_one_by_one_where_a_loop_does_not_pay(
        monkeypatch, builder, jit_compile):
    x, y, _ = data()
    array = hftatf.fuse(builder(), B)
    labels = y if len(array.outputs) == 1 else (y, y)
    array.compile("sgd", loss=LOSS, jit_compile=jit_compile,
                  models_per_pass=1)
    starts = traced_passes(monkeypatch)
    array.fit(x, labels, batch_size=BATCH, epochs=1, verbose=0)
    assert starts and starts == list(range(B)) * (len(starts) // B)


@pytest.mark.backends("tensorflow", reason=(
    "tf.TensorArray"))
def test_a_loop_over_passes_joins_their_outputs():
    import tensorflow as tf

    passes_ = tf.TensorArray(tf.float32, size=3, element_shape=(2, 4))
    for i in range(3):
        passes_ = passes_.write(i, tf.fill((2, 4), float(i)))
    joined = passes.joined(passes_)
    assert joined.shape == (6, 4)
    np.testing.assert_array_equal(joined.numpy()[:, 0], [0, 0, 1, 1, 2, 2])
    batch_first = tf.reshape(tf.range(24.0), (4, 2, 3))  # [batch, k, ...]
    np.testing.assert_array_equal(
        swap_model_axis(swap_model_axis(batch_first)), batch_first)
    assert passes.looped_passes(passes.bounds(7, 2)) == 3
    assert passes.looped_passes(passes.bounds(5, 2)) == 0
    assert passes.looped_passes(passes.bounds(3, 1)) == 3
    losses = passes.spread_losses(tf.constant([1.0, 2.0]), tf.constant(3), 6)
    np.testing.assert_array_equal(losses, [0, 0, 0, 1, 2, 0])
    np.testing.assert_array_equal(
        take_models(tf.reshape(tf.range(12), (2, 6)), tf.constant(2), 3,
                    axis=1), [[2, 3, 4], [8, 9, 10]])


# -- what training metrics read: output masks and logits ---------------------


def masked_tagger():
    ids = keras.Input((4,), dtype="int32")
    h = keras.layers.Embedding(10, 4, mask_zero=True)(ids)
    return keras.Model(ids, keras.layers.Dense(2)(h))


def saturated_softmax():
    x = keras.Input((1,))
    return keras.Model(x, keras.layers.Dense(
        3, activation="softmax", kernel_initializer=keras.initializers.
        Constant([[0.0, 40.0, -40.0]]))(x))


@pytest.mark.parametrize("setting", [
    # the replica step compiled on its own
    pytest.param({"strategy": True}, marks=pytest.mark.backends(
        "tensorflow", reason="a tf.distribute strategy")),
    {"models_per_pass": 1},
    {"models_per_pass": 1, "jit_compile": True},  # a loop over passes
])
def test_training_metrics_read_the_outputs_masks_and_logits(setting):
    # Accuracy leaves masked steps out; a crossentropy metric on a
    # saturated softmax reads its logits. Both were lost (accuracy over
    # every step, 0.5 for 0.6; the metric 16.1 for 70.0).
    setting = dict(setting)
    if setting.pop("strategy", False):
        import tensorflow as tf

        scope = tf.distribute.OneDeviceStrategy("/cpu:0").scope
    else:
        scope = contextlib.nullcontext
    ids = np.array([[1, 2, 0, 0], [3, 0, 0, 0], [4, 5, 6, 0],
                    [7, 8, 9, 1]], "int32")
    tags = np.array([[0, 1, 0, 0], [1, 0, 0, 0], [0, 1, 1, 0],
                     [1, 1, 0, 1]])
    x = np.array([[1.0], [2.0], [-1.0], [3.0]], "float32")
    cases = [
        (masked_tagger, ids, tags, keras.losses.SparseCategoricalCrossentropy(
            from_logits=True), "accuracy"),
        (saturated_softmax, x, np.zeros(4, "int32"),
         "sparse_categorical_crossentropy",
         "sparse_categorical_crossentropy")]
    for builder, inputs, labels, loss, metric in cases:
        keras.utils.set_random_seed(0)
        with scope():
            array = hftatf.fuse(builder(), B)
            stock = array.unfuse()
            array.compile(hftatf.optimizers.SGD(0.0), loss=loss,
                          metrics=[metric], **setting)
        history = array.fit(inputs, labels, batch_size=4, verbose=0).history
        for b, model in enumerate(stock):
            with scope():
                model.compile(keras.optimizers.SGD(0.0), loss=loss,
                              metrics=[metric])
            expected = model.fit(inputs, labels, batch_size=4,
                                 verbose=0).history[metric][0]
            assert_close(history[f"{metric}_{b}"][0], expected,
                         err_msg=f"{builder.__name__}, model {b}")


@pytest.mark.backends("jax", reason=(
    "passes were measured to pay on TensorFlow's CPU kernels only"))
def test_auto_is_one_pass_on_jax(monkeypatch):
    monkeypatch.setattr(passes, "auto_models_per_pass", lambda *args: 1)
    x, y, _ = data()
    array = hftatf.fuse(network(), B)
    array.compile("sgd", loss=LOSS)
    array.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    assert array.models_per_pass == B
