"""Fused normalization layers against their oracle: B stock Keras layers.

Every test builds B stock layers with random weights (moving statistics
too), stacks the same weights into one fused layer, and compares what model
`b` of the array computes on `x[:, b]` with what stock layer `b` computes on
`x[:, b]`: outputs, input and weight gradients, and every weight after the
call (so the moving statistics a training call updates).
"""

import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest
from testing import (
    ATOL,
    BACKEND,
    RTOL,
    assert_close,
    compare_layer_with_stock,
    layer_outputs_and_gradients,
    randomize_weights,
    stacked_weights,
)

import hftatf
from hftatf.layers import (
    FusedBatchNormalization,
    FusedFold,
    FusedGroupNormalization,
    FusedLayerNormalization,
    FusedNormalization,
    FusedRMSNormalization,
    resolve,
)

BATCH = 5
NUM_MODELS = 3


def stock_layers(stock_class, shape, rng, num_models=NUM_MODELS, **kwargs):
    """B stock layers built for stock inputs `(BATCH, *shape)` (the batch
    size is known, so an axis may name it), every weight random."""
    layers = []
    for _ in range(num_models):
        layer = stock_class(**kwargs)
        layer.build((BATCH, *shape))
        randomize_weights(layer, rng)
        if isinstance(layer, keras.layers.Normalization):
            # The stock layer snapshots its statistics when built or loaded,
            # not on set_weights.
            layer.finalize_state()
        layers.append(layer)
    return layers


def fused_twin(fused_class, stock, shape, **kwargs):
    """The fused layer holding the stock layers' weights, stacked."""
    fused = fused_class(len(stock), **kwargs)
    fused.build((BATCH, len(stock), *shape))
    assert [tuple(w.shape) for w in fused.weights] == [
        (len(stock), *w.shape) for w in stock[0].weights]
    fused.set_weights(stacked_weights(stock))
    return fused


def fused_inputs(rng, shape, num_models=NUM_MODELS, scale=1.0, shift=0.0):
    return (shift + scale * rng.standard_normal(
        (BATCH, num_models, *shape))).astype("float32")


def check_against_stock(stock_class, fused_class, shape, seed=0,
                        training=None, **kwargs):
    rng = np.random.default_rng(seed)
    stock = stock_layers(stock_class, shape, rng, **kwargs)
    fused = fused_twin(fused_class, stock, shape, **kwargs)
    # Shifted and scaled inputs: the moments must really be computed.
    x = fused_inputs(rng, shape, scale=2.0, shift=0.5)
    compare_layer_with_stock(stock, fused, [x], rng, training=training)
    return stock, fused


class MaskedCall(keras.layers.Layer):
    """Calls `layer(x, mask=mask)` with the mask as a positional input, so
    the oracle slices it per model like any other input."""

    def __init__(self, layer, **kwargs):
        super().__init__(**kwargs)
        self.layer = layer

    def call(self, x, mask, training=None):
        return self.layer(x, mask=mask, training=training)


# BatchNormalization.

BN_AXES = [
    ((4,), -1),
    ((3, 4), -1),
    ((3, 4), 1),
    ((3, 4), 2),
    ((3, 2, 4), -1),
    ((3, 2, 4), 1),
    ((3, 2, 4), -3),
    ((3, 4), 0),  # The batch axis as channels: statistics per position.
]


@pytest.mark.parametrize("training", [True, False, None])
@pytest.mark.parametrize("shape,axis", BN_AXES,
                         ids=[f"{len(s) + 1}d-axis{a}" for s, a in BN_AXES])
def test_batch_normalization_matches_stock(shape, axis, training):
    rng = np.random.default_rng(0)
    stock = stock_layers(keras.layers.BatchNormalization, shape, rng,
                         axis=axis, momentum=0.8)
    fused = fused_twin(FusedBatchNormalization, stock, shape, axis=axis,
                       momentum=0.8)
    before = fused.get_weights()
    x = fused_inputs(rng, shape, scale=2.0, shift=0.5)
    compare_layer_with_stock(stock, fused, [x], rng, training=training)
    # Only a training call moves the statistics (training=None: inference).
    moved = [not np.array_equal(a, b)
             for a, b in zip(fused.get_weights(), before)]
    assert moved == [False, False, bool(training), bool(training)]


@pytest.mark.parametrize("center,scale", [(True, True), (True, False),
                                          (False, True), (False, False)])
