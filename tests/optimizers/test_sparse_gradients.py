"""Sparse gradients (an embedding table's) against stock Keras.

A stock `Embedding`'s gradient is a `tf.IndexedSlices`, one row per id
looked up, and stock optimizers apply their element-wise operations to each
occurrence (Adam squares each one before a repeated row's are summed). The
oracle: B stock layers trained with B stock optimizers on batches that
repeat ids, against one `FusedEmbedding` trained with one fused optimizer.
"""

import keras
import numpy as np
import pytest
from testing import assert_close, stock_and_fused_embeddings

import hftatf
from hftatf import optimizers

pytestmark = pytest.mark.backends(
    "tensorflow", reason="sparse gradients (tf.IndexedSlices) are "
    "TensorFlow's: stock Keras on JAX, and the array with it, applies an "
    "embedding table's gradient dense, as any other")
tf = pytest.importorskip("tensorflow")

B = 3
VOCAB = 6
DIM = 4
RATES = [0.05, 0.02, 0.1]


def layers(rng, **kwargs):
    return stock_and_fused_embeddings(B, VOCAB, DIM, rng, **kwargs)


def batches(rng, steps):
    """Ids `[4, B, 5]` drawn from 3 of the 6 rows (each batch repeats ids and
    leaves rows out), and targets."""
    return [(rng.integers(0, 3, (4, B, 5)).astype("int32"),
             rng.standard_normal((4, B, 5, DIM)).astype("float32"))
            for _ in range(steps)]


def gradient(layer, ids, target):
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum((layer(ids) - target) ** 2)
    return tape.gradient(loss, layer.trainable_weights)


def train_both(name, kwargs, stock_kwargs=None, steps=3, seed=0,
               layer_kwargs=None, masks=None):
    """Trains stock layer b with `keras.optimizers.<name>(RATES[b],
    **stock_kwargs)` and the fused layer with the fused optimizer (per-model
    `RATES`, `**kwargs`); returns the stock layers and the fused one. Where
    `masks` (one `[B]` bool list per step) leaves a model out of a step,
    its stock layer skips that step."""
    rng = np.random.default_rng(seed)
    stock, fused = layers(rng, **(layer_kwargs or {}))
    data = batches(rng, steps)
    fused_optimizer = getattr(optimizers, name)(RATES, **kwargs)
    for step, (ids, target) in enumerate(data):
        grads = gradient(fused, ids, target)
        if layer_kwargs is None:
            assert isinstance(grads[0], tf.IndexedSlices)
        fused_optimizer.apply(grads, fused.trainable_weights,
                              model_mask=None if masks is None
                              else masks[step])
    for b, layer in enumerate(stock):
        optimizer = getattr(keras.optimizers, name)(
            RATES[b], **(kwargs if stock_kwargs is None else stock_kwargs))
        for step, (ids, target) in enumerate(data):
            if masks is not None and not masks[step][b]:
                continue
            grads = gradient(layer, ids[:, b], target[:, b])
            if layer_kwargs is None:
                assert isinstance(grads[0], tf.IndexedSlices)
            optimizer.apply(grads, layer.trainable_weights)
    return stock, fused


def assert_trained_alike(stock, fused, atol=1e-5):
    for b, layer in enumerate(stock):
        assert_close(fused.get_model_weights(b)[0], layer.get_weights()[0],
                     atol=atol, err_msg=f"model {b}")


@pytest.mark.parametrize("name, kwargs", [
    ("SGD", {}),
    ("SGD", {"momentum": 0.9, "nesterov": True}),
    ("Adam", {}),
    ("Adam", {"amsgrad": True}),
    ("AdamW", {"weight_decay": 0.1}),
    ("Adamax", {}),
    ("Nadam", {}),
    ("RMSprop", {}),
    ("RMSprop", {"centered": True, "momentum": 0.5}),
    ("Adagrad", {}),
    ("Adadelta", {}),
    ("Ftrl", {"l2_shrinkage_regularization_strength": 0.01}),
    ("Lion", {}),
    ("Adafactor", {}),
    ("Lamb", {}),
    ("Muon", {}),
])
def test_optimizers_apply_embedding_gradients_as_stock(name, kwargs):
    stock, fused = train_both(name, kwargs)
    assert_trained_alike(stock, fused)


def test_schedule_free_adamw_applies_them_as_stock():
    # Stock ScheduleFreeAdamW's momentum starts at zero outside `fit`;
    # hftatf's at the weights (README, Optimizers). Zero tables make the
    # two starts one.
    rng = np.random.default_rng(3)
    stock, fused = layers(rng)
    for layer in stock:
        layer.set_weights([np.zeros((VOCAB, DIM), "float32")])
    fused.set_weights([np.zeros((B, VOCAB, DIM), "float32")])
    data = batches(rng, 3)
    fused_optimizer = optimizers.ScheduleFreeAdamW(RATES)
    for ids, target in data:
        fused_optimizer.apply(gradient(fused, ids, target),
                              fused.trainable_weights)
    for b, layer in enumerate(stock):
        optimizer = keras.optimizers.ScheduleFreeAdamW(RATES[b])
        for ids, target in data:
            optimizer.apply(gradient(layer, ids[:, b], target[:, b]),
                            layer.trainable_weights)
    assert_trained_alike(stock, fused)


