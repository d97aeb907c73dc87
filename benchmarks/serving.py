"""Serving throughput: B models merged into one array against the same B
models run one after another.

NetFuse (arXiv 2009.13062) merges B fine-tuned models of one architecture
into one graph for inference. This benchmark builds B plain Keras models
with distinct weights (what fine-tuning yields; the weights' values do not
change the cost), merges them with `hftatf.fuse_models`, and times, on the
same batch and alternately within one run:

  * merged: the array's forward pass, `[batch, ...]` -> `[batch, B, ...]`;
  * sequential: the B stock models, one `tf.function` each, called one
    after another (B servables on one device).

Both sides run as `tf.function`s, with XLA or without it alike, and hand
their outputs back as NumPy arrays (what a server returns). With
`--saved-model` it also times what a server loads: the `shared` signature of
`hftatf.export_serving` against the B per-model SavedModels of
`model.export`.

    python -m benchmarks.serving --quick     # under a minute on 2 CPU cores
    python -m benchmarks.serving --models mlp,cnn --num-models 2,4,8,16

Prints one row per architecture, B and XLA setting: milliseconds per batch
of each side (median over repeats), predictions per second (B x batch per
call) and the ratio sequential / merged (above 1: merging pays).
"""

import argparse
import csv
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import hftatf  # noqa: E402
from benchmarks import flags  # noqa: E402


def mlp():
    """784-256-256-10, as in the HFTA MNIST experiments."""
    x = keras.Input((784,), name="x")
    h = keras.layers.Dense(256, activation="relu")(x)
    h = keras.layers.Dense(256, activation="relu")(h)
    y = keras.layers.Dense(10, activation="softmax")(h)
    return keras.Model(x, y, name="mlp")


def cnn():
    """A small CIFAR-sized convolutional classifier with BatchNorm."""
    x = keras.Input((32, 32, 3), name="image")
    h = x
    for filters in (16, 32):
        h = keras.layers.Conv2D(filters, 3, padding="same", use_bias=False)(h)
        h = keras.layers.BatchNormalization()(h)
        h = keras.layers.ReLU()(h)
        h = keras.layers.MaxPooling2D()(h)
    h = keras.layers.GlobalAveragePooling2D()(h)
    y = keras.layers.Dense(10, activation="softmax")(h)
    return keras.Model(x, y, name="cnn")


ARCHITECTURES = {"mlp": mlp, "cnn": cnn}


def parse_args(argv):
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.serving",
        description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="mlp,cnn",
                        help="comma list of: " + ", ".join(ARCHITECTURES))
    parser.add_argument("--num-models", default="2,4,8",
                        help="comma list of array sizes B")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--jit", choices=("on", "off", "both"),
                        default="both", help="XLA for both sides")
    parser.add_argument("--repeats", type=int, default=7,
                        help="timings per side (the median is reported)")
    parser.add_argument("--calls", type=int, default=10,
                        help="calls per timing")
    parser.add_argument("--saved-model", action="store_true",
                        help="also time the exported SavedModels")
    parser.add_argument("--csv", help="also write the rows to this file")
    parser.add_argument("--quick", action="store_true",
                        help="small sizes for a smoke run (under a minute)")
    args = parser.parse_args(argv)
    if args.quick:
        args.models, args.num_models, args.batch_size = "mlp,cnn", "2,4", 32
        args.jit, args.repeats, args.calls = "both", 3, 5
    args.models = flags.comma_list(parser, "--models", args.models)
    unknown = [m for m in args.models if m not in ARCHITECTURES]
    if unknown:
        parser.error(f"unknown --models {unknown}; known: "
                     f"{sorted(ARCHITECTURES)}")
    args.num_models = flags.array_sizes(parser, args.num_models,
                                        "--num-models")
    for name in ("batch_size", "repeats", "calls"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1; "
                         f"received {getattr(args, name)}")
    return args


def merged_and_sequential(build, num_models, jit):
    """The B stock models, their merged array, and a call for each side."""
    models = [build() for _ in range(num_models)]
    array = hftatf.fuse_models(models)

    def compiled(model):
        return tf.function(lambda x: model(x, training=False),
                           jit_compile=jit)

    merged = compiled(array)
    singles = [compiled(model) for model in models]

    def merged_call(x):
        return np.asarray(merged(x))

    def sequential_call(x):
        return [np.asarray(single(x)) for single in singles]

    return models, array, merged_call, sequential_call