@pytest.mark.parametrize("training", [True, False])
def test_batch_normalization_center_scale(center, scale, training):
    check_against_stock(
        keras.layers.BatchNormalization, FusedBatchNormalization, (3, 4),
        seed=1, training=training, center=center, scale=scale,
        momentum=0.5, epsilon=0.1)


def test_batch_normalization_training_updates_moving_statistics():
    rng = np.random.default_rng(2)
    stock = stock_layers(keras.layers.BatchNormalization, (3, 4), rng,
                         momentum=0.7)
    fused = fused_twin(FusedBatchNormalization, stock, (3, 4), momentum=0.7)
    before = fused.get_weights()
    # Consecutive training calls on different batches: the moving
    # statistics of every model keep following its stock twin.
    for step in range(3):
        x = fused_inputs(rng, (3, 4), scale=1.0 + step, shift=step)
        compare_layer_with_stock(stock, fused, [x], rng, training=True)
    moving_mean, moving_variance = fused.get_weights()[2:]
    assert not np.allclose(moving_mean, before[2])
    assert not np.allclose(moving_variance, before[3])
    # Inference afterwards uses the statistics the training calls left.
    compare_layer_with_stock(stock, fused, [fused_inputs(rng, (3, 4))], rng)


@pytest.mark.parametrize("training", [True, None])
def test_batch_normalization_not_trainable_runs_in_inference(training):
    rng = np.random.default_rng(3)
    stock = stock_layers(keras.layers.BatchNormalization, (4,), rng)
    fused = fused_twin(FusedBatchNormalization, stock, (4,))
    for layer in [*stock, fused]:
        layer.trainable = False
    before = fused.get_weights()
    compare_layer_with_stock(stock, fused, [fused_inputs(rng, (4,))], rng,
                             training=training)
    for got, expected in zip(fused.get_weights(), before):
        np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("renorm_clipping", [
    None, {"rmax": 1.2, "rmin": 0.8, "dmax": 0.1}])
@pytest.mark.parametrize("center,scale", [(True, True), (False, False)])
def test_batch_normalization_renorm(renorm_clipping, center, scale):
    rng = np.random.default_rng(4)
    kwargs = {"renorm": True, "renorm_clipping": renorm_clipping,
              "renorm_momentum": 0.6, "momentum": 0.7, "center": center,
              "scale": scale}
    stock = stock_layers(keras.layers.BatchNormalization, (3, 4), rng,
                         **kwargs)
    fused = fused_twin(FusedBatchNormalization, stock, (3, 4), **kwargs)
    for step in range(2):
        x = fused_inputs(rng, (3, 4), scale=2.0, shift=step)
        compare_layer_with_stock(stock, fused, [x], rng, training=True)
    compare_layer_with_stock(stock, fused, [x], rng, training=False)


def test_batch_normalization_renorm_initial_state_matches_stock():
    kwargs = {"renorm": True, "moving_variance_initializer":
              keras.initializers.Constant(4.0)}
    stock = keras.layers.BatchNormalization(**kwargs)
    stock.build((None, 3))
    fused = FusedBatchNormalization(2, **kwargs)
    fused.build((None, 2, 3))
    for got, expected in zip(fused.get_weights(), stock.get_weights()):
        np.testing.assert_array_equal(got, np.stack([expected] * 2))


MASKED = [((6, 4), -1), ((6, 4), 1), ((3, 2, 4), -1)]


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("shape,axis", MASKED,
                         ids=[f"{len(s) + 1}d-axis{a}" for s, a in MASKED])
def test_batch_normalization_mask(shape, axis, training):
    rng = np.random.default_rng(5)
    stock = stock_layers(keras.layers.BatchNormalization, shape, rng,
                         axis=axis, momentum=0.5)
    fused = fused_twin(FusedBatchNormalization, stock, shape, axis=axis,
                       momentum=0.5)
    x = fused_inputs(rng, shape, scale=3.0, shift=1.0)
    # Every model masks different positions, some whole samples.
    mask = rng.random((BATCH, NUM_MODELS, *shape[:-1])) > 0.4
    mask[0, 1] = False
    compare_layer_with_stock([MaskedCall(layer) for layer in stock],
                             MaskedCall(fused), [x, mask], rng,
                             training=training)
    # The masked moments differ from the unmasked ones.
    if training:
        unmasked = fused_twin(FusedBatchNormalization, stock, shape,
                              axis=axis, momentum=0.5)
        assert not np.allclose(unmasked(x, training=True),
                               fused(x, mask=mask, training=True))


