"""Fused attention layers against their oracles: B stock
`keras.layers.MultiHeadAttention` (or `GroupQueryAttention`) layers.

Every test builds B stock layers with random weights (biases included),
stacks the same weights into one fused layer, and compares what model `b`
computes on `query[:, b]`, `value[:, b]`, ... with what stock layer `b`
computes on them: outputs, attention scores, input and weight gradients.
"""

import keras
import numpy as np
import pytest
from testing import (
    assert_close,
    compare_layer_with_stock,
    randomize_weights,
    stacked_weights,
)

import hftatf
from hftatf.core import compat
from hftatf.layers import (
    FusedEmbedding,
    FusedGroupQueryAttention,
    FusedMultiHeadAttention,
    dense,
    resolve,
)

BATCH = 3
FUSED_FORMS = {keras.layers.MultiHeadAttention: FusedMultiHeadAttention,
               keras.layers.GroupQueryAttention: FusedGroupQueryAttention}


class Keywords:
    """Calls `layer` with its inputs by keyword: `Keywords(layer, ["query",
    "value", "attention_mask"])(q, v, m)` is `layer(query=q, value=v,
    attention_mask=m)`; everything else is the layer's (weights, ...)."""

    def __init__(self, layer, names):
        self.layer = layer
        self.names = names

    def __call__(self, *inputs, **kwargs):
        return self.layer(**dict(zip(self.names, inputs)), **kwargs)

    def __getattr__(self, name):
        return getattr(self.layer, name)


def stock_and_fused(num_models, rng, query_shape, value_shape,
                    key_shape=None, stock_class=keras.layers.MultiHeadAttention,
                    **kwargs):
    """B built stock layers with random weights, and their fused twin.

    Shapes are per model, without the batch axis. Weights are scaled so
    the softmax is not saturated and its gradients are not negligible.
    """
    def shape(s, *lead):
        return None if s is None else (*lead, *s)

    stock = []
    for _ in range(num_models):
        layer = stock_class(**kwargs)
        layer.build(shape(query_shape, BATCH), shape(value_shape, BATCH),
                    shape(key_shape, BATCH))
        randomize_weights(layer, rng, scale=0.5)
        stock.append(layer)
    fused = FUSED_FORMS[stock_class](num_models, **kwargs)
    fused.build(shape(query_shape, BATCH, num_models),
                shape(value_shape, BATCH, num_models),
                shape(key_shape, BATCH, num_models))
    fused.set_weights(stacked_weights(stock))
    return stock, fused


@pytest.fixture(params=["size-rule", "models-first"])
def product_rule(request, monkeypatch):
    """The projections' formulation: chosen by their sizes (for these small
    layers, a broadcasting matmul, so attention folds the batch first), or
    forced to the models-first products that larger layers take (attention
    then folds the models first)."""
    if request.param == "models-first":
        monkeypatch.setattr(
            dense, "products_models_first",
            lambda input_shape, num_models, *args: num_models > 1)
    return request.param


def random(rng, *shape):
    return rng.standard_normal(shape).astype("float32")


def random_mask(rng, *shape):
    return rng.random(shape) > 0.3


