"""One fused layer against the same B stock layers, side by side: where an
array gains or loses its time, layer by layer.

For each case (a stock Keras layer, its config and one model's input
shape) and each B, it times one training-style step (forward, and the
gradients of `0.5 * sum(y ** 2)` with respect to the input and the
weights) of

  * stock: B stock layers, each stepped on its own input in turn, as B
    models trained one after another run it;
  * fused: the fused form of the layer (`hftatf.layers.registry`) on the
    `[batch, B, ...]` input of all B; with `--shared_input`, every model
    reads one batch, and the fused side is the one wide layer that
    `hftatf.fuse` builds on a shared input (a Dense or convolution).

Both run in this process, on the Keras backend it runs on (TensorFlow:
`tf.function` and a gradient tape; JAX: `jax.grad` of the layer called
on its weights' values, under `jax.jit` with `--jit true`), in rounds that
alternate stock and fused, and
the speedups are medians of the ratios of side-by-side rounds, in
wall-clock and in processor time (all threads; the steadier measure on a
throttled machine). The table also gives the size of one model's output
and of the array's: when the array's activations outgrow the processor's
last-level cache while one model's fit in it, memory-bound layers (batch
norm, activations) lose what the array saves in kernel launches.

    python -m benchmarks.layers                       # the default cases
    python -m benchmarks.layers --layer Dense \\
        --config units=256,use_bias=false --input_shape 64,256,32 \\
        --num_models 1,2,8 --jit false,true
    python -m benchmarks.layers --layer Conv2D \\
        --config filters=16,kernel_size=3 --input_shape 64,32,32,3 \\
        --shared_input
"""

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from keras import ops  # noqa: E402

# XLA by default where stock Keras compiles its steps (JAX).
if keras.backend.backend() == "tensorflow":
    import tensorflow as tf
    DEFAULT_JIT = "false"
else:
    import jax
    DEFAULT_JIT = "true"

from benchmarks import flags  # noqa: E402
from benchmarks.flags import parse_overrides  # noqa: E402
from hftatf.layers import resolve  # noqa: E402

# (stock layer class name, config, one model's input shape with its batch):
# the per-point layers of the PointNet recipe at its narrowest and widest
# (1 MiB and 16 MiB of output per model), and the convolutions of a small
# image model.
DEFAULT_CASES = (
    ("Dense", {"units": 16, "use_bias": False}, (64, 256, 16)),
    ("Dense", {"units": 256, "use_bias": False}, (64, 256, 32)),
    ("BatchNormalization", {}, (64, 256, 16)),
    ("BatchNormalization", {}, (64, 256, 256)),
    ("Activation", {"activation": "relu"}, (64, 256, 16)),
    ("Activation", {"activation": "relu"}, (64, 256, 256)),
    ("Conv2D", {"filters": 32, "kernel_size": 3, "padding": "same"},
     (64, 16, 16, 32)),
    ("DepthwiseConv2D", {"kernel_size": 3, "padding": "same"},
     (64, 16, 16, 64)),
)


