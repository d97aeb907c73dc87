"""Trains an array of B zoo models as one fused model, on a TPU, GPUs or CPU.

With no flags it trains 4 MLPs on scikit-learn's bundled digits (no
download; the CPU is enough), with learning rates 0.3, 0.1, 0.03 and 0.01,
prints a table of each model's results and exports the 4 models:

    hftatf-train
    hftatf-train --model=resnet18 --grid="learning_rate=0.1,0.05;momentum=0,0.9"
    hftatf-train --tpu=local --model=bert_tiny --learning_rate=1e-3,5e-4,2e-4 \\
        --batch_size=1024 --mixed_precision=mixed_bfloat16

`python -m hftatf.tpu.train` is the same program. Rerunning a killed run
with the same flags resumes it from its last epoch. Every flag is described
in tpu/README.md and by --helpfull.
"""

import contextlib
import dataclasses
import pathlib
import shutil
import sys

import keras
from absl import app, flags, logging

import hftatf
from hftatf import backup, distribute, report
from hftatf import callbacks as fused_callbacks
from hftatf.core import optional
from hftatf.tpu import data, data_numpy, page, plots, results, resume
from hftatf.tpu.backend import BACKENDS, check_backend, relaunch_for_backend
from hftatf.tpu.builders import (  # noqa: F401
    build_model,
    check_examples_fit,
    make_learning_rate,
    make_optimizer,
)
from hftatf.tpu.config import (
    PRECISIONS,
    SCHEDULES,
    STRATEGIES,
    Config,
    ConfigError,
    field_names,
    parse_mapping,
    read_file,
)
from hftatf.tpu.header import header_lines

FLAGS = flags.FLAGS

BACKUP_DIR = "backup"
LOG_DIR = "logs"

# Other names of flags (kept for the command lines of earlier versions).
ALIASES = {"learning_rates": "learning_rate"}


class _Definer:
    """absl's `DEFINE_*` functions on one `FlagValues`, skipping the names
    it already has."""

    def __init__(self, flag_values):
        self.flag_values = flag_values

    def __getattr__(self, function):
        define = getattr(flags, function)

        def define_new(name, *args, **kwargs):
            if name not in self.flag_values:
                define(name, *args, flag_values=self.flag_values, **kwargs)

        return define_new


