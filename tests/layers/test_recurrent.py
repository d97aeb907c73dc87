"""Fused recurrent layers against their oracle: B stock SimpleRNN/LSTM/GRU.

Every comparison builds B stock layers with random weights (biases too),
stacks the same weights into one fused layer, and checks that model `b` of
the array computes what stock layer `b` computes on `x[:, b]`: outputs,
final states, input gradients (initial states included) and weight
gradients.
"""

import keras
import numpy as np
import pytest
from testing import (
    STEP_JIT,
    assert_close,
    compare_layer_with_stock,
    randomize_weights,
    stacked_weights,
)

import hftatf
from hftatf.layers import (
    FusedGRU,
    FusedLSTM,
    FusedPerModel,
    FusedSimpleRNN,
    resolve,
)

BATCH = 3
STEPS = 4
FEATURES = 5
UNITS = 3
NUM_MODELS = 2

# (stock class, fused class, number of states)
KINDS = {
    "simple_rnn": (keras.layers.SimpleRNN, FusedSimpleRNN, 1),
    "lstm": (keras.layers.LSTM, FusedLSTM, 2),
    "gru": (keras.layers.GRU, FusedGRU, 1),
}


class CallWith(keras.layers.Layer):
    """Calls `layer(x, mask=..., initial_state=[...])` from positional
    inputs, so that the oracle can slice masks and initial states per
    model like any other input."""

    def __init__(self, layer, with_mask=False, **kwargs):
        super().__init__(**kwargs)
        self.layer = layer
        self.with_mask = with_mask

    def call(self, x, *extra, training=None):
        step_mask = extra[0] if self.with_mask else None
        states = list(extra[1:] if self.with_mask else extra)
        return self.layer(x, mask=step_mask, initial_state=states or None,
                          training=training)


def stock_layers(kind, rng, num_models=NUM_MODELS, steps=STEPS, **kwargs):
    """B built stock layers, every weight random."""
    stock_class = KINDS[kind][0]
    layers = []
    for _ in range(num_models):
        layer = stock_class(UNITS, **kwargs)
        layer.build((None, steps, FEATURES))
        randomize_weights(layer, rng, scale=0.5)
        layers.append(layer)
    return layers


def fused_twin(kind, stock, steps=STEPS):
    """The fused layer made by `from_stock`, holding the stock weights."""
    fused = KINDS[kind][1].from_stock(stock[0], len(stock))
    fused.build((None, len(stock), steps, FEATURES))
    fused.set_weights(stacked_weights(stock))
    return fused


def sequences(rng, num_models=NUM_MODELS, steps=STEPS):
    return rng.standard_normal(
        (BATCH, num_models, steps, FEATURES)).astype("float32")


def per_model_mask(num_models=NUM_MODELS, steps=STEPS):
    """A `[batch, B, T]` mask that differs between models and samples: left
    and right padding, a hole, and one fully masked sequence."""
    mask = np.ones((BATCH, num_models, steps), bool)
    mask[0, 0, -1:] = False
    mask[1, 0, :2] = False
    mask[2, 0, 1] = False
    mask[0, 1, :] = False
    mask[1, 1, -2:] = False
    return mask


def initial_states(kind, rng, num_models=NUM_MODELS):
    return [rng.standard_normal((BATCH, num_models, UNITS)).astype("float32")
            for _ in range(KINDS[kind][2])]


# Outputs, states and gradients.


@pytest.mark.parametrize("go_backwards", [False, True],
                         ids=["forward", "backwards"])
@pytest.mark.parametrize("return_state", [False, True],
                         ids=["no_state", "state"])
@pytest.mark.parametrize("return_sequences", [False, True],
                         ids=["last", "sequences"])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_matches_stock(kind, return_sequences, return_state, go_backwards):
    rng = np.random.default_rng(0)
    kwargs = {"return_sequences": return_sequences,
              "return_state": return_state, "go_backwards": go_backwards}
    stock = stock_layers(kind, rng, **kwargs)
    fused = fused_twin(kind, stock)
    assert [tuple(w.shape) for w in fused.weights] == [
        (NUM_MODELS, *w.shape) for w in stock[0].weights]
    outputs = compare_layer_with_stock(stock, fused, [sequences(rng)], rng)
    num_outputs = 1 + KINDS[kind][2] * return_state
    assert len(outputs) == num_outputs
    expected = ((BATCH, NUM_MODELS, STEPS, UNITS) if return_sequences
                else (BATCH, NUM_MODELS, UNITS))
    assert outputs[0].shape == expected
    for state in outputs[1:]:
        assert state.shape == (BATCH, NUM_MODELS, UNITS)


@pytest.mark.parametrize("kwargs", [
    {"reset_after": False},
    {"reset_after": False, "return_sequences": True, "go_backwards": True},
    {"use_bias": False},
    {"reset_after": False, "use_bias": False},
], ids=["before", "before-sequences-backwards", "nobias", "before-nobias"])
def test_gru_variants_match_stock(kwargs):
    rng = np.random.default_rng(1)
    stock = stock_layers("gru", rng, **kwargs)
    fused = fused_twin("gru", stock)
    assert [tuple(w.shape) for w in fused.weights] == [
        (NUM_MODELS, *w.shape) for w in stock[0].weights]
    compare_layer_with_stock(stock, fused, [sequences(rng)], rng)