def test_batch_normalization_mask_passes_through():
    fused = FusedBatchNormalization(2)
    x = np.ones((BATCH, 2, 6, 4), "float32")
    mask = np.arange(BATCH * 2 * 6).reshape(BATCH, 2, 6) % 3 > 0
    np.testing.assert_array_equal(fused.compute_mask(x, mask), mask)


def test_batch_normalization_rejects_mask_of_wrong_rank():
    fused = FusedBatchNormalization(2)
    x = np.ones((BATCH, 2, 6, 4), "float32")
    with pytest.raises(ValueError, match="one dimension less"):
        fused(x, mask=np.ones((BATCH, 2), bool), training=True)


@pytest.mark.backends("tensorflow", reason="stock Keras refuses "
                      "`synchronized=True` off TensorFlow")
@pytest.mark.parametrize("training", [True, False])
def test_batch_normalization_synchronized_without_strategy(training):
    # Outside a strategy the stock layer takes its synchronized moments as
    # E[x^2] - E[x]^2; the array does the same per model.
    check_against_stock(
        keras.layers.BatchNormalization, FusedBatchNormalization, (3, 4),
        seed=6, training=training, synchronized=True, momentum=0.5)


SYNCHRONIZED_SCRIPT = textwrap.dedent("""
    import numpy as np
    import tensorflow as tf
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    import keras
    from hftatf.layers import FusedBatchNormalization
    num_models, channels = 3, 4
    x = np.random.default_rng(0).standard_normal(
        (8, num_models, 5, channels)).astype("float32")
    strategy = tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"])
    with strategy.scope():
        fused = FusedBatchNormalization(
            num_models, synchronized=True, momentum=0.5)
        fused.build((None, num_models, 5, channels))

    @tf.function
    def step(batch):
        return strategy.run(lambda b: fused(b, training=True), args=(batch,))

    data = tf.data.Dataset.from_tensor_slices(x).batch(8)
    for batch in strategy.experimental_distribute_dataset(data):
        replicas = strategy.experimental_local_results(step(batch))
    y = np.concatenate([np.asarray(r) for r in replicas])
    assert len(replicas) == 2
    for b in range(num_models):
        # The oracle sees the whole global batch on one device.
        stock = keras.layers.BatchNormalization(momentum=0.5)
        expected = np.asarray(stock(x[:, b], training=True))
        np.testing.assert_allclose(y[:, b], expected, atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(np.asarray(fused.moving_mean)[b],
                                   np.asarray(stock.moving_mean), atol=1e-6)
        np.testing.assert_allclose(np.asarray(fused.moving_variance)[b],
                                   np.asarray(stock.moving_variance), atol=1e-6)
    print("synchronized moments match")
""")


@pytest.mark.slow
@pytest.mark.backends("tensorflow", reason="stock Keras refuses "
                      "`synchronized=True` off TensorFlow")