def define_flags(flag_values=FLAGS):
    """Defines the launcher's flags on `flag_values` (once; every flag is
    optional, and `Config` holds the defaults that apply).

    A flag that another launcher of the same process already defined (e.g.
    `--model` of `hftatf.tpu.tune`, in one test session) is left as it is:
    only flags given explicitly are read, and `Config` converts their
    values."""
    if "params_override" in flag_values:
        return
    define = _Definer(flag_values)

    def string(name, help):
        define.DEFINE_string(name, None, help)

    # Where to run.
    define.DEFINE_enum(
        "backend", None, BACKENDS,
        "The Keras backend: tensorflow or jax (default: $KERAS_BACKEND, "
        "else tensorflow). hftatf-train applies it before Keras starts, "
        "by starting itself again with KERAS_BACKEND set.")
    define.DEFINE_enum(
        "strategy", "auto", STRATEGIES,
        "On tensorflow: tpu, a TPUStrategy on --tpu; mirrored, every local "
        "GPU (or the CPU); cpu, one CPU device; auto, a TPU where there is "
        "one, else the GPUs, else the CPU. On jax: keras.distribution "
        "instead of tf.distribute: auto, over every device JAX sees (a TPU "
        "VM's chips, the GPUs, else the CPU), the models split between "
        "them where their count divides --num_models, else each batch; "
        "mirrored, DataParallel over them; tpu, as auto after "
        "keras.distribution.initialize() on every host of a pod slice; "
        "cpu, one CPU device.")
    string("tpu", "The TPU: its name, a grpc://host:port address, or 'local' "
           "on a TPU VM.")
    string("zone", "The zone of a TPU given by name (Cloud TPU).")
    string("project", "The project of a TPU given by name (Cloud TPU).")
    # What to train.
    define.DEFINE_string(
        "model", "mlp", "The zoo model (hftatf.models.recipes.names()): "
        "mlp, resnet18, resnet34, mobilenet_v2, mobilenet_v3_small, "
        "mobilenet_v3_large, pointnet, pointnet_seg, bert_tiny, bert_mini, "
        "transformer_lm, dcgan, ...")
    string("model_args", "Builder arguments over the recipe's, as "
           "name=value pairs: --model_args=width=0.25,num_classes=10 (lists "
           "in brackets: hidden_units=[64,32]).")
    string("dataset", "The data: a zoo recipe name (default: the model's "
           "own), a TFRecord file name or glob (tfrecord: may prefix it; "
           "gs:// works), or a tensorflow-datasets name read from "
           "--data_dir (tfds: may prefix it).")
    string("validation_dataset", "TFRecord files of the validation set, "
           "with a TFRecord --dataset.")
    string("data_dir", "The tensorflow-datasets data directory (e.g. "
           "gs://bucket/tensorflow_datasets), prepared beforehand.")
    string("data_args", "Data recipe arguments over the recipe's, as "
           "name=value pairs: --data_args=image_size=32,augment=true.")
    # The array's models and their hyper-parameters.
    define.DEFINE_integer(
        "num_models", None, "The number of models B. Alone: B models with "
        "the same hyper-parameters (different initialisations).")
    define.DEFINE_list(
        "learning_rate", None, "One learning rate (shared) or one per model: "
        "--learning_rate=1e-3,3e-4,1e-4 trains 3 models. Default: the "
        "recipe's rate times 3, 1, 0.3 and 0.1 (4 models).")
    for alias, name in ALIASES.items():
        define.DEFINE_alias(alias, name)
    string("grid", "A grid of per-model hyper-parameters; one model per "
           "combination: --grid=\"learning_rate=1e-3,1e-4;weight_decay=0,"
           "1e-4\" trains 4. Not with per-model lists.")
    string("optimizer", "The hftatf.optimizers name (sgd, adam, adamw, "
           "lamb, lars, ...). Default: the recipe's.")
    string("optimizer_args", "Other optimizer arguments, as name=value "
           "pairs; a list gives one value per model: "
           "--optimizer_args=momentum=0.9,weight_decay=[0,1e-4].")
    define.DEFINE_enum(
        "schedule", "constant", SCHEDULES,
        "The learning-rate schedule, applied to each model's rate.")
    string("schedule_args", "Schedule arguments: alpha (cosine), decay_rate "
           "and decay_epochs (exponential, step), staircase (exponential), "
           "warmup_epochs (any).")
    # Training.
    define.DEFINE_integer(
        "batch_size", 64, "The global batch size, split evenly between the "
        "replicas.")
    define.DEFINE_integer("epochs", None, "Epochs. Default: the recipe's.")
    define.DEFINE_integer(
        "train_steps", None, "Training steps per epoch. Default: one pass "
        "over the training set.")
    define.DEFINE_integer(
        "eval_steps", None, "Validation steps per epoch. Default: one pass "
        "over the validation set; 0: no validation.")
    define.DEFINE_integer(
        "steps_per_execution", 1, "Training steps per compiled call (more "
        "keeps a TPU busy).")
    define.DEFINE_enum(
        "mixed_precision", "float32", PRECISIONS,
        "The Keras dtype policy (mixed_bfloat16 on TPUs).")
    define.DEFINE_enum(
        "jit_compile", "auto", ["auto", "true", "false"],
        "XLA compilation (TPUs always compile).")
    define.DEFINE_integer("seed", 0, "Seeds initialisation, data and dropout.")
    define.DEFINE_boolean(
        "deterministic", False, "Enable TensorFlow's op determinism (a "
        "resumed run then ends exactly as an uninterrupted one).")
    # Outputs and configuration.
    string("model_dir", "Where the backup, logs, config and results go. "
           "Default: runs/<model>.")
    string("export_dir", "Where each model is exported. Default: "
           "<model_dir>/export; '' for no export.")
    string("config_file", "A YAML (or JSON) file of configuration values, "
           "applied over the defaults.")
    string("params_override", "Configuration values applied over "
           "--config_file, as name=value pairs (model_args.width=0.5 sets "
           "one key) or a YAML mapping. Flags given explicitly win.")
    define.DEFINE_integer(
        "verbose", 1, "Keras verbosity: 0 silent, 1 progress bar, 2 one "
        "line per epoch; 3: a progress bar, and TensorFlow's start-up "
        "logging (silenced otherwise, unless TF_CPP_MIN_LOG_LEVEL is set).")
    define.DEFINE_integer(
        "table_every", 0, "Print the per-model table every this many "
        "epochs (0: only at the end).")


