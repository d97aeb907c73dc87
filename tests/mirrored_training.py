"""Trains one array on one device and under MirroredStrategy over N logical
CPU devices, in a fresh process (logical devices must be configured before
TensorFlow starts), and prints the largest weight and loss differences as
JSON. Run by test_distribute.py: `python mirrored_training.py N`."""

import json
import sys

import tensorflow as tf

REPLICAS = int(sys.argv[1])
# Synchronized BatchNormalization makes every replica normalise over the
# global batch, as one device does; it synchronises inside the forward pass,
# which then runs without XLA. Without it, the replica pass is compiled.
SYNCHRONIZED = len(sys.argv) > 2 and sys.argv[2] == "synchronized"
# Each replica's step computes its models in passes of one.
MODELS_PER_PASS = 1 if len(sys.argv) > 2 and sys.argv[2] == "passes" else None
# `jit_compile=True` asks for what "auto" gives under a strategy: each
# replica's pass compiled (Keras's whole distributed step does not compile).
JIT_COMPILE = (True if len(sys.argv) > 2 and sys.argv[2] == "compiled"
               else "auto")
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    cpu, [tf.config.LogicalDeviceConfiguration()] * REPLICAS)

import keras  # noqa: E402
import numpy as np  # noqa: E402

import hftatf  # noqa: E402

B = 3
STEPS = 10
GLOBAL_BATCH = 8


def build():
    keras.utils.set_random_seed(0)
    x = keras.Input((6,))
    h = keras.layers.Dense(8, activation="relu",
                           kernel_regularizer=keras.regularizers.L2(1e-3))(x)
    if SYNCHRONIZED:
        h = keras.layers.BatchNormalization(synchronized=True)(h)
    else:
        h = keras.layers.LayerNormalization()(h)
    y = keras.layers.Dense(3)(h)
    return hftatf.fuse(keras.Model(x, y), B)


def train(strategy):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(STEPS * GLOBAL_BATCH, 6)).astype("float32")
    y = rng.integers(0, 3, STEPS * GLOBAL_BATCH)
    with strategy.scope():
        array = build()
        array.compile(
            optimizer=hftatf.optimizers.Adam([0.01, 0.02, 0.03]),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"], models_per_pass=MODELS_PER_PASS,
            jit_compile=JIT_COMPILE)
    history = array.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1,
                        shuffle=False, verbose=0)
    weights = [np.asarray(w) for w in array.get_weights()]
    compiled.append(array._compiled_forward is not None)
    return weights, history.history


compiled = []


single, single_history = train(tf.distribute.OneDeviceStrategy("/cpu:0"))
devices = [d.name for d in tf.config.list_logical_devices("CPU")]
mirrored, mirrored_history = train(tf.distribute.MirroredStrategy(devices))
print(json.dumps({
    "replicas": len(devices),
    "max_weight_difference": max(
        float(np.max(np.abs(a - b))) for a, b in zip(single, mirrored)),
    "max_log_difference": max(
        abs(single_history[k][-1] - mirrored_history[k][-1])
        for k in single_history),
    "logs": sorted(single_history),
    "replica_xla": compiled,
}))
