"""FusedModel's training step on what real training scripts pass it: sample
and class weights (shared or per model), several outputs with their own
losses and loss weights, regularization losses, steps_per_execution and
jit_compile. The oracle: B stock models trained with stock `fit` on model
b's slice of everything."""

import gc

import keras
import numpy as np
import pytest
from testing import assert_close, compiled_programs, jaxpr_equations

import hftatf
from hftatf.core.compat import model_supports_jit

B = 3
RATES = [0.1, 0.05, 0.2]
N = 24
BATCH = 8


def classifier(regularized=False):
    regularizer = keras.regularizers.L2(0.01) if regularized else None
    x = keras.Input((5,), name="x")
    h = keras.layers.Dense(8, activation="tanh", name="h",
                           kernel_regularizer=regularizer)(x)
    return keras.Model(x, keras.layers.Dense(3, name="out")(h))


def two_headed():
    x = keras.Input((5,), name="x")
    h = keras.layers.Dense(8, activation="relu", name="h")(x)
    return keras.Model(x, {"cls": keras.layers.Dense(3, name="cls")(h),
                           "reg": keras.layers.Dense(2, name="reg")(h)})


LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def train_both(builder, x, fit_array, fit_stock, compile_kwargs,
               steps_per_execution=1, jit_compile="auto"):
    """Trains an array and its B stock twins from the same weights; returns
    the array, the array's history and the stock models' histories."""
    array = hftatf.fuse(builder(), B)
    stock = array.unfuse()
    array.compile(optimizer=hftatf.optimizers.SGD(RATES),
                  steps_per_execution=steps_per_execution,
                  jit_compile=jit_compile, **compile_kwargs)
    history = fit_array(array)
    stock_histories = []
    for b, model in enumerate(stock):
        model.compile(optimizer=keras.optimizers.SGD(RATES[b]),
                      **compile_kwargs)
        stock_histories.append(fit_stock(model, b))
    for b, (model, trained) in enumerate(zip(stock, array.unfuse())):
        for ours, theirs in zip(trained.weights, model.weights):
            assert_close(ours, theirs, err_msg=f"model {b} {theirs.path}")
    return array, history.history, [h.history for h in stock_histories]


def data(seed=0, per_model_labels=False):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(N, 5)).astype("float32")
    shape = (N, B) if per_model_labels else (N,)
    return x, rng.integers(0, 3, shape).astype("int32"), rng


def fit_kwargs():
    return {"batch_size": BATCH, "epochs": 2, "shuffle": False, "verbose": 0}


@pytest.mark.parametrize("per_model_labels", [False, True])
@pytest.mark.parametrize("weight_shape", [(N, B), (N, B, 1)])
def test_per_model_sample_weights(per_model_labels, weight_shape):
    # Model b's weights `[batch]` or `[batch, 1]`, as the stock model takes
    # them, weighing its loss and its weighted metrics.
    x, y, rng = data(1, per_model_labels)
    weights = rng.uniform(0.0, 2.0, weight_shape).astype("float32")

    def label(b):
        return y[:, b] if per_model_labels else y

    _, history, stock = train_both(
        classifier, x,
        lambda a: a.fit(x, y, sample_weight=weights, **fit_kwargs()),
        lambda m, b: m.fit(x, label(b), sample_weight=weights[:, b],
                           **fit_kwargs()),
        {"loss": LOSS, "weighted_metrics": ["sparse_categorical_accuracy"]})
    for b in range(B):
        assert_close(history[f"loss_{b}"], stock[b]["loss"])
        assert_close(history[f"sparse_categorical_accuracy_{b}"],
                     stock[b]["sparse_categorical_accuracy"])