def config_from_flags(flag_values=FLAGS):
    """The validated `Config` of the parsed flags: defaults, then
    `--config_file`, then `--params_override`, then each flag given
    explicitly."""
    config = Config()
    if flag_values.config_file:
        path = flag_values.config_file
        config = config.updated(read_file(path), f"--config_file {path}")
    if flag_values.params_override:
        config = config.updated(
            parse_mapping(flag_values.params_override, "params_override"),
            "--params_override")
    explicit = {name: flag_values[name].value for name in field_names()
                if name in flag_values
                and not flag_values[name].using_default_value}
    for alias, name in ALIASES.items():
        if alias in flag_values and not flag_values[alias].using_default_value:
            explicit[name] = flag_values[name].value
    return config.updated(explicit, "the flags").validate()


@dataclasses.dataclass
class Run:
    """What `train` did.

    Attributes:
        config: the resolved config.
        array: the trained `FusedModel`.
        history: the per-model history of every epoch (`{name_b: [...]}`),
            those before a resumption included.
        results: one dict per model (hyper-parameters, final values,
            status), as in `results.csv`.
        best: the best model's row by `best_by`, or None.
        best_by: the value `best` was chosen by: the recipe's monitor, or
            the training `loss` where the monitor has no values (e.g.
            without validation).
        model_dir: the run's directory.
        export_dir: where the models were exported, or None.
        hyperparameters: the names of the hyper-parameters in `results`.
        initial_epoch: the epoch the run started (or resumed) at.
        num_replicas: the replicas the array trained on.
        header: the lines printed before the first epoch.
        report_path: the run's `report.html`.
    """

    config: Config
    array: object
    history: dict
    results: list
    best: dict | None
    best_by: str
    model_dir: pathlib.Path
    export_dir: pathlib.Path | None
    hyperparameters: list
    initial_epoch: int
    num_replicas: int
    header: list
    report_path: pathlib.Path


def train(config, callbacks=()):
    """Runs `config`: builds the strategy, the inputs and the array, trains
    it (resuming from `model_dir/backup` if a killed run left one), writes
    the results and exports the models.

    Args:
        config: a `Config`.
        callbacks: more Keras callbacks for `fit`.

    Returns:
        A `Run`.

    Raises:
        ConfigError: before any training, and before anything is written
            to `model_dir`, for an invalid config, a strategy whose
            hardware is missing, a batch that does not split between the
            replicas, a training set smaller than one step, a model its
            builder refuses or that does not take the data's examples, or
            a backup in `model_dir` of another number of models.
    """
    plan = _prepare(config.validate().resolved())
    array, header = _fit(plan, callbacks)
    run = _report(plan, array, header)
    # Only now: a run killed while it wrote its results resumes from its
    # last epoch, to write them.
    backup.delete_backup(plan.model_dir / BACKUP_DIR)
    return run


@dataclasses.dataclass
class _Plan:
    """A checked run, of which nothing is written yet."""

    config: Config
    recipe: object
    num_models: int
    per_model: dict
    shared: dict
    source: object
    model_dir: pathlib.Path
    initial_epoch: int
    strategy: object
    inputs: object
    stock: keras.Model

    @property
    def history_path(self):
        return self.model_dir / results.HISTORY_FILE

    @property
    def columns(self):
        """Each model's hyper-parameter values by name: the learning rate,
        then the hyper-parameters given one value per model."""
        columns = {"learning_rate": self.per_model["learning_rate"]
                   if "learning_rate" in self.per_model
                   else [self.shared["learning_rate"]] * self.num_models}
        columns.update(self.per_model)
        return columns

    @property
    def hyperparameters(self):
        """The per-model columns of the history, in order."""
        return list(self.columns)