# MultiHeadAttention: (call inputs by name, per-model shapes, layer kwargs,
# call kwargs). Shapes: query (T=4, E=5), value (S=6, 7), key (S=6, 3).
MHA_CASES = {
    "self": (["query", "value"], [(4, 5), (4, 5)], {}, {}),
    "cross": (["query", "value"], [(4, 5), (6, 7)], {}, {}),
    "key": (["query", "value", "key"], [(4, 5), (6, 7), (6, 3)], {}, {}),
    "causal_self": (["query", "value"], [(4, 5), (4, 5)], {},
                    {"use_causal_mask": True}),
    "causal_cross": (["query", "value"], [(4, 5), (6, 7)], {},
                     {"use_causal_mask": True}),
    "scores": (["query", "value"], [(4, 5), (6, 7)], {},
               {"return_attention_scores": True}),
    "scores_causal": (["query", "value", "key"], [(4, 5), (6, 7), (6, 3)],
                      {}, {"return_attention_scores": True,
                           "use_causal_mask": True}),
    "attention_mask": (["query", "value", "attention_mask"],
                       [(4, 5), (6, 7), "mask"], {}, {}),
    "attention_mask_per_head": (["query", "value", "attention_mask"],
                                [(4, 5), (6, 7), "head_mask"], {}, {}),
    "attention_mask_causal": (["query", "value", "attention_mask"],
                              [(4, 5), (6, 7), "mask"], {},
                              {"use_causal_mask": True}),
    "attention_mask_scores": (["query", "value", "attention_mask"],
                              [(4, 5), (6, 7), "mask"], {},
                              {"return_attention_scores": True}),
    "input_masks": (["query", "value", "key", "value_mask", "key_mask"],
                    [(4, 5), (6, 7), (6, 3), "value_mask", "value_mask"], {},
                    {}),
    "input_masks_scores": (["query", "value", "value_mask"],
                           [(4, 5), (6, 7), "value_mask"], {},
                           {"return_attention_scores": True}),
    "two_attention_axes": (["query", "value"], [(3, 2, 5), (3, 2, 5)],
                           {"attention_axes": (1, 2)},
                           {"return_attention_scores": True}),
    "two_attention_axes_mask": (["query", "value", "attention_mask"],
                                [(3, 2, 5), (3, 2, 5), "mask"],
                                {"attention_axes": (1, 2)}, {}),
    "inner_attention_axis": (["query", "value"], [(3, 2, 5), (3, 4, 5)],
                             {"attention_axes": (2,)},
                             {"return_attention_scores": True}),
    "negative_attention_axis": (["query", "value"], [(3, 2, 5), (3, 4, 5)],
                                {"attention_axes": -2}, {}),
    "options": (["query", "value"], [(4, 5), (6, 7)],
                {"value_dim": 2, "use_bias": False, "output_shape": (2, 3)},
                {}),
    "gate_sliding_window": (["query", "value"], [(4, 5), (6, 7)],
                            {"use_gate": True, "sliding_window": 2}, {}),
    "dropout_inference": (["query", "value"], [(4, 5), (6, 7)],
                          {"dropout": 0.5}, {"training": False}),
}


def case_inputs(rng, num_models, names, shapes, attention_axes=1):
    """Fused inputs `[batch, B, ...]` for the named call arguments; masks
    are boolean `[batch, B, T, S]` (attention), `[batch, B, 2, T, S]`
    (attention per head), `[batch, B, T]` (query) or `[batch, B, S]`
    (value, key)."""
    query, value = shapes[0], shapes[1]
    inputs = []
    for shape in shapes:
        if shape == "head_mask":
            inputs.append(random_mask(rng, BATCH, num_models, 2, *query[:-1],
                                      *value[:-1]))
        elif shape == "mask":
            inputs.append(random_mask(rng, BATCH, num_models, *query[:-1],
                                      *value[:-1][-attention_axes:]))
        elif shape in ("query_mask", "value_mask"):
            mask = random_mask(rng, BATCH, num_models,
                               *(query if shape == "query_mask" else value)[
                                   :-1])
            mask[..., 0] = True
            inputs.append(mask)
        else:
            inputs.append(random(rng, BATCH, num_models, *shape))
    return inputs


# Stock Keras on JAX refuses a `value_dim` other than `key_dim` where it
# calls `dot_product_attention` ("cannot reshape"): no oracle there.
VALUE_DIM_ON_TF = pytest.mark.backends(
    "tensorflow", reason="stock `MultiHeadAttention` on JAX fails on a "
    "`value_dim` other than `key_dim`")


@pytest.mark.parametrize("case", [
    pytest.param(case, marks=VALUE_DIM_ON_TF) if case == "options" else case
    for case in MHA_CASES])
def test_matches_stock_multi_head_attention(case, product_rule):
    names, shapes, kwargs, call_kwargs = MHA_CASES[case]
    rng = np.random.default_rng(0)
    kwargs = {"num_heads": 2, "key_dim": 3, **kwargs}
    layer_shapes = [s for s in shapes if isinstance(s, tuple)]
    stock, fused = stock_and_fused(2, rng, *layer_shapes, **kwargs)
    assert [tuple(w.shape) for w in fused.weights] == [
        (2, *w.shape) for w in stock[0].weights]
    axes = len(kwargs.get("attention_axes", (1,))) if isinstance(
        kwargs.get("attention_axes", (1,)), tuple) else 1
    inputs = case_inputs(rng, 2, names, shapes, axes)
    call_kwargs = dict(call_kwargs)
    training = call_kwargs.pop("training", None)
    compare_layer_with_stock(
        [Keywords(layer, names) for layer in stock], Keywords(fused, names),
        inputs, rng, training=training, **call_kwargs)