@pytest.mark.parametrize("kind,kwargs", [
    ("lstm", {"activation": "relu", "recurrent_activation": "hard_sigmoid"}),
    ("lstm", {"use_bias": False, "unit_forget_bias": False}),
    ("gru", {"activation": "softsign", "recurrent_activation": "tanh"}),
    ("simple_rnn", {"activation": "relu", "use_bias": False}),
], ids=["lstm-activations", "lstm-nobias", "gru-activations",
        "simple-relu-nobias"])
def test_arguments_match_stock(kind, kwargs):
    rng = np.random.default_rng(2)
    stock = stock_layers(kind, rng, return_sequences=True, **kwargs)
    compare_layer_with_stock(stock, fused_twin(kind, stock),
                             [sequences(rng)], rng)


@pytest.mark.parametrize("go_backwards,return_sequences", [
    (False, False), (True, True)], ids=["forward-last", "backwards-sequences"])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_per_model_mask_matches_stock(kind, go_backwards, return_sequences):
    rng = np.random.default_rng(3)
    stock = stock_layers(kind, rng, return_sequences=return_sequences,
                         return_state=True, go_backwards=go_backwards)
    fused = fused_twin(kind, stock)
    mask = per_model_mask()
    compare_layer_with_stock(
        [CallWith(layer, with_mask=True) for layer in stock],
        CallWith(fused, with_mask=True), [sequences(rng), mask], rng)


def test_masked_steps_carry_state_and_output_forward():
    rng = np.random.default_rng(4)
    stock = stock_layers("lstm", rng, return_sequences=True)
    fused = fused_twin("lstm", stock)
    x = sequences(rng)
    mask = per_model_mask()
    y = np.asarray(fused(x, mask=mask))
    # Model 0, sample 0: last step masked, so its output repeats step T-2;
    # model 1, sample 0: everything masked, so the output stays zero.
    assert_close(y[0, 0, -1], y[0, 0, -2])
    assert_close(y[0, 1], np.zeros((STEPS, UNITS)))
    assert not np.allclose(y[0, 1], y[0, 0])


def test_mask_from_masking_layer_matches_stock():
    rng = np.random.default_rng(5)
    stock = stock_layers("gru", rng, return_sequences=True)
    fused = fused_twin("gru", stock)
    x = sequences(rng)
    x[per_model_mask() == 0] = 0.0
    # Masking runs per model through the array's fold wrapper.
    masking = hftatf.layers.resolve.fuse_layer(keras.layers.Masking(),
                                                NUM_MODELS)
    y = np.asarray(fused(masking(x)))
    for b, layer in enumerate(stock):
        assert_close(y[:, b], layer(keras.layers.Masking()(x[:, b])),
                     err_msg=f"model {b}")


def test_shared_mask_is_broadcast_to_models():
    rng = np.random.default_rng(6)
    stock = stock_layers("simple_rnn", rng, return_sequences=True)
    fused = fused_twin("simple_rnn", stock)
    x = sequences(rng)
    shared = per_model_mask()[:, 0]
    y = np.asarray(fused(x, mask=shared))
    for b, layer in enumerate(stock):
        assert_close(y[:, b], layer(x[:, b], mask=shared))


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_initial_state_matches_stock(kind):
    rng = np.random.default_rng(7)
    stock = stock_layers(kind, rng, return_sequences=True, return_state=True)
    fused = fused_twin(kind, stock)
    compare_layer_with_stock(
        [CallWith(layer) for layer in stock], CallWith(fused),
        [sequences(rng), *initial_states(kind, rng)], rng)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_initial_state_with_mask_backwards_matches_stock(kind):
    rng = np.random.default_rng(8)
    stock = stock_layers(kind, rng, return_state=True, go_backwards=True)
    fused = fused_twin(kind, stock)
    compare_layer_with_stock(
        [CallWith(layer, with_mask=True) for layer in stock],
        CallWith(fused, with_mask=True),
        [sequences(rng), per_model_mask(), *initial_states(kind, rng)], rng)


@pytest.mark.parametrize("with_mask", [False, True], ids=["nomask", "mask"])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_unroll_matches_stock(kind, with_mask):
    rng = np.random.default_rng(9)
    stock = stock_layers(kind, rng, unroll=True, return_sequences=True,
                         return_state=True, go_backwards=with_mask)
    fused = fused_twin(kind, stock)
    inputs = [sequences(rng)] + [per_model_mask()] * with_mask
    compare_layer_with_stock(
        [CallWith(layer, with_mask=with_mask) for layer in stock],
        CallWith(fused, with_mask=with_mask), inputs, rng)


