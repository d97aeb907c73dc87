"""export_serving: one SavedModel serving all the models of an array."""

import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest
from testing import assert_close

import hftatf

NUM_MODELS = 2


def load(path):
    """The SavedModel at `path`, read by TensorFlow (which writes it from
    either backend)."""
    return pytest.importorskip("tensorflow").saved_model.load(str(path))


def mlp():
    x = keras.Input((5,), name="x")
    h = keras.layers.Dense(8, activation="relu")(x)
    h = keras.layers.BatchNormalization()(h)
    h = keras.layers.Dropout(0.3)(h)
    y = keras.layers.Dense(3)(h)
    return keras.Model(x, y, name="mlp")


def cnn():
    x = keras.Input((8, 8, 2), name="image")
    h = keras.layers.Rescaling(0.5)(x)
    h = keras.layers.Conv2D(4, 3, activation="relu")(h)
    h = keras.layers.BatchNormalization()(h)
    h = keras.layers.MaxPooling2D()(h)
    h = keras.layers.Flatten()(h)
    y = keras.layers.Dense(3, activation="softmax")(h)
    return keras.Model(x, y, name="cnn")


def two_inputs():
    a = keras.Input((4,), name="a")
    b = keras.Input((3,), name="b")
    h = keras.layers.Concatenate()([keras.layers.Dense(5)(a), b])
    y = keras.layers.Dense(2)(h)
    return keras.Model([a, b], y, name="two_inputs")


def trained_like(build, seed):
    """A model of `build`'s architecture with random (trained-like) weights,
    BatchNormalization statistics included."""
    model = build()
    rng = np.random.default_rng(seed)
    for weight in model.weights:
        shape = weight.shape
        value = (rng.uniform(0.5, 2.0, shape) if "variance" in weight.path
                 else rng.normal(size=shape))
        weight.assign(value.astype("float32"))
    return model


def sample(rng, shape):
    return rng.normal(size=shape).astype("float32")


def test_signatures_serve_every_layout_and_every_model(tmp_path):
    models = [trained_like(mlp, seed) for seed in range(NUM_MODELS)]
    array = hftatf.fuse_models(models)
    hftatf.export_serving(array, tmp_path / "serving")
    served = load(tmp_path / "serving")
    assert set(served.signatures) == {
        "serving_default", "shared", "per_model", "model_0", "model_1"}
    shared = served.signatures["shared"]
    assert shared.structured_input_signature[1]["x"].shape.as_list() == [
        None, 5]
    per_model = served.signatures["per_model"]
    assert per_model.structured_input_signature[1]["x"].shape.as_list() == [
        None, NUM_MODELS, 5]
    default = served.signatures["serving_default"]
    assert default.structured_input_signature == (
        shared.structured_input_signature)

    rng = np.random.default_rng(0)
    x = sample(rng, (6, 5))
    expected = array.predict(x, verbose=0)
    assert_close(default(x=x)["output_0"], expected)
    assert_close(served.shared(x), expected)
    own = sample(rng, (6, NUM_MODELS, 5))
    outputs = per_model(x=own)["output_0"]
    for b, model in enumerate(models):
        assert_close(outputs[:, b], model.predict(own[:, b], verbose=0))
        single = served.signatures[f"model_{b}"](x=x)["output_0"]
        assert single.shape == (6, 3)
        assert_close(single, model.predict(x, verbose=0))
    # The variables are stored once, stacked, not once per signature.
    assert sorted(v.shape.as_list() for v in served.variables
                  if v.dtype == "float32") == sorted(
        list(w.shape) for w in array.weights if w.dtype == "float32")


def test_a_regressor_with_one_output_unit_is_served(tmp_path):
    # A one-unit Dense computes with a gradient of hftatf's own, which the
    # SavedModel traces with no op.
    x = keras.Input((5,), name="x")
    regressor = keras.Model(x, keras.layers.Dense(1)(
        keras.layers.Dense(4, activation="relu")(x)))
    array = hftatf.fuse(regressor, NUM_MODELS)
    hftatf.export_serving(array, tmp_path / "serving")
    served = load(tmp_path / "serving")
    inputs = sample(np.random.default_rng(1), (6, 5))
    assert_close(served.shared(inputs), array.predict(inputs, verbose=0))