@pytest.mark.parametrize("num_models", [1, 3])
def test_matches_stock_with_one_and_three_models(num_models, product_rule):
    rng = np.random.default_rng(1)
    stock, fused = stock_and_fused(num_models, rng, (4, 5), (6, 7),
                                   num_heads=2, key_dim=3)
    inputs = [random(rng, BATCH, num_models, 4, 5),
              random(rng, BATCH, num_models, 6, 7)]
    compare_layer_with_stock(stock, fused, inputs, rng,
                             return_attention_scores=True)


def test_shared_attention_mask_of_the_stock_shape(product_rule):
    # A [batch, T, S] mask is the stock shape: every model gets all of it.
    rng = np.random.default_rng(2)
    stock, fused = stock_and_fused(2, rng, (4, 5), (6, 7), num_heads=2,
                                   key_dim=3)
    names = ["query", "value", "attention_mask"]
    inputs = [random(rng, BATCH, 2, 4, 5), random(rng, BATCH, 2, 6, 7),
              random_mask(rng, BATCH, 4, 6)]
    compare_layer_with_stock(
        [Keywords(layer, names) for layer in stock], Keywords(fused, names),
        inputs, rng, shared=[False, False, True],
        return_attention_scores=True, use_causal_mask=True)


@pytest.mark.backends("tensorflow", reason="XLA by `tf.function`; JAX "
                      "compiles every op (test_stateless_jit.py: `jax.jit`)")
def test_matches_stock_under_xla():
    import tensorflow as tf

    rng = np.random.default_rng(3)
    stock, fused = stock_and_fused(2, rng, (4, 5), (6, 7), num_heads=2,
                                   key_dim=3)
    q, v = random(rng, BATCH, 2, 4, 5), random(rng, BATCH, 2, 6, 7)
    mask = random_mask(rng, BATCH, 2, 4, 6)

    @tf.function(jit_compile=True)
    def call(q, v, mask):
        return fused(q, v, attention_mask=mask, use_causal_mask=True)

    y = np.asarray(call(q, v, mask))
    for b in range(2):
        assert_close(y[:, b], stock[b](q[:, b], v[:, b],
                                       attention_mask=mask[:, b],
                                       use_causal_mask=True))


def test_symbolic_output_shapes():
    fused = FusedMultiHeadAttention(2, num_heads=3, key_dim=4,
                                    attention_axes=(2,))
    q, v = keras.Input((2, 5, 4, 7)), keras.Input((2, 5, 6, 8))
    y, scores = fused(q, v, return_attention_scores=True)
    assert tuple(y.shape) == (None, 2, 5, 4, 7)
    assert tuple(scores.shape) == (None, 2, 5, 3, 4, 6)
    rng = np.random.default_rng(4)
    y, scores = fused(random(rng, 1, 2, 5, 4, 7), random(rng, 1, 2, 5, 6, 8),
                      return_attention_scores=True)
    assert tuple(scores.shape) == (1, 2, 5, 3, 4, 6)


# Keras masks from the inputs, and propagated to the output.


@pytest.mark.parametrize("cross", [False, True], ids=["self", "cross"])
def test_keras_masks_from_embeddings_match_stock(cross):
    rng = np.random.default_rng(5)
    stock, fused = stock_and_fused(2, rng, (5, 4), (6, 4), num_heads=2,
                                   key_dim=3)
    embedding = FusedEmbedding(2, 5, 4, mask_zero=True)
    embedding.build()
    ids_q = rng.integers(0, 5, (BATCH, 2, 5)).astype("int32")
    ids_v = rng.integers(0, 5, (BATCH, 2, 6)).astype("int32")
    ids_q[:, :, 0] = ids_v[:, :, 0] = 1  # No row entirely masked.
    q = embedding(ids_q)
    v = embedding(ids_v) if cross else q
    y = fused(q, v)
    np.testing.assert_array_equal(compat.get_keras_mask(y), ids_q != 0)
    for b, layer in enumerate(stock):
        stock_embedding = keras.layers.Embedding(5, 4, mask_zero=True)
        stock_embedding.build()
        stock_embedding.set_weights(embedding.get_model_weights(b))
        q_b = stock_embedding(ids_q[:, b])
        v_b = stock_embedding(ids_v[:, b]) if cross else q_b
        y_b = layer(q_b, v_b)
        assert_close(y[:, b], y_b, err_msg=f"model {b}")
        np.testing.assert_array_equal(compat.get_keras_mask(y)[:, b],
                                      compat.get_keras_mask(y_b))