def test_zero_output_for_mask_matches_stock():
    rng = np.random.default_rng(10)
    stock = stock_layers("lstm", rng, return_sequences=True,
                         zero_output_for_mask=True)
    fused = fused_twin("lstm", stock)
    assert fused.zero_output_for_mask
    compare_layer_with_stock(
        [CallWith(layer, with_mask=True) for layer in stock],
        CallWith(fused, with_mask=True), [sequences(rng), per_model_mask()],
        rng)


@pytest.mark.backends("tensorflow", reason="XLA by `tf.function`; JAX "
                      "compiles every op (test_stateless_jit.py: `jax.jit`)")
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_matches_stock_under_xla(kind):
    import tensorflow as tf

    rng = np.random.default_rng(11)
    stock = stock_layers(kind, rng, return_sequences=True, return_state=True)
    fused = fused_twin(kind, stock)
    x = tf.constant(sequences(rng))
    mask = tf.constant(per_model_mask())
    states = [tf.constant(s) for s in initial_states(kind, rng)]

    @tf.function(jit_compile=True)
    def outputs_and_gradients(x, states):
        with tf.GradientTape() as tape:
            tape.watch(x)
            outputs = fused(x, mask=mask, initial_state=states)
            scalar = tf.add_n([tf.reduce_sum(o) for o in outputs])
        return outputs, tape.gradient(scalar, [x, *fused.trainable_weights])

    outputs, (dx, *dw) = outputs_and_gradients(x, states)
    for b, layer in enumerate(stock):
        with tf.GradientTape() as tape:
            x_b = x[:, b]
            tape.watch(x_b)
            expected = layer(x_b, mask=mask[:, b],
                             initial_state=[s[:, b] for s in states])
            scalar = tf.add_n([tf.reduce_sum(o) for o in expected])
        dx_b, *dw_b = tape.gradient(scalar, [x_b, *layer.trainable_weights])
        for got, want in zip(outputs, expected):
            assert_close(got[:, b], want, err_msg=f"model {b}")
        assert_close(dx[:, b], dx_b, err_msg=f"input gradient, model {b}")
        for got, want in zip(dw, dw_b):
            assert_close(got[b], want, err_msg=f"weight gradient, model {b}")


def test_stateful_matches_stock():
    rng = np.random.default_rng(12)
    stock = []
    for _ in range(NUM_MODELS):
        layer = keras.layers.LSTM(UNITS, stateful=True)
        layer.build((BATCH, STEPS, FEATURES))
        randomize_weights(layer, rng, scale=0.5)
        stock.append(layer)
    fused = FusedLSTM.from_stock(stock[0], NUM_MODELS)
    fused.build((BATCH, NUM_MODELS, STEPS, FEATURES))
    fused.set_weights(stacked_weights(stock))
    assert [tuple(s.shape) for s in fused.states] == [
        (BATCH * NUM_MODELS, UNITS)] * 2
    for _ in range(2):  # The second call starts from the first's states.
        x = sequences(rng)
        y = np.asarray(fused(x))
        for b, layer in enumerate(stock):
            assert_close(y[:, b], layer(x[:, b]), err_msg=f"model {b}")
    fused.reset_state()
    for layer in stock:
        layer.reset_state()
    x = sequences(rng)
    y = np.asarray(fused(x))
    for b, layer in enumerate(stock):
        assert_close(y[:, b], layer(x[:, b]), err_msg=f"model {b}")


def test_stateful_layer_names_the_batch_size_it_was_built_for():
    # Stock Keras refuses another batch size too; the array's message
    # gives the sizes per model, not the folded ones of its states.
    fused = FusedLSTM(NUM_MODELS, units=UNITS, stateful=True, name="lstm")
    fused.build((BATCH, NUM_MODELS, STEPS, FEATURES))
    x = np.zeros((BATCH * 2, NUM_MODELS, STEPS, FEATURES), "float32")
    with pytest.raises(ValueError) as error:
        fused(x)
    assert (f"its states hold {BATCH} samples per model. Received a batch "
            f"of {BATCH * 2} samples") in str(error.value)
    assert f"`batch_size={BATCH}`" in str(error.value)


# Dropout: independent per model, exact given the masks, off in inference.


DROPOUTS = [({"dropout": 0.5}, "dropout"),
            ({"recurrent_dropout": 0.5}, "recurrent"),
            ({"dropout": 0.4, "recurrent_dropout": 0.3}, "both")]


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_dropout_inference_matches_stock(kind):
    rng = np.random.default_rng(13)
    stock = stock_layers(kind, rng, return_sequences=True, dropout=0.4,
                         recurrent_dropout=0.3)
    fused = fused_twin(kind, stock)
    compare_layer_with_stock(stock, fused, [sequences(rng)], rng,
                             training=False)


@pytest.mark.parametrize("rates", [d[0] for d in DROPOUTS],
                         ids=[d[1] for d in DROPOUTS])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_dropout_masks_differ_between_models(kind, rates):
    rng = np.random.default_rng(14)
    layer = stock_layers(kind, rng, num_models=1, return_sequences=True,
                         **rates)[0]
    fused = fused_twin(kind, [layer] * NUM_MODELS)  # Identical models.
    x = np.repeat(sequences(rng, num_models=1), NUM_MODELS, axis=1)
    inference = np.asarray(fused(x, training=False))
    assert_close(inference[:, 0], inference[:, 1])
    y = np.asarray(fused(x, training=True))
    assert not np.allclose(y[:, 0], y[:, 1])
    assert not np.allclose(y, inference)
    # A new call draws new masks, as the stock layer does.
    assert not np.allclose(np.asarray(fused(x, training=True)), y)