@pytest.mark.parametrize("per_model_labels", [False, True])
def test_shared_sample_weights(per_model_labels):
    x, y, rng = data(2, per_model_labels)
    weights = rng.uniform(0.0, 2.0, (N,)).astype("float32")

    def label(b):
        return y[:, b] if per_model_labels else y

    train_both(
        classifier, x,
        lambda a: a.fit(x, y, sample_weight=weights, **fit_kwargs()),
        lambda m, b: m.fit(x, label(b), sample_weight=weights,
                           **fit_kwargs()),
        {"loss": LOSS})


def scalar_regressor():
    x = keras.Input((5,), name="x")
    return keras.Model(x, keras.layers.Reshape(())(keras.layers.Dense(1)(x)))


def squared_error(y_true, y_pred):
    return keras.ops.square(y_true - y_pred)


@pytest.mark.parametrize("per_model_weights", [False, True])
def test_sample_weights_of_an_output_of_one_value_per_sample(
        per_model_weights):
    # The stock output is `[batch]`, the array's `[batch, B]`.
    x, _, rng = data(6)
    y = rng.normal(size=(N,)).astype("float32")
    weights = rng.uniform(0.1, 2.0, (N, B) if per_model_weights else (N,))

    def weight(b):
        return weights[:, b] if per_model_weights else weights

    _, history, stock = train_both(
        scalar_regressor, x,
        lambda a: a.fit(x, y, sample_weight=weights, **fit_kwargs()),
        lambda m, b: m.fit(x, y, sample_weight=weight(b), **fit_kwargs()),
        {"loss": squared_error})
    for b in range(B):
        assert_close(history[f"loss_{b}"], stock[b]["loss"])


def tagger(steps=None):
    x = keras.Input((steps, 3), name="x")
    h = keras.layers.GRU(4, return_sequences=True, name="h")(x)
    return keras.Model(x, keras.layers.Dense(3, name="out")(h))


@pytest.mark.parametrize("weight_shape", [None, (N, 5), (N, 5, 1)])
def test_shared_sequence_labels_of_unknown_length_stay_shared(weight_shape):
    # A pipeline of sequences of any length: axis 1 of the labels and the
    # weights has no static size, and is time, not the models.
    rng = np.random.default_rng(7)
    x = rng.normal(size=(N, 5, 3)).astype("float32")
    y = rng.integers(0, 3, (N, 5, 1)).astype("int32")
    weights = None if weight_shape is None else rng.uniform(
        0.1, 2.0, weight_shape).astype("float32")

    tf = pytest.importorskip("tensorflow")

    def dataset():
        parts = (x, y) if weights is None else (x, y, weights)
        return tf.data.Dataset.from_generator(
            lambda: (tuple(p[i:i + BATCH] for p in parts)
                     for i in range(0, N, BATCH)),
            output_signature=tuple(
                tf.TensorSpec((None, None, *p.shape[2:]), p.dtype)
                for p in parts))

    _, history, stock = train_both(
        tagger, x,
        lambda a: a.fit(dataset(), epochs=2, verbose=0),
        lambda m, b: m.fit(dataset(), epochs=2, verbose=0),
        {"loss": LOSS})
    for b in range(B):
        assert_close(history[f"loss_{b}"], stock[b]["loss"])


@pytest.mark.parametrize("per_model_labels", [False, True])
def test_class_weights_follow_each_models_labels(per_model_labels):
    x, y, _ = data(3, per_model_labels)
    class_weight = {0: 0.2, 1: 3.0}  # class 2 keeps weight 1, as in Keras

    def label(b):
        return y[:, b] if per_model_labels else y

    _, history, stock = train_both(
        classifier, x,
        lambda a: a.fit(x, y, class_weight=class_weight, **fit_kwargs()),
        lambda m, b: m.fit(x, label(b), class_weight=class_weight,
                           **fit_kwargs()),
        {"loss": LOSS, "weighted_metrics": ["accuracy"]})
    for b in range(B):
        assert_close(history[f"loss_{b}"], stock[b]["loss"])
        assert_close(history[f"accuracy_{b}"], stock[b]["accuracy"])