def text_model(vocabulary=10, length=6, dim=8):
    # The session is cleared so that both models' automatically named mask
    # operations get the same names (hftatf.fuse_models compares them).
    keras.backend.clear_session()
    ids = keras.Input((length,), dtype="int32")
    x = keras.layers.Embedding(vocabulary, dim, mask_zero=True)(ids)
    x = keras.layers.MultiHeadAttention(2, 4, dropout=0.1)(x, x)
    x = keras.layers.GlobalAveragePooling1D()(x)
    return keras.Model(ids, keras.layers.Dense(3)(x))


def padded_ids(rng, batch=5, vocabulary=10, length=6):
    ids = rng.integers(1, vocabulary, (batch, length)).astype("int32")
    for row, size in enumerate(rng.integers(1, length + 1, batch)):
        ids[row, size:] = 0
    return ids


def test_fuse_models_text_model_outputs_equal_each_model():
    rng = np.random.default_rng(6)
    models = [text_model() for _ in range(2)]
    for model in models:
        for layer in model.layers:
            if layer.weights:
                randomize_weights(layer, rng, scale=0.5)
    array = hftatf.fuse_models(models)
    assert type(array.get_layer(models[0].layers[2].name)) is (
        FusedMultiHeadAttention)
    ids = padded_ids(rng)
    outputs = np.asarray(array(ids))
    for b, model in enumerate(models):
        assert_close(outputs[:, b], model(ids), err_msg=f"model {b}")


def test_fuse_models_text_models_built_in_one_session():
    keras.backend.clear_session()

    def model():
        ids = keras.Input((6,), dtype="int32")
        x = keras.layers.Embedding(10, 8, mask_zero=True)(ids)
        x = keras.layers.MultiHeadAttention(2, 4)(x, x)
        x = keras.layers.GlobalAveragePooling1D()(x)
        return keras.Model(ids, keras.layers.Dense(3)(x))

    hftatf.fuse_models([model(), model()])


def test_fuse_builds_attention_from_fused_shapes():
    array = hftatf.fuse(text_model(), 3)
    layer = next(la for la in array.layers
                 if isinstance(la, FusedMultiHeadAttention))
    assert [tuple(w.shape) for w in layer.weights][:2] == [
        (3, 8, 2, 4), (3, 2, 4)]
    rng = np.random.default_rng(7)
    assert array.predict(padded_ids(rng), verbose=0).shape == (5, 3, 3)


# Dropout on the attention probabilities, one mask per model.


def dropout_probe(num_models, rate, heads=2, length=4, features=5):
    """A fused layer whose output is its dropped attention probabilities:
    value inputs are one-hot positions, the value and output projections
    identities, so output `[n, b, t, h * length + s]` is the probability of
    `t` attending to `s` in head `h` after dropout. All models share the
    weights, so only their dropout masks differ."""
    kwargs = {"num_heads": heads, "key_dim": 3, "value_dim": length,
              "dropout": rate, "output_shape": heads * length}
    stock = keras.layers.MultiHeadAttention(**kwargs)
    stock.build((None, length, features), (None, length, length))
    rng = np.random.default_rng(8)
    weights = [random(rng, *w.shape) for w in stock.get_weights()]
    names = [w.path.split("/", 1)[1] for w in stock.weights]
    identity = np.eye(length, dtype="float32")
    weights[names.index("value/kernel")] = np.repeat(
        identity[:, None], heads, axis=1)
    weights[names.index("attention_output/kernel")] = np.eye(
        heads * length, dtype="float32").reshape(heads, length, -1)
    for name in ("value/bias", "attention_output/bias"):
        weights[names.index(name)] *= 0.0
    stock.set_weights(weights)
    fused = FusedMultiHeadAttention(num_models, **kwargs)
    fused.build((None, num_models, length, features),
                (None, num_models, length, length))
    fused.set_weights([np.stack([w] * num_models) for w in weights])
    query = random(rng, 32, length, features)
    value = np.broadcast_to(identity, (32, length, length))
    return stock, fused, query, value


