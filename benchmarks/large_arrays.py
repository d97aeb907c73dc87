"""Large arrays: what fusing, compiling and a first epoch cost as B grows.

hftatf's promise is many models at once; for a tiny model the cost of an
array is then what grows with B outside the arithmetic: building the fused
layers, tracing the step, per-model logs and metrics. For a tiny MLP
(`--units`, 4-8-3 by default: 67 parameters) and each B, in a fresh
process per B and XLA setting, this times

  * fuse: `hftatf.fuse(model, B)`;
  * compile: `array.compile(...)` (the fused Adam with one learning rate
    per model, sparse categorical cross-entropy, accuracy);
  * first epoch: `fit` for one epoch of `--samples` samples in batches of
    `--batch_size` (tracing, XLA compiling where on, and the steps);

and reads the process's peak resident memory (`ru_maxrss` of the child,
from `os.wait4`) and its resident memory after each phase. A process that
runs past `--time_limit` seconds or over `--memory_limit` MiB is stopped
and recorded as such, with the phases it finished; one that crashes is
recorded as failed (its error is printed) and makes the run exit with
status 1 after writing its tables.

    python -m benchmarks.large_arrays --num_models 10,100,1000
    python -m benchmarks.large_arrays --num_models 10000 --time_limit 300 \
        --append
    python -m benchmarks.large_arrays --num_models 1000 --xla off --profile

Writes `results.csv` (after every measurement), `results.md` and
`large_arrays.png` (time and peak memory against B, log-log; with
matplotlib) to `--output_dir`; `--profile` adds each process's cProfile
statistics (`profile_B<B>_xla_<on|off>.prof`) and prints its top
functions.
"""

import argparse
import cProfile
import csv
import json
import os
import pathlib
import pstats
import subprocess
import sys
import tempfile
import threading
import time

from benchmarks import flags

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULT_PREFIX = "LARGE_ARRAYS_RESULT "
PHASES = ("fuse", "compile", "epoch")
COLUMNS = ("num_models", "xla", "parameters", "status", "fuse_s",
           "compile_s", "epoch_s", "total_s", "process_s",
           "rss_after_fuse_mib", "rss_after_compile_mib",
           "rss_after_epoch_mib", "peak_rss_mib")
XLA_SETTINGS = {"off": False, "on": True}


def parse_args(argv):
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.large_arrays",
        description=__doc__.split("\n\n")[0])
    parser.add_argument("--num_models", default="10,100,1000",
                        help="comma-separated array sizes B")
    parser.add_argument("--xla", default="off,on",
                        help="comma list of XLA settings to measure: off, on")
    parser.add_argument("--units", default="4,8,3",
                        help="comma list: input features, hidden units..., "
                             "classes (the MLP's widths)")
    parser.add_argument("--samples", type=int, default=8,
                        help="samples in the one timed epoch")
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--time_limit", type=float, default=600,
                        help="seconds one process (one B, one XLA setting) "
                             "may run, imports included")
    parser.add_argument("--memory_limit", type=float, default=8192,
                        help="MiB of resident memory one process may hold")
    parser.add_argument("--output_dir",
                        default=str(ROOT / "benchmarks" / "results"
                                    / "large_arrays"))
    parser.add_argument("--append", action="store_true",
                        help="keep the rows of an existing results.csv in "
                             "--output_dir for other B and XLA settings")
    parser.add_argument("--profile", action="store_true",
                        help="profile each process (cProfile) and print "
                             "its top functions")
    args = parser.parse_args(argv)
    args.num_models = flags.array_sizes(parser, args.num_models)
    args.xla = flags.comma_list(parser, "--xla", args.xla)
    unknown = [s for s in args.xla if s not in XLA_SETTINGS]
    if unknown:
        parser.error(f"--xla takes off and on; received {unknown}")
    args.units = flags.comma_list(parser, "--units", args.units, int)
    if len(args.units) < 2 or min(args.units) < 1:
        parser.error("--units must list at least two positive widths "
                     f"(inputs, ..., classes); received {args.units}")
    if args.units[-1] < 2:
        parser.error("--units must end with at least 2 classes; received "
                     f"{args.units}")
    flags.check_minimums(parser, args, {"samples": 1, "batch_size": 1})
    for name in ("time_limit", "memory_limit"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name} must be positive; received "
                         f"{getattr(args, name)}")
    return args


# -- One measurement, in its own process ------------------------------------