def test_class_weights_are_not_kept_for_the_next_fit():
    x, y, _ = data(4)
    array = hftatf.fuse(classifier(), B)
    array.compile(optimizer=hftatf.optimizers.SGD(0.0), loss=LOSS)
    weighted = array.fit(x, y, class_weight={0: 5.0}, **fit_kwargs())
    plain = array.fit(x, y, **fit_kwargs())
    assert not np.allclose(weighted.history["loss"], plain.history["loss"])
    assert_close(array.evaluate(x, y, verbose=0, return_dict=True)["loss"],
                 plain.history["loss"][-1])


def test_class_weight_is_validated():
    x, y, _ = data(5)
    array = hftatf.fuse(classifier(), B)
    array.compile(optimizer="sgd", loss=LOSS)
    with pytest.raises(ValueError, match="class_weight"):
        array.fit(x, y, class_weight={"cat": 1.0}, verbose=0)


def test_several_outputs_with_loss_weights():
    x, _, rng = data(6)
    targets = {"cls": rng.integers(0, 3, (N,)).astype("int32"),
               "reg": rng.normal(size=(N, 2)).astype("float32")}
    compile_kwargs = {"loss": {"cls": LOSS, "reg": "mse"},
                      "loss_weights": {"cls": 1.0, "reg": 0.3},
                      "metrics": {"cls": ["accuracy"], "reg": ["mae"]}}
    _, history, stock = train_both(
        two_headed, x,
        lambda a: a.fit(x, targets, **fit_kwargs()),
        lambda m, b: m.fit(x, targets, **fit_kwargs()),
        compile_kwargs)
    for b in range(B):
        for name in ("loss", "cls_loss", "reg_loss", "cls_accuracy",
                     "reg_mae"):
            assert_close(history[f"{name}_{b}"], stock[b][name],
                         err_msg=name)


def test_regularization_losses_are_counted_per_model():
    x, y, _ = data(7)
    _, history, stock = train_both(
        lambda: classifier(regularized=True), x,
        lambda a: a.fit(x, y, **fit_kwargs()),
        lambda m, b: m.fit(x, y, **fit_kwargs()),
        {"loss": LOSS})
    for b in range(B):
        assert_close(history[f"loss_{b}"], stock[b]["loss"])


@pytest.mark.gpu
@pytest.mark.parametrize("steps_per_execution, jit_compile", [
    (3, "auto"), (1, True), (2, False)])
def test_steps_per_execution_and_jit_compile(steps_per_execution,
                                             jit_compile):
    x, y, _ = data(8)
    array, history, stock = train_both(
        classifier, x,
        lambda a: a.fit(x, y, **fit_kwargs()),
        lambda m, b: m.fit(x, y, **fit_kwargs()),
        {"loss": LOSS, "metrics": ["accuracy"]},
        steps_per_execution=steps_per_execution, jit_compile=jit_compile)
    assert array.jit_compile == (jit_compile in (True, "auto"))
    for b in range(B):
        assert_close(history[f"loss_{b}"], stock[b]["loss"])
        assert_close(history[f"accuracy_{b}"], stock[b]["accuracy"])


@pytest.mark.backends("tensorflow", reason=(
    "XLA or TensorFlow's kernels: JAX compiles every step with XLA"))
@pytest.mark.parametrize("layer, expected", [
    (lambda: keras.layers.Dense(4), True),
    (lambda: keras.layers.Conv1D(4, 3), False),
    (lambda: keras.layers.SeparableConv1D(4, 3), False),
    (lambda: lambda x: keras.layers.MultiHeadAttention(2, 2)(x, x), True),
])
def test_auto_jit_compile_on_cpu_skips_convolutions(layer, expected):
    # On this CPU-only machine: XLA for dense and attention arrays,
    # TensorFlow's kernels where there are convolutions (the rule in
    # FusedModel.compile).
    inputs = keras.Input((8, 3))
    model = keras.Model(inputs, keras.layers.Flatten()(layer()(inputs)))
    array = hftatf.fuse(model, 2)
    array.compile("sgd", loss="mse", jit_compile="auto")
    assert array.jit_compile is expected
    array.compile("sgd", loss="mse", jit_compile=True)
    assert array.jit_compile is True