def dropout_masks(rng, rows, width, rate, count):
    """`count` random inverted-dropout masks `[rows, width]` (or one mask
    when `count` is None), as `DropoutRNNCell` draws them."""
    def one():
        keep = rng.random((rows, width)) >= rate
        return (keep / (1.0 - rate)).astype("float32")
    return one() if count is None else [one() for _ in range(count)]


def model_slice(masks, b):
    """Model `b`'s rows of folded `[batch * B, d]` masks."""
    if masks is None:
        return None
    if isinstance(masks, list):
        return [model_slice(m, b) for m in masks]
    return masks.reshape(BATCH, NUM_MODELS, -1)[:, b]


@pytest.mark.parametrize("rates", [d[0] for d in DROPOUTS],
                         ids=[d[1] for d in DROPOUTS])
@pytest.mark.parametrize("kind,kwargs", [
    ("simple_rnn", {}), ("lstm", {}), ("gru", {}),
    ("gru", {"reset_after": False}),
], ids=["simple_rnn", "lstm", "gru", "gru-before"])
def test_dropout_with_given_masks_matches_stock(kind, kwargs, rates):
    rng = np.random.default_rng(15)
    stock = stock_layers(kind, rng, return_sequences=True, **rates, **kwargs)
    fused = fused_twin(kind, stock)
    count = getattr(fused.cell, "dropout_mask_count", None)
    assert count == getattr(stock[0].cell, "dropout_mask_count", None)
    rows = BATCH * NUM_MODELS
    # Only for the rates in use: a stock cell applies any cached mask.
    dropout = recurrent = None
    if rates.get("dropout"):
        dropout = dropout_masks(rng, rows, FEATURES, 0.5, count)
    if rates.get("recurrent_dropout"):
        recurrent = dropout_masks(rng, rows, UNITS, 0.5, count)
    x = sequences(rng)
    # The RNN draws masks only where none are cached; set them by hand.
    fused.cell._dropout_mask = dropout
    fused.cell._recurrent_dropout_mask = recurrent
    y = np.asarray(fused(x, training=True))
    for b, layer in enumerate(stock):
        layer.cell._dropout_mask = model_slice(dropout, b)
        layer.cell._recurrent_dropout_mask = model_slice(recurrent, b)
        assert_close(y[:, b], layer(x[:, b], training=True),
                     err_msg=f"model {b}")


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_from_stock_keeps_the_cell_implementation(kind):
    stock = KINDS[kind][0](UNITS, dropout=0.5, implementation=1)
    fused = KINDS[kind][1].from_stock(stock, NUM_MODELS)
    assert fused.cell.implementation == 1
    assert fused.cell.dropout_mask_count == stock.cell.dropout_mask_count
    clone = type(fused).from_config(fused.get_config())
    assert clone.cell.dropout_mask_count == stock.cell.dropout_mask_count


# Initialisation, regularizers, constraints.


def test_unit_forget_bias_per_model():
    fused = FusedLSTM(3, UNITS)
    fused.build((None, 3, STEPS, FEATURES))
    bias = np.asarray(fused.cell.bias)
    expected = np.concatenate([np.zeros(UNITS), np.ones(UNITS),
                               np.zeros(2 * UNITS)])
    for b in range(3):
        np.testing.assert_array_equal(bias[b], expected)


def test_seeded_slice_zero_equals_stock_and_slices_differ():
    kwargs = {"kernel_initializer": keras.initializers.GlorotUniform(seed=1),
              "recurrent_initializer": keras.initializers.Orthogonal(seed=2),
              "bias_initializer": keras.initializers.RandomNormal(seed=3)}
    fused = FusedLSTM(3, UNITS, **kwargs)
    fused.build((None, 3, STEPS, FEATURES))
    stock = keras.layers.LSTM(UNITS, **kwargs)
    stock.build((None, STEPS, FEATURES))
    for got, expected in zip(fused.get_model_weights(0), stock.get_weights()):
        np.testing.assert_array_equal(got, expected)
    forget = slice(UNITS, 2 * UNITS)
    for w in fused.get_weights():
        for b in range(1, 3):
            assert not np.array_equal(w[b], w[0])
    for b in range(3):
        np.testing.assert_array_equal(
            np.asarray(fused.cell.bias)[b, forget], 1.0)


def test_orthogonal_recurrent_kernel_per_slice():
    fused = FusedGRU(3, UNITS)
    fused.build((None, 3, STEPS, FEATURES))
    for b, kernel in enumerate(np.asarray(fused.cell.recurrent_kernel)):
        # Orthogonal rows of the stock [units, 3 * units] kernel.
        assert_close(kernel @ kernel.T, np.eye(UNITS), atol=1e-5,
                     err_msg=f"model {b}")


