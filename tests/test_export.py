"""Export and import: per-model files that load without hftatf, and back."""

import json
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest
from testing import BACKEND, assert_close

import hftatf
from hftatf.core import logs
from hftatf.graph import architecture, first_difference

NUM_MODELS = 2
RATES = [0.1, 0.2]

# TF checkpoints hold the TensorFlow backend's variables; the `.keras` file
# is every backend's.
TF_CHECKPOINTS = pytest.mark.backends(
    "tensorflow", reason="a TF checkpoint holds TensorFlow variables")
QUICK_FORMAT = "checkpoint" if BACKEND == "tensorflow" else "keras"


def tensorflow():
    """TensorFlow, which reads SavedModels (it writes them from either
    backend)."""
    return pytest.importorskip("tensorflow")


def mlp():
    x = keras.Input((5,), name="x")
    h = keras.layers.Dense(8, activation="relu")(x)
    h = keras.layers.BatchNormalization()(h)
    h = keras.layers.Dropout(0.2)(h)
    y = keras.layers.Dense(3, activation="softmax")(h)
    return keras.Model(x, y, name="mlp")


def cnn():
    x = keras.Input((8, 8, 2), name="image")
    h = keras.layers.Conv2D(4, 3, activation="relu")(x)
    h = keras.layers.BatchNormalization()(h)
    h = keras.layers.MaxPooling2D()(h)
    h = keras.layers.Flatten()(h)
    y = keras.layers.Dense(3)(h)
    return keras.Model(x, y, name="cnn")


def trained_like(build, seed):
    """A model of `build`'s architecture with random (trained-like) weights,
    BatchNormalization statistics included."""
    model = build()
    rng = np.random.default_rng(seed)
    for weight in model.weights:
        value = (rng.uniform(0.5, 2.0, weight.shape)
                 if "variance" in weight.path
                 else rng.normal(size=weight.shape))
        weight.assign(value.astype("float32"))
    return model