@pytest.mark.parametrize("clipping", [
    {"clipnorm": [0.5, 2.0, 0.0]},
    {"clipvalue": [0.3, 1.0, 0.0]},
    {"global_clipnorm": [0.5, 2.0, 0.0]},
])
def test_clipping_takes_the_occurrences(clipping):
    # Stock clipping of IndexedSlices: norms and values of the occurrences.
    (option, values), = clipping.items()
    rng = np.random.default_rng(1)
    stock, fused = layers(rng)
    data = batches(rng, 2)
    fused_optimizer = optimizers.Adam(RATES, **clipping)
    for ids, target in data:
        fused_optimizer.apply(gradient(fused, ids, target),
                              fused.trainable_weights)
    for b, layer in enumerate(stock):
        optimizer = keras.optimizers.Adam(
            RATES[b], **({option: values[b]} if values[b] else {}))
        for ids, target in data:
            optimizer.apply(gradient(layer, ids[:, b], target[:, b]),
                            layer.trainable_weights)
    assert_trained_alike(stock, fused)


def test_gradient_accumulation_and_moving_averages():
    kwargs = {"gradient_accumulation_steps": 2, "use_ema": True,
              "ema_momentum": 0.9}
    stock, fused = train_both("Adam", kwargs, steps=4)
    assert_trained_alike(stock, fused)


def test_a_step_left_out_leaves_a_model_as_it_was():
    masks = [[True, True, True], [True, False, True], [False, True, True]]
    stock, fused = train_both("Adam", {}, masks=masks)
    assert_trained_alike(stock, fused)


def test_a_regularized_table_has_the_stock_dense_gradient():
    layer_kwargs = {"embeddings_regularizer": keras.regularizers.L2(0.1)}
    rng = np.random.default_rng(2)
    stock, fused = layers(rng, **layer_kwargs)
    ids, target = batches(rng, 1)[0]
    with tf.GradientTape() as tape:
        # (The fused regularizer's loss is `[B]`, one per model.)
        loss = tf.reduce_sum((fused(ids) - target) ** 2) + tf.reduce_sum(
            fused.losses)
    (grad,) = tape.gradient(loss, fused.trainable_weights)
    assert not isinstance(grad, tf.IndexedSlices)
    for b, layer in enumerate(stock):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(
                (layer(ids[:, b]) - target[:, b]) ** 2) + tf.add_n(
                    layer.losses)
        (expected,) = tape.gradient(loss, layer.trainable_weights)
        assert not isinstance(expected, tf.IndexedSlices)
        assert_close(grad[b], expected, err_msg=f"model {b}")


def test_loss_scaling_unscales_each_models_occurrences():
    rng = np.random.default_rng(4)
    stock, fused = layers(rng)
    data = batches(rng, 2)
    fused_optimizer = optimizers.LossScaleOptimizer(
        optimizers.Adam(RATES), initial_scale=64.0)
    for ids, target in data:
        with tf.GradientTape() as tape:
            loss = fused_optimizer.scale_model_losses(tf.reduce_sum(
                (fused(ids) - target) ** 2, axis=(0, 2, 3)))
        fused_optimizer.apply(tape.gradient(loss, fused.trainable_weights),
                              fused.trainable_weights)
    for b, layer in enumerate(stock):
        optimizer = keras.optimizers.LossScaleOptimizer(
            keras.optimizers.Adam(RATES[b]), initial_scale=64.0)
        for ids, target in data:
            with tf.GradientTape() as tape:
                loss = optimizer.scale_loss(tf.reduce_sum(
                    (layer(ids[:, b]) - target[:, b]) ** 2))
            optimizer.apply(tape.gradient(loss, layer.trainable_weights),
                            layer.trainable_weights)
    assert_trained_alike(stock, fused)


# -- in fit: one pass, passes, XLA --------------------------------------------


def text_model():
    ids = keras.Input((5,), dtype="int32")
    h = keras.layers.Embedding(VOCAB, DIM, mask_zero=True)(ids)
    h = keras.layers.GlobalAveragePooling1D()(h)
    return keras.Model(ids, keras.layers.Dense(2)(h))


@pytest.mark.parametrize("jit_compile, models_per_pass", [
    (False, None),
    (True, None),
    (False, 1),
    (True, 1),  # three passes: a loop over passes
])
def test_fit_trains_text_models_as_stock(jit_compile, models_per_pass):
    rng = np.random.default_rng(5)
    x = rng.integers(0, 3, (16, 5)).astype("int32")
    y = rng.integers(0, 2, (16,)).astype("int32")
    array = hftatf.fuse(text_model(), B)
    stock = array.unfuse()
    array.compile(optimizers.Adam(RATES, clipnorm=0.5),
                  loss=keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True),
                  jit_compile=jit_compile,
                  models_per_pass=models_per_pass or "auto")
    array.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    for b, model in enumerate(stock):
        model.compile(keras.optimizers.Adam(RATES[b], clipnorm=0.5),
                      loss=keras.losses.SparseCategoricalCrossentropy(
                          from_logits=True), jit_compile=jit_compile)
        model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        for ours, theirs in zip(array.unfuse()[b].weights, model.weights):
            assert_close(ours, theirs, err_msg=f"model {b} {theirs.path}")