def test_regularizers_give_per_model_losses():
    rng = np.random.default_rng(16)
    kwargs = {"kernel_regularizer": keras.regularizers.L2(0.01),
              "recurrent_regularizer": keras.regularizers.L1(0.02),
              "bias_regularizer": keras.regularizers.L2(0.03),
              "activity_regularizer": keras.regularizers.L1(0.04),
              "return_state": True}
    stock = stock_layers("lstm", rng, **kwargs)
    fused = fused_twin("lstm", stock)
    x = sequences(rng)
    fused(x)
    losses = [np.asarray(loss) for loss in fused.losses]
    assert [loss.shape for loss in losses] == [(NUM_MODELS,)] * len(losses)
    for b, layer in enumerate(stock):
        layer(x[:, b])
        expected = [np.asarray(loss) for loss in layer.losses]
        assert len(expected) == len(losses)
        assert_close(sorted(loss[b] for loss in losses), sorted(expected),
                     err_msg=f"model {b}")


def test_constraints_apply_per_slice():
    rng = np.random.default_rng(17)
    kwargs = {"kernel_constraint": keras.constraints.MaxNorm(1.0, axis=0),
              "recurrent_constraint": keras.constraints.UnitNorm(axis=0),
              "bias_constraint": keras.constraints.NonNeg()}
    stock = stock_layers("gru", rng, **kwargs)
    fused = fused_twin("gru", stock)
    for fused_weight, stock_weights in zip(
            fused.weights, zip(*(layer.weights for layer in stock))):
        constrained = np.asarray(fused_weight.constraint(fused_weight))
        for b, weight in enumerate(stock_weights):
            assert_close(constrained[b], weight.constraint(weight))


# Through hftatf.fuse_models: per-model inputs with per-model masks.


def masked_model(functional):
    layers = [keras.layers.Masking(),
              keras.layers.LSTM(UNITS, return_sequences=True),
              keras.layers.SimpleRNN(UNITS, go_backwards=True)]
    if not functional:
        return keras.Sequential([keras.Input((STEPS, FEATURES)), *layers])
    inputs = keras.Input((STEPS, FEATURES))
    outputs = inputs
    for layer in layers:
        outputs = layer(outputs)
    return keras.Model(inputs, outputs)


def check_fuse_models_with_per_model_masks(functional):
    rng = np.random.default_rng(18)
    models = [masked_model(functional) for _ in range(NUM_MODELS)]
    for m in models:
        for layer in m.layers:
            if layer.weights:
                randomize_weights(layer, rng, scale=0.5)
    array = hftatf.fuse_models(models, shared_inputs=False)
    x = sequences(rng)
    x[per_model_mask() == 0] = 0.0
    y = np.asarray(array(x))
    for b, m in enumerate(models):
        assert_close(y[:, b], m(x[:, b]), err_msg=f"model {b}")


def test_fuse_models_with_per_model_masked_inputs():
    check_fuse_models_with_per_model_masks(functional=False)


def test_fuse_models_with_per_model_masked_inputs_functional():
    check_fuse_models_with_per_model_masks(functional=True)


# Serialization.


CONFIGURED = {
    "simple_rnn": {"activation": "relu"},
    "lstm": {"recurrent_activation": "hard_sigmoid",
             "unit_forget_bias": False, "use_cudnn": False},
    "gru": {"reset_after": False, "recurrent_activation": "tanh"},
}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_config_round_trip(kind):
    fused_class = KINDS[kind][1]
    layer = fused_class(
        3, UNITS, use_bias=True,
        kernel_initializer=keras.initializers.HeNormal(seed=3),
        kernel_regularizer=keras.regularizers.L2(0.01),
        activity_regularizer=keras.regularizers.L1(0.02),
        recurrent_constraint=keras.constraints.MaxNorm(2.0),
        dropout=0.25, recurrent_dropout=0.5, seed=7, return_sequences=True,
        return_state=True, go_backwards=True, unroll=True,
        name=f"fused_{kind}", **CONFIGURED[kind])
    config = layer.get_config()
    assert config["num_models"] == 3
    clone = fused_class.from_config(config)
    assert clone.get_config() == config
    restored = keras.saving.deserialize_keras_object(
        keras.saving.serialize_keras_object(layer))
    assert type(restored) is fused_class
    assert restored.get_config() == config


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_from_stock_keeps_the_stock_config(kind):
    stock_class = KINDS[kind][0]
    stock = stock_class(UNITS, dropout=0.1, go_backwards=True, unroll=True,
                        return_state=True, name=f"stock_{kind}",
                        **{k: v for k, v in CONFIGURED[kind].items()
                           if k != "use_cudnn"})
    fused = KINDS[kind][1].from_stock(stock, 2)
    config = fused.get_config()
    for key, value in stock.get_config().items():
        assert config[key] == value, key