def _prepare(config):
    """Everything that may refuse `config`, before anything is written to
    its `model_dir`: a killed run's files stay as they were."""
    recipe = config.recipe()
    num_models, per_model, shared = config.array_plan()
    source = data.resolve(config, recipe)
    model_dir = pathlib.Path(config.model_dir)
    initial_epoch = resume.backed_up_epoch(model_dir / BACKUP_DIR,
                                           num_models)
    if config.deterministic and source.tf_data:
        # TensorFlow runs the input (and, on its backend, the array); the
        # NumPy input is deterministic as it is.
        tf = data.tensorflow("--deterministic")
        tf.config.experimental.enable_op_determinism()
    strategy = make_strategy(config, num_models, tf_data=source.tf_data)
    data.per_replica_batch_size(config.batch_size,
                                strategy.num_replicas_in_sync)
    keras.utils.set_random_seed(config.seed)
    # A training set of less than one step is a ConfigError here.
    inputs = (data if source.tf_data else data_numpy).distributed_inputs(
        strategy, source, config.batch_size,
        train_steps=config.train_steps, eval_steps=config.eval_steps,
        steps_per_execution=config.steps_per_execution,
        initial_epoch=initial_epoch,
        static_shapes=data.is_tpu_strategy(strategy))
    with _global_policy(config.mixed_precision):
        # A builder that refuses its arguments, or a model that does not
        # take the data's examples.
        stock = build_model(recipe, config)
        check_examples_fit(stock, inputs.element_spec, recipe)
    return _Plan(config=config, recipe=recipe, num_models=num_models,
                 per_model=per_model, shared=shared, source=source,
                 model_dir=model_dir, initial_epoch=initial_epoch,
                 strategy=strategy, inputs=inputs, stock=stock)


def _fit(plan, callbacks):
    """Writes the run's config, clears what a fresh run replaces, and
    trains the array of `plan`; returns it."""
    config, model_dir, inputs = plan.config, plan.model_dir, plan.inputs
    resume.check_resumed_config(config, model_dir, plan.initial_epoch)
    config.write(model_dir)
    results.trim_history(plan.history_path, plan.initial_epoch)
    if plan.initial_epoch == 0:
        shutil.rmtree(model_dir / LOG_DIR, ignore_errors=True)
    else:
        logging.warning("Resuming %s from its backup at epoch %d of %d.",
                        model_dir, plan.initial_epoch, config.epochs)
    with _global_policy(config.mixed_precision), plan.strategy.scope():
        array = hftatf.fuse(plan.stock, plan.num_models,
                            model_class=plan.recipe.model_class
                            or hftatf.FusedModel)
        array.compile(
            optimizer=make_optimizer(config, plan.per_model, plan.shared,
                                     inputs.steps_per_epoch),
            loss=plan.recipe.loss, metrics=list(plan.recipe.metrics) or None,
            steps_per_execution=config.steps_per_execution,
            jit_compile=config.jit_compile)
        header = header_lines(plan, array)
        if config.verbose:
            print("\n".join(header), flush=True)
        array.fit(
            inputs.train, validation_data=inputs.validation,
            epochs=config.epochs, steps_per_epoch=inputs.steps_per_epoch,
            validation_steps=inputs.validation_steps or None,
            # The pipelines shuffle (seeded, every pass).
            shuffle=False, verbose=min(config.verbose, 2) if (
                config.verbose != 3) else 1,
            callbacks=[
                # Logged before the backup: epochs logged after the last
                # backup of a killed run are trimmed when it resumes.
                fused_callbacks.CSVLogger(
                    plan.history_path, append=True,
                    hyperparameters=plan.hyperparameters),
                *_tensorboard(plan),
                backup.BackupAndRestore(model_dir / BACKUP_DIR,
                                        delete_checkpoint=False),
                *_table_logger(plan),
                *callbacks,
            ])
    return array, header


def _tensorboard(plan):
    """Each model's TensorBoard run, as a list: none where TensorFlow, which
    writes them, is not installed."""
    if not optional.tensorflow_installed():
        logging.warning("No TensorBoard logs: TensorFlow writes them, and "
                        "it is not installed (pip install tensorflow).")
        return []
    return [fused_callbacks.TensorBoard(
        plan.model_dir / LOG_DIR, hyperparameters=plan.hyperparameters)]


def _table_logger(plan):
    """The per-model table every `--table_every` epochs, as a list."""
    if not plan.config.table_every:
        return []
    return [report.TableLogger(
        plan.config.table_every, monitor=plan.recipe.monitor,
        mode=plan.recipe.monitor_mode, hyperparameters=plan.columns)]


