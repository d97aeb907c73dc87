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
when a measurement failed.

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
"""

import argparse
import csv
import json
import math
import os
import pathlib
import platform
import subprocess
import sys
import tempfile
import threading
import time

from benchmarks import backends, flags, protocol
from benchmarks.flags import parse_overrides
from benchmarks.protocol import summarize

MODES = ("serial", "concurrent", "fused")
# What `benchmark_model` records for a measurement that did not finish.
TIMED_OUT, FAILED = "timed out", "failed"
ROOT = pathlib.Path(__file__).resolve().parent.parent

# The columns of results.csv.
COLUMNS = (
    "model", "mode", "num_models", "batch_size", "steps", "epochs",
    "repeats", "timeouts", "failures", "jit_compile", "models_per_pass",
    "samples_per_s", "samples_per_s_min", "samples_per_s_max", "speedup",
    "speedup_min", "speedup_max",
    "cpu_samples_per_s", "cpu_speedup", "peak_rss_mb", "step_gflop",
    "gflop_per_s", "matmul_peak_gflop_per_s", "percent_of_peak",
    "load_average",
)


# What --quick sets, where the command line does not.
QUICK_DEFAULTS = {"num_models": "1,2,4", "epochs": 2, "warmup_steps": 2,
                  "epoch_seconds": 0.5}

# Integer flags and the least value each takes.
MINIMUMS = {"batch_size": 1, "epochs": 1, "warmup_steps": 1,
            "data_batches": 1, "repeats": 1, "steps_per_execution": 1,
            "stock_steps_per_execution": 1, "peak_size": 1}


def parse_args(argv):
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.run",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", default="mlp",
                        help="comma list of zoo recipe names, or 'all'")
    parser.add_argument("--num_models", default="1,2,4,8,16",
                        help="comma list of array sizes B")
    parser.add_argument("--modes", default=",".join(MODES),
                        help="comma list of: " + ", ".join(MODES))
    parser.add_argument("--batch_size", type=int, default=64,
                        help="samples per step of each model")
    parser.add_argument("--steps", default="auto",
                        help="timed steps per epoch; 'auto': as many as "
                             "make a stock model's epoch last "
                             "--epoch_seconds")
    parser.add_argument("--epoch_seconds", type=float, default=2.0,
                        help="target of --steps=auto")
    parser.add_argument("--epochs", type=int, default=3,
                        help="timed epochs (the median epoch is used)")
    parser.add_argument("--warmup_steps", type=int, default=3,
                        help="untimed steps before the timed epochs "
                             "(tracing and compilation happen there)")
    parser.add_argument("--data_batches", type=int, default=8,
                        help="distinct batches cycled through")
    parser.add_argument("--repeats", type=int, default=1,
                        help="measurements of every mode and B")
    parser.add_argument("--stock_jit", choices=("best", "true", "false"),
                        default="best",
                        help="jit_compile of stock models; 'best' measures "
                             "both and keeps the faster")
    parser.add_argument("--fused_jit",
                        choices=("best", "auto", "true", "false"),
                        default="best",
                        help="jit_compile of the array; 'best' measures "
                             "both (each in its own process) and keeps the "
                             "faster, as for the stock models; 'auto' is "
                             "hftatf's default")
    parser.add_argument("--steps_per_execution", type=int, default=1,
                        help="of the array")
    parser.add_argument("--models_per_pass", default="auto",
                        help="of the array's training step: 'auto' "
                             "(hftatf's default), 'all' (one pass) or a "
                             "positive integer (at most B: an array of "
                             "fewer models takes them all in one pass)")
    parser.add_argument("--stock_steps_per_execution", type=int, default=1,
                        help="of the stock models")
    parser.add_argument("--model_args", default="",
                        help="builder arguments over the recipe's, as "
                             "name=value pairs (tuples as (a;b))")
    parser.add_argument("--data_args", default="",
                        help="data arguments over the recipe's")
    parser.add_argument("--output_dir", default="benchmark_results",
                        help="where results.csv and the plots go")
    parser.add_argument("--peak_size", type=int, default=2048,
                        help="side of the matmul that measures the peak")
    parser.add_argument("--peak_seconds", type=float, default=2.0,
                        help="time spent measuring the matmul peak")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=3600,
                        help="seconds allowed to one measurement; one that "
                             "runs longer is recorded as timed out")
    parser.add_argument("--append", action="store_true",
                        help="keep the rows of other models already in "
                             "<output_dir>/results.csv (a run split into "
                             "several invocations, e.g. with other flags "
                             "per model); the table and plots show all")
    parser.add_argument("--report_only", action="store_true",
                        help="measure nothing: print the table of "
                             "<output_dir>/results.csv and redraw its "
                             "results.md and plots (e.g. after installing "
                             "matplotlib)")
    backends.add_flag(parser)
    parser.add_argument("--quick", action="store_true",
                        help="a small run: the defaults become "
                             + ", ".join(f"--{k} {v}"
                                         for k, v in QUICK_DEFAULTS.items())
                             + " (flags given explicitly still win)")
    args = parser.parse_args(argv)
    if args.quick:
        # Parsed again so that only the flags not given take the quick
        # values.
        parser.set_defaults(**QUICK_DEFAULTS)
        args = parser.parse_args(argv)
    flags.check_minimums(parser, args, MINIMUMS)
    try:
        # Before the zoo (and so Keras) is imported to check --model.
        args.backend = backends.apply(args.backend)
    except ValueError as error:
        parser.error(str(error))
    for name in ("epoch_seconds", "timeout"):
        if not getattr(args, name) > 0:
            parser.error(f"--{name} must be a positive number of seconds; "
                         f"received {getattr(args, name)}")
    args.models = _models(parser, args.model)
    args.num_models = flags.array_sizes(parser, args.num_models)
    args.modes = flags.comma_list(parser, "--modes", args.modes)
    unknown = [m for m in args.modes if m not in MODES]
    if unknown:
        parser.error(f"unknown --modes {unknown}; known: {list(MODES)}")
    if args.steps != "auto":
        try:
            args.steps = int(args.steps)
        except ValueError:
            parser.error(f"--steps must be 'auto' or an integer; received "
                         f"{args.steps!r}")
        if args.steps < 1:
            parser.error(f"--steps must be 'auto' or at least 1; received "
                         f"{args.steps}")
    # Whole executions only: a shorter last one would trace anew.
    args.execution = math.lcm(args.steps_per_execution,
                              args.stock_steps_per_execution)
    args.warmup_steps = _whole(args.warmup_steps, args.execution)
    if args.steps != "auto":
        args.steps = _whole(args.steps, args.execution)
    if args.models_per_pass not in ("auto", "all"):
        try:
            args.models_per_pass = int(args.models_per_pass)
        except ValueError:
            parser.error("--models_per_pass must be 'auto', 'all' or an "
                         f"integer; received {args.models_per_pass!r}")
        if args.models_per_pass < 1:
            parser.error("--models_per_pass must be 'auto', 'all' or at "
                         f"least 1; received {args.models_per_pass}")
    args.model_args = parse_overrides(args.model_args)
    args.data_args = parse_overrides(args.data_args)
    return args


def _models(parser, text):
    """The zoo recipes `--model` names ('all': every one)."""
    from hftatf.models import recipes

    known = list(recipes.names())
    models = flags.comma_list(parser, "--model", text)
    if "all" in models:
        if len(models) > 1:
            parser.error("--model all stands alone: it names every zoo "
                         f"recipe already; received {text!r}")
        return known
    unknown = [m for m in models if m not in known]
    if unknown:
        parser.error(f"unknown --model {', '.join(unknown)}; known: "
                     f"{', '.join(known)} (or 'all')")
    return models


def _whole(steps, execution):
    """`steps` (at least 1) rounded up to a multiple of `execution`."""
    return -(-steps // execution) * execution


# -- running workers -------------------------------------------------------


def _command(spec):
    return [sys.executable, "-m", "benchmarks.worker", json.dumps(spec)]


def _environment():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


class WorkerError(RuntimeError):
    """A benchmark worker process that ended without a result."""


def _parse_result(stdout, stderr, spec):
    for line in reversed(stdout.splitlines()):
        if line.startswith(protocol.RESULT_PREFIX):
            return json.loads(line[len(protocol.RESULT_PREFIX):])
    raise WorkerError(
        f"Benchmark worker {spec['task']} for {spec['model']} (B="
        f"{spec.get('num_models')}) failed:\n{stderr[-4000:]}")


def run_worker(spec, timeout):
    """Runs one task in a fresh process; returns its result dict."""
    done = subprocess.run(_command(spec), capture_output=True, text=True,
                          cwd=ROOT, env=_environment(), timeout=timeout)
    return _parse_result(done.stdout, done.stderr, spec)


def run_concurrent(spec, num_models, timeout):
    """B `single` workers at once: all warm up, then all start together.

    Returns the per-process results. Raises `subprocess.TimeoutExpired`
    when the whole measurement, warm-up included, takes over `timeout`
    seconds.
    """
    processes, logs = [], []
    deadline = time.monotonic() + timeout
    # Waiting for READY blocks on a pipe: past the deadline this kills the
    # workers, which ends the wait.
    expired = threading.Event()
    alarm = threading.Timer(timeout, _expire, (expired, processes))
    try:
        for index in range(num_models):
            log = tempfile.TemporaryFile(mode="w+")
            logs.append(log)
            processes.append(subprocess.Popen(
                _command({**spec, "task": "single",
                          "seed": spec["seed"] + index}),
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                text=True, cwd=ROOT, env=_environment()))
        alarm.start()
        for process, log in zip(processes, logs):
            line = process.stdout.readline()
            while line and line.strip() != protocol.READY:
                line = process.stdout.readline()
            if expired.is_set():
                raise subprocess.TimeoutExpired(_command(spec), timeout)
            if not line:
                log.seek(0)
                raise WorkerError(
                    f"A concurrent worker for {spec['model']} exited "
                    f"before it was ready:\n{log.read()[-4000:]}")
        alarm.cancel()
        for process in processes:
            process.stdin.write("go\n")
            process.stdin.flush()
        results = []
        for process, log in zip(processes, logs):
            stdout, _ = process.communicate(
                timeout=max(0.0, deadline - time.monotonic()))
            log.seek(0)
            results.append(_parse_result(stdout, log.read(), spec))
        return results
    finally:
        alarm.cancel()
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
        for log in logs:
            log.close()


def _expire(expired, processes):
    expired.set()
    for process in processes:
        if process.poll() is None:
            process.kill()


# -- one model -------------------------------------------------------------


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
                   else _whole(10, args.execution))
    result = run_worker({**base, "task": "probe", "steps": probe_steps,
                         "jit_settings": settings,
                         "peak_size": args.peak_size,
                         "peak_seconds": args.peak_seconds}, args.timeout)
    seconds = {jit == "true": _median(times) / probe_steps
               for jit, times in result["jit"].items()}
    jit = min(seconds, key=seconds.get)
    steps = args.steps
    if steps == "auto":
        steps = _whole(max(5, min(1000, round(
            args.epoch_seconds / seconds[jit]))), args.execution)
    timings = ", ".join(f"{1e3 * s:.1f} ms with jit_compile={j}"
                        for j, s in seconds.items())
    print(f"[{name}] stock step: {timings}; serial uses jit_compile={jit}; "
          f"{steps} steps per epoch", flush=True)
    return {"jit_compile": jit, "steps": steps,
            "step_flops": result["step_flops"],
            "matmul_peak_flops": result["matmul_peak_flops"],
            "stock_seconds": seconds}


def measure_mode(args, mode, num_models, spec):
    """`(seconds per round, processor seconds per round, peak RSS MiB,
    jit, models per pass)`: a round is `steps` steps of each of the B
    models; models per pass is None for the stock modes.

    Every mode times epochs alike: each process's median epoch. Raises
    `subprocess.TimeoutExpired` when the mode did not finish within
    `--timeout`, and `WorkerError` when its worker crashed (for the fused
    mode: under no `jit_compile` setting; a crash wins over a timeout).
    """
    if mode == "serial":
        result = run_worker({**spec, "task": "serial",
                             "num_models": num_models}, args.timeout)
        seconds = sum(_median(epochs)
                      for epochs in result["model_epoch_seconds"])
        cpu_seconds = sum(_median(epochs)
                          for epochs in result["model_epoch_cpu_seconds"])
        return (seconds, cpu_seconds, result["peak_rss_mb"],
                spec["jit_compile"], None)
    if mode == "concurrent":
        results = run_concurrent(spec, num_models, args.timeout)
        # Each process trains `steps` steps per median epoch, all at once:
        # their rates add up. A round, B models' steps, takes B over that
        # sum of rounds per second.
        rate = sum(1.0 / _median(r["epoch_seconds"]) for r in results)
        cpu_seconds = sum(_median(r["epoch_cpu_seconds"]) for r in results)
        return (num_models / rate, cpu_seconds,
                sum(r["peak_rss_mb"] for r in results), spec["jit_compile"],
                None)
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
                    result["peak_rss_mb"], result["jit_compile"],
                    result.get("models_per_pass"))
        # The other setting gets a few times as long as this one took.
        timeout = min(args.timeout, max(
            120.0, 3 * (time.perf_counter() - started)))
    if best is None:
        raise error
    return best


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
            "stock_steps_per_execution": args.stock_steps_per_execution}
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
    for num_models in args.num_models:
        spec_b = {**spec, "models_per_pass": _models_per_pass(
            args.models_per_pass, num_models)}
        measured = {mode: [] for mode in args.modes}
        for repeat in range(args.repeats):
            shift = repeat % len(args.modes)
            for mode in args.modes[shift:] + args.modes[:shift]:
                try:
                    seconds, cpu_seconds, rss, jit, per_pass = measure_mode(
                        args, mode, num_models, spec_b)
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
                                       per_pass))
                print(f"[{name}] B={num_models:<3} {mode:<10} "
                      f"{num_models * work / seconds:10.1f} samples/s  "
                      f"{rss:8.0f} MiB", flush=True)
        yield [_row(args, name, mode, num_models, values,
                    measured.get("serial"), probe)
               for mode, values in measured.items()]


def _row(args, name, mode, num_models, values, serial, probe):
    """The CSV row of one mode at B from its measurements (`TIMED_OUT` or
    `FAILED` for one that did not finish); `serial` holds the serial
    mode's, side by side."""
    done = [v for v in values if not _missing(v)]
    row = {"model": name, "mode": mode, "num_models": num_models,
           "batch_size": args.batch_size, "steps": probe["steps"],
           "epochs": args.epochs, "repeats": len(done),
           "timeouts": values.count(TIMED_OUT),
           "failures": values.count(FAILED)}
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


