"""Training throughput: an hftatf array of B models against the same B
models trained by stock Keras, one after another and all at once.

The command line of `python -m benchmarks.run` (whose docstring says what
it measures): its flags, their checks, and the values they resolve to.
"""

import argparse
import math

from benchmarks import backends, flags
from benchmarks.flags import parse_overrides

MODES = ("serial", "concurrent", "fused")

# The Keras dtype policies --dtype_policy takes.
DTYPE_POLICIES = ("float32", "mixed_bfloat16", "mixed_float16")

# What --quick sets, where the command line does not.
QUICK_DEFAULTS = {"num_models": "1,2,4", "epochs": 2, "warmup_steps": 2,
                  "epoch_seconds": 0.5}

# Integer flags and the least value each takes.
MINIMUMS = {"batch_size": 1, "epochs": 1, "warmup_steps": 1,
            "data_batches": 1, "repeats": 1, "steps_per_execution": 1,
            "stock_steps_per_execution": 1, "peak_size": 1,
            "max_num_models": 1}


def parse_args(argv):
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.run",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", default="mlp",
                        help="comma list of zoo recipe names, or 'all'")
    parser.add_argument("--num_models", default="1,2,4,8,16",
                        help="comma list of array sizes B; 'auto' among "
                             "them adds the B that "
                             "hftatf.tuning.auto_num_models picks for each "
                             "model on this device (the largest that fits "
                             "and still pays, up to --max_num_models)")
    parser.add_argument("--max_num_models", type=int, default=1024,
                        help="the largest B that --num_models auto tries")
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
    parser.add_argument("--serial_models", default="all",
                        help="stock models the serial mode trains one "
                             "after another: 'all' (B at each B), or at "
                             "most this many, timed once and their time "
                             "scaled to each B (every one is the same "
                             "program on the same batches; for a run on a "
                             "time budget)")
    parser.add_argument("--dtype_policy", default="float32",
                        choices=DTYPE_POLICIES,
                        help="Keras dtype policy of the stock models and "
                             "the array alike; the matmul peak is measured "
                             "in its compute dtype")
    parser.add_argument("--time_budget", type=float, default=None,
                        help="seconds: a measurement not started within "
                             "this time of the run's start is left out, "
                             "and the table and plots show what was "
                             "measured")
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
    for name in ("epoch_seconds", "timeout", "time_budget"):
        if getattr(args, name) is not None and not getattr(args, name) > 0:
            parser.error(f"--{name} must be a positive number of seconds; "
                         f"received {getattr(args, name)}")
    args.models = _models(parser, args.model)
    sizes = flags.comma_list(parser, "--num_models", args.num_models)
    args.auto_size = "auto" in sizes
    fixed = [size for size in sizes if size != "auto"]
    args.num_models = (flags.array_sizes(parser, ",".join(fixed)) if fixed
                       else [])
    args.modes = flags.comma_list(parser, "--modes", args.modes)
    unknown = [m for m in args.modes if m not in MODES]
    if unknown:
        parser.error(f"unknown --modes {unknown}; known: {list(MODES)}")
    args.steps = _count_or(parser, "--steps", args.steps, ("auto",))
    # Whole executions only: a shorter last one would trace anew.
    args.execution = math.lcm(args.steps_per_execution,
                              args.stock_steps_per_execution)
    args.warmup_steps = whole_executions(args.warmup_steps, args.execution)
    if args.steps != "auto":
        args.steps = whole_executions(args.steps, args.execution)
    args.models_per_pass = _count_or(parser, "--models_per_pass",
                                     args.models_per_pass, ("auto", "all"))
    args.serial_models = _count_or(parser, "--serial_models",
                                   args.serial_models, ("all",))
    args.model_args = parse_overrides(args.model_args)
    args.data_args = parse_overrides(args.data_args)
    return args


def _count_or(parser, flag, value, words):
    """`value` as an integer of at least 1, or one of `words` as it is."""
    if value in words:
        return value
    allowed = ", ".join(repr(word) for word in words)
    try:
        count = int(value)
    except ValueError:
        parser.error(f"{flag} must be {allowed} or an integer; received "
                     f"{value!r}")
    if count < 1:
        parser.error(f"{flag} must be {allowed} or at least 1; received "
                     f"{count}")
    return count


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


def whole_executions(steps, execution):
    """`steps` (at least 1) rounded up to a multiple of `execution`."""
    return -(-steps // execution) * execution
