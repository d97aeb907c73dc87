"""Tunes a zoo model's hyper-parameters, trials trained as fused arrays.

With no flags it runs a random search of 8 learning rates (log-uniform in
[1e-3, 0.3]) for the digits MLP, 4 trials per array, prints a table of the
trials and exports the best model:

    hftatf-tune
    hftatf-tune --tuner=hyperband --epochs=9 --num_models=auto \\
        --search_space="learning_rate=float:1e-3:0.3:log;momentum=choice:0,0.9"
    hftatf-tune --search_space_file=space.yaml --local_workers=2

The search space is a `;`-separated list of `name=kind:arguments` entries
(`--search_space`) or a YAML/JSON mapping (`--search_space_file`), as
`hftatf.tuning.space` reads them. Each name is an argument of the model's
builder (e.g. `hidden_units`, `dropout`), of the optimizer (e.g.
`learning_rate`, `momentum`), or `optimizer` itself; `model.` or
`optimizer.` in front of a name says which where both take it.

Distributed: `--local_workers=N` runs a chief and N workers on this machine
(one per GPU where there are GPUs); on several machines run the same command
everywhere with `--tuner_id` (`chief` on one) and `--oracle_address`
(host:port of the chief), or with keras-tuner's environment variables.
Rerunning with the same flags resumes the project; `--overwrite` starts
over. `python -m hftatf.tpu.tune` is the same program.
"""

import inspect
import json
import os
import pathlib
import shutil
import sys

import keras
import keras_tuner
from absl import app, flags

import hftatf
from hftatf import report, tuning
from hftatf.core import optional
from hftatf.models import recipes
from hftatf.tpu import data, data_numpy
from hftatf.tpu.config import ConfigError, check_directory, parse_mapping
from hftatf.tuning import distributed, space

FLAGS = flags.FLAGS

TUNERS = ("random", "hyperband", "bayesian")
DEFAULT_SPACE = "learning_rate=float:1e-3:0.3:log"


class FlagError(ValueError):
    """A flag value that cannot work; the launcher exits with usage."""


def define_flags(flag_values=FLAGS):
    """Defines the launcher's flags on `flag_values` (once)."""
    if "search_space" in flag_values:
        return

    def string(name, default, help):
        flags.DEFINE_string(name, default, help, flag_values=flag_values)

    def integer(name, default, help, **bounds):
        flags.DEFINE_integer(name, default, help, flag_values=flag_values,
                             **bounds)

    # What to tune.
    string("model", "mlp", "The zoo model (hftatf.models.recipes.names()).")
    string("model_args", None, "Builder arguments over the recipe's: "
           "name=value pairs (--model_args=hidden_units=[64],dropout=0.1) "
           "or a JSON object.")
    string("data_args", None, "Data-recipe arguments over the recipe's, "
           "as --model_args (e.g. --data_args=sequence_length=32).")
    string("search_space", None, "The space: 'name=kind:args;...' (see "
           f"hftatf.tuning.space). Default: {DEFAULT_SPACE}.")
    string("search_space_file", None, "The space as a YAML or JSON "
           "mapping; --search_space entries replace its entries of the "
           "same name.")
    string("optimizer", None, "The optimizer (a keras.optimizers or "
           "hftatf.optimizers name) when the space has no `optimizer`. "
           "Default: the recipe's.")
    # How to search.
    flags.DEFINE_enum("tuner", "random", TUNERS, "The keras-tuner oracle.",
                      flag_values=flag_values)
    integer("max_trials", 8, "Trials at most (random, bayesian).")
    integer("epochs", None, "Epochs per trial (hyperband: the most). "
            "Default: the recipe's.")
    integer("factor", 3, "Hyperband's reduction factor.")
    integer("hyperband_iterations", 1, "Hyperband's iterations.")
    integer("num_initial_points", None, "Bayesian optimization's random "
            "trials before its model of the objective.")
    string("objective", None, "The log entry to optimize. Default: the "
           "recipe's monitor.")
    flags.DEFINE_enum("direction", None, ["min", "max"], "Whether the "
                      "objective is minimized or maximized. Default: the "
                      "recipe's for its monitor; for another objective, "
                      "what its name says (min for losses, max for "
                      "accuracies), else this flag is needed.",
                      flag_values=flag_values)
    integer("executions_per_trial", 1, "Trainings per trial (averaged).")
    integer("seed", 0, "Seeds the oracle, the data and each trial's "
            "initial weights.")
    # Arrays.
    string("num_models", "4", "The largest array, in models, or 'auto' "
           "(probed and cached per model and device).")
    flags.DEFINE_boolean("pad_arrays", True, "Build every array for a "
                         "whole round so that later rounds reuse it.",
                         flag_values=flag_values)
    flags.DEFINE_enum("jit_compile", "auto", ["auto", "true", "false"],
                      "XLA for the arrays (auto: on accelerators).",
                      flag_values=flag_values)
    # Training.
    integer("batch_size", 64, "The batch size.")
    integer("train_steps", None, "Training steps per epoch (the training "
            "set repeats as needed). Default: one pass over the training "
            "set.", lower_bound=1)
    integer("eval_steps", None, "Validation steps per epoch, the same "
            "batches every epoch (at most what the validation set holds). "
            "Default: one pass over the validation set.", lower_bound=1)
    integer("verbose", 0, "Keras verbosity of each array's fit: 0 silent, "
            "1 progress bar, 2 one line per epoch.", lower_bound=0,
            upper_bound=2)
    # Outputs.
    string("directory", "runs/tune", "Where keras-tuner's project goes.")
    string("project_name", None, "The project. Default: the model's name.")
    flags.DEFINE_boolean("overwrite", False, "Start the project over.",
                         flag_values=flag_values)
    string("export_dir", None, "Where the best models go, as .keras files "
           "with their hyper-parameters. Default: <project>/best; '' for "
           "none.")
    integer("num_best", 1, "How many of the best models to export.")
    # Distribution.
    integer("local_workers", 0, "Run a chief and this many workers on this "
            "machine (worker i sees GPU i where there are GPUs).")
    string("tuner_id", None, "This process's id in a distributed search: "
           "'chief' for the oracle, a unique id per worker.")
    string("oracle_address", None, "The chief's host:port in a "
           "distributed search.")


