"""The results of `python -m benchmarks.run`: the rows of results.csv
(written and read back), the table printed, results.md, and the
speedup-vs-B plots.
"""

import csv

from benchmarks.run_flags import MODES

# The columns of results.csv.
COLUMNS = (
    "model", "mode", "num_models", "batch_size", "steps", "epochs",
    "repeats", "timeouts", "failures", "jit_compile", "models_per_pass",
    "samples_per_s", "samples_per_s_min", "samples_per_s_max", "speedup",
    "speedup_min", "speedup_max",
    "cpu_samples_per_s", "cpu_speedup", "peak_rss_mb", "step_gflop",
    "gflop_per_s", "matmul_peak_gflop_per_s", "percent_of_peak",
    "load_average", "peak_device_mb", "serial_models_timed", "dtype_policy",
    "sized",
)


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
    array's share of the matmul peak; where the device reports its own
    memory (a GPU), each mode's peak there (the serial mode's is one stock
    model's: it trains them one at a time) and the array's against B
    stock models'. Notes under the table say where the serial mode timed
    fewer than B models, and the dtype policy other than float32."""
    modes = [m for m in MODES if any(r["mode"] == m for r in rows)]
    header = (["model", "B"] + [f"{m} samples/s" for m in modes]
              + [f"{m} speedup" for m in modes if m != "serial"]
              + [f"{m} CPU-time speedup" for m in modes if m != "serial"]
              + [f"{m} MiB" for m in modes] + ["fused % of peak",
                                               "fused XLA",
                                               "fused models/pass"])
    on_device = any(r.get("peak_device_mb") is not None for r in rows)
    if on_device:
        header += ([("serial device MiB (one model)" if m == "serial"
                     else f"{m} device MiB") for m in modes]
                   + ["fused device memory / B stock models'"])
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
        if on_device:
            serial = by_mode.get("serial", {}).get("peak_device_mb")
            cells += [_format(by_mode.get(m, {}).get("peak_device_mb"), 0)
                      for m in modes]
            cells.append("-" if serial is None or fused.get(
                "peak_device_mb") is None else _format(
                    fused["peak_device_mb"] / (num_models * serial), 2))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines + _notes(rows)) + "\n"


def _notes(rows):
    """The lines under the table: serial modes that timed fewer than B
    models, the sizes `auto_num_models` chose, and a dtype policy other
    than float32."""
    notes = []
    scaled = sorted({r["serial_models_timed"] for r in rows
                     if r.get("serial_models_timed") is not None
                     and r["serial_models_timed"] < r["num_models"]})
    if scaled:
        notes.append(
            f"\nserial: {', '.join(str(n) for n in scaled)} stock "
            "model(s) timed one after another, their time scaled to B "
            "(`--serial_models`: each is the same program on the same "
            "batches).")
    sized = sorted({(r["model"], r["num_models"]) for r in rows
                    if r.get("sized")}, key=lambda key: _order(rows, key[0]))
    if sized:
        notes.append(
            "\nB chosen by `hftatf.tuning.auto_num_models` (the largest "
            "array that fits and still gains throughput): "
            + ", ".join(f"{model} {b}" for model, b in sized) + ".")
    policies = sorted({r["dtype_policy"] for r in rows
                       if r.get("dtype_policy") not in (None, "float32")})
    if policies:
        notes.append(f"\ndtype policy: {', '.join(policies)}.")
    return notes


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
                elif key in ("model", "mode", "dtype_policy"):
                    parsed[key] = value
                elif key in ("jit_compile", "sized"):
                    parsed[key] = value == "True"
                elif key == "models_per_pass":
                    # A count, or how the array sizes its passes ("auto"
                    # for an array that trains all its models at once).
                    parsed[key] = int(value) if value.isdigit() else value
                else:
                    number = float(value)
                    parsed[key] = int(number) if key in (
                        "num_models", "batch_size", "steps", "epochs",
                        "repeats", "timeouts", "failures",
                        "serial_models_timed") else number
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