def test_batch_normalization_synchronized_across_replicas(tmp_path):
    # Two logical CPUs must be configured before TensorFlow starts, so the
    # MirroredStrategy run lives in its own process.
    script = tmp_path / "synchronized.py"
    script.write_text(SYNCHRONIZED_SCRIPT)
    result = subprocess.run([sys.executable, str(script)], capture_output=True,
                            text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "synchronized moments match" in result.stdout


@pytest.mark.backends("tensorflow", reason="XLA by `tf.function`; JAX "
                      "compiles every op (test_stateless_jit.py: `jax.jit`)")
def test_batch_normalization_under_xla():
    import tensorflow as tf

    rng = np.random.default_rng(7)
    stock = stock_layers(keras.layers.BatchNormalization, (3, 4), rng,
                         momentum=0.6)
    fused = fused_twin(FusedBatchNormalization, stock, (3, 4), momentum=0.6)
    compiled = tf.function(jit_compile=True)

    @compiled
    def train_step(x, cotangent):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = fused(x, training=True)
            scalar = tf.reduce_sum(y * cotangent)
        return y, tape.gradient(scalar, [x, *fused.trainable_weights])

    infer = compiled(lambda x: fused(x, training=False))
    for step in range(2):
        x = fused_inputs(rng, (3, 4), scale=2.0, shift=step)
        cotangent = rng.standard_normal(x.shape).astype("float32")
        y, (dx, dgamma, dbeta) = train_step(x, cotangent)
        for b, layer in enumerate(stock):
            y_b, (dx_b,), (dgamma_b, dbeta_b) = layer_outputs_and_gradients(
                layer, [x[:, b]], [cotangent[:, b]], training=True)[0:3]
            assert_close(y[:, b], y_b[0])
            assert_close(dx[:, b], dx_b)
            assert_close(dgamma[b], dgamma_b)
            assert_close(dbeta[b], dbeta_b)
            assert_close(fused.moving_mean[b], layer.moving_mean)
            assert_close(fused.moving_variance[b], layer.moving_variance)
    for b, layer in enumerate(stock):
        assert_close(infer(x)[:, b], layer(x[:, b], training=False))


def test_batch_normalization_default_initial_weights_match_stock():
    stock = keras.layers.BatchNormalization()
    stock.build((None, 4))
    fused = FusedBatchNormalization(3)
    fused.build((None, 3, 4))
    for got, expected in zip(fused.get_weights(), stock.get_weights()):
        np.testing.assert_array_equal(got, np.stack([expected] * 3))


def test_batch_normalization_seeded_initializers_differ_per_model():
    fused = FusedBatchNormalization(
        3, gamma_initializer=keras.initializers.RandomNormal(seed=5))
    fused.build((None, 3, 4))
    stock = keras.layers.BatchNormalization(
        gamma_initializer=keras.initializers.RandomNormal(seed=5))
    stock.build((None, 4))
    gamma = np.asarray(fused.gamma)
    # Model 0 starts as the stock layer with the same seed; the others not.
    np.testing.assert_array_equal(gamma[0], np.asarray(stock.gamma))
    assert not np.allclose(gamma[0], gamma[1])


def test_batch_normalization_regularizers_and_constraints_per_model():
    rng = np.random.default_rng(8)
    kwargs = {"gamma_regularizer": keras.regularizers.L2(0.1),
              "beta_regularizer": keras.regularizers.L1(0.2),
              "gamma_constraint": keras.constraints.NonNeg(),
              "beta_constraint": keras.constraints.MaxNorm(1.0, axis=0)}
    stock = stock_layers(keras.layers.BatchNormalization, (4,), rng,
                         **kwargs)
    fused = fused_twin(FusedBatchNormalization, stock, (4,), **kwargs)
    gamma_loss, beta_loss = [np.asarray(loss) for loss in fused.losses]
    assert gamma_loss.shape == beta_loss.shape == (NUM_MODELS,)
    for b, layer in enumerate(stock):
        stock_gamma_loss, stock_beta_loss = layer.losses
        assert_close(gamma_loss[b], stock_gamma_loss)
        assert_close(beta_loss[b], stock_beta_loss)
        assert_close(fused.gamma.constraint(fused.gamma)[b],
                     layer.gamma.constraint(layer.gamma))
        assert_close(fused.beta.constraint(fused.beta)[b],
                     layer.beta.constraint(layer.beta))


# LayerNormalization.

LN_AXES = [
    ((4,), -1),
    ((3, 4), -1),
    ((3, 4), 1),
    ((3, 4), [1, 2]),
    ((3, 4), [-2, -1]),
    ((3, 2, 4), [1, 3]),
    ((3, 2, 4), [2]),
    # Mixed signs: the stock weight is shaped in sorted order ([-1, 1]).
    ((3, 4), [1, -1]),
    ((3, 4), [0, 2]),  # Across the batch, still per model.
]


@pytest.mark.parametrize("shape,axis", LN_AXES,
                         ids=[f"{len(s) + 1}d-axis{a}" for s, a in LN_AXES])
def test_layer_normalization_matches_stock(shape, axis):
    check_against_stock(
        keras.layers.LayerNormalization, FusedLayerNormalization, shape,
        seed=10, axis=axis)


@pytest.mark.parametrize("kwargs", [
    {"center": False},
    {"scale": False},
    {"center": False, "scale": False, "epsilon": 0.5},
    {"rms_scaling": True},
    {"rms_scaling": True, "scale": False, "axis": [1, 2]},
], ids=["no-center", "no-scale", "neither", "rms", "rms-no-scale"])
@pytest.mark.filterwarnings("ignore:You passed `rms_scaling=True`")
def test_layer_normalization_options(kwargs):
    check_against_stock(
        keras.layers.LayerNormalization, FusedLayerNormalization, (3, 4),
        seed=11, **kwargs)


def test_layer_normalization_rms_scaling_warns_like_stock():
    with pytest.warns(UserWarning, match="rms_scaling=True"):
        FusedLayerNormalization(2, rms_scaling=True)


def test_layer_normalization_training_flag_does_not_matter():
    rng = np.random.default_rng(12)
    fused = fused_twin(FusedLayerNormalization, stock_layers(
        keras.layers.LayerNormalization, (4,), rng), (4,))
    x = fused_inputs(rng, (4,))
    np.testing.assert_array_equal(fused(x, training=True),
                                  fused(x, training=False))


def test_layer_normalization_axis_becomes_a_sorted_list_like_stock():
    for axis in (-1, [2, 1]):
        stock = keras.layers.LayerNormalization(axis=axis)
        fused = FusedLayerNormalization(2, axis=axis)
        assert fused.get_config()["axis"] == stock.get_config()["axis"]
        stock.build((None, 3, 4))
        fused.build((None, 2, 3, 4))
        assert fused.get_config()["axis"] == stock.get_config()["axis"]


# GroupNormalization.

GN_CASES = [
    ((6,), -1, 3),
    ((3, 6), -1, 2),
    ((3, 6), -1, 1),
    ((3, 6), -1, -1),
    ((6, 3), 1, 3),
    ((6, 2, 3), 1, 2),
    ((2, 3, 4), -1, 2),
    ((2, 6, 3), -2, 3),
]


@pytest.mark.parametrize(
    "shape,axis,groups", GN_CASES,
    ids=[f"{len(s) + 1}d-axis{a}-groups{g}" for s, a, g in GN_CASES])
def test_group_normalization_matches_stock(shape, axis, groups):
    _, fused = check_against_stock(
        keras.layers.GroupNormalization, FusedGroupNormalization, shape,
        seed=20, axis=axis, groups=groups)
    if groups == -1:
        assert fused.groups == shape[axis]


@pytest.mark.parametrize("center,scale", [(True, False), (False, True),
                                          (False, False)])
def test_group_normalization_center_scale(center, scale):
    check_against_stock(
        keras.layers.GroupNormalization, FusedGroupNormalization, (3, 6),
        seed=21, groups=3, center=center, scale=scale, epsilon=0.2)


def test_group_normalization_passes_mask_through():
    fused = FusedGroupNormalization(2, groups=2)
    x = np.ones((BATCH, 2, 3, 4), "float32")
    mask = np.arange(BATCH * 2 * 3).reshape(BATCH, 2, 3) % 2 > 0
    np.testing.assert_array_equal(fused.compute_mask(x, mask), mask)


@pytest.mark.parametrize("kwargs,shape,match", [
    ({"groups": 4}, (3, 6), "must be a multiple"),
    ({"groups": 8}, (3, 6), "cannot be more than"),
    ({"groups": 2, "axis": 0}, (3, 6), "batch axis"),
    ({"groups": 2, "axis": 3}, (3, 6), "out of bounds"),
])
def test_group_normalization_rejects_bad_arguments(kwargs, shape, match):
    with pytest.raises(ValueError, match=match):
        FusedGroupNormalization(2, **kwargs).build((BATCH, 2, *shape))


@pytest.mark.parametrize("groups", [0, -2, 2.0])
def test_group_normalization_rejects_bad_groups(groups):
    with pytest.raises(ValueError, match="groups"):
        FusedGroupNormalization(2, groups=groups)


# Normalization (preprocessing).

NORMALIZATION_CASES = [
    ((4,), -1, False),
    ((3, 4), -1, True),
    ((3, 4), (1, 2), False),
    ((3, 4), 1, True),
    ((3, 4), None, False),
    ((3, 4), (0, 2), False),
]


@pytest.mark.parametrize(
    "shape,axis,invert", NORMALIZATION_CASES,
    ids=[f"{len(s) + 1}d-axis{a}-invert{i}"
         for s, a, i in NORMALIZATION_CASES])
def test_normalization_with_statistics_matches_stock(shape, axis, invert):
    check_against_stock(keras.layers.Normalization, FusedNormalization, shape,
                        seed=30, axis=axis, invert=invert)


@pytest.mark.parametrize("mean,variance,axis", [
    (0.5, 2.0, -1),
    ([1.0, -2.0, 0.5, 3.0], [0.5, 2.0, 1e-16, 4.0], -1),
    ([[1.0, 2.0, 3.0, 4.0]] * 3, [[2.0, 3.0, 4.0, 5.0]] * 3, (1, 2)),
])
@pytest.mark.parametrize("invert", [False, True])
def test_normalization_with_constant_statistics(mean, variance, axis, invert):
    rng = np.random.default_rng(31)
    kwargs = {"mean": mean, "variance": variance, "axis": axis,
              "invert": invert}
    stock = stock_layers(keras.layers.Normalization, (3, 4), rng, **kwargs)
    fused = fused_twin(FusedNormalization, stock, (3, 4), **kwargs)
    assert fused.weights == []
    compare_layer_with_stock(stock, fused, [fused_inputs(rng, (3, 4))], rng)


def test_normalization_adapt_per_model_matches_stock():
    rng = np.random.default_rng(32)
    data = (rng.standard_normal((20, NUM_MODELS, 3, 4))
            * np.arange(1, NUM_MODELS + 1)[:, None, None]).astype("float32")
    fused = FusedNormalization(NUM_MODELS, axis=-1)
    fused.adapt(data)
    stock = []
    for b in range(NUM_MODELS):
        layer = keras.layers.Normalization(axis=-1)
        layer.adapt(data[:, b])
        stock.append(layer)
    for got, expected in zip(fused.get_weights(), stacked_weights(stock)):
        assert_close(got, expected)
    compare_layer_with_stock(stock, fused, [data[:BATCH]], rng)


def test_normalization_with_constants_cannot_adapt():
    fused = FusedNormalization(2, mean=0.0, variance=1.0)
    with pytest.raises(ValueError, match="no statistics to adapt"):
        fused.adapt(np.zeros((4, 2, 3), "float32"))


@pytest.mark.parametrize("kwargs,match", [
    ({"mean": 1.0}, "both `mean` and `variance`"),
    ({"mean": [1.0, 2.0], "variance": [1.0]}, "same shape"),
    ({"mean": [[1.0]], "variance": [[1.0]]}, "rank of `mean`"),
])
def test_normalization_rejects_bad_constants(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FusedNormalization(2, **kwargs)


def test_normalization_rejects_axis_out_of_range():
    with pytest.raises(ValueError, match="range"):
        FusedNormalization(2, axis=3).build((BATCH, 2, 3, 4))


# UnitNormalization folds (no weights); checked here with its family.


@pytest.mark.parametrize("axis", [-1, [1, 2]])
def test_unit_normalization_folds(axis):
    rng = np.random.default_rng(40)
    stock = keras.layers.UnitNormalization(axis=axis)
    fused = resolve.fuse_layer(stock, NUM_MODELS)
    assert isinstance(fused, FusedFold)
    compare_layer_with_stock([stock] * NUM_MODELS, fused,
                             [fused_inputs(rng, (3, 4))], rng)


# Mixed precision.


@pytest.fixture
def mixed_bfloat16():
    previous = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    yield
    keras.mixed_precision.set_global_policy(previous)


# Outputs are bfloat16 (8 significant bits): float32 results that differ in
# their last bits (reductions in another order) can round to neighbouring
# bfloat16 values, one unit in the last place (2^-8 relative) apart. So can
# the input gradients of BatchNormalization and Normalization, which cast
# their inputs to bfloat16. The weight gradients and the moving statistics
# are float32 computations on identical bfloat16 values: float32 tolerance.
BF16_TOL = 1e-2


@pytest.mark.parametrize("stock_class,fused_class,kwargs,training", [
    (keras.layers.BatchNormalization, FusedBatchNormalization,
     {"momentum": 0.5}, True),
    (keras.layers.BatchNormalization, FusedBatchNormalization, {}, False),
    (keras.layers.LayerNormalization, FusedLayerNormalization,
     {"axis": [1, 2]}, None),
    (keras.layers.GroupNormalization, FusedGroupNormalization,
     {"groups": 2}, None),
    (keras.layers.Normalization, FusedNormalization, {}, None),
], ids=["batch-train", "batch-infer", "layer", "group", "normalization"])
def test_mixed_bfloat16_matches_stock(mixed_bfloat16, stock_class,
                                      fused_class, kwargs, training):
    rng = np.random.default_rng(50)
    stock = stock_layers(stock_class, (3, 4), rng, **kwargs)
    fused = fused_twin(fused_class, stock, (3, 4), **kwargs)
    assert fused.compute_dtype == "bfloat16"
    assert [w.dtype for w in fused.weights] == [
        w.dtype for w in stock[0].weights]
    x = fused_inputs(rng, (3, 4), scale=2.0, shift=0.5)
    cotangent = rng.standard_normal(x.shape).astype("float32")
    y, (dx,), dw = layer_outputs_and_gradients(fused, [x], [cotangent],
                                               training=training)
    assert y[0].dtype == np.dtype("bfloat16")
    casts_inputs = stock[0].autocast
    for b, layer in enumerate(stock):
        y_b, (dx_b,), dw_b = layer_outputs_and_gradients(
            layer, [x[:, b]], [cotangent[:, b]], training=training)
        assert_close(y[0][:, b].astype("float32"),
                     y_b[0].astype("float32"), BF16_TOL, BF16_TOL)
        assert_close(dx[:, b], dx_b, *((BF16_TOL, BF16_TOL) if casts_inputs
                                       else (ATOL, RTOL)))
        for got, expected in zip(dw, dw_b):
            assert_close(got[b], expected)
        for got, expected in zip(fused.get_weights(), layer.get_weights()):
            assert_close(got[b], expected)


# An array made of trained stock models.


def small_model(seed):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((6,)),
        keras.layers.Dense(8),
        keras.layers.BatchNormalization(momentum=0.6),
        keras.layers.LayerNormalization(),
        keras.layers.PReLU(alpha_initializer="random_uniform"),
        keras.layers.Dense(3),
    ])