def test_dropout_draws_an_independent_mask_per_model():
    num_models, rate = 3, 0.3
    stock, fused, query, value = dropout_probe(num_models, rate)
    tile = (1, num_models, 1, 1)
    y = np.asarray(fused(np.tile(query[:, None], tile),
                         np.tile(value[:, None], tile), training=True))
    probabilities = np.asarray(stock(query, value, training=False))
    dropped = y == 0.0
    assert not (probabilities == 0.0).any()
    size = dropped[:, 0].size
    for b in range(num_models):
        # Kept probabilities are scaled by 1 / (1 - rate), as in the stock
        # layer.
        kept = ~dropped[:, b]
        assert_close(y[:, b][kept], probabilities[kept] / (1.0 - rate))
        # Each model drops about `rate` of its probabilities: 4 standard
        # deviations of a binomial fraction.
        fraction = dropped[:, b].mean()
        assert abs(fraction - rate) < 4 * np.sqrt(rate * (1 - rate) / size)
        for other in range(b):
            assert (dropped[:, b] != dropped[:, other]).any()
            # Independent masks: both drop a position with rate ** 2.
            both = (dropped[:, b] & dropped[:, other]).mean()
            p = rate ** 2
            assert abs(both - p) < 4 * np.sqrt(p * (1 - p) / size), (
                b, other, both)


def test_dropout_inference_is_deterministic():
    stock, fused, query, value = dropout_probe(2, 0.5)
    tile = (1, 2, 1, 1)
    q, v = np.tile(query[:, None], tile), np.tile(value[:, None], tile)
    first = np.asarray(fused(q, v, training=False))
    np.testing.assert_array_equal(first, np.asarray(fused(q, v)))
    for b in range(2):
        assert_close(first[:, b], stock(query, value))


# Weights: order, names, initialisation, regularization.


def test_weight_order_and_names_follow_stock():
    kwargs = {"num_heads": 2, "key_dim": 3, "use_gate": True}
    stock = keras.layers.MultiHeadAttention(name="mha", **kwargs)
    stock.build((None, 4, 5), (None, 6, 7))
    fused = FusedMultiHeadAttention(2, name="mha", **kwargs)
    fused.build((None, 2, 4, 5), (None, 2, 6, 7))
    assert [w.path for w in fused.weights] == [w.path for w in stock.weights]
    assert fused.query_dense is fused._query_dense
    assert isinstance(fused.output_dense, hftatf.layers.FusedEinsumDense)


def test_seeded_slices_equal_stock_layers_seeded_per_model():
    def build(layer, *shapes):
        layer.build(*shapes)
        return layer

    fused = build(FusedMultiHeadAttention(
        3, num_heads=2, key_dim=3,
        kernel_initializer=keras.initializers.GlorotUniform(seed=5),
        bias_initializer=keras.initializers.RandomNormal(seed=9)),
        (None, 3, 4, 5), (None, 3, 6, 7))
    for b in range(3):
        stock = build(keras.layers.MultiHeadAttention(
            num_heads=2, key_dim=3,
            kernel_initializer=keras.initializers.GlorotUniform(seed=5 + b),
            bias_initializer=keras.initializers.RandomNormal(seed=9 + b)),
            (None, 4, 5), (None, 6, 7))
        for got, expected, weight in zip(fused.get_model_weights(b),
                                         stock.get_weights(), stock.weights):
            assert_close(got, expected, atol=0, rtol=0,
                         err_msg=f"{weight.path}, model {b}")


def test_regularizers_give_per_model_losses():
    rng = np.random.default_rng(9)
    kwargs = {"num_heads": 2, "key_dim": 3,
              "kernel_regularizer": keras.regularizers.L2(0.01),
              "bias_regularizer": keras.regularizers.L1(0.02),
              "activity_regularizer": keras.regularizers.L2(0.03)}
    stock, fused = stock_and_fused(3, rng, (4, 5), (6, 7), **kwargs)
    q, v = random(rng, BATCH, 3, 4, 5), random(rng, BATCH, 3, 6, 7)
    fused(q, v)
    losses = np.stack([np.asarray(loss) for loss in fused.losses])
    assert losses.shape == (12, 3)
    for b, layer in enumerate(stock):
        layer(q[:, b], v[:, b])
        assert len(layer.losses) == 12
        assert_close(np.sort(losses[:, b]),
                     np.sort([np.asarray(loss) for loss in layer.losses]),
                     err_msg=f"model {b}")


# Serialization and the registry.