def _report(plan, array, header):
    """Writes the results, the plots, the report page and the exports of
    the trained `array`; returns the `Run`."""
    config, columns = plan.config, plan.columns
    history = results.read_history(plan.history_path, plan.num_models)
    rows = report.model_results(history, columns, array.diverged_models)
    results.write_csv(rows, plan.model_dir / results.RESULTS_FILE)
    best_by, mode = report.best_monitor(rows, plan.recipe.monitor,
                                        plan.recipe.monitor_mode)
    best = report.best_model(rows, best_by, mode)
    best_index = None if best is None else best["model"]
    images = [image for image in (
        plots.plot_loss_curves(
            history, [_label(row, columns) for row in rows],
            plan.model_dir / plots.LOSS_CURVES_FILE, best=best_index,
            diverged=array.diverged_models),
        plots.plot_hyperparameters(
            rows, columns, plan.model_dir / plots.HYPERPARAMETERS_FILE,
            best=best_index)) if image is not None]
    report_path = page.write_report(
        plan.model_dir / page.REPORT_FILE, f"hftatf-train: {config.model}",
        header, rows, columns, best=best_index, images=images)
    export_dir = None
    if config.export_dir:
        export_dir = pathlib.Path(config.export_dir)
        metrics = {key: values for key, values in history.items()
                   if key.rpartition("_")[0] not in columns}
        hftatf.export.export_models(array, export_dir, history=metrics,
                                    verbose=min(config.verbose, 1))
    return Run(config=config, array=array, history=history, results=rows,
               best=best, best_by=best_by, model_dir=plan.model_dir,
               export_dir=export_dir, hyperparameters=plan.hyperparameters,
               initial_epoch=plan.initial_epoch,
               num_replicas=plan.strategy.num_replicas_in_sync,
               header=header, report_path=report_path)


@contextlib.contextmanager
def _global_policy(name):
    """Keras' global dtype policy set to `name` for the block."""
    policy = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy(name)
    try:
        yield
    finally:
        keras.mixed_precision.set_global_policy(policy)


def make_strategy(config, num_models=1, tf_data=True):
    """The `tf.distribute.Strategy` of `config` (TPU connected and
    initialised; on JAX, the `keras.distribution` of an array of
    `num_models` set), or for input that is not `tf.data` (`tf_data`
    False: NumPy batches, on JAX) that distribution's
    `data_numpy.Placement`; a missing TPU is a ConfigError, not a
    hang."""
    try:
        if not tf_data:
            return data_numpy.placement(config.strategy, num_models)
        return distribute.strategy_from_name(
            config.strategy, tpu=config.tpu, zone=config.zone,
            project=config.project, num_models=num_models)
    except ValueError as error:
        raise ConfigError(f"--strategy={config.strategy}: {error}") from None


def _label(row, columns):
    values = ", ".join(f"{name}={report.format_hyperparameter(row[name])}"
                       for name in columns)
    return f"model {row['model']} ({values})"


def main(argv):
    check_backend(FLAGS["backend"].value if "backend" in FLAGS else None)
    if len(argv) > 1:
        raise ConfigError(
            f"Unexpected arguments: {' '.join(argv[1:])} (every option is a "
            "--flag; see --helpfull).")
    # TensorFlow's notes (SavedModel assets, ...) would drown the run's.
    logging.set_verbosity(logging.WARNING)
    run = train(config_from_flags())
    print(report.format_table(
        run.results, run.hyperparameters,
        best=None if run.best is None else run.best["model"]))
    if run.best is not None:
        described = ", ".join(
            f"{name} {report.format_hyperparameter(run.best[name])}"
            for name in run.hyperparameters)
        monitor = run.config.recipe().monitor
        by = "" if run.best_by == monitor else (
            f", by the training {run.best_by} ({monitor} has no values)")
        print(f"Best: model {run.best['model']} ({described}){by}.")
    print(f"Results: {run.model_dir / results.RESULTS_FILE}, "
          f"{run.report_path}")
    if run.export_dir is not None:
        print(f"Exported {len(run.results)} models to {run.export_dir}/")


def _main_cli(argv):
    try:
        main(argv)
    except ConfigError as error:
        print(f"hftatf-train: error: {error}", file=sys.stderr)
        sys.exit(2)


def run():
    """Console-script entry point (`hftatf-train`)."""
    relaunch_for_backend(sys.argv)
    define_flags()
    app.run(_main_cli)


if __name__ == "__main__":
    run()