def train(array, seed=0):
    array.compile(hftatf.optimizers.SGD(RATES, momentum=0.5),
                  loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    rng = np.random.default_rng(seed)
    inputs = rng.normal(size=(24, 5)).astype("float32")
    labels = rng.integers(0, 3, size=24)
    history = array.fit(inputs, labels, epochs=2, batch_size=8, verbose=0)
    return history, inputs


def assert_same_weights(actual, expected):
    assert len(actual) == len(expected)
    for ours, theirs in zip(actual, expected):
        np.testing.assert_array_equal(ours, theirs)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A trained MLP array (BatchNormalization, Dropout) exported once."""
    keras.utils.set_random_seed(0)
    array = hftatf.fuse(mlp(), NUM_MODELS)
    history, inputs = train(array)
    directory = tmp_path_factory.mktemp("export") / "models"
    paths = array.export_models(directory)
    return array, history, inputs, directory, paths


# -- export_models ----------------------------------------------------------


def test_exported_models_predict_like_the_array(exported):
    array, _, inputs, _, paths = exported
    assert [p.name for p in paths] == ["model_0", "model_1"]
    expected = array.predict(inputs, verbose=0)
    for b, path in enumerate(paths):
        model = keras.models.load_model(path / "model.keras")
        assert not any("hftatf" in type(layer).__module__
                       for layer in model.layers)
        assert_close(model.predict(inputs, verbose=0), expected[:, b])
        served = tensorflow().saved_model.load(str(path / "saved_model"))
        assert_close(served.serve(inputs), expected[:, b])
        default = served.signatures["serving_default"]
        assert_close(default(x=inputs)["output_0"], expected[:, b])


def test_saved_model_signature_is_the_stock_models(exported, tmp_path):
    _, _, _, directory, _ = exported
    stock = mlp()
    stock.export(str(tmp_path / "stock"), verbose=False)
    tf = tensorflow()
    reference = tf.saved_model.load(str(tmp_path / "stock"))
    served = tf.saved_model.load(str(directory / "model_0" / "saved_model"))
    ours = served.signatures["serving_default"]
    theirs = reference.signatures["serving_default"]
    assert ours.structured_input_signature == (
        theirs.structured_input_signature)
    assert ours.structured_outputs == theirs.structured_outputs


def test_metadata_records_hyperparameters_metrics_and_versions(exported):
    _, history, _, directory, _ = exported
    index = json.loads((directory / "index.json").read_text())
    assert [entry["path"] for entry in index] == ["model_0", "model_1"]
    for b, rate in enumerate(RATES):
        metadata = json.loads(
            (directory / f"model_{b}" / "metadata.json").read_text())
        assert index[b] == {**metadata, "path": f"model_{b}"}
        assert metadata["index"] == b
        assert metadata["num_models"] == NUM_MODELS
        hyper = metadata["hyperparameters"]
        assert hyper["optimizer"] == "SGD"
        assert np.isclose(hyper["learning_rate"], rate)
        assert np.isclose(hyper["momentum"], 0.5)
        assert metadata["metrics"]["loss"] == history.history[f"loss_{b}"][-1]
        assert metadata["metrics"]["accuracy"] == (
            history.history[f"accuracy_{b}"][-1])
        assert metadata["diverged"] is False
        assert metadata["versions"]["hftatf"] == hftatf.__version__
        assert metadata["versions"]["keras"] == keras.__version__
        assert metadata["versions"]["tensorflow"] == tensorflow().__version__
        assert metadata["versions"]["backend"] == BACKEND


def test_metadata_metrics_are_each_models_own():
    # A metric named `top_1` logs `top_1` (the mean) and `top_1_0`,
    # `top_1_1`: its mean is not model 1's `top`.
    history = {"loss": [0.9, 0.4], "loss_0": [1.0, 0.3], "loss_1": [0.8, 0.5],
               "top_1": [0.4], "top_1_0": [0.3], "top_1_1": [0.5],
               "val_top_1": [0.2], "val_top_1_0": [0.1],
               "val_top_1_1": [0.3]}
    assert hftatf.export.model_metrics(history, 1, 2) == {
        "loss": 0.5, "top_1": 0.5, "val_top_1": 0.3}


def test_metadata_leaves_out_quantities_never_logged():
    # A CSV history holds NaN where a run logged nothing (no validation).
    nan = float("nan")
    history = {"loss_0": [1.0, 0.3], "loss_1": [0.8, nan],
               "val_loss_0": [nan, nan], "val_loss_1": [nan, nan]}
    assert hftatf.export.model_metrics(history, 0, 2) == {"loss": 0.3}
    (diverged,) = hftatf.export.model_metrics(history, 1, 2).values()
    assert np.isnan(diverged)


def test_metadata_of_a_loss_scaled_optimizer_is_the_inner_ones():
    optimizer = hftatf.optimizers.LossScaleOptimizer(
        hftatf.optimizers.Adam([0.1, 0.2], amsgrad=True))
    hyper = hftatf.export.model_hyperparameters(optimizer, 1)
    assert hyper["optimizer"] == "Adam"
    assert hyper["amsgrad"] is True and hyper["loss_scale"] is True
    assert np.isclose(hyper["learning_rate"], 0.2)


def test_divergence_status_is_recorded(tmp_path):
    array = hftatf.fuse(mlp(), NUM_MODELS)
    array.compile(hftatf.optimizers.SGD([0.01, 1e38]),
                  loss="sparse_categorical_crossentropy")
    rng = np.random.default_rng(0)
    history = array.fit(rng.normal(size=(16, 5)).astype("float32"),
                        rng.integers(0, 3, size=16), batch_size=8, verbose=0)
    assert list(array.diverged_models) == [False, True]
    hftatf.export_models(array, tmp_path, format=QUICK_FORMAT)
    index = json.loads((tmp_path / "index.json").read_text())
    assert [entry["diverged"] for entry in index] == [False, True]
    # JSON has no NaN: the diverged model's loss is written as null.
    assert index[0]["metrics"]["loss"] == history.history["loss_0"][-1]
    assert index[1]["metrics"]["loss"] is None


def test_divergence_is_null_where_the_array_does_not_track_it():
    class Untracked:
        pass

    assert hftatf.export.model_diverged(Untracked(), 0) is None


def test_exported_model_loads_without_hftatf(exported, tmp_path):
    array, _, inputs, directory, _ = exported
    np.save(tmp_path / "inputs.npy", inputs)
    model_dir = directory / "model_1"
    script = textwrap.dedent(f"""
        import sys
        sys.modules["hftatf"] = None  # any import of hftatf now fails
        import numpy as np, keras, tensorflow as tf
        x = np.load(r"{tmp_path / 'inputs.npy'}")
        m = keras.models.load_model(r"{model_dir / 'model.keras'}")
        s = tf.saved_model.load(r"{model_dir / 'saved_model'}")
        y = [m.predict(x, verbose=0), s.serve(x)]
        if {BACKEND == "tensorflow"}:  # (TF checkpoints: TensorFlow's)
            fresh = keras.saving.deserialize_keras_object(
                __import__("json").load(open(r"{model_dir / 'config.json'}")))
            tf.train.Checkpoint(model=fresh).read(
                r"{model_dir / 'checkpoint' / 'model'}").assert_consumed()
            y.append(fresh.predict(x, verbose=0))
        y = np.stack(y)
        np.save(sys.argv[1], y)
        assert not any(name.startswith("hftatf.") for name in sys.modules)
    """)
    out = tmp_path / "out.npy"
    result = subprocess.run([sys.executable, "-c", script, str(out)],
                            cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    expected = array.predict(inputs, verbose=0)[:, 1]
    for outputs in np.load(out):
        assert_close(outputs, expected)


def test_load_models_loads_the_zoos_own_keras_objects(tmp_path):
    # PointNet's transform nets carry the zoo's OrthogonalityRegularizer,
    # registered only once its module is imported.
    from hftatf.models import pointnet

    array = hftatf.fuse(pointnet.pointnet(num_points=16, num_classes=3,
                                          width=0.0625), 2)
    array.compile(hftatf.optimizers.SGD(0.01),
                  loss="sparse_categorical_crossentropy")
    # In the Keras format alone: a SavedModel of each model (TensorFlow's
    # default) would take most of the test and is loaded by other tests.
    array.export_models(tmp_path / "export", format="keras")
    inputs = np.random.default_rng(0).normal(size=(4, 16, 3)).astype(
        "float32")
    np.save(tmp_path / "inputs.npy", inputs)
    script = textwrap.dedent(f"""
        import sys
        import numpy as np
        import hftatf
        models = hftatf.load_models(r"{tmp_path / 'export'}")
        x = np.load(r"{tmp_path / 'inputs.npy'}")
        np.save(sys.argv[1], np.stack([m.predict(x, verbose=0)
                                       for m in models], 1))
    """)
    out = tmp_path / "out.npy"
    result = subprocess.run([sys.executable, "-c", script, str(out)],
                            cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert_close(np.load(out), array.predict(inputs, verbose=0))


@TF_CHECKPOINTS
def test_checkpoint_restores_into_a_fresh_stock_model(exported):
    array, _, inputs, directory, _ = exported
    unfused = array.unfuse()
    for b in range(NUM_MODELS):
        fresh = mlp()
        tensorflow().train.Checkpoint(model=fresh).read(
            str(directory / f"model_{b}" / "checkpoint" / "model")
        ).assert_consumed()
        assert_same_weights(fresh.get_weights(), unfused[b].get_weights())
        assert_close(fresh.predict(inputs, verbose=0),
                     array.predict(inputs, verbose=0)[:, b])


# -- load_models and from_exported -----------------------------------------


def test_load_models_returns_the_unfused_models_exactly(exported):
    array, _, _, directory, _ = exported
    models = hftatf.load_models(directory)
    assert len(models) == NUM_MODELS
    for model, unfused in zip(models, array.unfuse()):
        assert type(model) is type(unfused)
        assert_same_weights(model.get_weights(), unfused.get_weights())


def test_from_exported_returns_the_array_exactly(exported):
    array, _, inputs, directory, _ = exported
    again = hftatf.export.from_exported(directory)
    assert isinstance(again, hftatf.FusedModel)
    assert again.name == array.name
    assert again.shared_inputs == array.shared_inputs
    assert_same_weights(again.get_weights(), array.get_weights())
    assert_close(again.predict(inputs, verbose=0),
                 array.predict(inputs, verbose=0))


@TF_CHECKPOINTS
def test_export_from_checkpoints_alone_loads_back(tmp_path):
    array = hftatf.fuse(mlp(), NUM_MODELS, shared_inputs=False)
    paths = hftatf.export_models(array, tmp_path, format=["checkpoint"])
    assert not (paths[0] / "model.keras").exists()
    assert not (paths[0] / "saved_model").exists()
    class Array(hftatf.FusedModel):
        pass

    again = hftatf.from_exported(tmp_path, model_class=Array)
    assert type(again) is Array
    assert again.shared_inputs == (False,)
    assert_same_weights(again.get_weights(), array.get_weights())


def test_adapted_normalization_keeps_its_statistics_everywhere(tmp_path):
    # An adapted Normalization computes with a mean and variance read from
    # its weights when adapted or loaded from a file, not when its weights
    # are set: every path from the array to stock models must derive them.
    rng = np.random.default_rng(5)
    data = rng.normal(3.0, 2.0, size=(16, 5)).astype("float32")

    def adapted(seed):
        keras.utils.set_random_seed(seed)
        x = keras.Input((5,), name="x")
        normalize = keras.layers.Normalization()
        normalize.adapt(data + seed)
        return keras.Model(x, keras.layers.Dense(3)(normalize(x)))

    models = [adapted(b) for b in range(NUM_MODELS)]
    array = hftatf.fuse_models(models)
    expected = [model.predict(data, verbose=0) for model in models]
    predicted = {"unfuse": [m.predict(data, verbose=0)
                            for m in array.unfuse()]}
    paths = array.export_models(tmp_path / "models")
    tf = tensorflow()
    # (Each loaded SavedModel kept alive while it computes.)
    saved = [tf.saved_model.load(str(path / "saved_model"))
             for path in paths]
    predicted["saved_model"] = [model.serve(data) for model in saved]
    hftatf.export_models(array, tmp_path / "quick", format=QUICK_FORMAT)
    predicted[QUICK_FORMAT] = [
        m.predict(data, verbose=0)
        for m in hftatf.load_models(tmp_path / "quick")]
    served = tf.saved_model.load(
        str(hftatf.export_serving(array, tmp_path / "serving")))
    predicted["serving"] = [served.signatures[f"model_{b}"](x=data)[
        "output_0"] for b in range(NUM_MODELS)]
    for name, outputs in predicted.items():
        for b in range(NUM_MODELS):
            assert_close(outputs[b], expected[b], err_msg=name)
    # Serving model b computes its stock graph alone (a MatMul, where the
    # array's fused Dense computes every model in a BatchMatMul); from JAX
    # the graph is one XLA program (jax2tf), whose ops are not listed.
    if BACKEND != "tensorflow":
        return
    assert graph_ops(served.signatures["model_0"]) >= {"MatMul"}
    assert "BatchMatMulV2" not in graph_ops(served.signatures["model_0"])
    assert "BatchMatMulV2" in graph_ops(served.signatures["shared"])


def graph_ops(function):
    """The op types of a loaded concrete function and those it calls."""
    graph = function.graph.as_graph_def()
    return {node.op for inner in graph.library.function
            for node in inner.node_def}


def _doubled_relu(x):
    return 2.0 * keras.ops.relu(x)


@pytest.mark.parametrize("format", [
    "keras", pytest.param("checkpoint", marks=TF_CHECKPOINTS)])
def test_unregistered_objects_load_with_custom_objects(tmp_path, format):
    x = keras.Input((5,), name="x")
    y = keras.layers.Dense(3, activation=_doubled_relu)(x)
    array = hftatf.fuse(keras.Model(x, y), NUM_MODELS)
    hftatf.export_models(array, tmp_path, format=format)
    with pytest.raises(Exception, match="_doubled_relu"):
        hftatf.load_models(tmp_path)
    custom = {"_doubled_relu": _doubled_relu}
    data = np.random.default_rng(0).normal(size=(4, 5)).astype("float32")
    expected = array.predict(data, verbose=0)
    for b, model in enumerate(hftatf.load_models(tmp_path, custom)):
        assert_close(model.predict(data, verbose=0), expected[:, b])
    again = hftatf.from_exported(tmp_path, custom_objects=custom)
    assert_close(again.predict(data, verbose=0), expected)


def test_cnn_array_round_trips(tmp_path):
    models = [trained_like(cnn, seed) for seed in range(NUM_MODELS)]
    array = hftatf.fuse_models(models)
    paths = hftatf.export_models(array, tmp_path,
                                 format=("keras", "saved_model"))
    inputs = np.random.default_rng(1).normal(
        size=(3, 8, 8, 2)).astype("float32")
    for b, model in enumerate(hftatf.load_models(tmp_path)):
        assert_same_weights(model.get_weights(), models[b].get_weights())
        served = tensorflow().saved_model.load(
            str(paths[b] / "saved_model"))
        assert_close(served.serve(inputs), models[b].predict(inputs,
                                                              verbose=0))
    again = hftatf.from_exported(tmp_path)
    assert_same_weights(again.get_weights(), array.get_weights())


@pytest.mark.backends("tensorflow", reason="tf.distribute strategies")
def test_distributed_array_exports_its_values(tmp_path):
    tf = tensorflow()
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    keras.utils.set_random_seed(2)
    with strategy.scope():
        array = hftatf.fuse(mlp(), NUM_MODELS)
        _, inputs = train(array)
    assert "Mirrored" in type(array.weights[0].value).__name__
    with strategy.scope():
        array.export_models(tmp_path)
    expected = array.predict(inputs, verbose=0)
    for b, model in enumerate(hftatf.load_models(tmp_path)):
        assert_close(model.predict(inputs, verbose=0), expected[:, b])
        served = tf.saved_model.load(
            str(tmp_path / f"model_{b}" / "saved_model"))
        assert_close(served.serve(inputs), expected[:, b])
    again = hftatf.from_exported(tmp_path)
    assert_same_weights(again.get_weights(), array.get_weights())


# -- atomic writes ----------------------------------------------------------


def failing_save(monkeypatch, fail_at):
    """Makes the `fail_at`-th `Model.save` call raise, as a crash would."""
    save = keras.Model.save
    calls = []

    def flaky(self, *args, **kwargs):
        calls.append(self.name)
        if len(calls) == fail_at:
            raise OSError("disk full")
        return save(self, *args, **kwargs)

    monkeypatch.setattr(keras.Model, "save", flaky)


def test_failed_export_leaves_no_model_that_looks_complete(
        tmp_path, monkeypatch):
    array = hftatf.fuse(mlp(), NUM_MODELS)
    failing_save(monkeypatch, fail_at=2)  # while writing model 1
    with pytest.raises(OSError, match="disk full"):
        hftatf.export_models(array, tmp_path, format="keras")
    assert not (tmp_path / "model_0").exists()
    assert not (tmp_path / "model_1").exists()
    assert not (tmp_path / "index.json").exists()
    assert list(tmp_path.iterdir()) == []  # no temporary files left
    with pytest.raises(ValueError, match="no index.json"):
        hftatf.load_models(tmp_path)


def test_failed_export_keeps_the_earlier_one(tmp_path, monkeypatch):
    first = hftatf.fuse(mlp(), NUM_MODELS)
    hftatf.export_models(first, tmp_path, format="keras")
    failing_save(monkeypatch, fail_at=2)
    with pytest.raises(OSError, match="disk full"):
        hftatf.export_models(hftatf.fuse(mlp(), NUM_MODELS), tmp_path,
                             format="keras")
    monkeypatch.undo()
    assert_same_weights(hftatf.from_exported(tmp_path).get_weights(),
                        first.get_weights())
    second = hftatf.fuse(mlp(), NUM_MODELS)
    hftatf.export_models(second, tmp_path, format="keras")
    assert_same_weights(hftatf.from_exported(tmp_path).get_weights(),
                        second.get_weights())
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "index.json", "model_0", "model_1"]


# -- fuse_models from paths and of BatchNormalization state -----------------


def test_fuse_models_reads_paths(exported):
    array, _, _, directory, _ = exported
    again = hftatf.fuse_models([
        directory / "model_0" / "model.keras",
        str(directory / "model_1" / "saved_model"),
    ])
    assert_same_weights(again.get_weights(), array.get_weights())
    again = hftatf.fuse_models([directory / "model_0", directory / "model_1"])
    assert_same_weights(again.get_weights(), array.get_weights())


def test_fuse_models_carries_batch_normalization_statistics():
    models = [trained_like(mlp, seed) for seed in range(NUM_MODELS)]
    array = hftatf.fuse_models(models)
    statistics = [w for w in array.non_trainable_weights
                  if "moving" in w.path]
    assert len(statistics) == 2
    inputs = np.random.default_rng(3).normal(size=(4, 5)).astype("float32")
    outputs = array.predict(inputs, verbose=0)
    for b, (model, unfused) in enumerate(zip(models, array.unfuse())):
        assert_same_weights(unfused.get_weights(), model.get_weights())
        assert_close(outputs[:, b], model.predict(inputs, verbose=0))


def test_fuse_models_round_trips_a_cnn_exactly():
    array = hftatf.fuse(cnn(), NUM_MODELS)
    again = hftatf.fuse_models(array.unfuse())
    assert_same_weights(again.get_weights(), array.get_weights())


# -- refusals ---------------------------------------------------------------


def functional(*layers, shape=(5,)):
    x = keras.Input(shape)
    h = x
    for layer in layers:
        h = layer(h)
    return keras.Model(x, h)


L = keras.layers


@pytest.mark.parametrize("reference, other, message", [
    (lambda: functional(L.Dense(4), L.BatchNormalization(), L.Dense(2)),
     lambda: functional(L.BatchNormalization(), L.Dense(4), L.Dense(2)),
     r"model 1 .*layer 1 is a BatchNormalization where model 0 has a Dense "
     r"\(layer order"),
    (lambda: functional(L.Dense(4)),
     lambda: functional(L.Dense(4), shape=(6,)),
     r"layer 0 \(InputLayer\) differs in configuration: "
     r"config.batch_shape is \[None, 6\] instead of \[None, 5\]"),
    (lambda: functional(L.Dense(4), L.BatchNormalization()),
     lambda: functional(L.Dense(4), L.BatchNormalization(epsilon=0.01)),
     r"layer 2 \(BatchNormalization\) differs in configuration: "
     r"config.epsilon is 0.01 instead of 0.001"),
    (lambda: functional(L.Conv2D(3, 3), shape=(6, 6, 1)),
     lambda: functional(L.Conv2D(3, 5), shape=(6, 6, 1)),
     r"layer 1 \(Conv2D\) differs in configuration: config.kernel_size"),
    (lambda: functional(L.Dense(4)),
     lambda: functional(L.Dense(4), L.Dense(4)),
     r"it has 3 layers instead of 2, from layer 2 \(Dense\) on"),
], ids=["layer order", "input shape", "layer config", "kernel shape",
        "extra layer"])
def test_fuse_models_names_the_first_difference(reference, other, message):
    with pytest.raises(ValueError, match=message):
        hftatf.fuse_models([reference(), other()])


def test_weight_shape_difference_is_named():
    reference = architecture(functional(L.Dense(4)))
    other = [dict(layer) for layer in reference]
    other[1]["weights"] = [(6, 4), (4,)]
    assert first_difference(reference, other) == (
        "layer 1 (Dense) differs in weight shapes: [(6, 4), (4,)] instead "
        "of [(5, 4), (4,)]")
    assert first_difference(reference, reference) is None


def test_bare_saved_model_is_refused(tmp_path):
    mlp().export(str(tmp_path / "bare"), verbose=False)
    # A `.keras` file beside it is another model's, not its weights.
    mlp().save(tmp_path / "model.keras")
    with pytest.raises(ValueError, match="SavedModel without a Keras model"):
        hftatf.fuse_models([tmp_path / "bare", tmp_path / "bare"])


def test_bad_paths_and_arguments_are_refused(exported, tmp_path):
    array, _, _, directory, _ = exported
    with pytest.raises(TypeError, match="sequence of models or paths"):
        hftatf.fuse_models(str(directory))
    with pytest.raises(ValueError, match="whole export"):
        hftatf.fuse_models([directory])
    with pytest.raises(ValueError, match="No such file"):
        hftatf.fuse_models([tmp_path / "missing.keras"])
    (tmp_path / "weights.npy").write_text("")
    with pytest.raises(ValueError, match="expected a `.keras` file"):
        hftatf.fuse_models([tmp_path / "weights.npy"])
    with pytest.raises(ValueError, match="holds no Keras model"):
        hftatf.fuse_models([tmp_path])
    with pytest.raises(ValueError, match="no index.json"):
        hftatf.from_exported(tmp_path)
    with pytest.raises(ValueError, match="format"):
        hftatf.export_models(array, tmp_path / "out", format="onnx")
    with pytest.raises(TypeError, match="FusedModel"):
        hftatf.export_models(mlp(), tmp_path / "out")


def test_hyperparameters_are_written_as_given(tmp_path):
    x = keras.Input((3,))
    model = keras.Model(x, keras.layers.Dense(2)(x))
    array = hftatf.fuse(model, 2)
    array.compile(hftatf.optimizers.Adam([0.03, 1e-4], beta_1=0.85),
                  loss="mse")
    array.export_models(tmp_path, format="keras")
    index = json.loads((tmp_path / "index.json").read_text())
    assert [entry["hyperparameters"]["learning_rate"] for entry in index] == [
        0.03, 1e-4]
    assert index[0]["hyperparameters"]["beta_1"] == 0.85


def test_as_given_keeps_float64_values():
    assert logs.as_given(np.float32(0.03)) == 0.03
    assert logs.as_given(np.float64(0.1234567891234)) == 0.1234567891234
    assert logs.as_given("adam") == "adam"