def test_fuse_models_of_trained_models():
    rng = np.random.default_rng(60)
    x = rng.standard_normal((16, 6)).astype("float32")
    y = rng.standard_normal((16, 3)).astype("float32")
    models = []
    for seed in range(2):
        model = small_model(seed)
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)
        models.append(model)
    array = hftatf.fuse_models(models)
    fused_bn = array.get_layer(models[0].layers[1].name)
    assert isinstance(fused_bn, FusedBatchNormalization)
    outputs = np.asarray(array(x, training=False))
    for b, model in enumerate(models):
        assert_close(outputs[:, b], model(x, training=False))
    # Training mode: each model normalises with its own batch moments.
    outputs = np.asarray(array(x[:8], training=True))
    for b, model in enumerate(models):
        assert_close(outputs[:, b], model(x[:8], training=True))
    # One training step of the array and of every stock model: the moving
    # statistics, like every weight, stay those of each stock model.
    array.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    array.train_on_batch(x[8:], y[8:])
    for model in models:
        model.train_on_batch(x[8:], y[8:])
    for b, model in enumerate(models):
        bn = model.layers[1]
        assert_close(fused_bn.moving_mean[b], bn.moving_mean)
        assert_close(fused_bn.moving_variance[b], bn.moving_variance)
    for model, unfused in zip(models, array.unfuse()):
        for got, expected in zip(unfused.get_weights(), model.get_weights()):
            assert_close(got, expected)