@pytest.mark.backends("tensorflow", reason=(
    "operations TensorFlow's XLA cannot compile"))
@pytest.mark.parametrize("layer, expected", [
    (lambda: keras.layers.Resizing(4, 4, antialias=True), False),
    (lambda: keras.layers.Resizing(4, 4, interpolation="bicubic"), False),
    (lambda: keras.layers.MixUp(), False),
    (lambda: keras.layers.Resizing(4, 4), True),
    (lambda: keras.layers.UpSampling2D(interpolation="bilinear"), False),
    (lambda: keras.layers.UpSampling2D(), True),
])
def test_auto_jit_compile_leaves_layers_without_xla_kernels(layer, expected):
    # They say they support XLA, but XLA cannot compile their operations:
    # "auto" must not turn it on for them, and the array trains.
    inputs = keras.Input((6, 6, 2))
    hidden = keras.layers.GlobalAveragePooling2D()(layer()(inputs))
    model = keras.Model(inputs, keras.layers.Dense(1)(hidden))
    array = hftatf.fuse(model, 2)
    array.compile("sgd", loss="mse")
    assert array.jit_compile is expected
    rng = np.random.default_rng(0)
    array.fit(rng.normal(size=(4, 6, 6, 2)).astype("float32"),
              rng.normal(size=(4, 1)).astype("float32"), verbose=0)


@pytest.mark.parametrize("data_format", ["channels_last", "channels_first"])
def test_bilinear_upsampling_computes_as_the_stock_model(data_format):
    # Under XLA, a bilinear UpSampling2D (which resizes to a size computed
    # in the graph) is off by as much as its values; stock Keras on a CPU
    # runs without XLA, and so must the array by default.
    inputs = keras.Input((3, 4, 3))
    hidden = keras.layers.Dense(3)(inputs)
    model = keras.Model(inputs, keras.layers.UpSampling2D(
        (2, 3), data_format=data_format,
        interpolation="bilinear")(hidden))
    array = hftatf.fuse(model, 2)
    array.compile("sgd", loss="mse")
    x = np.random.default_rng(0).normal(size=(2, 3, 4, 3)).astype("float32")
    outputs = array.predict(x, verbose=0)
    for b, stock in enumerate(array.unfuse(compile=False)):
        assert_close(outputs[:, b], stock.predict(x, verbose=0))


@pytest.mark.gpu
@pytest.mark.backends("tensorflow", reason=(
    "XLA or TensorFlow's kernels: JAX compiles every step with XLA"))
def test_auto_jit_compile_on_gpu_compiles_convolutions():
    tf = pytest.importorskip("tensorflow")
    if not tf.config.list_physical_devices("GPU"):
        pytest.skip("needs a GPU (HFTATF_TEST_GPU=1)")
    inputs = keras.Input((8, 3))
    model = keras.Model(inputs, keras.layers.Flatten()(
        keras.layers.Conv1D(4, 3)(inputs)))
    array = hftatf.fuse(model, 2)
    array.compile("sgd", loss="mse", jit_compile="auto")
    assert array.jit_compile is True


def test_predict_gives_every_models_outputs():
    x, _, _ = data(9)
    array = hftatf.fuse(two_headed(), B)
    outputs = array.predict(x, batch_size=BATCH, verbose=0)
    for b, model in enumerate(array.unfuse()):
        expected = model.predict(x, batch_size=BATCH, verbose=0)
        for name in ("cls", "reg"):
            assert_close(outputs[name][:, b], expected[name])


