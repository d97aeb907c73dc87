"""Trains an array on 4 CPU devices under a `keras.distribution` and on
one device, and prints what `test_jax_distribution.py` checks (JSON)."""

import contextlib
import json
import sys

import jax
import keras
import numpy as np

import hftatf
from hftatf.distribution import ModelAxisParallel, distribution_from_name

B = 4


def network():
    x = keras.Input((6,))
    h = keras.layers.Dense(8, activation="relu")(x)
    h = keras.layers.BatchNormalization()(h)
    return keras.Model(x, keras.layers.Dense(3)(h))


def train(distribution, initial):
    keras.utils.set_random_seed(0)
    with (distribution.scope() if distribution
          else contextlib.nullcontext()):
        array = hftatf.fuse(network(), B)
        array.set_weights(initial)
        # SGD with momentum: an update proportional to the gradients, so
        # that a batch split over devices, which sums the gradients in
        # another order, moves the weights by that rounding alone (Adam
        # divides a near-zero gradient by its own size, and its rounding
        # becomes a difference of the order of the learning rate).
        array.compile(hftatf.optimizers.SGD([0.005, 0.01, 0.02, 0.05],
                                            momentum=0.9),
                      loss=keras.losses.SparseCategoricalCrossentropy(
                          from_logits=True), metrics=["accuracy"])
        rng = np.random.default_rng(0)
        x = rng.normal(size=(32, 6)).astype("float32")
        y = rng.integers(0, 3, (32,)).astype("int32")
        history = array.fit(x, y, batch_size=8, epochs=2, shuffle=False,
                            verbose=0).history
    return array, history


def main(case):
    devices = keras.distribution.list_devices()
    if case == "indivisible":
        errors = []
        for make in (lambda: ModelAxisParallel(6, devices),
                     lambda: distribution_from_name("models", 6, devices)):
            try:
                make()
            except ValueError as error:
                errors.append(str(error))
        print(json.dumps({"errors": errors}))
        return
    if case == "partial_batch":
        x = np.zeros((21, 6), "float32")
        y = np.zeros((21,), "int32")
        refusals = {}
        with keras.distribution.DataParallel(devices=devices).scope():
            array = hftatf.fuse(network(), B)
            array.compile(hftatf.optimizers.SGD(0.1),
                          loss="sparse_categorical_crossentropy")
            before = [np.asarray(w) for w in array.get_weights()]
            for name, call in (
                    ("fit", lambda: array.fit(x, y, batch_size=8,
                                              verbose=0)),
                    ("predict", lambda: array.predict(x, batch_size=6,
                                                      verbose=0))):
                try:
                    call()
                except ValueError as error:
                    refusals[name] = str(error)
            untouched = all(np.array_equal(a, np.asarray(b)) for a, b in zip(
                before, array.get_weights()))
        print(json.dumps({"refusals": refusals, "untouched": untouched}))
        return
    distribution = {
        "models": lambda: ModelAxisParallel(B, devices),
        "data": lambda: keras.distribution.DataParallel(devices=devices),
        "models_and_batch": lambda: ModelAxisParallel(
            B, devices, model_devices=2),
    }[case]()
    keras.utils.set_random_seed(0)
    initial = hftatf.fuse(network(), B).get_weights()
    ours, history = train(distribution, initial)
    theirs, expected = train(None, initial)
    difference = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                     for a, b in zip(ours.weights, theirs.weights))
    change = max(float(np.max(np.abs(np.asarray(a) - b)))
                 for a, b in zip(theirs.weights, initial) if a.trainable)
    kernel = ours.trainable_variables[0].value
    spec = [a for a in kernel.sharding.spec] if hasattr(
        kernel.sharding, "spec") else []
    print(json.dumps({
        "devices": len(jax.devices()),
        "largest_difference": difference,
        "largest_change": change,
        "losses_match": all(np.allclose(history[k], expected[k], rtol=1e-5,
                                        atol=1e-6) for k in expected),
        "kernel_spec": spec,
    }))


if __name__ == "__main__":
    main(sys.argv[1])
