"""Arrays of models that hold lookup layers (`StringLookup`,
`IntegerLookup`, `TextVectorization`) against their stock twins: the
vocabulary a lookup learned in `adapt`, which its config leaves out, goes
with the array, its saved file, its unfused models and its exports."""

import keras
import numpy as np
import pytest
from testing import assert_close

import hftatf

# Stock Keras runs its lookups in `tf.data` on other backends: a model
# holding one runs on TensorFlow only.
pytestmark = pytest.mark.backends(
    "tensorflow", reason="Keras runs lookup layers inside a model on "
    "TensorFlow only (on JAX, in tf.data)")

RATES = [0.05, 0.1]


def adapted_lookups():
    import tensorflow as tf

    colors = keras.layers.StringLookup(output_mode="one_hot", name="colors")
    colors.adapt(tf.constant([["red"], ["green"], ["blue"], ["red"]]))
    codes = keras.layers.IntegerLookup(name="codes")
    codes.adapt(np.array([3, 5, 7, 7, 9]))
    words = keras.layers.TextVectorization(
        max_tokens=20, output_mode="tf_idf", name="words")
    words.adapt(tf.constant(["the cat sat", "a dog ran far", "the dog"]))
    return colors, codes, words


def tabular_model():
    colors, codes, words = adapted_lookups()
    color = keras.Input((1,), dtype="string", name="color")
    code = keras.Input((1,), dtype="int64", name="code")
    text = keras.Input((1,), dtype="string", name="text")
    features = keras.layers.Concatenate()([
        keras.layers.Flatten()(colors(color)),
        keras.layers.Flatten()(keras.layers.Embedding(8, 3)(codes(code))),
        keras.layers.Flatten()(words(text))])
    hidden = keras.layers.Dense(6, activation="relu")(features)
    return keras.Model([color, code, text], keras.layers.Dense(1)(hidden))


def tabular_data(n=16, seed=0):
    import tensorflow as tf

    rng = np.random.default_rng(seed)
    x = [tf.constant(rng.choice(["red", "green", "blue", "pink"], (n, 1))),
         rng.choice([3, 5, 7, 9, 11], (n, 1)),
         tf.constant(rng.choice(["the cat", "a dog sat", "far cat", "zebra"],
                                (n, 1)))]
    return x, rng.standard_normal((n, 1)).astype("float32")


def vocabularies(model):
    return [model.get_layer(name).get_vocabulary()
            for name in ("colors", "codes", "words")]


def test_adapted_lookups_on_shared_inputs_train_like_stock(tmp_path):
    model = tabular_model()
    x, y = tabular_data()
    array = hftatf.fuse(model, 2)
    twins = array.unfuse()
    for twin in twins:
        assert vocabularies(twin) == vocabularies(model)
    predictions = array.predict(x, verbose=0)
    array.compile(hftatf.optimizers.SGD(RATES), loss="mse")
    array.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    trained = array.unfuse()
    for b, twin in enumerate(twins):
        assert_close(predictions[:, b], twin.predict(x, verbose=0))
        twin.compile(keras.optimizers.SGD(RATES[b]), loss="mse")
        twin.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
        for got, want in zip(trained[b].get_weights(), twin.get_weights()):
            assert_close(got, want, err_msg=f"model {b}")
        assert vocabularies(trained[b]) == vocabularies(model)

    # The array's file, its unfused models and its exports keep them.
    path = str(tmp_path / "array.keras")
    array.save(path)
    loaded = keras.models.load_model(path)
    assert_close(loaded.predict(x, verbose=0), array.predict(x, verbose=0))
    assert vocabularies(loaded.unfuse()[1]) == vocabularies(model)
    hftatf.export_models(array, str(tmp_path / "export"))
    for b, exported in enumerate(
            hftatf.load_models(str(tmp_path / "export"))):
        assert vocabularies(exported) == vocabularies(model)
        assert_close(exported.predict(x, verbose=0),
                     twins[b].predict(x, verbose=0), err_msg=f"model {b}")


def integer_model(vocabulary):
    code = keras.Input((2,), dtype="int64")
    codes = keras.layers.IntegerLookup()
    codes.adapt(np.array(vocabulary))
    embedded = keras.layers.Embedding(6, 3)(codes(code))
    return keras.Model(code, keras.layers.Dense(1)(
        keras.layers.Flatten()(embedded)))


def test_a_lookup_on_inputs_of_each_models_own_trains_like_stock():
    rng = np.random.default_rng(1)
    x = rng.choice([3, 5, 7, 11], (8, 2, 2))  # [batch, B, ...]
    y = rng.standard_normal((8, 2, 1)).astype("float32")
    array = hftatf.fuse(integer_model([3, 5, 7]), 2, shared_inputs=False)
    twins = array.unfuse()
    array.compile(hftatf.optimizers.SGD(RATES), loss="mse",
                  per_model_labels=True)
    array.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    for b, (got, twin) in enumerate(zip(array.unfuse(), twins)):
        twin.compile(keras.optimizers.SGD(RATES[b]), loss="mse")
        twin.fit(x[:, b], y[:, b], batch_size=4, epochs=2, shuffle=False,
                 verbose=0)
        for g, w in zip(got.get_weights(), twin.get_weights()):
            assert_close(g, w, err_msg=f"model {b}")


def test_fuse_models_takes_one_vocabulary_and_refuses_two():
    first, same, other = (integer_model(v) for v in (
        [3, 5, 7], [3, 5, 7], [3, 5, 9]))
    x = np.array([[3, 5], [7, 9], [11, 3]])
    array = hftatf.fuse_models([first, same])
    assert_close(array.predict(x, verbose=0)[:, 1],
                 same.predict(x, verbose=0))
    with pytest.raises(ValueError, match=(
            r"model 1 .*IntegerLookup.*vocabulary learned in `adapt`")):
        hftatf.fuse_models([first, other])


def test_text_padded_per_batch_on_inputs_of_each_models_own_is_refused():
    import tensorflow as tf

    words = keras.layers.TextVectorization(max_tokens=10, name="words")
    words.adapt(tf.constant(["a b c", "d e"]))
    text = keras.Input((1,), dtype="string")
    model = keras.Model(text, keras.layers.Dense(1)(
        keras.layers.Embedding(10, 2)(words(text))))
    with pytest.raises(ValueError, match=(
            r"'words'.*pads each batch.*`output_sequence_length`")):
        hftatf.fuse(model, 2, shared_inputs=False)
    # On the input all models share it runs once, as in the stock model.
    array = hftatf.fuse(model, 2)
    texts = tf.constant([["a b"], ["c d e zz"]])
    twins = array.unfuse()
    predictions = array.predict(texts, verbose=0)
    for b, twin in enumerate(twins):
        assert_close(predictions[:, b], twin.predict(texts, verbose=0))
