"""The programs an hftatf array compiles to, timed against the B per-model
programs they replace, on any device JAX sees: for an accelerator that has
JAX and no TensorFlow build.

An array's training step under `jit_compile=True` is one XLA program. This
script writes the same fused forms that hftatf's layers lower to in JAX,
whose XLA is the compiler TensorFlow's `jit_compile` uses, and times one
SGD training step (forward, gradients, update) of

  * serial: B models, each stepped by its own one-model program in turn
    (the model's stock form: at B = 1 every fused form below is the plain
    dot or convolution);
  * fused: one program for all B, in hftatf's layouts: activations
    `[batch, B, ...]`, the first layer of a shared input one wide layer,
    dense layers one batched dot over the model axis, convolutions folded
    into channels and run as one grouped convolution (`grouped`, hftatf's
    choice on a GPU or TPU) or as B convolutions in one program
    (`per_model`, its choice on a CPU).

The serial side pays only a Python call per model step, far less than
stock Keras `fit` pays, so the speedups are a floor for what an array gains
over stock Keras on the device. With `--torch` (PyTorch installed) it also
times the cuDNN kernels that TensorFlow runs without XLA: one grouped
convolution against B convolutions, forward and backward.

Every workload trains all models on the same batch, as `benchmarks.run`
does. "% of peak" is the FLOPs XLA counts in the program per second, against
the float32 matmul rate measured in the same run at the default precision
(TF32 on a GPU that has it, as TensorFlow's default is).

    python -m benchmarks.kernels --quick          # a small run, any device
    python -m benchmarks.kernels --torch --output_dir benchmark_results/gpu
"""

import argparse
import csv
import json
import os
import platform
import statistics
import sys
import time

import numpy as np

from benchmarks import flags

WORKLOADS = ("mlp", "mlp_wide", "convnet", "transformer")

# One model of each workload: (batch size, widths or layers, classes).
MLP = {"batch": 64, "units": (64, 128, 64, 10)}
MLP_WIDE = {"batch": 512, "units": (1024, 4096, 4096, 10)}
# (filters, stride) of 3x3 convolutions on 32x32x3 images, ResNet-like.
CONVNET = {"batch": 128, "image": (32, 32, 3), "classes": 10,
           "layers": ((64, 1), (64, 1), (128, 2), (128, 1), (256, 2),
                      (256, 1))}
# A BERT-tiny-sized encoder on float sequence inputs.
TRANSFORMER = {"batch": 32, "length": 128, "width": 128, "heads": 2,
               "ffn": 512, "layers": 2, "classes": 2}
LEARNING_RATE = 0.01


def _import_jax():
    try:
        import jax
        import jax.numpy as jnp
    except ImportError:
        sys.exit("benchmarks.kernels needs JAX: `pip install jax` "
                 "(`jax[cuda12]` or `jax[cuda13]` on an NVIDIA GPU).")
    return jax, jnp


jax, jnp = None, None


# -- The fused forms -------------------------------------------------------


def _dense_params(rng, num_models, fan_in, units):
    scale = np.sqrt(2.0 / fan_in)
    return {"kernel": rng.normal(0, scale, (num_models, fan_in, units)),
            "bias": np.zeros((num_models, units))}


def _shared_dense(x, params):
    """`[batch, i]` read by every model -> `[batch, B, o]`: one wide dot."""
    kernel = params["kernel"]
    b, i, o = kernel.shape
    wide = jnp.reshape(jnp.moveaxis(kernel, 0, 1), (i, b * o))
    y = jnp.reshape(x @ wide, (x.shape[0], b, o))
    return y + params["bias"]


def _dense(x, params):
    """`[batch, B, ..., i]` -> `[batch, B, ..., o]`, model b's own kernel."""
    y = jnp.einsum("nb...i,bio->nb...o", x, params["kernel"])
    return y + jnp.reshape(params["bias"],
                           (1, y.shape[1]) + (1,) * (y.ndim - 3) + (-1,))