# Configuration and bad arguments.


CONFIGURED = [
    (FusedBatchNormalization, {
        "axis": 1, "momentum": 0.9, "epsilon": 0.01, "center": False,
        "gamma_regularizer": keras.regularizers.L2(0.1),
        "gamma_constraint": keras.constraints.NonNeg(),
        "moving_variance_initializer": "random_uniform", "renorm": True,
        "renorm_clipping": {"rmax": 2.0},
        # Stock Keras refuses it off TensorFlow.
        "synchronized": BACKEND == "tensorflow"}),
    (FusedLayerNormalization, {
        "axis": [1, 2], "epsilon": 0.01, "scale": False,
        "beta_initializer": "random_normal"}),
    (FusedGroupNormalization, {
        "groups": 2, "axis": 1, "beta_constraint": "non_neg"}),
    (FusedNormalization, {"axis": (1, 2), "invert": True}),
    (FusedNormalization, {"mean": [1.0, 2.0, 3.0, 4.0],
                          "variance": [1.0, 1.0, 2.0, 2.0]}),
]


@pytest.mark.parametrize("fused_class,kwargs", CONFIGURED,
                         ids=[c.__name__ for c, _ in CONFIGURED[:4]]
                         + ["FusedNormalization-constants"])
def test_config_round_trip(fused_class, kwargs):
    layer = fused_class(NUM_MODELS, name="norm", **kwargs)
    config = layer.get_config()
    assert config["num_models"] == NUM_MODELS
    clone = fused_class.from_config(config)
    assert clone.get_config() == config
    restored = keras.saving.deserialize_keras_object(
        keras.saving.serialize_keras_object(layer))
    assert type(restored) is fused_class
    assert restored.get_config() == config
    shape = (BATCH, NUM_MODELS, 6, 4)
    layer.build(shape)
    clone.build(shape)
    clone.set_weights(layer.get_weights())
    x = np.random.default_rng(70).standard_normal(shape).astype("float32")
    np.testing.assert_array_equal(clone(x), layer(x))


