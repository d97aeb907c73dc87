"""Training throughput: an hftatf array of B models against the same B
models trained by stock Keras, one after another and all at once.

For every model (a zoo recipe, `hftatf.models.recipes.names()`) and every
array size B it times three ways of training B models on the same data:

  * serial: B stock Keras models trained with stock `fit` one after
    another, with the stock `jit_compile` setting that is faster on this
    device for this model (both are measured first, by a probe);
  * concurrent: B processes, each training one stock model, started
    together once all have compiled;
  * fused: one array of B (`hftatf.fuse(model, B)`, the fused form of the
    recipe's optimizer), with the faster `jit_compile` setting, measured
    like the stock one (`--fused_jit auto` takes hftatf's default).

Keras runs on `--backend` (or `KERAS_BACKEND`) in every worker; on JAX
every step is compiled by XLA, so the probe measures `jit_compile=True`
alone there.

Every mode does the same global work: `epochs` x `steps` steps of
`batch_size` samples for each of the B models, after untimed warm-up steps
(tracing and compilation). Every mode is timed the same way, by the median
epoch of each process: serial adds up its models' median epochs; the
concurrent processes' rates (steps per median epoch) add up. Each
measurement runs in a fresh process, so its peak memory (RSS; summed over
the processes of the concurrent mode) is its own. With `--repeats R` every
measurement is repeated R times, the order of the modes rotating, and the
speedups are the medians of the ratios of measurements made side by side.
A measurement that runs past `--timeout` is recorded as timed out, and one
whose worker crashes as failed (its error is printed); neither has a
throughput or a speedup, and the run goes on. The run exits with status 1
when a measurement failed. On a time budget (a borrowed accelerator):
`--time_budget` starts no measurement after that many seconds and reports
what was measured; `--serial_models K` times K stock models of the serial
mode once and scales their time to each B. `--num_models 1,8,auto` also
measures the B that `hftatf.tuning.auto_num_models` picks for each model on
this device (the largest array that fits and still pays, up to
`--max_num_models`). `--dtype_policy` trains the
stock models and the array alike under a Keras mixed-precision policy;
where the device reports its own memory (a GPU), each mode's peak there is
recorded too.

    python -m benchmarks.run --quick
    python -m benchmarks.run --backend jax --quick --num_models 8
    python -m benchmarks.run --model mlp,pointnet --num_models 1,2,4,8,16
    python -m benchmarks.run --model all --repeats 3

It prints one row per model, mode and B: throughput in model-samples per
second, speedup over serial (median and range over repeats), the speedup
in processor time (model-samples per CPU-second of all threads, summed
over the concurrent processes: the steadier measure where wall-clock time
is throttled in coarse steps, as on shared virtual machines), peak memory,
and achieved FLOP/s (the FLOPs XLA counts in one stock training step, times
the steps all B models took, per second) against the matmul peak measured
on this device in the same run. The rows go to `<output_dir>/results.csv`
as each B is measured (and a Markdown table to `results.md`), and
speedup-vs-B curves to
`<output_dir>/speedup_<model>.png` and
`speedup.png` when matplotlib is installed.

This module measures; its flags are parsed in `benchmarks.run_flags`, its
worker processes started in `benchmarks.run_workers`, and its results
written and drawn in `benchmarks.run_results`.
"""

import os
import pathlib
import platform
import subprocess
import sys
import tempfile
import time

from benchmarks.protocol import summarize
from benchmarks.run_flags import parse_args, whole_executions
from benchmarks.run_results import read_csv, report, write_csv
from benchmarks.run_workers import WorkerError, run_concurrent, run_worker

# What `benchmark_model` records for a measurement that did not finish.
TIMED_OUT, FAILED = "timed out", "failed"


def _missing(measurement):
    return isinstance(measurement, str)


def _median(values):
    return summarize(values)[0]


def _best_settings(args):
    """The `jit_compile` settings `--stock_jit best` and `--fused_jit best`
    compare. On JAX a step without XLA runs op by op in Python, nobody
    trains so: XLA alone."""
    return [True] if args.backend == "jax" else [False, True]