def _softmax_loss(logits, labels):
    """Sum over models of each model's mean cross-entropy: model b's
    gradient is its own."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    picked = jnp.take_along_axis(logp, labels[:, None, None], axis=-1)
    return -jnp.sum(jnp.mean(picked, axis=0))


def mlp(rng, num_models, config, form):
    del form
    units = config["units"]
    params = [_dense_params(rng, num_models, i, o)
              for i, o in zip(units[:-1], units[1:])]

    def loss(params, x, y):
        h = _shared_dense(x, params[0])
        for layer in params[1:]:
            h = _dense(jax.nn.relu(h), layer)
        return _softmax_loss(h, y)

    x = rng.normal(size=(config["batch"], units[0]))
    y = rng.integers(0, units[-1], config["batch"])
    return params, loss, (x, y)


def _fold(x):
    """`[batch, B, h, w, c]` -> `[batch, h, w, B * c]`."""
    n, b, h, w, c = x.shape
    return jnp.reshape(jnp.moveaxis(x, 1, 3), (n, h, w, b * c))


def _unfold(x, num_models):
    n, h, w, bc = x.shape
    return jnp.moveaxis(jnp.reshape(x, (n, h, w, num_models, -1)), 3, 1)


def _conv(x, kernel, stride, groups=1):
    return jax.lax.conv_general_dilated(
        x, kernel, (stride, stride), "SAME",
        dimension_numbers=("NHWC", "HWIO", "NHWC"),
        feature_group_count=groups)


def _models_into_filters(kernel):
    """`[B, kh, kw, i, o]` -> `[kh, kw, i, B * o]`."""
    b, kh, kw, i, o = kernel.shape
    return jnp.reshape(jnp.moveaxis(kernel, 0, 3), (kh, kw, i, b * o))


def _fused_conv(x, kernel, stride, form):
    """`[batch, B, h, w, c]` convolved with model b's `kernel[b]`."""
    num_models = kernel.shape[0]
    if form == "grouped":
        outputs = _conv(_fold(x), _models_into_filters(kernel), stride,
                        groups=num_models)
        return _unfold(outputs, num_models)
    return jnp.stack([_conv(x[:, b], kernel[b], stride)
                      for b in range(num_models)], axis=1)


def convnet(rng, num_models, config, form):
    channels = config["image"][-1]
    params = []
    for filters, _ in config["layers"]:
        scale = np.sqrt(2.0 / (9 * channels))
        params.append({
            "kernel": rng.normal(0, scale,
                                 (num_models, 3, 3, channels, filters)),
            "bias": np.zeros((num_models, filters))})
        channels = filters
    head = _dense_params(rng, num_models, channels, config["classes"])
    strides = [stride for _, stride in config["layers"]]

    def loss(params, x, y):
        layers, head = params
        # The first layer reads the shared input: one wide convolution.
        first = layers[0]
        h = _unfold(_conv(x, _models_into_filters(first["kernel"]),
                          strides[0]), num_models)
        h = jax.nn.relu(h + first["bias"][None, :, None, None, :])
        for layer, stride in zip(layers[1:], strides[1:]):
            h = _fused_conv(h, layer["kernel"], stride, form)
            h = jax.nn.relu(h + layer["bias"][None, :, None, None, :])
        return _softmax_loss(_dense(jnp.mean(h, axis=(2, 3)), head), y)

    x = rng.normal(size=(config["batch"], *config["image"]))
    y = rng.integers(0, config["classes"], config["batch"])
    return (params, head), loss, (x, y)