@pytest.mark.parametrize("stock", [
    keras.layers.BatchNormalization(axis=1, momentum=0.5, renorm=True),
    keras.layers.LayerNormalization(axis=[-2, -1], center=False),
    keras.layers.GroupNormalization(groups=-1),
    keras.layers.Normalization(axis=None, invert=True),
    keras.layers.Normalization(mean=2.0, variance=3.0),
], ids=["batch", "layer", "group", "normalization", "normalization-const"])
def test_registered_for_stock_layers(stock):
    fused = resolve.fuse_layer(stock, NUM_MODELS)
    config = {k: v for k, v in fused.get_config().items()
              if k not in ("num_models", "activity_regularizer")}
    assert config == {k: v for k, v in stock.get_config().items()
                      if k != "activity_regularizer"}


def test_saved_array_file_round_trip(tmp_path):
    rng = np.random.default_rng(71)
    inputs = keras.Input((NUM_MODELS, 3, 4))
    hidden = FusedBatchNormalization(NUM_MODELS, axis=1)(inputs)
    hidden = FusedLayerNormalization(NUM_MODELS, axis=[1, 2])(hidden)
    hidden = FusedGroupNormalization(NUM_MODELS, groups=2)(hidden)
    outputs = FusedNormalization(NUM_MODELS, invert=True)(hidden)
    model = keras.Model(inputs, outputs)
    for w in model.weights:
        value = rng.standard_normal(w.shape)
        if "variance" in w.name:
            value = 0.5 + np.abs(value)
        w.assign(value.astype(w.dtype))
    path = tmp_path / "normalizations.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    x = fused_inputs(rng, (3, 4))
    np.testing.assert_array_equal(loaded(x), model(x))