# -- reporting -------------------------------------------------------------


def _format(value, digits=1):
    if value is None or value == "":
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _throughput(row):
    """A row's samples/s as printed: "failed" where no measurement of it
    finished and one crashed, "timed out" where they all ran past
    --timeout."""
    if row.get("samples_per_s") is None:
        if row.get("failures"):
            return "failed"
        if row.get("timeouts"):
            return "timed out"
    return _format(row.get("samples_per_s"), 0)


def print_table(rows):
    header = (f"{'model':<16}{'mode':<11}{'B':>4}{'samples/s':>12}"
              f"{'speedup':>9}{'range':>13}{'CPU-time':>9}{'RSS MiB':>9}"
              f"{'GFLOP/s':>9}{'% peak':>8}")
    print(header)
    for row in rows:
        spread = ""
        if row.get("speedup_min") is not None and row["repeats"] > 1:
            spread = (f"{row['speedup_min']:.2f}-{row['speedup_max']:.2f}")
        print(f"{row['model']:<16}{row['mode']:<11}{row['num_models']:>4}"
              f"{_throughput(row):>12}"
              f"{_format(row.get('speedup'), 2):>9}{spread:>13}"
              f"{_format(row.get('cpu_speedup'), 2):>9}"
              f"{_format(row.get('peak_rss_mb'), 0):>9}"
              f"{_format(row.get('gflop_per_s'), 2):>9}"
              f"{_format(row.get('percent_of_peak'), 1):>8}")