def parse_args(argv):
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.layers",
        description=__doc__.split("\n\n")[0])
    parser.add_argument("--layer", default=None,
                        help="a keras.layers class name; without it, the "
                             "default cases")
    parser.add_argument("--config", default="",
                        help="the layer's arguments, name=value pairs "
                             "(tuples as (a;b))")
    parser.add_argument("--input_shape", default=None,
                        help="one model's input shape with its batch, "
                             "e.g. 64,256,32")
    parser.add_argument("--num_models", default="8",
                        help="comma-separated array sizes B")
    parser.add_argument("--jit", default=DEFAULT_JIT,
                        help="comma-separated jit_compile settings of both "
                             "sides: false, true (default: false on "
                             "TensorFlow; true on JAX, where stock Keras "
                             "compiles its steps)")
    parser.add_argument("--shared_input", action="store_true",
                        help="every model reads the same batch; the fused "
                             "side is one wide layer (Dense, convolutions)")
    parser.add_argument("--steps", type=int, default=10,
                        help="steps per model and side in one round")
    parser.add_argument("--rounds", type=int, default=5,
                        help="side-by-side rounds (medians are reported)")
    args = parser.parse_args(argv)
    args.num_models = flags.array_sizes(parser, args.num_models)
    jit_names = flags.comma_list(parser, "--jit", args.jit.lower())
    if not set(jit_names) <= {"true", "false"}:
        parser.error(f"--jit takes true and false, comma-separated; "
                     f"received {args.jit!r}")
    args.jit = [j == "true" for j in jit_names]
    flags.check_minimums(parser, args, {"steps": 1, "rounds": 1})
    if args.layer is None:
        if args.config or args.input_shape:
            parser.error("--config and --input_shape need --layer")
        args.cases = list(DEFAULT_CASES)
    else:
        if not isinstance(getattr(keras.layers, args.layer, None), type):
            parser.error(f"keras.layers has no layer {args.layer!r}")
        if not args.input_shape:
            parser.error("--layer needs --input_shape")
        try:
            shape = tuple(int(d) for d in args.input_shape.split(","))
            if any(d < 1 for d in shape):
                raise ValueError
        except ValueError:
            parser.error("--input_shape takes positive integers, "
                         f"comma-separated; received {args.input_shape!r}")
        try:
            config = parse_overrides(args.config)
        except ValueError as error:
            parser.error(str(error))
        try:
            stock_layer(args.layer, config)
        except (TypeError, ValueError) as error:
            parser.error(f"--config {args.config!r} does not make a "
                         f"keras.layers.{args.layer}: {error}; pass its "
                         "arguments as name=value pairs")
        args.cases = [(args.layer, config, shape)]
    if args.shared_input:
        for name, config, _ in args.cases:
            if not resolve.takes_shared_input(stock_layer(name, config)):
                parser.error(f"{name} has no fused form that takes a "
                             "shared input (--shared_input): a Dense or a "
                             "convolution with groups=1 does")
    return args


def stock_layer(name, config):
    return getattr(keras.layers, name)(**config)


def training_step(layer, jit_compile):
    """A function of `x`: the gradients of `0.5 * sum(y ** 2)`, `y` the
    layer's output in training, with respect to `x` and the layer's
    weights, compiled by XLA with `jit_compile`."""
    if keras.backend.backend() == "tensorflow":
        return _tensorflow_step(layer, jit_compile)
    return _jax_step(layer, jit_compile)


def _tensorflow_step(layer, jit_compile):
    @tf.function(jit_compile=jit_compile)
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x, training=True)
            loss = 0.5 * tf.reduce_sum(tf.square(y))
        return tape.gradient(loss, [x] + layer.trainable_variables)
    return step


def _jax_step(layer, jit_compile):
    def loss(x, trainable, non_trainable):
        # The layer called as a model calls it (`training` where its
        # `call` takes it), on these values of its weights.
        mapping = list(zip(layer.trainable_variables, trainable)) + list(
            zip(layer.non_trainable_variables, non_trainable))
        with keras.StatelessScope(state_mapping=mapping):
            y = layer(x, training=True)
        return 0.5 * ops.sum(ops.square(y))

    gradients = jax.grad(loss, argnums=(0, 1))
    if jit_compile:
        gradients = jax.jit(gradients)

    def step(x):
        if not layer.built:
            layer(x, training=True)
        dx, dw = gradients(x, [v.value for v in layer.trainable_variables],
                           [v.value for v in layer.non_trainable_variables])
        return [dx, *dw]
    return step


def _time(function, steps):
    """(wall, processor) seconds of `steps` calls; each call's results are
    fetched, so no work is left pending."""
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        for value in function():
            np.asarray(value)
    return time.perf_counter() - wall, time.process_time() - cpu