@pytest.mark.parametrize("loss", [
    keras.losses.MeanSquaredError(reduction="none"),
    {"cls": "mse", "reg": keras.losses.MeanAbsoluteError(reduction=None)}])
def test_a_loss_that_reduces_nothing_is_refused(loss):
    array = hftatf.fuse(two_headed(), B)
    with pytest.raises(ValueError, match="reduction=.*'sum'"):
        array.compile(optimizer=hftatf.optimizers.SGD(RATES), loss=loss)


@pytest.mark.backends("jax", reason="the jit_compile rule of stock Keras")
@pytest.mark.parametrize("layer", [
    lambda: keras.layers.Dense(4), lambda: keras.layers.Conv1D(4, 3)])
def test_auto_jit_compile_on_jax_compiles_every_step(layer):
    # As stock Keras on JAX: XLA is JAX's compiler on every device.
    inputs = keras.Input((8, 3))
    model = keras.Model(inputs, keras.layers.Flatten()(layer()(inputs)))
    array = hftatf.fuse(model, 2)
    array.compile("sgd", loss="mse", jit_compile="auto")
    model.compile("sgd", loss="mse", jit_compile="auto")
    assert array.jit_compile is True and model.jit_compile is True


@pytest.mark.parametrize("augmentation, supported", [
    (lambda: keras.layers.RandAugment(seed=2), False),
    (lambda: keras.layers.MixUp(seed=2), True),
])
def test_jit_compile_follows_the_layers_a_per_model_layer_runs(
        augmentation, supported):
    # RandAugment runs once per model; its rotations and shears do not
    # support XLA, so stock Keras trains without it, even when asked for
    # it (with a warning), and so must the array.
    inputs = keras.Input((8, 8, 3))
    hidden = keras.layers.GlobalAveragePooling2D()(augmentation()(inputs))
    model = keras.Model(inputs, keras.layers.Dense(1)(hidden))
    array = hftatf.fuse(model, 2)
    [per_model] = [layer for layer in array.layers
                   if isinstance(layer, hftatf.layers.FusedPerModel)]
    assert per_model.supports_jit is supported
    assert model_supports_jit(array) is supported
    for jit_compile in ("auto", True):
        model.compile("sgd", loss="mse", jit_compile=jit_compile)
        array.compile("sgd", loss="mse", jit_compile=jit_compile)
        if not supported:
            assert array.jit_compile is model.jit_compile is False
    if keras.backend.backend() == "jax":
        assert array.jit_compile is model.jit_compile is supported


def one_batch():
    x, y = data()[:2]
    return x[:BATCH], y[:BATCH]


def accuracy_array(num_models, **compile_kwargs):
    """The classifier's array compiled with Adam, its loss and accuracy."""
    array = hftatf.fuse(classifier(), num_models)
    array.compile(optimizer=hftatf.optimizers.Adam(1e-3), loss=LOSS,
                  metrics=["accuracy"], **compile_kwargs)
    return array


def traced_step_size(array, x, y):
    """How many operations the array's training step traces to: the
    operations of TensorFlow's graph, or the equations of JAX's program
    (those of the programs it nests included)."""
    array.fit(x, y, batch_size=len(x), verbose=0)  # Builds every state.
    if keras.backend.backend() == "jax":
        import jax

        program = jax.make_jaxpr(array.train_step)(jax_state(array),
                                                   (x, y))
        return sum(1 for _ in jaxpr_equations(program.jaxpr))
    import tensorflow as tf

    step = tf.function(lambda x, y: array.train_step((x, y)))
    return len(step.get_concrete_function(x, y).graph.get_operations())


def test_the_traced_step_does_not_grow_model_by_model():
    # Each model's loss and accuracy are one mapped computation over one
    # `[B, ...]` variable per metric variable, and each log one `[B]`
    # entry: nothing in the step is per model (a loss and an accuracy
    # traced model by model took about 60 operations per model, their
    # variables read and assigned one by one about 10).
    x, y = one_batch()

    def size(num_models):
        return traced_step_size(
            accuracy_array(num_models, jit_compile=False), x, y)

    small, large = size(4), size(64)
    assert large - small < 60, (small, large)