def configured_layer():
    return FusedMultiHeadAttention(
        3, num_heads=2, key_dim=3, value_dim=4, dropout=0.1, use_bias=True,
        output_shape=(6,), attention_axes=(1,), sliding_window=3,
        kernel_initializer=keras.initializers.HeNormal(seed=3),
        bias_initializer="ones",
        kernel_regularizer=keras.regularizers.L2(0.01),
        bias_regularizer=keras.regularizers.L1(0.02),
        activity_regularizer=keras.regularizers.L1(0.03),
        kernel_constraint=keras.constraints.MaxNorm(2.0, axis=0),
        bias_constraint=keras.constraints.NonNeg(),
        use_gate=True, seed=4, name="fused_mha_under_test",
    )


def test_config_round_trip():
    layer = configured_layer()
    config = layer.get_config()
    assert config["num_models"] == 3
    clone = FusedMultiHeadAttention.from_config(config)
    assert clone.get_config() == config
    restored = keras.saving.deserialize_keras_object(
        keras.saving.serialize_keras_object(layer))
    assert type(restored) is FusedMultiHeadAttention
    assert restored.get_config() == config
    rng = np.random.default_rng(10)
    q, v = random(rng, BATCH, 3, 4, 5), random(rng, BATCH, 3, 6, 7)
    layer(q, v)
    clone(q, v)
    clone.set_weights(layer.get_weights())
    assert_close(clone(q, v), layer(q, v))


def test_config_matches_stock_config():
    stock = keras.layers.MultiHeadAttention(
        num_heads=2, key_dim=3, attention_axes=-2, name="mha")
    stock.build((None, 4, 3, 5), (None, 4, 3, 5))
    fused = resolve.fuse_layer(stock, 2)
    assert type(fused) is FusedMultiHeadAttention
    fused.build((None, 2, 4, 3, 5), (None, 2, 4, 3, 5))
    config = fused.get_config()
    assert config.pop("num_models") == 2
    assert config == stock.get_config()


def test_saved_model_file_round_trip(tmp_path):
    rng = np.random.default_rng(11)
    q = keras.Input((2, 4, 5))
    v = keras.Input((2, 6, 7))
    y = FusedMultiHeadAttention(2, num_heads=2, key_dim=3)(q, v)
    model = keras.Model([q, v], y)
    for w in model.weights:
        w.assign(random(rng, *w.shape))
    path = tmp_path / "fused_mha.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    x = [random(rng, BATCH, 2, 4, 5), random(rng, BATCH, 2, 6, 7)]
    np.testing.assert_array_equal(loaded(x), model(x))


# Bad input.


@pytest.mark.parametrize("shape", [(BATCH, 6), (BATCH, 3, 4, 6),
                                   (BATCH, 2, 2, 2, 4, 6)])
def test_rejects_attention_mask_of_wrong_shape(shape):
    rng = np.random.default_rng(12)
    _, fused = stock_and_fused(2, rng, (4, 5), (6, 7), num_heads=2,
                               key_dim=3)
    with pytest.raises(ValueError, match="attention_mask"):
        fused(random(rng, BATCH, 2, 4, 5), random(rng, BATCH, 2, 6, 7),
              attention_mask=np.ones(shape, bool))


def test_rejects_wrong_model_axis():
    layer = FusedMultiHeadAttention(3, num_heads=2, key_dim=3)
    with pytest.raises(ValueError, match="num_models=3 on axis 1"):
        layer(np.zeros((BATCH, 2, 4, 5), "float32"),
              np.zeros((BATCH, 2, 4, 5), "float32"))


@pytest.mark.parametrize("kwargs,match", [
    ({"num_heads": 0}, "num_heads"), ({"key_dim": 2.0}, "key_dim"),
    ({"value_dim": -1}, "value_dim"), ({"sliding_window": 0},
                                       "sliding_window"),
    ({"attention_axes": "1"}, "attention_axes"),
    ({"flash_attention": True, "dropout": 0.1}, "flash attention"),
])
def test_rejects_bad_arguments_like_stock(kwargs, match):
    kwargs = {"num_heads": 2, "key_dim": 3, **kwargs}
    with pytest.raises(ValueError, match=match):
        keras.layers.MultiHeadAttention(**kwargs)
    with pytest.raises(ValueError, match=match):
        FusedMultiHeadAttention(2, **kwargs)


# GroupQueryAttention.