def convnet_flops(config, num_models):
    """FLOPs of one training step (forward, and gradients of inputs and
    kernels: three times the forward products), counted by hand: XLA on a
    GPU runs convolutions as library calls its cost analysis leaves out."""
    height, width, channels = config["image"]
    total = 0
    for filters, stride in config["layers"]:
        height, width = -(-height // stride), -(-width // stride)
        total += 2 * height * width * 9 * channels * filters
        channels = filters
    total += 2 * channels * config["classes"]
    return 3 * total * config["batch"] * num_models


def _layer_norm(x, epsilon=1e-6):
    mean = jnp.mean(x, axis=-1, keepdims=True)
    variance = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(variance + epsilon)


def transformer(rng, num_models, config, form):
    del form
    width, heads, ffn = config["width"], config["heads"], config["ffn"]
    head_width = width // heads
    layers = []
    for _ in range(config["layers"]):
        layer = {name: _dense_params(rng, num_models, width, width)
                 for name in ("query", "key", "value", "output")}
        layer["up"] = _dense_params(rng, num_models, width, ffn)
        layer["down"] = _dense_params(rng, num_models, ffn, width)
        layers.append(layer)
    head = _dense_params(rng, num_models, width, config["classes"])

    def attention(h, layer):
        n, b, s, _ = h.shape
        q, k, v = (jnp.reshape(_dense(h, layer[name]),
                               (n, b, s, heads, head_width))
                   for name in ("query", "key", "value"))
        scores = jnp.einsum("nbqhd,nbkhd->nbhqk", q, k) / np.sqrt(head_width)
        mixed = jnp.einsum("nbhqk,nbkhd->nbqhd", jax.nn.softmax(scores), v)
        return _dense(jnp.reshape(mixed, (n, b, s, width)), layer["output"])

    def loss(params, x, y):
        layers, head = params
        h = jnp.broadcast_to(x[:, None], (x.shape[0], num_models, *x.shape[1:]))
        for layer in layers:
            h = _layer_norm(h + attention(h, layer))
            h = _layer_norm(
                h + _dense(jax.nn.gelu(_dense(h, layer["up"])), layer["down"]))
        return _softmax_loss(_dense(jnp.mean(h, axis=2), head), y)

    x = rng.normal(size=(config["batch"], config["length"], width))
    y = rng.integers(0, config["classes"], config["batch"])
    return (layers, head), loss, (x, y)


BUILDERS = {"mlp": (mlp, MLP), "mlp_wide": (mlp, MLP_WIDE),
            "convnet": (convnet, CONVNET),
            "transformer": (transformer, TRANSFORMER)}
# `--quick`: shapes a CPU steps in milliseconds.
QUICK = {"mlp_wide": {"batch": 64, "units": (256, 512, 512, 10)},
         "convnet": {"batch": 16, "image": (16, 16, 3),
                     "layers": ((16, 1), (32, 2), (32, 1))},
         "transformer": {"batch": 8, "length": 32, "width": 64, "ffn": 128,
                         "layers": 1}}
FORMS = {"convnet": ("grouped", "per_model")}


def _full_precision():
    """Float32 matrix products at full precision (not TF32) while checking."""
    return jax.default_matmul_precision("highest")


def check(workload, form, num_models=3, seed=0):
    """Largest relative difference (in norm) between the fused program's
    loss and each model's gradients and those of the model's one-model
    program on its slice of the parameters, at full float32 precision."""
    build, config = BUILDERS[workload]
    params, fused_loss, batch = build(np.random.default_rng(seed),
                                      num_models, config, form)
    _, one_loss, _ = build(np.random.default_rng(seed), 1, config, form)
    params, batch = _to_device(params), _to_device(batch)
    worst = 0.0
    with _full_precision():
        # Compiled, as op-by-op dispatch on a GPU compiles every op alone.
        value, grads = jax.jit(jax.value_and_grad(fused_loss))(params, *batch)
        one_step = jax.jit(jax.value_and_grad(one_loss))
        total = 0.0
        for b in range(num_models):
            mine = jax.tree.map(lambda a, b=b: a[b:b + 1], params)
            one_value, one_grads = one_step(mine, *batch)
            total += one_value
            got = np.concatenate([np.ravel(g[b:b + 1])
                                  for g in jax.tree.leaves(grads)])
            want = np.concatenate([np.ravel(g)
                                   for g in jax.tree.leaves(one_grads)])
            worst = max(worst, float(np.linalg.norm(got - want)
                                     / np.linalg.norm(want)))
        worst = max(worst, abs(float(value) - float(total)) / abs(float(total)))
    return worst


# -- Timing ----------------------------------------------------------------


def _to_device(tree):
    return jax.tree.map(lambda a: jnp.asarray(a, jnp.float32)
                        if np.asarray(a).dtype.kind == "f" else jnp.asarray(a),
                        tree)


class Program:
    """One compiled SGD training step of `num_models` models and its
    parameters on the device; `like` shares the compiled step of another
    program of the same shapes."""

    def __init__(self, workload, num_models, form, seed=0, like=None):
        build, config = BUILDERS[workload]
        rng = np.random.default_rng(seed)
        params, loss, batch = build(rng, num_models, config, form)
        self.params = _to_device(params)
        self.batch = _to_device(batch)
        self.samples = config["batch"]
        self.value = None
        if like is not None:
            self.step, self.flops = like.step, like.flops
            return

        def step(params, x, y):
            value, grads = jax.value_and_grad(loss)(params, x, y)
            return jax.tree.map(lambda p, g: p - LEARNING_RATE * g,
                                params, grads), value

        self.step = jax.jit(step, donate_argnums=0).lower(
            self.params, *self.batch).compile()
        self.flops = (convnet_flops(config, num_models)
                      if workload == "convnet" else _cost(self.step))

    def run(self, steps):
        for _ in range(steps):
            self.params, self.value = self.step(self.params, *self.batch)

    def block(self):
        jax.block_until_ready((self.params, self.value))


def _cost(compiled):
    try:
        cost = compiled.cost_analysis()
    except Exception:  # noqa: BLE001 - not every backend reports costs
        return None
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else {}
    return (cost or {}).get("flops")


class Serial:
    """B one-model programs stepped one after another."""

    def __init__(self, workload, num_models):
        first = Program(workload, 1, "grouped")
        self.programs = [first] + [
            Program(workload, 1, "grouped", seed=b, like=first)
            for b in range(1, num_models)]
        self.flops = (None if self.programs[0].flops is None
                      else num_models * self.programs[0].flops)
        self.samples = self.programs[0].samples

    def run(self, steps):
        for _ in range(steps):
            for program in self.programs:
                program.run(1)

    def block(self):
        for program in self.programs:
            program.block()


def _seconds_per_step(sides, seconds, repeats):
    """Median seconds per step of each side, timed in alternating rounds of
    about `seconds` each."""
    counts = []
    for side in sides:
        side.run(2)  # warm-up: first dispatches and allocations
        side.block()
        steps, elapsed = 1, 0.0
        while elapsed < seconds / 4 and steps < 1 << 20:
            steps *= 2
            start = time.perf_counter()
            side.run(steps)
            side.block()
            elapsed = time.perf_counter() - start
        counts.append(max(1, int(steps * seconds / elapsed)))
    times = [[] for _ in sides]
    for _ in range(repeats):
        for side, steps, measured in zip(sides, counts, times):
            start = time.perf_counter()
            side.run(steps)
            side.block()
            measured.append((time.perf_counter() - start) / steps)
    return [statistics.median(measured) for measured in times]


def matmul_peak(size, dtype, precision, repeats=10):
    """FLOP/s of a `size`-cube matrix product on the default device."""
    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.normal(size=(size, size)), dtype)
    b = jnp.asarray(rng.normal(size=(size, size)), dtype)
    product = jax.jit(lambda a, b: jnp.matmul(a, b, precision=precision))
    product(a, b).block_until_ready()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        product(a, b).block_until_ready()
        times.append(time.perf_counter() - start)
    return 2 * size ** 3 / statistics.median(times)