def saved_model_calls(models, array, directory):
    """The served forms: one `export_serving` SavedModel against B
    per-model ones."""
    hftatf.export_serving(array, os.path.join(directory, "array"))
    served = tf.saved_model.load(os.path.join(directory, "array"))
    singles = []
    for b, model in enumerate(models):
        path = os.path.join(directory, f"model_{b}")
        model.export(path, verbose=False)
        singles.append(tf.saved_model.load(path))

    def merged_call(x):
        return np.asarray(served.shared(x))

    def sequential_call(x):
        return [np.asarray(single.serve(x)) for single in singles]

    return merged_call, sequential_call


def time_side_by_side(merged, sequential, x, repeats, calls):
    """Median seconds per call of each, timed alternately (the order swaps
    every repeat, so drift in the machine's load hits both)."""
    outputs = merged(x)
    expected = np.stack(sequential(x), axis=1)
    # A benchmark of wrong answers measures nothing.
    np.testing.assert_allclose(outputs, expected, atol=1e-4, rtol=1e-4)
    times = {merged: [], sequential: []}
    for repeat in range(repeats):
        order = (merged, sequential) if repeat % 2 == 0 else (
            sequential, merged)
        for call in order:
            start = time.perf_counter()
            for _ in range(calls):
                call(x)
            times[call].append((time.perf_counter() - start) / calls)
    return statistics.median(times[merged]), statistics.median(
        times[sequential])


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    # Every model gets its own tf.function, by design: no retracing notes.
    tf.get_logger().setLevel("ERROR")
    jits = {"on": [True], "off": [False], "both": [False, True]}[args.jit]
    rng = np.random.default_rng(0)
    rows = []
    header = (f"{'model':<6}{'form':<13}{'B':>4}{'batch':>7}{'xla':>7}"
              f"{'merged ms':>11}{'seq. ms':>10}{'merged pred/s':>15}"
              f"{'seq. pred/s':>13}{'ratio':>7}")
    print(f"devices: {[d.name for d in tf.config.list_logical_devices()]}")
    print(header)
    for name in args.models:
        build = ARCHITECTURES[name]
        shape = build().input_shape[1:]
        x = rng.normal(size=(args.batch_size, *shape)).astype("float32")
        for num_models in args.num_models:
            keras.utils.set_random_seed(num_models)
            for jit in jits:
                models, array, merged, sequential = merged_and_sequential(
                    build, num_models, jit)
                forms = [("in memory", merged, sequential)]
                if args.saved_model and jit == jits[0]:
                    directory = tempfile.mkdtemp(prefix="hftatf-serving-")
                    forms.append(("saved model", *saved_model_calls(
                        models, array, directory)))
                for form, merged_call, sequential_call in forms:
                    merged_s, sequential_s = time_side_by_side(
                        merged_call, sequential_call, x, args.repeats,
                        args.calls)
                    predictions = num_models * args.batch_size
                    row = {
                        "model": name, "form": form, "num_models": num_models,
                        "batch_size": args.batch_size,
                        "xla": jit if form == "in memory" else "",
                        "merged_ms": 1e3 * merged_s,
                        "sequential_ms": 1e3 * sequential_s,
                        "merged_predictions_per_s": predictions / merged_s,
                        "sequential_predictions_per_s":
                            predictions / sequential_s,
                        "ratio": sequential_s / merged_s,
                    }
                    rows.append(row)
                    print(f"{name:<6}{form:<13}{num_models:>4}"
                          f"{args.batch_size:>7}{str(row['xla']):>7}"
                          f"{row['merged_ms']:>11.2f}"
                          f"{row['sequential_ms']:>10.2f}"
                          f"{row['merged_predictions_per_s']:>15.0f}"
                          f"{row['sequential_predictions_per_s']:>13.0f}"
                          f"{row['ratio']:>7.2f}", flush=True)
    if args.csv:
        with open(args.csv, "w", newline="") as file:
            writer = csv.DictWriter(file, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    return rows


if __name__ == "__main__":
    main()