@pytest.mark.backends("tensorflow", reason=(
    "how TensorFlow's vectorized loops meet XLA; JAX's vmap is inline"))
def test_the_mapped_losses_are_inline_in_the_compiled_step():
    # Under XLA, `tf.vectorized_map` builds its loop as a function call,
    # whose gradient made XLA take the step's batch and weights as
    # compile-time constants: the step was compiled anew at every batch
    # (BERT's masked-LM array then aborted after minutes).
    import tensorflow as tf

    x, y = one_batch()
    array = accuracy_array(B, jit_compile=True)
    array.fit(x, y, batch_size=BATCH, verbose=0)
    step = tf.function(lambda x, y: array.train_step((x, y)),
                       jit_compile=True)
    graph = step.get_concrete_function(x, y).graph
    calls = [op.name for op in graph.get_operations()
             if op.type in ("PartitionedCall", "StatefulPartitionedCall")]
    assert not calls, calls


def test_the_traced_step_returns_one_entry_per_log_whatever_b():
    # The logs of each model are split from one `[B]` entry on the host:
    # TensorFlow's graph optimizer walks a step's outputs one by one.
    x, y = one_batch()

    def entries(num_models):
        array = accuracy_array(num_models)
        history = array.fit(x, y, batch_size=len(x), verbose=0).history
        assert sorted(history) == sorted(
            [*(f"{name}_{b}" for name in ("loss", "accuracy")
               for b in range(num_models)), "loss", "accuracy"])
        return sorted(traced_step_logs(array, x, y))

    assert entries(4) == entries(32)


def traced_step_logs(array, x, y):
    """The logs the array's training step returns, traced."""
    if keras.backend.backend() == "jax":
        import jax

        return jax.eval_shape(array.train_step, jax_state(array),
                              (x, y))[0]
    import tensorflow as tf

    step = tf.function(lambda x, y: array.train_step((x, y)))
    return step.get_concrete_function(x, y).structured_outputs


def jax_state(array):
    """The array's four state lists, as the JAX trainer's step takes them."""
    return ([v.value for v in array.trainable_variables],
            [v.value for v in array.non_trainable_variables],
            [v.value for v in array.optimizer.variables],
            [v.value for v in array.metrics_variables])


@pytest.mark.backends("tensorflow", reason=(
    "tf.function traces a step that creates variables twice; a JAX step "
    "takes its state built"))
@pytest.mark.parametrize("data", ["arrays", "dataset"])
def test_the_first_fit_traces_the_step_once(data):
    x = np.random.default_rng(0).normal(size=(N, 5)).astype("float32")
    y = np.arange(N) % 3
    array = hftatf.fuse(classifier(), B)
    traces = []

    def train_step(batch):
        traces.append(1)
        return hftatf.FusedModel.train_step(array, batch)

    array.train_step = train_step
    array.compile(hftatf.optimizers.Adam(RATES), loss=LOSS,
                  metrics=["accuracy"])
    if data == "dataset":
        import tensorflow as tf

        array.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH),
                  epochs=2, verbose=0)
    else:
        array.fit(x, y, batch_size=BATCH, epochs=2, verbose=0)
    assert len(traces) == 1