def probe_model(args, name, base):
    """Measures one stock model with and without XLA: the stock setting,
    the step count of `--steps auto`, FLOPs and the matmul peak."""
    settings = (_best_settings(args) if args.stock_jit == "best"
                else [args.stock_jit == "true"])
    print(f"[{name}] probing the stock model (jit_compile "
          f"{', '.join(str(s) for s in settings)})...", flush=True)
    probe_steps = (args.steps if args.steps != "auto"
                   else whole_executions(10, args.execution))
    result = run_worker({**base, "task": "probe", "steps": probe_steps,
                         "jit_settings": settings,
                         "peak_size": args.peak_size,
                         "peak_seconds": args.peak_seconds}, args.timeout)
    seconds = {jit == "true": _median(times) / probe_steps
               for jit, times in result["jit"].items()}
    jit = min(seconds, key=seconds.get)
    steps = args.steps
    if steps == "auto":
        steps = whole_executions(max(5, min(1000, round(
            args.epoch_seconds / seconds[jit]))), args.execution)
    timings = ", ".join(f"{1e3 * s:.1f} ms with jit_compile={j}"
                        for j, s in seconds.items())
    print(f"[{name}] stock step: {timings}; serial uses jit_compile={jit}; "
          f"{steps} steps per epoch", flush=True)
    return {"jit_compile": jit, "steps": steps,
            "step_flops": result["step_flops"],
            "matmul_peak_flops": result["matmul_peak_flops"],
            "stock_seconds": seconds}


def size_array(args, name, base, failed):
    """The B that `hftatf.tuning.auto_num_models` picks for model `name` on
    this device (`--num_models auto`), or None where the sizing ran past
    --timeout or failed (then noted in `failed`)."""
    print(f"[{name}] sizing the array (auto_num_models, B up to "
          f"{args.max_num_models})...", flush=True)
    try:
        result = run_worker({**base, "task": "size",
                             "max_num_models": args.max_num_models},
                            args.timeout)
    except subprocess.TimeoutExpired:
        print(f"[{name}] sizing ran past --timeout {args.timeout:.0f} s",
              flush=True)
        failed.append(f"{name} sizing")
        return None
    except WorkerError as error:
        print(f"[{name}] sizing failed:\n{error}", flush=True)
        failed.append(f"{name} sizing")
        return None
    print(f"[{name}] auto_num_models picks B={result['num_models']}",
          flush=True)
    return result["num_models"]


def measure_mode(args, mode, num_models, spec, serial=None):
    """`(seconds per round, processor seconds per round, peak RSS MiB,
    peak device MiB, jit, models per pass)`: a round is `steps` steps of
    each of the B models; models per pass is None for the stock modes, and
    peak device memory None where the device does not report it (a CPU).

    The serial mode trains `_serial_count` stock models and scales their
    time to B; `serial`, where given, keeps its measurements by that count
    for the next B (`--serial_models`).

    Every mode times epochs alike: each process's median epoch. Raises
    `subprocess.TimeoutExpired` when the mode did not finish within
    `--timeout`, and `WorkerError` when its worker crashed (for the fused
    mode: under no `jit_compile` setting; a crash wins over a timeout).
    """
    if mode == "serial":
        count = _serial_count(args, num_models)
        if serial is None or count not in serial:
            result = run_worker({**spec, "task": "serial",
                                 "num_models": count}, args.timeout)
            timed = (sum(_median(epochs)
                         for epochs in result["model_epoch_seconds"]),
                     sum(_median(epochs)
                         for epochs in result["model_epoch_cpu_seconds"]),
                     result["peak_rss_mb"], result.get("peak_device_mb"))
            if serial is not None:
                serial[count] = timed
        else:
            timed = serial[count]
        seconds, cpu_seconds, rss, device = timed
        scale = num_models / count
        return (seconds * scale, cpu_seconds * scale, rss, device,
                spec["jit_compile"], None)
    if mode == "concurrent":
        results = run_concurrent(spec, num_models, args.timeout)
        # Each process trains `steps` steps per median epoch, all at once:
        # their rates add up. A round, B models' steps, takes B over that
        # sum of rounds per second.
        rate = sum(1.0 / _median(r["epoch_seconds"]) for r in results)
        cpu_seconds = sum(_median(r["epoch_cpu_seconds"]) for r in results)
        return (num_models / rate, cpu_seconds,
                sum(r["peak_rss_mb"] for r in results),
                _unless_missing(sum, (r.get("peak_device_mb")
                                      for r in results)),
                spec["jit_compile"], None)
    settings = (_best_settings(args) if args.fused_jit == "best"
                else [spec["fused_jit_compile"]])
    best, timeout, error = None, args.timeout, None
    for jit in settings:
        started = time.perf_counter()
        try:
            result = run_worker({**spec, "task": "fused",
                                 "num_models": num_models,
                                 "fused_jit_compile": jit}, timeout)
        except subprocess.TimeoutExpired as expired:
            # Far slower than the setting already measured: not the best.
            print(f"[{spec['model']}] B={num_models} fused with "
                  f"jit_compile={jit}: stopped after {timeout:.0f} s",
                  flush=True)
            if not isinstance(error, WorkerError):
                error = expired
            continue
        except WorkerError as crashed:
            # E.g. an XLA compilation failure: the other setting may run.
            print(f"[{spec['model']}] B={num_models} fused with "
                  f"jit_compile={jit} failed: {crashed}", flush=True)
            error = crashed
            continue
        seconds = _median(result["epoch_seconds"])
        if best is None or seconds < best[0]:
            best = (seconds, _median(result["epoch_cpu_seconds"]),
                    result["peak_rss_mb"], result.get("peak_device_mb"),
                    result["jit_compile"], result.get("models_per_pass"))
        # The other setting gets a few times as long as this one took.
        timeout = min(args.timeout, max(
            120.0, 3 * (time.perf_counter() - started)))
    if best is None:
        raise error
    return best