def markdown_table(rows):
    """The rows as a Markdown table, one line per model and B: each mode's
    throughput, the fused and concurrent speedups over serial (wall-clock,
    then in processor time), the peak memory of each mode, and the fused
    array's share of the matmul peak."""
    modes = [m for m in MODES if any(r["mode"] == m for r in rows)]
    header = (["model", "B"] + [f"{m} samples/s" for m in modes]
              + [f"{m} speedup" for m in modes if m != "serial"]
              + [f"{m} CPU-time speedup" for m in modes if m != "serial"]
              + [f"{m} MiB" for m in modes] + ["fused % of peak",
                                               "fused XLA",
                                               "fused models/pass"])
    lines = ["| " + " | ".join(header) + " |",
             "|" + "---|" * len(header)]
    keys = sorted({(r["model"], r["num_models"]) for r in rows},
                  key=lambda key: (_order(rows, key[0]), key[1]))
    for model, num_models in keys:
        by_mode = {r["mode"]: r for r in rows if r["model"] == model
                   and r["num_models"] == num_models}
        fused = by_mode.get("fused", {})
        cells = ([model, str(num_models)]
                 + [_throughput(by_mode.get(m, {})) for m in modes]
                 + [_format(by_mode.get(m, {}).get("speedup"), 2)
                    for m in modes if m != "serial"]
                 + [_format(by_mode.get(m, {}).get("cpu_speedup"), 2)
                    for m in modes if m != "serial"]
                 + [_format(by_mode.get(m, {}).get("peak_rss_mb"), 0)
                    for m in modes]
                 + [_format(fused.get("percent_of_peak"), 1),
                    _format(fused.get("jit_compile")),
                    _format(fused.get("models_per_pass"))])
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _order(rows, model):
    """Models in the order they were measured."""
    return next(i for i, r in enumerate(rows) if r["model"] == model)