def test_saved_model_file_round_trip(tmp_path):
    rng = np.random.default_rng(19)
    inputs = keras.Input((NUM_MODELS, STEPS, FEATURES))
    hidden = FusedGRU(NUM_MODELS, UNITS, return_sequences=True)(inputs)
    outputs = FusedLSTM(NUM_MODELS, UNITS)(hidden)
    model = keras.Model(inputs, outputs)
    for w in model.weights:
        w.assign(rng.standard_normal(w.shape).astype("float32"))
    path = tmp_path / "fused_rnn.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    for got, expected in zip(loaded.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(got, expected)
    x = sequences(rng)
    assert_close(loaded(x), model(x))


# Bad input.


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_rejects_use_cudnn_true(kind):
    with pytest.raises(ValueError, match="use_cudnn='auto' or False"):
        KINDS[kind][1](2, UNITS, use_cudnn=True)
    with pytest.raises(ValueError, match="use_cudnn"):
        KINDS[kind][1](2, UNITS, use_cudnn="yes")


@pytest.mark.parametrize("units", [0, -1, 2.0, True])
def test_rejects_bad_units(units):
    with pytest.raises(ValueError, match="units"):
        FusedSimpleRNN(2, units)


def test_rejects_bad_num_models():
    with pytest.raises(ValueError, match="num_models"):
        FusedLSTM(0, UNITS)


def test_rejects_wrong_model_axis():
    layer = FusedGRU(3, UNITS)
    with pytest.raises(ValueError, match="num_models=3 on axis 1"):
        layer(np.zeros((BATCH, 2, STEPS, FEATURES), "float32"))
    with pytest.raises(ValueError):
        layer(np.zeros((BATCH, STEPS, FEATURES), "float32"))


def test_rejects_wrong_initial_states():
    layer = FusedLSTM(NUM_MODELS, UNITS)
    x = np.zeros((BATCH, NUM_MODELS, STEPS, FEATURES), "float32")
    state = np.zeros((BATCH, NUM_MODELS, UNITS), "float32")
    with pytest.raises(ValueError, match="received 1 initial state"):
        layer(x, initial_state=[state])
    with pytest.raises(ValueError, match=r"\[batch, num_models, units\]"):
        layer(x, initial_state=[state[:, 0], state[:, 0]])


def test_rejects_wrong_mask_rank():
    layer = FusedSimpleRNN(NUM_MODELS, UNITS)
    x = np.zeros((BATCH, NUM_MODELS, STEPS, FEATURES), "float32")
    with pytest.raises(ValueError, match="mask of shape"):
        layer(x, mask=np.ones((BATCH,), bool))


# keras.layers.RNN over a stock cell.


CELLS = {
    "simple_rnn": lambda **kw: keras.layers.SimpleRNNCell(
        UNITS, activation="relu", **kw),
    "lstm": lambda **kw: keras.layers.LSTMCell(
        UNITS, unit_forget_bias=False, **kw),
    "gru": lambda **kw: keras.layers.GRUCell(UNITS, reset_after=False, **kw),
}


def stock_cell_rnns(kind, rng, cell_kwargs=None, **kwargs):
    """B built stock `RNN(cell)` layers, every weight random."""
    layers = []
    for _ in range(NUM_MODELS):
        layer = keras.layers.RNN(CELLS[kind](**(cell_kwargs or {})),
                                 **kwargs)
        layer.build((None, STEPS, FEATURES))
        randomize_weights(layer, rng, scale=0.5)
        layers.append(layer)
    return layers


@pytest.mark.parametrize("kwargs", [
    {},
    {"return_sequences": True, "return_state": True, "go_backwards": True},
    {"return_sequences": True, "unroll": True, "zero_output_for_mask": True},
], ids=["last", "sequences_state_backwards", "unroll_zero_output"])
@pytest.mark.parametrize("kind", sorted(CELLS))
def test_rnn_of_a_stock_cell_matches_stock(kind, kwargs):
    rng = np.random.default_rng(20)
    stock = stock_cell_rnns(kind, rng, **kwargs)
    fused = resolve.fuse_layer(stock[0], NUM_MODELS)
    assert type(fused) is KINDS[kind][1]
    fused.build((None, NUM_MODELS, STEPS, FEATURES))
    fused.set_weights(stacked_weights(stock))
    # The cell's arguments and the RNN's carried over.
    for key, value in stock[0].cell.get_config().items():
        if key not in ("name", "trainable", "dtype"):
            assert fused.cell.get_config()[key] == value, key
    for key in ("return_sequences", "return_state", "go_backwards",
                "unroll", "zero_output_for_mask"):
        assert getattr(fused, key) == getattr(stock[0], key), key
    compare_layer_with_stock(
        [CallWith(layer, with_mask=True) for layer in stock],
        CallWith(fused, with_mask=True), [sequences(rng), per_model_mask()],
        rng)


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_rnn_of_a_stock_cell_keeps_its_implementation_and_dropout(kind):
    cell = CELLS[kind](dropout=0.5, recurrent_dropout=0.25, seed=4,
                       implementation=1)
    fused = resolve.fuse_layer(keras.layers.RNN(cell), NUM_MODELS)
    assert fused.cell.implementation == 1
    assert fused.cell.dropout_mask_count == cell.dropout_mask_count
    assert (fused.dropout, fused.recurrent_dropout) == (0.5, 0.25)