GQA_CASES = {
    "self": (["query", "value"], [(4, 5), (4, 5)], {}, {}),
    "cross": (["query", "value"], [(4, 5), (6, 5)], {}, {}),
    "key": (["query", "value", "key"], [(4, 5), (6, 5), (6, 3)], {}, {}),
    "one_kv_head_scores": (["query", "value"], [(4, 5), (6, 5)],
                           {"num_key_value_heads": 1},
                           {"return_attention_scores": True}),
    "causal": (["query", "value"], [(4, 5), (4, 5)], {},
               {"use_causal_mask": True}),
    "attention_mask_scores": (["query", "value", "attention_mask"],
                              [(4, 5), (6, 5), "mask"], {},
                              {"return_attention_scores": True}),
    "input_masks": (["query", "value", "query_mask", "value_mask"],
                    [(4, 5), (6, 5), "query_mask", "value_mask"], {}, {}),
    "gate_no_bias_window": (["query", "value"], [(4, 5), (6, 5)],
                            {"use_gate": True, "use_bias": False,
                             "sliding_window": 2}, {}),
    "dropout_inference": (["query", "value"], [(4, 5), (6, 5)],
                          {"dropout": 0.5}, {"training": False}),
}


@pytest.mark.parametrize("case", list(GQA_CASES))
def test_matches_stock_group_query_attention(case, product_rule):
    names, shapes, kwargs, call_kwargs = GQA_CASES[case]
    rng = np.random.default_rng(13)
    kwargs = {"head_dim": 3, "num_query_heads": 4, "num_key_value_heads": 2,
              **kwargs}
    layer_shapes = [s for s in shapes if isinstance(s, tuple)]
    stock, fused = stock_and_fused(
        2, rng, *layer_shapes, stock_class=keras.layers.GroupQueryAttention,
        **kwargs)
    assert [tuple(w.shape) for w in fused.weights] == [
        (2, *w.shape) for w in stock[0].weights]
    inputs = case_inputs(rng, 2, names, shapes)
    call_kwargs = dict(call_kwargs)
    training = call_kwargs.pop("training", None)
    compare_layer_with_stock(
        [Keywords(layer, names) for layer in stock], Keywords(fused, names),
        inputs, rng, training=training, **call_kwargs)


def test_group_query_attention_activity_regularizer_matches_stock():
    rng = np.random.default_rng(14)
    kwargs = {"head_dim": 3, "num_query_heads": 4, "num_key_value_heads": 2,
              "activity_regularizer": keras.regularizers.L2(0.03)}
    stock, fused = stock_and_fused(
        3, rng, (4, 5), (6, 5), stock_class=keras.layers.GroupQueryAttention,
        **kwargs)
    q, v = random(rng, BATCH, 3, 4, 5), random(rng, BATCH, 3, 6, 5)
    fused(q, v)
    losses = np.stack([np.asarray(loss) for loss in fused.losses])
    for b, layer in enumerate(stock):
        layer(q[:, b], v[:, b])
        assert len(layer.losses) == len(losses)
        assert_close(np.sort(losses[:, b]),
                     np.sort([np.asarray(loss) for loss in layer.losses]),
                     err_msg=f"model {b}")


def test_group_query_attention_config_round_trip():
    stock = keras.layers.GroupQueryAttention(
        head_dim=3, num_query_heads=4, num_key_value_heads=2, dropout=0.1,
        use_gate=True, sliding_window=2, seed=3, name="gqa",
        kernel_regularizer=keras.regularizers.L2(0.01))
    fused = resolve.fuse_layer(stock, 2)
    assert type(fused) is FusedGroupQueryAttention
    config = fused.get_config()
    assert config.pop("num_models") == 2
    assert config == stock.get_config()
    restored = keras.saving.deserialize_keras_object(
        keras.saving.serialize_keras_object(fused))
    assert restored.get_config() == fused.get_config()


def test_group_query_attention_rejects_indivisible_heads():
    with pytest.raises(ValueError, match="divisible"):
        FusedGroupQueryAttention(2, head_dim=3, num_query_heads=4,
                                   num_key_value_heads=3)


# Attention and AdditiveAttention: [query, value(, key)] lists.


class Listed:
    """Calls `layer` with its first `count` inputs as a list and the rest
    (if any) as the list of masks; everything else is the layer's."""

    def __init__(self, layer, count):
        self.layer = layer
        self.count = count

    def __call__(self, *inputs, **kwargs):
        masks = list(inputs[self.count:]) or None
        return self.layer(list(inputs[:self.count]), mask=masks, **kwargs)

    def __getattr__(self, name):
        return getattr(self.layer, name)