@pytest.mark.parametrize("fused_class,kwargs", [
    (FusedBatchNormalization, {}),
    (FusedLayerNormalization, {}),
    (FusedGroupNormalization, {"groups": 2}),
    (FusedNormalization, {}),
])
def test_rejects_wrong_model_axis(fused_class, kwargs):
    with pytest.raises(ValueError, match="num_models=3 on axis 1"):
        fused_class(3, **kwargs)(np.zeros((BATCH, 4, 6), "float32"))


def test_batch_normalization_rejects_list_axis_like_stock():
    with pytest.raises(TypeError):
        keras.layers.BatchNormalization(axis=[1, 2])
    with pytest.raises(TypeError, match=r"one axis.*axis=\[1, 2\]"):
        FusedBatchNormalization(2, axis=[1, 2])


@pytest.mark.parametrize("fused_class", [FusedBatchNormalization,
                                         FusedLayerNormalization])
@pytest.mark.parametrize("axis", [3, -4])
def test_rejects_axis_out_of_bounds(fused_class, axis):
    # Stock rank 3: the model axis does not count, -3 is the batch.
    with pytest.raises(ValueError, match="out of bounds"):
        fused_class(2, axis=axis).build((BATCH, 2, 3, 4))


def test_layer_normalization_rejects_bad_axis_type():
    with pytest.raises(TypeError, match="int or a list"):
        FusedLayerNormalization(2, axis="last")


@pytest.mark.parametrize("renorm_clipping,match", [
    ({"rmax": 1.0, "bad": 2.0}, "invalid keys"),
    ({"rmax": 0.5, "rmin": 1.0}, "rmax should be greater"),
    ({"dmax": -1.0}, "non-negative"),
])
def test_batch_normalization_rejects_bad_renorm_clipping(renorm_clipping,
                                                         match):
    with pytest.raises(ValueError, match=match):
        FusedBatchNormalization(2, renorm=True,
                                renorm_clipping=renorm_clipping)


# RMSNormalization.


@pytest.mark.parametrize("axis, shape", [
    (-1, (5, 4)), ([1, 2], (5, 4)), (1, (4, 4)), (-1, (6,)), ([-1], (2, 3)),
])
def test_rms_normalization_matches_stock(axis, shape):
    rng = np.random.default_rng(40)
    stock = [keras.layers.RMSNormalization(axis=axis, epsilon=1e-3)
             for _ in range(NUM_MODELS)]
    for layer in stock:
        layer.build((None, *shape))
        randomize_weights(layer, rng)
    fused = FusedRMSNormalization(NUM_MODELS, axis=axis, epsilon=1e-3)
    fused.build((None, NUM_MODELS, *shape))
    fused.set_weights(stacked_weights(stock))
    x = rng.standard_normal((BATCH, NUM_MODELS, *shape)).astype("float32")
    compare_layer_with_stock(stock, fused, [x], rng)


def test_rms_normalization_is_registered_and_serializes():
    stock = keras.layers.RMSNormalization(axis=-1, epsilon=1e-4)
    fused = resolve.fuse_layer(stock, 2)
    assert isinstance(fused, FusedRMSNormalization)
    again = FusedRMSNormalization.from_config(fused.get_config())
    assert again.epsilon == 1e-4 and again.num_models == 2