def _serial_count(args, num_models):
    """How many stock models the serial mode trains at B (`--serial_models`:
    B, or at most that many)."""
    if args.serial_models == "all":
        return num_models
    return min(num_models, args.serial_models)


def _unless_missing(combine, values):
    """`combine(values)`, or None where one of them is None (a device that
    reports no memory of its own)."""
    values = list(values)
    return None if any(v is None for v in values) else combine(values)


def _past_budget(args):
    """Whether the run is past `--time_budget`: measurements not started
    by then are left out."""
    return args.deadline is not None and time.monotonic() > args.deadline


def _models_per_pass(setting, num_models):
    """The array's `models_per_pass` for `--models_per_pass setting` at B:
    None for 'all' (one pass), a count at most B."""
    if setting == "all":
        return None
    if setting == "auto":
        return setting
    return min(setting, num_models)


def benchmark_model(args, name, failed):
    """Every mode at every B for the zoo model `name`: yields the CSV rows
    of each B (one per mode) as soon as they are measured.

    A measurement that runs past `--timeout` is recorded as timed out, and
    one whose worker crashed as failed (no throughput); the run goes on. A
    probe that times out or fails leaves the model out. What crashed (the
    probe, or a mode at a B) is appended to the list `failed`.
    """
    base = {"model": name, "batch_size": args.batch_size,
            "model_args": args.model_args, "data_args": args.data_args,
            "epochs": args.epochs, "warmup_steps": args.warmup_steps,
            "data_batches": args.data_batches, "seed": args.seed,
            "fused_jit_compile": {"auto": "auto", "true": True,
                                  "false": False}.get(args.fused_jit),
            "steps_per_execution": args.steps_per_execution,
            "stock_steps_per_execution": args.stock_steps_per_execution,
            "dtype_policy": args.dtype_policy}
    if _past_budget(args):
        print(f"[{name}] left out: past --time_budget "
              f"{args.time_budget:.0f} s", flush=True)
        return
    try:
        probe = probe_model(args, name, base)
    except subprocess.TimeoutExpired:
        print(f"[{name}] the probe ran past --timeout {args.timeout:.0f} s: "
              f"{name} is not measured", flush=True)
        return
    except WorkerError as error:
        print(f"[{name}] the probe failed: {name} is not measured.\n{error}",
              flush=True)
        failed.append(f"{name} probe")
        return
    spec = {**base, "steps": probe["steps"],
            "jit_compile": probe["jit_compile"]}
    work = spec["steps"] * args.batch_size
    sizes, sized = list(args.num_models), None
    if args.auto_size and not _past_budget(args):
        sized = size_array(args, name, base, failed)
        if sized is not None and sized not in sizes:
            sizes = sorted(sizes + [sized])
    # The serial mode's measurements of each repeat, by model count, where
    # --serial_models times fewer than B models.
    serial = [{} for _ in range(args.repeats)]
    for num_models in sizes:
        spec_b = {**spec, "models_per_pass": _models_per_pass(
            args.models_per_pass, num_models)}
        measured = {mode: [] for mode in args.modes}
        for repeat in range(args.repeats):
            shift = repeat % len(args.modes)
            for mode in args.modes[shift:] + args.modes[:shift]:
                if _past_budget(args):
                    print(f"[{name}] B={num_models:<3} {mode:<10} left "
                          f"out: past --time_budget {args.time_budget:.0f} "
                          "s", flush=True)
                    continue
                try:
                    (seconds, cpu_seconds, rss, device, jit,
                     per_pass) = measure_mode(args, mode, num_models,
                                              spec_b, serial[repeat])
                except subprocess.TimeoutExpired:
                    print(f"[{name}] B={num_models:<3} {mode:<10} timed out "
                          f"after {args.timeout:.0f} s", flush=True)
                    measured[mode].append(TIMED_OUT)
                    continue
                except WorkerError as error:
                    print(f"[{name}] B={num_models:<3} {mode:<10} failed:\n"
                          f"{error}", flush=True)
                    measured[mode].append(FAILED)
                    failed.append(f"{name} B={num_models} {mode}")
                    continue
                measured[mode].append((num_models * work / seconds, rss, jit,
                                       os.getloadavg()[0],
                                       num_models * work / cpu_seconds,
                                       per_pass, device))
                on_device = ("" if device is None
                             else f"  {device:8.0f} device MiB")
                print(f"[{name}] B={num_models:<3} {mode:<10} "
                      f"{num_models * work / seconds:10.1f} samples/s  "
                      f"{rss:8.0f} MiB{on_device}", flush=True)
        if not any(measured.values()):
            return
        rows = [_row(args, name, mode, num_models, values,
                     measured.get("serial"), probe)
                for mode, values in measured.items() if values]
        for row in rows:
            row["sized"] = num_models == sized
        yield rows