def test_rnn_of_a_stock_cell_trains_and_unfuses():
    rng = np.random.default_rng(21)

    def model():
        inputs = keras.Input((STEPS, FEATURES))
        hidden = keras.layers.Masking()(inputs)
        hidden = keras.layers.RNN(keras.layers.LSTMCell(UNITS),
                                  return_sequences=True)(hidden)
        hidden = keras.layers.RNN(keras.layers.GRUCell(UNITS))(hidden)
        return keras.Model(inputs, keras.layers.Dense(1)(hidden))

    stock = [model() for _ in range(NUM_MODELS)]
    array = hftatf.fuse_models(stock)
    rates = [0.1, 0.03]
    array.compile(hftatf.optimizers.SGD(rates), loss="mse",
                  jit_compile=STEP_JIT)
    x = rng.standard_normal((8, STEPS, FEATURES)).astype("float32")
    x[:3, -1] = 0.0  # masked last steps
    y = rng.standard_normal((8, 1)).astype("float32")
    history = array.fit(x, y, batch_size=4, epochs=2, shuffle=False,
                        verbose=0).history
    for b, model_b in enumerate(stock):
        model_b.compile(keras.optimizers.SGD(rates[b]), loss="mse")
        expected = model_b.fit(x, y, batch_size=4, epochs=2, shuffle=False,
                               verbose=0).history
        assert_close(history[f"loss_{b}"], expected["loss"])
        for got, want in zip(array.get_model_weights(b),
                             model_b.get_weights()):
            assert_close(got, want)
    unfused = array.unfuse()
    assert [type(layer.cell) for layer in unfused[0].layers
            if isinstance(layer, keras.layers.RNN)] == [
        keras.layers.LSTMCell, keras.layers.GRUCell]
    for b, model_b in enumerate(unfused):
        assert_close(model_b.predict(x, verbose=0), stock[b].predict(
            x, verbose=0))


class OwnCell(keras.layers.Layer):
    state_size = UNITS

    def build(self, input_shape):
        self.kernel = self.add_weight(shape=(input_shape[-1], UNITS))

    def call(self, inputs, states):
        output = keras.ops.matmul(inputs, self.kernel) + states[0]
        return output, [output]


@pytest.mark.parametrize("cell", [
    lambda: OwnCell(),
    lambda: [keras.layers.LSTMCell(UNITS), keras.layers.LSTMCell(UNITS)],
], ids=["own_cell", "stacked_cells"])
def test_rnn_of_another_cell_runs_once_per_model(cell):
    layer = keras.layers.RNN(cell())
    fused = resolve.fuse_layer(layer, NUM_MODELS)
    assert type(fused) is FusedPerModel
    rng = np.random.default_rng(31)
    x = rng.standard_normal((3, NUM_MODELS, STEPS, 2)).astype("float32")
    y = keras.ops.convert_to_numpy(fused(x))
    for b in range(NUM_MODELS):
        stock = keras.layers.RNN(cell())
        stock(x[:, b])
        stock.set_weights([w[b] for w in fused.get_weights()])
        assert_close(y[:, b], stock(x[:, b]))


# ConvLSTM1D/2D/3D.

CONV_LSTM_CASES = {
    "2d_same_sequences": (lambda **kw: keras.layers.ConvLSTM2D(
        UNITS, 3, padding="same", return_sequences=True, **kw),
        (STEPS, 5, 5, 2)),
    "2d_strided_state": (lambda **kw: keras.layers.ConvLSTM2D(
        UNITS, (2, 3), strides=2, return_state=True, **kw), (3, 6, 7, 2)),
    "1d_dilated_backwards": (lambda **kw: keras.layers.ConvLSTM1D(
        2, 2, dilation_rate=2, go_backwards=True, unit_forget_bias=False,
        activation="relu", **kw), (3, 8, 3)),
    "3d_same": (lambda **kw: keras.layers.ConvLSTM3D(
        2, 2, padding="same", use_bias=False, **kw), (2, 3, 3, 3, 1)),
}


def conv_lstm_twins(case, rng, num_models=NUM_MODELS, **kwargs):
    make, shape = CONV_LSTM_CASES[case]
    stock = []
    for _ in range(num_models):
        layer = make(**kwargs)
        layer.build((None, *shape))
        randomize_weights(layer, rng, scale=0.5)
        stock.append(layer)
    fused = resolve.fuse_layer(stock[0], num_models)
    fused.build((None, num_models, *shape))
    fused.set_weights(stacked_weights(stock))
    return stock, fused, shape


@pytest.mark.parametrize("case", sorted(CONV_LSTM_CASES))
def test_conv_lstm_matches_stock(case):
    rng = np.random.default_rng(30)
    stock, fused, shape = conv_lstm_twins(case, rng)
    assert type(fused).__name__ == "Fused" + type(stock[0]).__name__
    x = rng.standard_normal((BATCH, NUM_MODELS, *shape)).astype("float32")
    outputs = compare_layer_with_stock(stock, fused, [x], rng)
    expected = fused.compute_output_shape((None, NUM_MODELS, *shape))
    expected = expected if isinstance(expected, tuple) and isinstance(
        expected[0], tuple) else (expected,)
    assert [o.shape[1:] for o in outputs] == [e[1:] for e in expected]