def _rss_mib():
    """This process's resident memory now, in MiB (None off Linux)."""
    try:
        with open("/proc/self/statm") as file:
            pages = int(file.read().split()[1])
    except OSError:
        return None
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def measure(spec, report):
    """Fuses, compiles and trains one epoch of the spec's array, calling
    `report` with the seconds and resident memory of every phase so far
    after each phase (so a stopped process still tells how far it got)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras
    import numpy as np

    import hftatf

    units, num_models = spec["units"], spec["num_models"]
    inputs = keras.Input((units[0],))
    hidden = inputs
    for width in units[1:-1]:
        hidden = keras.layers.Dense(width, activation="relu")(hidden)
    outputs = keras.layers.Dense(units[-1], activation="softmax")(hidden)
    model = keras.Model(inputs, outputs)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((spec["samples"], units[0])).astype("float32")
    y = rng.integers(0, units[-1], spec["samples"])
    # A tuning sweep: one learning rate per model.
    rates = np.geomspace(1e-4, 1e-1, num_models).tolist()
    steps = {
        "fuse": lambda: hftatf.fuse(model, num_models),
        "compile": lambda array: array.compile(
            hftatf.optimizers.Adam(rates),
            "sparse_categorical_crossentropy", metrics=["accuracy"],
            jit_compile=spec["xla"]),
        "epoch": lambda array: array.fit(
            x, y, batch_size=spec["batch_size"], epochs=1, verbose=0,
            shuffle=False),
    }
    result = {"parameters": model.count_params()}
    array = None
    for phase in PHASES:
        start = time.perf_counter()
        if phase == "fuse":
            array = steps[phase]()
        else:
            steps[phase](array)
        result[f"{phase}_s"] = time.perf_counter() - start
        result[f"rss_after_{phase}_mib"] = _rss_mib()
        report(result)


def child(spec):
    """The body of a measuring process: prints what it measured so far on
    one line after each phase."""
    def report(result):
        print(RESULT_PREFIX + json.dumps(result), flush=True)

    if not spec.get("profile"):
        return measure(spec, report)
    profiler = cProfile.Profile()
    profiler.runcall(measure, spec, report)
    stats = pstats.Stats(profiler, stream=sys.stderr)
    stats.dump_stats(spec["profile"])
    stats.sort_stats("cumulative").print_stats(40)
    stats.sort_stats("tottime").print_stats(25)


# -- The parent: one process per B and setting ------------------------------

class _Watch:
    """Stops process `pid` past `seconds` or over `mib` MiB resident."""

    def __init__(self, pid, seconds, mib):
        self.pid, self.reason = pid, None
        self._deadline = time.monotonic() + seconds
        self._mib = mib
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _resident_mib(self):
        try:
            with open(f"/proc/{self.pid}/statm") as file:
                pages = int(file.read().split()[1])
        except (OSError, ValueError, IndexError):
            return 0.0
        return pages * os.sysconf("SC_PAGE_SIZE") / 2**20

    def _run(self):
        while not self._done.wait(0.2):
            if time.monotonic() > self._deadline:
                self.reason = "timed out"
            elif self._resident_mib() > self._mib:
                self.reason = "over memory"
            else:
                continue
            try:
                os.kill(self.pid, 9)
            except ProcessLookupError:
                pass
            return

    def stop(self):
        self._done.set()
        self._thread.join()


def run_one(args, num_models, xla, directory):
    """Measures one B and XLA setting in a fresh process; returns its CSV
    row."""
    spec = {"num_models": num_models, "xla": XLA_SETTINGS[xla],
            "units": args.units, "samples": args.samples,
            "batch_size": args.batch_size}
    if args.profile:
        spec["profile"] = str(
            directory / f"profile_B{num_models}_xla_{xla}.prof")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    row = {"num_models": num_models, "xla": xla}
    with tempfile.TemporaryFile("w+") as out, \
            tempfile.TemporaryFile("w+") as err:
        start = time.perf_counter()
        process = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.large_arrays", "--child",
             json.dumps(spec)], stdout=out, stderr=err, cwd=ROOT, env=env)
        watch = _Watch(process.pid, args.time_limit, args.memory_limit)
        # wait4, not wait: the child's own resource usage, peak memory
        # included, whether it finished or was stopped.
        _, status, usage = os.wait4(process.pid, 0)
        process.returncode = os.waitstatus_to_exitcode(status)
        watch.stop()
        row["process_s"] = time.perf_counter() - start
        row["peak_rss_mib"] = usage.ru_maxrss / (
            2**20 if sys.platform == "darwin" else 2**10)
        out.seek(0)
        err.seek(0)
        result = [line for line in out.read().splitlines()
                  if line.startswith(RESULT_PREFIX)]
        errors = err.read()
    if result:
        row.update(json.loads(result[-1][len(RESULT_PREFIX):]))
    finished = all(f"{phase}_s" in row for phase in PHASES)
    if watch.reason:
        row["status"] = watch.reason
    elif process.returncode or not finished:
        row["status"] = "failed"
        print(f"B={num_models} xla={xla} failed (exit status "
              f"{process.returncode}):\n{errors[-4000:]}", flush=True)
    else:
        row["status"] = "ok"
        row["total_s"] = sum(row[f"{phase}_s"] for phase in PHASES)
        if args.profile:
            print(errors, flush=True)
    return row


# -- Tables and curves ------------------------------------------------------

def write_csv(rows, path):
    with open(path, "w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=COLUMNS)
        writer.writeheader()
        for row in rows:
            writer.writerow({key: _cell(row.get(key)) for key in COLUMNS})


def _cell(value):
    return f"{value:.3f}" if isinstance(value, float) else (
        "" if value is None else value)


def read_csv(path):
    """The rows of a results.csv written by `write_csv`, numbers parsed;
    [] when there is no such file."""
    if not path.exists():
        return []
    with open(path, newline="") as file:
        rows = list(csv.DictReader(file))
    for row in rows:
        for key, value in row.items():
            if key in ("num_models", "parameters") and value:
                row[key] = int(value)
            elif key not in ("xla", "status"):
                row[key] = float(value) if value else None
    return rows


def markdown_table(rows):
    lines = ["| B | XLA | parameters | fuse s | compile s | first epoch s "
             "| total s | peak MiB | status |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        seconds = [row.get(f"{key}_s") for key in (*PHASES, "total")]
        cells = [row["num_models"], row["xla"], row.get("parameters") or ""]
        cells += ["" if s is None else f"{s:.2f}" for s in seconds]
        cells += [f"{row['peak_rss_mib']:.0f}", row["status"]]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def plot(rows, path, title):
    """Total seconds and peak MiB against B, log-log, one curve per XLA
    setting; a stopped process is an open triangle at its process time and
    peak memory so far. Returns whether a plot was written (not without
    matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install 'hftatf[bench]'): "
              "no plot.")
        return False
    figure, (left, right) = plt.subplots(1, 2, figsize=(9, 3.8))
    for xla, color in zip(XLA_SETTINGS, ("tab:blue", "tab:orange")):
        done = sorted((r["num_models"], r["total_s"], r["peak_rss_mib"])
                      for r in rows if r["xla"] == xla
                      and r["status"] == "ok")
        if done:
            sizes, seconds, memory = zip(*done)
            left.plot(sizes, seconds, marker="o", color=color,
                      label=f"XLA {xla}")
            right.plot(sizes, memory, marker="o", color=color,
                       label=f"XLA {xla}")
        # A stopped process ran at least this long and this large.
        stopped = sorted((r["num_models"], r["process_s"], r["peak_rss_mib"])
                         for r in rows if r["xla"] == xla
                         and r["status"] not in ("ok", "failed"))
        if stopped:
            sizes, seconds, memory = zip(*stopped)
            style = {"marker": "^", "linestyle": "none", "color": color,
                     "markerfacecolor": "none",
                     "label": f"XLA {xla}, stopped (at least)"}
            left.plot(sizes, seconds, **style)
            right.plot(sizes, memory, **style)
    for axes, label in ((left, "fuse + compile + first epoch (s)"),
                        (right, "peak resident memory (MiB)")):
        axes.set_xscale("log")
        axes.set_yscale("log")
        axes.set_xlabel("models B")
        axes.set_ylabel(label)
        if axes.get_legend_handles_labels()[0]:
            axes.legend(fontsize="small")
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return True


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        return child(json.loads(argv[1]))
    args = parse_args(argv)
    directory = pathlib.Path(args.output_dir)
    directory.mkdir(parents=True, exist_ok=True)
    measured = {(b, xla) for b in args.num_models for xla in args.xla}
    rows = [row for row in read_csv(directory / "results.csv")
            if (row["num_models"], row["xla"]) not in measured
            ] if args.append else []
    for num_models in args.num_models:
        for xla in args.xla:
            row = run_one(args, num_models, xla, directory)
            rows.append(row)
            rows.sort(key=lambda r: (r["num_models"], r["xla"]))
            print(markdown_table([row]).splitlines()[-1], flush=True)
            write_csv(rows, directory / "results.csv")
    (directory / "results.md").write_text(markdown_table(rows))
    title = "arrays of the MLP " + "-".join(map(str, args.units))
    if plot(rows, directory / "large_arrays.png", title):
        print(f"wrote {directory / 'large_arrays.png'}")
    print(f"wrote {directory / 'results.csv'} and "
          f"{directory / 'results.md'}")
    failed = [r for r in rows if r["status"] == "failed"]
    if failed:
        raise SystemExit(
            f"{len(failed)} measurement(s) failed (errors above): " + ", ".join(
                f"B={r['num_models']} xla={r['xla']}" for r in failed))
    return rows


if __name__ == "__main__":
    main()