def test_loads_in_a_process_without_hftatf(tmp_path):
    models = [trained_like(cnn, seed) for seed in range(NUM_MODELS)]
    array = hftatf.fuse_models(models)
    hftatf.export_serving(array, tmp_path / "serving")
    rng = np.random.default_rng(1)
    x = sample(rng, (3, 8, 8, 2))
    own = sample(rng, (3, NUM_MODELS, 8, 8, 2))
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "own.npy", own)
    script = textwrap.dedent(f"""
        import sys
        sys.modules["hftatf"] = None  # any import of hftatf now fails
        try:
            import hftatf  # noqa: F401
        except ImportError:
            pass
        else:
            raise SystemExit("hftatf could be imported")
        import numpy as np
        import tensorflow as tf
        served = tf.saved_model.load(r"{tmp_path / 'serving'}")
        x = np.load(r"{tmp_path / 'x.npy'}")
        own = np.load(r"{tmp_path / 'own.npy'}")
        signatures = served.signatures
        outputs = {{
            "default": signatures["serving_default"](image=x)["output_0"],
            "per_model": signatures["per_model"](image=own)["output_0"],
        }}
        for b in range({NUM_MODELS}):
            outputs[f"model_{{b}}"] = signatures[f"model_{{b}}"](
                image=x)["output_0"]
        np.savez(sys.argv[1], **{{k: v.numpy() for k, v in outputs.items()}})
        assert not any(name.startswith("hftatf.") for name in sys.modules)
        assert sys.modules["hftatf"] is None
    """)
    out = tmp_path / "out.npz"
    result = subprocess.run([sys.executable, "-c", script, str(out)],
                            cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    served = np.load(out)
    assert_close(served["default"], array.predict(x, verbose=0))
    for b, model in enumerate(models):
        assert_close(served[f"model_{b}"], model.predict(x, verbose=0))
        assert_close(served["per_model"][:, b],
                     model.predict(own[:, b], verbose=0))


def test_array_of_per_model_inputs_serves_shared_inputs_too(tmp_path):
    models = [trained_like(mlp, seed) for seed in range(NUM_MODELS)]
    array = hftatf.fuse_models(models, shared_inputs=False)
    hftatf.export_serving(array, tmp_path / "serving")
    served = load(tmp_path / "serving")
    default = served.signatures["serving_default"]
    assert default.structured_input_signature[1]["x"].shape.as_list() == [
        None, NUM_MODELS, 5]
    rng = np.random.default_rng(2)
    own = sample(rng, (4, NUM_MODELS, 5))
    assert_close(default(x=own)["output_0"], array.predict(own, verbose=0))
    x = sample(rng, (4, 5))
    shared = served.signatures["shared"](x=x)["output_0"]
    for b, model in enumerate(models):
        assert_close(shared[:, b], model.predict(x, verbose=0))


def test_mixed_layout_gets_its_own_endpoint(tmp_path):
    models = [trained_like(two_inputs, seed) for seed in range(NUM_MODELS)]
    array = hftatf.fuse_models(models, shared_inputs=[True, False])
    hftatf.export_serving(array, tmp_path / "serving")
    served = load(tmp_path / "serving")
    assert "serve" in served.signatures
    rng = np.random.default_rng(3)
    a = sample(rng, (4, 4))
    b_own = sample(rng, (4, NUM_MODELS, 3))
    b_shared = sample(rng, (4, 3))
    a_own = sample(rng, (4, NUM_MODELS, 4))
    signatures = served.signatures
    assert_close(signatures["serving_default"](a=a, b=b_own)["output_0"],
                 array.predict([a, b_own], verbose=0))
    shared = signatures["shared"](a=a, b=b_shared)["output_0"]
    per_model = signatures["per_model"](a=a_own, b=b_own)["output_0"]
    for index, model in enumerate(models):
        assert_close(shared[:, index],
                     model.predict([a, b_shared], verbose=0))
        assert_close(per_model[:, index],
                     model.predict([a_own[:, index], b_own[:, index]],
                                   verbose=0))
        assert_close(
            signatures[f"model_{index}"](a=a, b=b_shared)["output_0"],
            model.predict([a, b_shared], verbose=0))


def test_array_without_stock_architecture_slices_the_fused_graph(tmp_path):
    x = keras.Input((5,), name="x")
    h = hftatf.layers.BroadcastToModels(NUM_MODELS)(x)
    y = hftatf.layers.FusedDense(NUM_MODELS, 3)(h)
    array = hftatf.FusedModel(x, y, num_models=NUM_MODELS)
    hftatf.export_serving(array, tmp_path / "serving")
    served = load(tmp_path / "serving")
    # Per-model inputs cannot reach an array built for shared ones.
    assert "per_model" not in served.signatures
    inputs = sample(np.random.default_rng(4), (3, 5))
    expected = array.predict(inputs, verbose=0)
    assert_close(served.shared(inputs), expected)
    for b in range(NUM_MODELS):
        assert_close(served.signatures[f"model_{b}"](x=inputs)["output_0"],
                     expected[:, b])


def served_array():
    x = keras.Input((5,), name="x")
    h = hftatf.layers.BroadcastToModels(NUM_MODELS)(x)
    y = hftatf.layers.FusedDense(NUM_MODELS, 3)(h)
    return hftatf.FusedModel(x, y, num_models=NUM_MODELS)


def test_export_replaces_an_earlier_one_whole(tmp_path):
    first, second = served_array(), served_array()
    hftatf.export_serving(first, tmp_path / "serving")
    hftatf.export_serving(second, tmp_path / "serving")
    assert [p.name for p in tmp_path.iterdir()] == ["serving"]
    served = load(tmp_path / "serving")
    inputs = sample(np.random.default_rng(6), (3, 5))
    assert_close(served.shared(inputs), second.predict(inputs, verbose=0))


@pytest.mark.backends("tensorflow", reason="tf.distribute strategies")
def test_distributed_array_is_served_from_its_values(tmp_path):
    tf = pytest.importorskip("tensorflow")
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    models = [trained_like(mlp, seed) for seed in range(NUM_MODELS)]
    with strategy.scope():
        array = hftatf.fuse_models(models)
    assert "Mirrored" in type(array.weights[0].value).__name__
    hftatf.export_serving(array, tmp_path / "serving")
    served = load(tmp_path / "serving")
    x = sample(np.random.default_rng(5), (4, 5))
    for b, model in enumerate(models):
        assert_close(served.signatures[f"model_{b}"](x=x)["output_0"],
                     model.predict(x, verbose=0))
    assert_close(served.shared(x), array.predict(x, verbose=0))


@pytest.mark.parametrize("bad", [None, "not a model"])
def test_non_array_is_refused(tmp_path, bad):
    with pytest.raises(TypeError, match="FusedModel"):
        hftatf.export_serving(bad, tmp_path / "serving")


def test_refuses_to_replace_a_file(tmp_path):
    target = tmp_path / "notes.txt"
    target.write_text("the user's notes")
    with pytest.raises(ValueError, match="notes.txt' is a file"):
        hftatf.export_serving(served_array(), target)
    assert target.read_text() == "the user's notes"
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


def test_refuses_to_replace_a_directory_of_other_files(tmp_path):
    target = tmp_path / "serving"
    (target / "data").mkdir(parents=True)
    (target / "data" / "train.csv").write_text("1,2,3")
    (target / "README").write_text("mine")
    with pytest.raises(ValueError, match=r"\['README', 'data'\]"):
        hftatf.export_serving(served_array(), target)
    assert (target / "data" / "train.csv").read_text() == "1,2,3"
    assert (target / "README").read_text() == "mine"
    assert sorted(p.name for p in target.iterdir()) == ["README", "data"]
    assert [p.name for p in tmp_path.iterdir()] == ["serving"]


def test_writes_into_an_empty_directory(tmp_path):
    (tmp_path / "serving").mkdir()
    array = served_array()
    hftatf.export_serving(array, tmp_path / "serving")
    served = load(tmp_path / "serving")
    inputs = sample(np.random.default_rng(7), (3, 5))
    assert_close(served.shared(inputs), array.predict(inputs, verbose=0))