DOT_CASES = {
    "dot": ({}, 2, False, {}),
    "dot_scale_key": ({"use_scale": True}, 3, False, {}),
    "concat_scores": ({"score_mode": "concat"}, 2, False,
                      {"return_attention_scores": True}),
    "concat_scale_masks": ({"score_mode": "concat", "use_scale": True}, 2,
                           True, {}),
    "masks_causal_scores": ({"use_scale": True}, 3, True,
                            {"use_causal_mask": True,
                             "return_attention_scores": True}),
    "dropout_inference": ({"dropout": 0.5}, 2, False, {"training": False}),
    "additive": ({}, 2, False, {"return_attention_scores": True}),
    "additive_no_scale_masks_causal": ({"use_scale": False}, 3, True,
                                       {"use_causal_mask": True}),
}


@pytest.mark.parametrize("case", list(DOT_CASES))
def test_matches_stock_attention(case):
    kwargs, count, masked, call_kwargs = DOT_CASES[case]
    call_kwargs = dict(call_kwargs)
    training = call_kwargs.pop("training", None)
    stock_class, fused_class = (
        (keras.layers.AdditiveAttention, hftatf.layers.FusedAdditiveAttention)
        if case.startswith("additive") else
        (keras.layers.Attention, hftatf.layers.FusedAttention))
    rng = np.random.default_rng(15)
    shapes = [(4, 3), (6, 3), (6, 3)][:count]
    stock = []
    for _ in range(2):
        layer = stock_class(**kwargs)
        layer.build([(BATCH, *s) for s in shapes])
        randomize_weights(layer, rng)
        stock.append(layer)
    fused = fused_class(2, **kwargs)
    fused.build([(BATCH, 2, *s) for s in shapes])
    fused.set_weights(stacked_weights(stock))
    assert [tuple(w.shape) for w in fused.weights] == [
        (2, *w.shape) for w in stock[0].weights]
    inputs = [random(rng, BATCH, 2, *s) for s in shapes]
    if masked:
        masks = [random_mask(rng, BATCH, 2, 4), random_mask(rng, BATCH, 2, 6)]
        masks[1][..., 0] = True
        inputs += masks
    compare_layer_with_stock(
        [Listed(layer, count) for layer in stock], Listed(fused, count),
        inputs, rng, training=training, **call_kwargs)


def test_attention_dropout_differs_per_model():
    fused = hftatf.layers.FusedAttention(2, dropout=0.5)
    rng = np.random.default_rng(16)
    q = np.repeat(random(rng, 8, 1, 4, 3), 2, axis=1)
    _, scores = fused([q, q], training=True, return_attention_scores=True)
    dropped = np.asarray(scores) == 0.0
    assert dropped.any()
    assert (dropped[:, 0] != dropped[:, 1]).any()


@pytest.mark.parametrize("stock_class", [keras.layers.Attention,
                                         keras.layers.AdditiveAttention])
def test_attention_config_round_trip(stock_class):
    stock = stock_class(use_scale=True, dropout=0.1, seed=3, name="att")
    fused = resolve.fuse_layer(stock, 2)
    assert type(fused).__name__ == "Fused" + stock_class.__name__
    config = fused.get_config()
    assert config.pop("num_models") == 2
    assert config == {**stock.get_config(), "activity_regularizer": None}
    restored = keras.saving.deserialize_keras_object(
        keras.saving.serialize_keras_object(fused))
    assert restored.get_config() == fused.get_config()


def test_attention_keras_masks_propagate_like_stock():
    rng = np.random.default_rng(17)
    embedding = FusedEmbedding(2, 5, 3, mask_zero=True)
    ids = rng.integers(0, 5, (BATCH, 2, 4)).astype("int32")
    ids[:, :, 0] = 1
    x = embedding(ids)
    y = hftatf.layers.FusedAttention(2)([x, x])
    np.testing.assert_array_equal(compat.get_keras_mask(y), ids != 0)
    for b in range(2):
        stock_embedding = keras.layers.Embedding(5, 3, mask_zero=True)
        stock_embedding.build()
        stock_embedding.set_weights(embedding.get_model_weights(b))
        x_b = stock_embedding(ids[:, b])
        assert_close(y[:, b], keras.layers.Attention()([x_b, x_b]))