def measure_case(name, config, shape, num_models, jit_compile, steps, rounds,
                 seed=0, shared_input=False):
    """One row: the case's stock and fused timings (medians over rounds)
    and speedups. With `shared_input`, every model reads one batch."""
    rng = np.random.default_rng(seed)
    inputs = [ops.convert_to_tensor(rng.standard_normal(shape,
                                                        dtype="float32"))
              for _ in range(1 if shared_input else num_models)]
    stock = [stock_layer(name, config) for _ in range(num_models)]
    stock_steps = [training_step(layer, jit_compile) for layer in stock]
    fused_layer = resolve.fuse_layer(stock[0], num_models,
                                      shared_input=shared_input)
    if shared_input:
        fused_inputs, inputs = inputs[0], inputs * num_models
    else:
        fused_inputs = ops.stack(inputs, axis=1)
    fused_step = training_step(fused_layer, jit_compile)

    def run_stock():
        for step, x in zip(stock_steps, inputs):
            yield from step(x)

    def run_fused():
        return fused_step(fused_inputs)

    # Tracing, compilation and weight creation, untimed.
    _time(run_stock, 1)
    _time(run_fused, 1)
    measured = {"stock": [], "fused": []}
    for round_ in range(rounds):
        order = ("stock", "fused") if round_ % 2 == 0 else ("fused", "stock")
        for side in order:
            function = run_stock if side == "stock" else run_fused
            measured[side].append(_time(function, steps))
    stock_output = stock[0](inputs[0]).shape
    bytes_per_model = 4 * int(np.prod(stock_output))
    row = {"layer": name, "config": config, "input_shape": shape,
           "num_models": num_models, "jit_compile": jit_compile,
           "shared_input": shared_input,
           "model_output_mib": bytes_per_model / 2**20,
           "array_output_mib": num_models * bytes_per_model / 2**20}
    for index, unit in enumerate(("wall", "cpu")):
        stock_seconds = [m[index] for m in measured["stock"]]
        fused_seconds = [m[index] for m in measured["fused"]]
        row[f"stock_{unit}_ms"] = 1e3 * statistics.median(
            stock_seconds) / steps
        row[f"fused_{unit}_ms"] = 1e3 * statistics.median(
            fused_seconds) / steps
        row[f"{unit}_speedup"] = statistics.median(
            s / f for s, f in zip(stock_seconds, fused_seconds))
    return row


def _describe(row):
    config = ",".join(f"{k}={v}" for k, v in row["config"].items())
    shape = "x".join(str(d) for d in row["input_shape"])
    shared = " (shared)" if row.get("shared_input") else ""
    return f"{row['layer']}({config}) on {shape}{shared}"


def print_header():
    print(f"{'case':<64}{'B':>3}{'XLA':>6}{'MiB/model':>10}{'MiB/array':>10}"
          f"{'stock ms':>10}{'fused ms':>10}{'speedup':>9}{'CPU-time':>9}")


def print_row(row):
    print(f"{_describe(row):<64}{row['num_models']:>3}"
          f"{str(row['jit_compile']):>6}{row['model_output_mib']:>10.1f}"
          f"{row['array_output_mib']:>10.1f}{row['stock_wall_ms']:>10.2f}"
          f"{row['fused_wall_ms']:>10.2f}{row['wall_speedup']:>9.2f}"
          f"{row['cpu_speedup']:>9.2f}", flush=True)


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if keras.backend.backend() == "tensorflow":
        tf.get_logger().setLevel("ERROR")
    rows = []
    print_header()
    for name, config, shape in args.cases:
        for jit_compile in args.jit:
            for num_models in args.num_models:
                keras.backend.clear_session()
                rows.append(measure_case(
                    name, config, shape, num_models, jit_compile, args.steps,
                    args.rounds, shared_input=args.shared_input))
                print_row(rows[-1])
    return rows


if __name__ == "__main__":
    main()
