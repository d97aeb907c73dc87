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

The fused programs and their check are in `benchmarks.kernel_forms`, how
they are timed in `benchmarks.kernel_timing`, the cuDNN kernels in
`benchmarks.kernel_cudnn`; this module is the command.

    python -m benchmarks.kernels --quick          # a small run, any device
    python -m benchmarks.kernels --torch --output_dir benchmark_results/gpu
"""

import argparse
import csv
import json
import os
import platform
import sys
import time

# Said once, before anything else needs JAX.
try:
    import jax
    import jax.numpy as jnp
except ImportError:
    sys.exit("benchmarks.kernels needs JAX: `pip install jax` "
             "(`jax[cuda12]` or `jax[cuda13]` on an NVIDIA GPU).")

from benchmarks import flags
from benchmarks.kernel_cudnn import TORCH_CASES, torch_convolutions
from benchmarks.kernel_forms import BUILDERS, FORMS, QUICK, WORKLOADS, check
from benchmarks.kernel_timing import (
    Program,
    Serial,
    matmul_peak,
    seconds_per_step,
)


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
                serial_s, fused_s = seconds_per_step(
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