# -- cuDNN kernels through PyTorch ------------------------------------------


# (batch, image size, channels, filters) of one model's 3x3 convolution.
TORCH_CASES = ((128, 32, 64, 64), (128, 16, 128, 128), (128, 8, 256, 256))


def _cudnn_case(torch, device, batch, size, channels, filters, num_models,
                repeats):
    """Median seconds of B convolutions and of one grouped convolution."""
    # Each model reads its own input, as B models do; the array's
    # activations are already folded into one tensor.
    inputs = [torch.randn(batch, channels, size, size, device=device)
              .to(memory_format=torch.channels_last).requires_grad_()
              for _ in range(num_models)]
    folded = torch.cat([x.detach() for x in inputs], 1).to(
        memory_format=torch.channels_last).requires_grad_()
    kernels = [torch.randn(filters, channels, 3, 3, device=device,
                           requires_grad=True) for _ in range(num_models)]
    wide = torch.cat([k.detach() for k in kernels]).requires_grad_()

    def grouped():
        y = torch.nn.functional.conv2d(folded, wide, padding=1,
                                       groups=num_models)
        y.backward(torch.ones_like(y))

    def per_model():
        for x, kernel in zip(inputs, kernels):
            y = torch.nn.functional.conv2d(x, kernel, padding=1)
            y.backward(torch.ones_like(y))

    seconds = []
    for function in (per_model, grouped):
        for _ in range(3):
            function()
        times = []
        for _ in range(repeats):
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            function()
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        seconds.append(statistics.median(times))
    return seconds


