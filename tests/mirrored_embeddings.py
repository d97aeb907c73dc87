"""Trains arrays of a text model (an Embedding whose batches repeat ids)
and their stock models under MirroredStrategy over 2 logical CPU devices,
in a fresh process, and prints the largest weight difference per optimizer
setting as JSON. Run by test_distribute.py."""

import json

import tensorflow as tf

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

import keras  # noqa: E402
import numpy as np  # noqa: E402

import hftatf  # noqa: E402

B = 2
RATES = [0.05, 0.02]
SETTINGS = {
    # Stock replicas sum the dense gradients global clipping makes.
    "adam_global_clipnorm": ("Adam", {"global_clipnorm": [0.05, 1e6]}),
    "adam_global_clipnorm_one_off": ("Adam", {"global_clipnorm": [0.05, 0]}),
    "adafactor": ("Adafactor", {}),
    "rmsprop_clipnorm": ("RMSprop", {"clipnorm": [0.05, 0.1]}),
}


def build():
    ids = keras.Input((5,), dtype="int32")
    h = keras.layers.Embedding(12, 6)(ids)
    h = keras.layers.GlobalAveragePooling1D()(h)
    return keras.Model(ids, keras.layers.Dense(3, activation="softmax")(h))


rng = np.random.default_rng(0)
x = rng.integers(1, 6, (16, 5)).astype("int32")
y = rng.integers(0, 3, (16,)).astype("int32")
strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
report = {}
for name, (optimizer, kwargs) in SETTINGS.items():
    keras.utils.set_random_seed(1)
    with strategy.scope():
        array = hftatf.fuse(build(), B)
        stock = array.unfuse()
        array.compile(getattr(hftatf.optimizers, optimizer)(RATES, **kwargs),
                      loss="sparse_categorical_crossentropy")
        for b, model in enumerate(stock):
            model.compile(getattr(keras.optimizers, optimizer)(
                RATES[b], **{k: v[b] for k, v in kwargs.items() if v[b]}),
                loss="sparse_categorical_crossentropy")
    array.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    difference = 0.0
    for b, model in enumerate(stock):
        model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        difference = max(difference, *(
            float(np.max(np.abs(ours - theirs))) for ours, theirs in zip(
                array.get_model_weights(b), model.get_weights())))
    report[name] = difference
print(json.dumps(report))