@pytest.mark.parametrize("builder", [classifier, two_headed])
def test_batch_after_batch_calls_the_array_only_in_its_first_step(
        builder, monkeypatch):
    # Every later train_on_batch and test_on_batch runs the compiled steps:
    # tracing the array again (to build state that never gets built) cost
    # a MobileNet array more than its step.
    x = np.random.default_rng(0).normal(size=(BATCH, 5)).astype("float32")
    y = np.arange(BATCH) % 3
    if builder is two_headed:
        y = {"cls": y, "reg": x[:, :2]}
    array = hftatf.fuse(builder(), B)
    array.compile(hftatf.optimizers.Adam(RATES), loss=(
        LOSS if builder is classifier else {"cls": LOSS, "reg": "mse"}),
        metrics=["accuracy"] if builder is classifier else None)
    calls = []
    call = hftatf.FusedModel.call

    def counted(self, *args, **kwargs):
        calls.append(1)
        return call(self, *args, **kwargs)

    monkeypatch.setattr(hftatf.FusedModel, "call", counted)
    array.train_on_batch(x, y)
    array.test_on_batch(x, y)
    first = len(calls)
    for _ in range(3):
        array.train_on_batch(x, y)
        array.test_on_batch(x, y)
    assert len(calls) == first


def test_metric_variables_do_not_grow_with_the_number_of_models():
    # One `[B, ...]` variable per variable of one model's metrics: the
    # state a step carries (on JAX, one argument per variable) has as many
    # entries at B = 16 as at B = 2.
    x, y = one_batch()

    def variables(num_models):
        array = accuracy_array(num_models)
        array.fit(x, y, batch_size=len(x), verbose=0)
        return array.metrics_variables

    small, large = variables(2), variables(16)
    assert len(small) == len(large)
    assert [tuple(v.shape) for v in large] == [
        (16, *v.shape[1:]) if len(v.shape) and v.shape[0] == 2
        else tuple(v.shape) for v in small]


@pytest.mark.backends("jax", reason=(
    "JAX compiles an eager slice of an array at each index anew"))
def test_results_outside_the_step_do_not_compile_a_program_per_model(caplog):
    # At the end of an epoch each metric's `[B]` result is split into the
    # models' entries outside the step: slice by slice, that compiled B
    # programs; and their means were taken over one stack of B operands.
    import jax

    x, y = one_batch()
    num_models = 97
    array = accuracy_array(num_models)
    array.fit(x, y, batch_size=len(x), verbose=0)
    jax.clear_caches()  # What the end of `fit`'s epoch compiled.
    with compiled_programs(caplog) as operands:
        logs = array.get_metrics_result()
    assert len(logs) == 2 * (num_models + 1)
    # Measured: 20 programs (the result mapped over the models, the
    # means, the split), 118 when the models' entries were sliced one by
    # one.
    assert len(operands) < num_models // 2, len(operands)
    # None stacks the models' entries in one program of B operands, whose
    # compile time grows faster than B (20 s at B = 10,000).
    assert max(operands) <= 64 < num_models, operands


@pytest.mark.backends("tensorflow", reason=(
    "the process-wide gradient registry that held traced steps is "
    "TensorFlow's"))
def test_a_deleted_array_leaves_no_traced_step_in_memory():
    from tensorflow.python.framework import func_graph

    def graphs():
        gc.collect()
        return {id(o) for o in gc.get_objects()
                if isinstance(o, func_graph.FuncGraph)}

    before = graphs()
    # Per-model products on the Eigen kernel, a sparse embedding gradient
    # and per-model bias rows: each traced with a gradient of its own.
    model = keras.Sequential([
        keras.Input((6,), dtype="int32"), keras.layers.Embedding(20, 4),
        keras.layers.Dense(8, activation="relu"), keras.layers.Flatten(),
        keras.layers.Dense(1)])
    array = hftatf.fuse(model, 3)
    array.compile(hftatf.optimizers.SGD([0.1, 0.2, 0.3]), loss="mse",
                  jit_compile=False)
    rng = np.random.default_rng(0)
    x = rng.integers(0, 20, size=(16, 6))
    y = rng.normal(size=(16, 1)).astype("float32")
    array.fit(x, y, batch_size=8, epochs=1, verbose=0)
    array.evaluate(x, y, verbose=0)
    assert graphs() - before, "the array traced no step"
    del array, model
    assert not graphs() - before