def torch_convolutions(num_models_list, repeats, cases=TORCH_CASES):
    """Forward and backward of one grouped cuDNN convolution against B
    convolutions, channels-last, TF32 on: the choice TensorFlow makes
    without XLA."""
    try:
        import torch
    except ImportError:
        print("--torch: PyTorch is not installed; skipped.")
        return []
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.allow_tf32 = True
    rows = []
    for batch, size, channels, filters in cases:
        for num_models in num_models_list:
            seconds = _cudnn_case(torch, device, batch, size, channels,
                                  filters, num_models, repeats)
            rows.append({"case": f"{size}x{size}x{channels}->{filters}",
                         "batch": batch, "num_models": num_models,
                         "per_model_ms": 1e3 * seconds[0],
                         "grouped_ms": 1e3 * seconds[1],
                         "grouped_speedup": seconds[0] / seconds[1]})
            print("cudnn conv {case} B={num_models}: per-model "
                  "{per_model_ms:.3f} ms, grouped {grouped_ms:.3f} ms, "
                  "grouped {grouped_speedup:.2f}x".format(**rows[-1]),
                  flush=True)
    return rows


# -- The run ---------------------------------------------------------------


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default=",".join(WORKLOADS),
                        help=f"comma-separated, of {', '.join(WORKLOADS)}")
    parser.add_argument("--num_models", default="1,2,4,8,16,32",
                        help="comma list of array sizes B")
    parser.add_argument("--batch_size", type=int, default=None,
                        help="samples per step of every model (default: "
                        "each workload's own)")
    parser.add_argument("--seconds", type=float, default=0.1,
                        help="length of one timed round of each side")
    parser.add_argument("--repeats", type=int, default=5,
                        help="timed rounds of each side; medians reported")
    parser.add_argument("--torch", action="store_true",
                        help="also time cuDNN grouped convolutions (PyTorch)")
    parser.add_argument("--quick", action="store_true",
                        help="B = 1, 2, 4; small matmul; short rounds")
    parser.add_argument("--output_dir", default="benchmark_results/kernels")
    args = parser.parse_args(argv)
    args.workloads = flags.comma_list(parser, "--workloads", args.workloads)
    unknown = sorted(set(args.workloads) - set(WORKLOADS))
    if unknown:
        parser.error(f"unknown workloads {unknown}; choose from {WORKLOADS}")
    args.num_models = flags.array_sizes(parser, args.num_models)
    flags.check_minimums(parser, args, {"repeats": 1})
    if args.seconds <= 0:
        parser.error(f"--seconds must be positive; received {args.seconds}")
    if args.quick:
        args.num_models = [b for b in args.num_models if b <= 4] or [1, 2, 4]
        args.seconds = min(args.seconds, 0.05)
        args.repeats = min(args.repeats, 3)
        for workload, overrides in QUICK.items():
            BUILDERS[workload][1].update(overrides)
    if args.batch_size is not None:
        flags.check_minimums(parser, args, {"batch_size": 1})
        for _, config in BUILDERS.values():
            config["batch"] = args.batch_size
    return args