@pytest.mark.backends("tensorflow", reason="stock `ConvLSTM2D` on JAX fails "
                      "on a mask: its `[batch, 1]` step mask does not "
                      "broadcast against `[batch, *spatial, filters]` states")
def test_conv_lstm_mask_and_initial_state_match_stock():
    rng = np.random.default_rng(31)
    stock, fused, shape = conv_lstm_twins("2d_same_sequences", rng)
    x = rng.standard_normal((BATCH, NUM_MODELS, *shape)).astype("float32")
    states = [rng.standard_normal((BATCH, NUM_MODELS, 5, 5, UNITS)).astype(
        "float32") for _ in range(2)]
    compare_layer_with_stock(
        [CallWith(layer, with_mask=True) for layer in stock],
        CallWith(fused, with_mask=True), [x, per_model_mask(), *states],
        rng)
    with pytest.raises(ValueError, match=r"\*spatial, filters\]"):
        fused(x, initial_state=[s[:, 0] for s in states])


def test_conv_lstm_dropout_per_model_and_in_inference():
    rng = np.random.default_rng(32)
    stock, fused, shape = conv_lstm_twins(
        "2d_same_sequences", rng, dropout=0.3, recurrent_dropout=0.4)
    x = rng.standard_normal((BATCH, NUM_MODELS, *shape)).astype("float32")
    compare_layer_with_stock(stock, fused, [x], rng, training=False)
    # As the stock cell: one mask per gate, drawn per sample and model.
    assert fused.cell.dropout_mask_count == stock[0].cell.dropout_mask_count
    same, twin, _ = conv_lstm_twins("2d_same_sequences", rng, num_models=1,
                                    dropout=0.3, recurrent_dropout=0.4)
    twin = resolve.fuse_layer(same[0], NUM_MODELS)
    twin.build((None, NUM_MODELS, *shape))
    twin.set_weights(stacked_weights(same * NUM_MODELS))
    x = np.repeat(x[:, :1], NUM_MODELS, axis=1)
    y = np.asarray(twin(x, training=True))
    assert not np.allclose(y[:, 0], y[:, 1])


def next_frame_model():
    inputs = keras.Input((None, 6, 6, 1))
    hidden = keras.layers.ConvLSTM2D(
        4, 3, padding="same", return_sequences=True)(inputs)
    hidden = keras.layers.BatchNormalization()(hidden)
    hidden = keras.layers.ConvLSTM2D(
        4, 1, padding="same", return_sequences=True)(hidden)
    outputs = keras.layers.Conv3D(1, 3, padding="same",
                                  activation="sigmoid")(hidden)
    return keras.Model(inputs, outputs)


def test_conv_lstm_model_trains_like_stock_and_round_trips(tmp_path):
    rng = np.random.default_rng(33)
    array = hftatf.fuse(next_frame_model(), NUM_MODELS)
    stock = array.unfuse()
    x = rng.uniform(0, 1, (8, 3, 6, 6, 1)).astype("float32")
    y = rng.uniform(0, 1, (8, 3, 6, 6, 1)).astype("float32")
    rates = [0.1, 0.03]
    array.compile(hftatf.optimizers.SGD(rates), loss="binary_crossentropy")
    array.fit(x, y, epochs=2, batch_size=4, shuffle=False, verbose=0)
    for b, model in enumerate(stock):
        model.compile(keras.optimizers.SGD(rates[b]),
                      loss="binary_crossentropy")
        model.fit(x, y, epochs=2, batch_size=4, shuffle=False, verbose=0)
        for got, expected in zip(array.unfuse()[b].get_weights(),
                                 model.get_weights()):
            assert_close(got, expected, err_msg=f"model {b}")
    path = tmp_path / "array.keras"
    array.save(path)
    loaded = keras.saving.load_model(path)
    np.testing.assert_array_equal(loaded.predict(x, verbose=0),
                                  array.predict(x, verbose=0))


def test_conv_lstm_from_stock_keeps_the_stock_config():
    stock = keras.layers.ConvLSTM2D(
        UNITS, (3, 2), strides=(1, 2), padding="same", dropout=0.1,
        recurrent_dropout=0.2, go_backwards=True, return_state=True,
        kernel_regularizer=keras.regularizers.L2(0.01), seed=4,
        name="stock_conv_lstm")
    fused = resolve.fuse_layer(stock, 3)
    config = fused.get_config()
    for key, value in stock.get_config().items():
        assert config[key] == value, key
    clone = type(fused).from_config(config)
    assert clone.get_config() == config
    with pytest.raises(ValueError, match="channels_last"):
        resolve.fuse_layer(keras.layers.ConvLSTM2D(
            2, 3, data_format="channels_first"), 2)