def write_csv(rows, path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=COLUMNS)
        writer.writeheader()
        for row in rows:
            writer.writerow({key: row.get(key, "") for key in COLUMNS})


def read_csv(path):
    """The rows of a results.csv written by `write_csv`, numbers parsed
    (empty cells are None); [] when there is no such file."""
    if not path.exists():
        return []
    rows = []
    with open(path, newline="") as file:
        for row in csv.DictReader(file):
            parsed = {}
            for key, value in row.items():
                if value == "":
                    parsed[key] = None
                elif key in ("model", "mode"):
                    parsed[key] = value
                elif key == "jit_compile":
                    parsed[key] = value == "True"
                elif key == "models_per_pass":
                    # A count, or how the array sizes its passes ("auto"
                    # for an array that trains all its models at once).
                    parsed[key] = int(value) if value.isdigit() else value
                else:
                    number = float(value)
                    parsed[key] = int(number) if key in (
                        "num_models", "batch_size", "steps", "epochs",
                        "repeats", "timeouts", "failures") else number
            rows.append(parsed)
    return rows


def plot(rows, directory):
    """Speedup over serial against B: one PNG per model and one of every
    model's fused curve. Returns the files written ([] without
    matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install 'hftatf[bench]'): "
              "no plots.")
        return []
    written = []
    models = sorted({r["model"] for r in rows})

    def curve(axes, model, mode, **style):
        points = sorted((r["num_models"], r["speedup"]) for r in rows
                        if r["model"] == model and r["mode"] == mode
                        and r.get("speedup") is not None)
        if points:
            axes.plot(*zip(*points), marker="o", **style)

    def finish(figure, axes, title, path):
        axes.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
        axes.set_xscale("log", base=2)
        axes.set_xlabel("models B")
        axes.set_ylabel("speedup over serial stock fit")
        axes.set_title(title)
        if axes.get_legend_handles_labels()[0]:
            axes.legend()
        figure.tight_layout()
        figure.savefig(path, dpi=100)
        plt.close(figure)
        written.append(path)

    for model in models:
        figure, axes = plt.subplots(figsize=(5, 3.5))
        for mode in ("fused", "concurrent"):
            curve(axes, model, mode, label=mode)
        finish(figure, axes, model, directory / f"speedup_{model}.png")
    figure, axes = plt.subplots(figsize=(6, 4))
    for model in models:
        curve(axes, model, "fused", label=model)
    finish(figure, axes, "fused array vs serial", directory / "speedup.png")
    return written


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
            + "); see above.")
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


def report(rows, directory):
    """Prints the table of `rows` and writes its plots and results.md
    into `directory` (created if need be)."""
    directory.mkdir(parents=True, exist_ok=True)
    print_table(rows)
    peaks = [row["matmul_peak_gflop_per_s"] for row in rows
             if row.get("matmul_peak_gflop_per_s")]
    if peaks:
        print(f"matmul peak: {peaks[-1]:.1f} GFLOP/s")
    for path in plot(rows, directory):
        print(f"wrote {path}")
    (directory / "results.md").write_text(markdown_table(rows))
    print(f"wrote {directory / 'results.md'}")
    return rows


if __name__ == "__main__":
    main()