def _plot(rows, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot.")
        return
    figure, axes = plt.subplots(figsize=(6, 4))
    for (workload, form) in sorted({(r["workload"], r["form"]) for r in rows}):
        points = [(r["num_models"], r["speedup"]) for r in rows
                  if r["workload"] == workload and r["form"] == form]
        axes.plot(*zip(*points), marker="o", label=f"{workload} ({form})")
    axes.axhline(1.0, color="gray", linewidth=0.8)
    axes.set_xscale("log", base=2)
    axes.set_xlabel("models in the array (B)")
    axes.set_ylabel("fused speedup over serial")
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    print(f"wrote {path}")


def _write_csv(rows, output_dir):
    """Rewritten after every row, so a run that is stopped keeps what it
    measured."""
    with open(os.path.join(output_dir, "kernels.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def main(argv=None):
    started = time.perf_counter()
    args = parse_args(argv)
    global jax, jnp
    jax, jnp = _import_jax()
    os.makedirs(args.output_dir, exist_ok=True)
    device = jax.devices()[0]
    accelerator = device.platform != "cpu"
    size = 8192 if accelerator and not args.quick else 1024
    peaks = {
        "float32_default": matmul_peak(size, jnp.float32, None),
        "float32_highest": matmul_peak(size, jnp.float32, "highest"),
        "bfloat16": matmul_peak(size, jnp.bfloat16, None),
    }
    info = {"device": getattr(device, "device_kind", str(device)),
            "platform": device.platform, "jax": jax.__version__,
            "python": platform.python_version(), "matmul_size": size,
            "peak_flops": peaks}
    print(json.dumps(info, indent=1), flush=True)
    peak = peaks["float32_default"]

    rows = []
    for workload in args.workloads:
        for form in FORMS.get(workload, ("fused",)):
            error = check(workload, form)
            print(f"{workload} ({form}): fused against one-model programs, "
                  f"largest relative difference {error:.1e}", flush=True)
            if not error < 1e-4:
                sys.exit(f"{workload} ({form}): the fused program does not "
                         "compute the models' own steps; nothing timed.")
            for num_models in args.num_models:
                serial = Serial(workload, num_models)
                fused = Program(workload, num_models, form)
                serial_s, fused_s = _seconds_per_step(
                    [serial, fused], args.seconds, args.repeats)
                samples = num_models * fused.samples
                row = {"workload": workload, "form": form,
                       "num_models": num_models,
                       "serial_ms": 1e3 * serial_s,
                       "fused_ms": 1e3 * fused_s,
                       "serial_model_samples_per_s": samples / serial_s,
                       "fused_model_samples_per_s": samples / fused_s,
                       "speedup": serial_s / fused_s,
                       "fused_pct_of_peak": (
                           None if fused.flops is None
                           else 100 * fused.flops / fused_s / peak),
                       "serial_pct_of_peak": (
                           None if serial.flops is None
                           else 100 * serial.flops / serial_s / peak)}
                rows.append(row)
                _write_csv(rows, args.output_dir)
                print("{workload} ({form}) B={num_models}: serial "
                      "{serial_ms:.3f} ms, fused {fused_ms:.3f} ms, "
                      "speedup {speedup:.2f}x".format(**row),
                      f"[{time.perf_counter() - started:.0f} s]", flush=True)
                del serial, fused

    torch_rows = (torch_convolutions(
        [b for b in args.num_models if b > 1], args.repeats,
        ((8, 8, 8, 8),) if args.quick else TORCH_CASES)
        if args.torch else [])

    with open(os.path.join(args.output_dir, "kernels.json"), "w") as f:
        json.dump({"info": info, "rows": rows, "cudnn": torch_rows}, f,
                  indent=1)
    _plot(rows, os.path.join(args.output_dir, "kernels_speedup.png"))

    def pct(value):
        return "-" if value is None else f"{value:.1f}"

    print(f"\n{info['device']} ({info['platform']}), float32 matmul peak "
          f"{peak / 1e12:.1f} TFLOP/s (highest precision "
          f"{peaks['float32_highest'] / 1e12:.1f}, bfloat16 "
          f"{peaks['bfloat16'] / 1e12:.1f})\n")
    print("| workload | form | B | serial ms/step | fused ms/step | speedup "
          "| serial % of peak | fused % of peak |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        print(f"| {row['workload']} | {row['form']} | {row['num_models']} | "
              f"{row['serial_ms']:.3f} | {row['fused_ms']:.3f} | "
              f"{row['speedup']:.2f}x | {pct(row['serial_pct_of_peak'])} | "
              f"{pct(row['fused_pct_of_peak'])} |")
    if torch_rows:
        print("\n| cuDNN convolution | B | B convolutions ms | grouped ms "
              "| grouped speedup |\n|---|---:|---:|---:|---:|")
        for row in torch_rows:
            print(f"| {row['case']} | {row['num_models']} | "
                  f"{row['per_model_ms']:.3f} | {row['grouped_ms']:.3f} | "
                  f"{row['grouped_speedup']:.2f}x |")


if __name__ == "__main__":
    main()