def _row(args, name, mode, num_models, values, serial, probe):
    """The CSV row of one mode at B from its measurements (`TIMED_OUT` or
    `FAILED` for one that did not finish); `serial` holds the serial
    mode's, side by side."""
    done = [v for v in values if not _missing(v)]
    row = {"model": name, "mode": mode, "num_models": num_models,
           "batch_size": args.batch_size, "steps": probe["steps"],
           "epochs": args.epochs, "repeats": len(done),
           "timeouts": values.count(TIMED_OUT),
           "failures": values.count(FAILED),
           "dtype_policy": args.dtype_policy}
    if mode == "serial":
        row["serial_models_timed"] = _serial_count(args, num_models)
    flops, peak = probe["step_flops"], probe["matmul_peak_flops"]
    row["matmul_peak_gflop_per_s"] = peak / 1e9
    if not done:
        return row
    rates = [v[0] for v in done]
    rate, low, high = summarize(rates)
    row.update({"jit_compile": done[0][2], "models_per_pass": done[0][5],
                "samples_per_s": rate,
                "samples_per_s_min": low, "samples_per_s_max": high,
                "peak_rss_mb": _median([v[1] for v in done]),
                "peak_device_mb": _unless_missing(_median,
                                                  [v[6] for v in done]),
                "load_average": _median([v[3] for v in done]),
                "cpu_samples_per_s": _median([v[4] for v in done])})
    # Ratios of measurements made side by side, where both finished.
    pairs = [(v, s) for v, s in zip(values, serial or [])
             if not _missing(v) and not _missing(s)]
    if pairs:
        row["speedup"], row["speedup_min"], row["speedup_max"] = summarize(
            [v[0] / s[0] for v, s in pairs])
        row["cpu_speedup"] = _median([v[4] / s[4] for v, s in pairs])
    if flops:
        achieved = rate / args.batch_size * flops
        row.update(step_gflop=flops / 1e9, gflop_per_s=achieved / 1e9,
                   percent_of_peak=100.0 * achieved / peak)
    return row


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    directory = pathlib.Path(args.output_dir)
    print(f"{platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.1f}; python {platform.python_version()}; "
          f"Keras on {args.backend}", flush=True)
    if args.report_only:
        rows = read_csv(directory / "results.csv")
        if not rows:
            raise SystemExit(
                f"--report_only: no results in {directory / 'results.csv'}.")
        return report(rows, directory)
    _check_writable(directory)
    args.deadline = (None if args.time_budget is None
                     else time.monotonic() + args.time_budget)
    rows = []
    failed = []
    if args.append:
        rows = [row for row in read_csv(directory / "results.csv")
                if row["model"] not in args.models]
    for name in args.models:
        for measured in benchmark_model(args, name, failed):
            rows.extend(measured)
            # Written after every B: a long run that dies keeps what it
            # measured.
            write_csv(rows, directory / "results.csv")
    if not rows:
        raise SystemExit(
            "Nothing was measured: every probe ran past --timeout "
            f"{args.timeout:.0f} s or failed (" + "; ".join(failed)
            + "), or the run was past --time_budget; see above.")
    rows = report(rows, directory)
    if failed:
        raise SystemExit(
            f"{len(failed)} measurement(s) failed (their errors are "
            f"above): {'; '.join(failed)}. The others are in "
            f"{directory / 'results.csv'}.")
    return rows


def _check_writable(directory):
    """Creates `directory` and writes a file there, before anything is
    measured; exits naming --output_dir if it cannot."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as error:
        raise SystemExit(
            f"--output_dir {str(directory)!r} cannot hold the results "
            f"({error}); pass a directory this user can create and write "
            "to.") from error


if __name__ == "__main__":
    main()