def _settings(flag_values):
    """The checked flag values a search needs, as a dict."""
    recipe = _recipe(flag_values.model)
    if recipe.model_class is not None:
        raise FlagError(
            f"--model={recipe.name} trains with "
            f"{recipe.model_class.__name__}, a step of its own, which the "
            "tuners do not run (they compile a loss and metrics for fit); "
            "train a grid of it with hftatf-train --grid instead.")
    num_models = flag_values.num_models
    if num_models != "auto":
        try:
            num_models = int(num_models)
        except ValueError:
            num_models = 0
        if num_models < 1:
            raise FlagError(
                f"--num_models must be a positive int or 'auto'. Received: "
                f"{flag_values.num_models!r}.")
    for name in ("max_trials", "factor", "hyperband_iterations",
                 "executions_per_trial", "batch_size", "num_best"):
        if flag_values[name].value < 1:
            raise FlagError(f"--{name} must be >= 1. Received: "
                            f"{flag_values[name].value}.")
    if num_models != "auto" and num_models < flag_values.executions_per_trial:
        raise FlagError(
            f"--num_models={num_models} is below --executions_per_trial="
            f"{flag_values.executions_per_trial}: a trial's executions "
            "train side by side in one array.")
    epochs = recipe.epochs if flag_values.epochs is None else (
        flag_values.epochs)
    if epochs < 1:
        raise FlagError(f"--epochs must be >= 1. Received: {epochs}.")
    for name in ("directory", "export_dir"):
        if flag_values[name].value:
            try:
                check_directory(f"--{name}", flag_values[name].value)
            except ConfigError as error:
                raise FlagError(str(error)) from None
    params = []
    text = flag_values.search_space
    try:
        if flag_values.search_space_file:
            params += space.read_file(flag_values.search_space_file)
        if text is None and not params:
            text = DEFAULT_SPACE
        # An entry of --search_space replaces the file's of that name.
        flagged = space.parse(text)
        names = {p.name for p in flagged}
        params = [p for p in params if p.name not in names] + flagged
        # keras-tuner's own checks (e.g. log sampling from 0), before any
        # work.
        hp = keras_tuner.HyperParameters()
        for param in params:
            param.declare(hp)
    except (OSError, ValueError, TypeError) as error:
        raise FlagError(f"Bad search space: {error}") from None
    try:
        model_args = {**recipe.model_args,
                      **parse_mapping(flag_values.model_args, "model_args")}
        data_args = parse_mapping(flag_values.data_args, "data_args")
        source = data.recipe_source(recipe, flag_values.seed, data_args)
    except ConfigError as error:
        raise FlagError(str(error)) from None
    jit = {"auto": "auto", "true": True, "false": False}[
        flag_values.jit_compile]
    return {
        "recipe": recipe,
        "params": params,
        "model_args": model_args,
        "optimizer": flag_values.optimizer or recipe.optimizer,
        "num_models": num_models,
        "epochs": epochs,
        "jit_compile": jit,
        "objective": _objective(recipe, flag_values),
        "source": source,
    }


def _objective(recipe, flag_values):
    """The objective of `--objective` and `--direction`: the recipe's
    monitor and mode by default; an objective of another name goes the
    way its name says (keras-tuner's reading: min for losses, max for
    accuracies), or needs `--direction`."""
    name = flag_values.objective or recipe.monitor
    direction = flag_values.direction
    if direction is None:
        direction = (recipe.monitor_mode if name == recipe.monitor else
                     keras_tuner.engine.metrics_tracking
                     .infer_metric_direction(name))
    if direction is None:
        raise FlagError(
            f"--objective={name}: pass --direction=min or --direction=max; "
            "its name does not say which way is better.")
    return keras_tuner.Objective(name, direction)


def _recipe(name):
    try:
        return recipes.get(name)
    except ValueError as error:
        raise FlagError(str(error)) from None


def make_hypermodel(recipe, params, model_args, optimizer, seed=None,
                    objective=None):
    """A `build(hp)` for keras-tuner: the recipe's model with the space's
    builder arguments, compiled with the space's optimizer arguments.

    Raises:
        FlagError: for a name that neither the builder nor the optimizer
            takes, arguments the builder refuses, or an `objective` (a log
            entry's name) that the model does not log (checked by building
            once with the defaults).
    """
    parameters = inspect.signature(recipe.build).parameters.values()
    builder_args = {p.name for p in parameters if p.kind not in (
        p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    # A builder taking **kwargs (resnet18's) takes names of its own too.
    open_builder = any(p.kind == p.VAR_KEYWORD for p in parameters)

    def build(hp):
        if seed is not None:
            # Every trial starts from the same draw, as in a fair sweep.
            keras.utils.set_random_seed(seed)
        values = {p.name: p.declare(hp) for p in params}
        name = values.pop("optimizer", optimizer)
        optimizer_class = _optimizer_class(name)
        optimizer_args = set(inspect.signature(optimizer_class).parameters)
        args, optimizer_kwargs = dict(model_args), {}
        for key, value in values.items():
            target, _, short = key.rpartition(".")
            if target == "model" or (not target and short in builder_args):
                args[short] = value
            elif target == "optimizer" or (not target and short in (
                    optimizer_args)):
                optimizer_kwargs[short] = value
            elif not target and open_builder:
                args[short] = value
            else:
                raise FlagError(
                    f"Hyper-parameter '{key}' is neither an argument of the "
                    f"'{recipe.name}' builder "
                    f"({', '.join(sorted(builder_args))}) nor of "
                    f"{optimizer_class.__name__}. Prefix it with model. or "
                    "optimizer. where both take it.")
        optimizer_kwargs.setdefault("learning_rate", recipe.learning_rate)
        model = recipe.build(**args)
        model.compile(optimizer=optimizer_class(**optimizer_kwargs),
                      loss=recipe.loss, metrics=list(recipe.metrics))
        return model

    try:
        model = build(keras_tuner.HyperParameters())
    except (TypeError, ValueError) as error:
        if isinstance(error, FlagError):
            raise
        raise FlagError(
            f"The '{recipe.name}' model could not be built with --model_args"
            " and the search space's first values (each entry's default or "
            f"lowest value): {error}") from None
    # A recipe's own array class (a GAN's) logs what its steps say.
    names = None if recipe.model_class else _logged_names(model)
    if objective is not None and names is not None and (
            objective not in names):
        raise FlagError(
            f"--objective={objective} is not logged by the "
            f"'{recipe.name}' model; it logs {', '.join(names)}.")
    return build


def _logged_names(model):
    """The log entries that a `fit` of the compiled `model` with validation
    data writes, or None where they cannot be told before training (a
    custom `train_step`, several outputs, metrics per output)."""
    if type(model).train_step is not keras.Model.train_step or len(
            getattr(model, "outputs", None) or ()) != 1:
        return None
    config = model.get_compile_config() or {}
    if not config.get("loss"):
        return None
    names = ["loss"]
    for key in ("metrics", "weighted_metrics"):
        for metric in config.get(key) or ():
            if isinstance(metric, str):
                names.append(metric)
            elif isinstance(metric, dict) and "name" in metric.get(
                    "config", {}):
                names.append(metric["config"]["name"])
            else:
                return None
    return names + [f"val_{name}" for name in names]


def _optimizer_class(name):
    """The stock Keras optimizer class called `name`, or hftatf's where
    Keras has none (e.g. lars)."""
    for module in (keras.optimizers, hftatf.optimizers):
        for attribute in dir(module):
            candidate = getattr(module, attribute)
            if attribute.lower() == str(name).lower() and isinstance(
                    candidate, type) and issubclass(
                    candidate, keras.optimizers.Optimizer):
                return candidate
    raise FlagError(f"Unknown optimizer {name!r}: use a keras.optimizers or "
                    "hftatf.optimizers name (sgd, adam, adamw, ...).")


def make_tuner(settings, flag_values):
    """The fused keras-tuner tuner the flags describe."""
    hypermodel = make_hypermodel(
        settings["recipe"], settings["params"], settings["model_args"],
        settings["optimizer"],
        seed=flag_values.seed if flag_values.executions_per_trial == 1
        else None, objective=settings["objective"].name)
    common = dict(
        hypermodel=hypermodel, objective=settings["objective"],
        seed=flag_values.seed, num_models=settings["num_models"],
        jit_compile=settings["jit_compile"],
        pad_arrays=flag_values.pad_arrays,
        executions_per_trial=flag_values.executions_per_trial,
        directory=flag_values.directory,
        project_name=flag_values.project_name or settings["recipe"].name,
        overwrite=flag_values.overwrite)
    if flag_values.tuner == "hyperband":
        return tuning.FusedHyperband(
            max_epochs=settings["epochs"], factor=flag_values.factor,
            hyperband_iterations=flag_values.hyperband_iterations, **common)
    if flag_values.tuner == "bayesian":
        return tuning.FusedBayesianOptimization(
            max_trials=flag_values.max_trials,
            num_initial_points=flag_values.num_initial_points, **common)
    return tuning.FusedRandomSearch(max_trials=flag_values.max_trials,
                                    **common)


def search(settings, flag_values):
    """Runs (or serves, on a chief) the search; returns the tuner."""
    try:
        # The training launcher's inputs: every array's fit reads the
        # training stream from its start and validates on the same batches
        # every epoch. Checked before the tuner (re)writes its project.
        source = settings["source"]
        if source.tf_data:
            pipeline = data
            strategy = data.tensorflow().distribute.get_strategy()
        else:
            # NumPy batches (on JAX), under the keras.distribution set.
            pipeline = data_numpy
            strategy = data_numpy.Placement(keras.distribution.distribution())
        inputs = pipeline.distributed_inputs(
            strategy, source, flag_values.batch_size,
            train_steps=flag_values.train_steps,
            eval_steps=flag_values.eval_steps)
    except ConfigError as error:
        raise FlagError(str(error)) from None
    if inputs.validation is None and (
            settings["objective"].name.startswith("val_")):
        raise FlagError(
            f"--objective={settings['objective'].name} needs validation, "
            f"but the validation set of --model={flag_values.model} holds "
            f"not one batch of {flag_values.batch_size}: lower --batch_size.")
    tuner = make_tuner(settings, flag_values)
    # The recipe's pipeline shuffles the training set itself.
    fit = dict(validation_data=inputs.validation,
               verbose=flag_values.verbose, shuffle=False,
               steps_per_epoch=inputs.steps_per_epoch,
               validation_steps=inputs.validation_steps or None)
    if flag_values.tuner != "hyperband":
        fit["epochs"] = settings["epochs"]
    tuner.search(inputs.train, **fit)
    return tuner


def results(tuner):
    """One row per finished trial, best first: id, score, hyper-parameter
    values."""
    rows = []
    for trial in tuner.oracle.get_best_trials(len(tuner.oracle.trials)):
        values = {k: v for k, v in trial.hyperparameters.values.items()
                  if not k.startswith("tuner/")}
        rows.append({"trial": trial.trial_id, "status": trial.status,
                     "score": trial.score, **values})
    return rows


def format_table(rows, objective):
    """The rows as an aligned text table."""
    if not rows:
        return "No trials."
    names = []
    for row in rows:
        names += [k for k in row if k not in names]
    names = [n if n != "score" else objective for n in names]
    cells = [[_cell(row.get("score" if n == objective else n)) for n in
              names] for row in rows]
    return report.aligned(names, cells, left=True)


def _cell(value):
    if isinstance(value, float):
        return f"{value:.6g}"
    return "" if value is None else str(value)


def export_best(tuner, directory, num_best):
    """Saves the `num_best` best models as `rank_<i>/model.keras` with
    `hyperparameters.json` next to each; returns their directories."""
    directory = pathlib.Path(directory)
    written = []
    # (keras-tuner pads the best with unfinished trials.)
    trials = [trial for trial in tuner.oracle.get_best_trials(num_best)
              if trial.status == "COMPLETED"]
    for rank, (trial, model) in enumerate(zip(
            trials, tuner.get_best_models(len(trials)))):
        path = directory / f"rank_{rank}"
        path.mkdir(parents=True, exist_ok=True)
        optimizer = getattr(model, "optimizer", None)
        if optimizer is not None and not optimizer.built:
            # Saved with the slots its variables need (fresh ones), so that
            # loading it compiled finds the state it builds.
            optimizer.build(model.trainable_variables)
        model.save(path / "model.keras")
        (path / "hyperparameters.json").write_text(json.dumps(
            {"trial": trial.trial_id, "score": trial.score,
             "hyperparameters": trial.hyperparameters.values}, indent=1))
        written.append(path)
    return written


def distributed_environment(flag_values):
    """keras-tuner's variables for `--tuner_id` and `--oracle_address`."""
    if flag_values.local_workers < 0:
        raise FlagError("--local_workers must be >= 0. Received: "
                        f"{flag_values.local_workers}.")
    if flag_values.local_workers and flag_values.tuner_id:
        raise FlagError("--local_workers starts its own chief and workers; "
                        "it does not go with --tuner_id.")
    if bool(flag_values.tuner_id) != bool(flag_values.oracle_address):
        raise FlagError("--tuner_id and --oracle_address go together: give "
                        "both (or neither).")
    if not flag_values.tuner_id:
        return {}
    host, _, port = flag_values.oracle_address.rpartition(":")
    if not host or not port.isdigit():
        raise FlagError(
            "--oracle_address must be host:port. Received: "
            f"{flag_values.oracle_address!r}.")
    return distributed.environment(flag_values.tuner_id, host, port)


def _local_cluster(argv, settings, flag_values):
    """Runs this command as a chief and `--local_workers` workers; the
    chief prints the trials and exports the best models."""
    project = pathlib.Path(flag_values.directory) / (
        flag_values.project_name or settings["recipe"].name)
    if flag_values.overwrite and project.exists():
        # Here, once: each process overwriting would delete the others'.
        shutil.rmtree(project)
    command = [sys.executable, "-m", "hftatf.tpu.tune"] + [
        a for a in argv[1:] if not a.startswith(
            ("--local_workers", "--overwrite", "--nooverwrite"))] + [
        "--nooverwrite"]
    gpus = sum("gpu" in device.lower()
               for device in keras.distribution.list_devices())

    def worker_env(index):
        return {"CUDA_VISIBLE_DEVICES": str(index % gpus)} if gpus else {}

    distributed.launch(command, flag_values.local_workers,
                       worker_env=worker_env)


def main(argv, flag_values=FLAGS):
    """Runs the search the flags describe, prints its trials (best first)
    and exports the best models; returns the tuner (None after a local
    cluster, whose chief prints and exports)."""
    if len(argv) > 1:
        raise FlagError(
            f"Unexpected arguments: {' '.join(argv[1:])} (every option is a "
            "--flag; see --helpfull).")
    tf = optional.imported_tensorflow()
    if tf is not None:
        tf.get_logger().setLevel("WARNING")
    settings = _settings(flag_values)
    os.environ.update(distributed_environment(flag_values))
    if flag_values.local_workers > 0:
        _local_cluster(sys.argv, settings, flag_values)
        return None
    tuner = search(settings, flag_values)
    if distributed.role() == "worker":
        return tuner
    print(format_table(results(tuner), settings["objective"].name))
    export_dir = flag_values.export_dir
    if export_dir is None:
        export_dir = os.path.join(tuner.project_dir, "best")
    if export_dir:
        written = export_best(tuner, export_dir, flag_values.num_best)
        for path in written:
            print(f"Exported {path}/model.keras")
        if not written:
            raise FlagError(
                "No trial completed, so no model was exported: see the "
                "trials' errors above.")
    return tuner


def _main_cli(argv):
    try:
        main(argv)
    except FlagError as error:
        print(f"hftatf-tune: error: {error}", file=sys.stderr)
        sys.exit(2)


def run():
    """Console-script entry point (`hftatf-tune`)."""
    define_flags()
    app.run(_main_cli)


if __name__ == "__main__":
    run()
