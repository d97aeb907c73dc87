"""The launcher's configuration: one validated dataclass.

A run is described by a `Config`. Its values come, from the weakest to the
strongest, from the defaults below, a `--config_file` (YAML, or JSON), a
`--params_override` string, and the flags given explicitly on the command
line. The merged configuration is validated before any work starts (no
accelerator is touched, no data read) and written, resolved (defaults of the
zoo recipe filled in), to `model_dir/config.yaml` (`config.json` where PyYAML
is missing), so that `--config_file=model_dir/config.yaml` reruns it.

Per-model hyper-parameters. An array trains B models; each gets its own
values of the optimizer's float hyper-parameters, from one of:

* lists: `learning_rate: [1e-3, 3e-4]` (`--learning_rate=1e-3,3e-4`), or a
  list in `optimizer_args` (`--optimizer_args=weight_decay=[0,1e-4]`); every
  list has B values;
* a grid: `grid: {learning_rate: [1e-3, 1e-4], weight_decay: [0, 1e-4]}`
  (`--grid="learning_rate=1e-3,1e-4;weight_decay=0,1e-4"`): one model per
  combination, the first name varying slowest;
* `num_models: B` alone: B models with the same hyper-parameters (they
  differ by their initialisation only);
* nothing: 4 models, with the recipe's learning rate times 3, 1, 0.3 and 0.1.
"""

import contextlib
import dataclasses
import inspect
import itertools
import json
import pathlib

import keras

from hftatf import optimizers
from hftatf.core.files import is_remote, unwritable_directory_error
from hftatf.models import recipes
from hftatf.tpu.config_text import (  # noqa: F401
    MAPPINGS,
    ConfigError,
    check_positive,
    describe,
    is_number,
    normalize,
    not_int,
    parse_grid,
    parse_mapping,
    parse_value,
    plain,
    read_file,
    round_value,
)

# Multipliers of a recipe's learning rate that an array gets when no
# hyper-parameter is given: a half-decade sweep around it.
DEFAULT_SWEEP = (3.0, 1.0, 0.3, 0.1)

STRATEGIES = ("auto", "tpu", "mirrored", "cpu")
SCHEDULES = ("constant", "cosine", "exponential", "step")
PRECISIONS = ("float32", "mixed_float16", "mixed_bfloat16")

# The arguments each schedule takes in `schedule_args` (see `Config`).
SCHEDULE_ARGS = {
    "constant": ("warmup_epochs",),
    "cosine": ("alpha", "warmup_epochs"),
    "exponential": ("decay_rate", "decay_epochs", "staircase",
                    "warmup_epochs"),
    "step": ("decay_rate", "decay_epochs", "warmup_epochs"),
}

# Arguments every fused optimizer takes besides its own (those of
# `keras.optimizers.Optimizer`).
BASE_OPTIMIZER_ARGS = ("weight_decay", "clipnorm", "clipvalue",
                       "global_clipnorm", "use_ema", "ema_momentum",
                       "ema_overwrite_frequency", "loss_scale_factor",
                       "gradient_accumulation_steps")

CONFIG_YAML = "config.yaml"
CONFIG_JSON = "config.json"


@dataclasses.dataclass
class Config:
    """A launcher run. Each field is the flag of the same name.

    Where to run:
        strategy: `"auto"`, `"tpu"`, `"mirrored"` or `"cpu"` (see
            `hftatf.distribute.strategy_from_name`).
        tpu: the TPU's name, `grpc://host:port` address, or `"local"`.
        zone, project: where a TPU given by name lives (Cloud TPU).

    What to train:
        model: the name of a zoo recipe (`hftatf.models.recipes.names()`).
        model_args: arguments of the recipe's builder, over its defaults.
        dataset: None (the recipe's own data), another zoo recipe's name
            (its data), a TFRecord file name or glob (`gs://` paths work;
            `tfrecord:` may prefix it), or a tensorflow-datasets name read
            from `data_dir` (`tfds:` may prefix it).
        validation_dataset: TFRecord files of the validation set, for a
            TFRecord `dataset` (None: no validation).
        data_dir: the tensorflow-datasets data directory, for a
            tensorflow-datasets `dataset`.
        data_args: arguments of the data recipe, over its defaults (e.g.
            `image_size`, `augment`, `samples_per_shape`).

    The array (see the module docstring):
        num_models: the number of models B.
        learning_rate: one rate (shared) or one per model.
        grid: hyper-parameter name -> values; one model per combination.
        optimizer: an `hftatf.optimizers` name (None: the recipe's).
        optimizer_args: the optimizer's other arguments; a list value gives
            one value per model.
        schedule: `"constant"`, `"cosine"` (to `alpha` times the rate over
            the run), `"exponential"` (times `decay_rate`, default 0.9,
            every `decay_epochs`, default 1) or `"step"` (times
            `decay_rate`, default 0.1, every `decay_epochs`, default a
            third of the run).
        schedule_args: the schedule's arguments, and `warmup_epochs` (a
            linear warm-up from 0, for any schedule).

    Training:
        batch_size: the global batch size, split evenly between replicas.
        epochs: the number of epochs (None: the recipe's).
        train_steps: steps per epoch (None: one pass over the training set).
        eval_steps: validation steps per epoch (None: the validation set).
        steps_per_execution: steps per compiled call.
        mixed_precision: a Keras dtype policy name.
        jit_compile: `"auto"`, True or False (XLA; always on on TPUs).
        seed: seeds the models' initialisation, the data and dropout
            (0 to 2**32 - 1).
        deterministic: whether to enable TensorFlow's op determinism.

    Outputs:
        model_dir: checkpoints, logs, the config and the results (None:
            `runs/<model>`).
        export_dir: where each model is exported (None: `model_dir/export`,
            `""`: no export).
        verbose: Keras' verbosity (0 silent, 1 progress bar, 2 one line per
            epoch); 3: a progress bar, and TensorFlow's own start-up
            logging (its C++ runtime's notes and warnings), which the
            launchers otherwise silence.
        table_every: print the per-model table every this many epochs
            (0: only at the end).
    """

    strategy: str = "auto"
    tpu: str | None = None
    zone: str | None = None
    project: str | None = None
    model: str = "mlp"
    model_args: dict = dataclasses.field(default_factory=dict)
    dataset: str | None = None
    validation_dataset: str | None = None
    data_dir: str | None = None
    data_args: dict = dataclasses.field(default_factory=dict)
    num_models: int | None = None
    learning_rate: list | None = None
    grid: dict = dataclasses.field(default_factory=dict)
    optimizer: str | None = None
    optimizer_args: dict = dataclasses.field(default_factory=dict)
    schedule: str = "constant"
    schedule_args: dict = dataclasses.field(default_factory=dict)
    batch_size: int = 64
    epochs: int | None = None
    train_steps: int | None = None
    eval_steps: int | None = None
    steps_per_execution: int = 1
    mixed_precision: str = "float32"
    jit_compile: str | bool = "auto"
    seed: int = 0
    deterministic: bool = False
    model_dir: str | None = None
    export_dir: str | None = None
    verbose: int = 1
    table_every: int = 0

    def __post_init__(self):
        for field in dataclasses.fields(self):
            setattr(self, field.name, normalize(
                field.name, getattr(self, field.name), "Config"))

    # -- building -----------------------------------------------------------

    @classmethod
    def from_dict(cls, values, source="the configuration"):
        """A Config from a mapping of field names to values; unknown names
        are an error naming `source`."""
        if not isinstance(values, dict):
            raise ConfigError(
                f"{source} must be a mapping of configuration names to "
                f"values. Received: {values!r}.")
        return cls().updated(values, source)

    def updated(self, values, source):
        """A copy with `values` (field name, or `mapping.key`, -> value)
        applied over this config. Mappings (`model_args`, `grid`, ...) are
        merged key by key; other fields are replaced."""
        names = field_names()
        current = dataclasses.asdict(self)
        for key, value in values.items():
            name, _, item = str(key).partition(".")
            if name not in names:
                raise ConfigError(
                    f"Unknown configuration name {key!r} in {source}. "
                    f"Known names: {', '.join(names)}.")
            if item:
                if name not in MAPPINGS:
                    raise ConfigError(
                        f"{source} sets {key!r}, but {name!r} is not a "
                        f"mapping; set it as {name}=VALUE.")
                value = {item: value}
            value = normalize(name, value, source)
            if name in MAPPINGS and value:
                current[name] = {**current[name], **value}
            else:
                current[name] = value
        return type(self)(**current)

    def to_dict(self):
        """The config as plain JSON/YAML-ready values."""
        return plain(dataclasses.asdict(self))

    # -- validation ---------------------------------------------------------

    def validate(self):
        """Checks everything that can be checked before any work starts;
        returns self. Raises ConfigError naming the flag and the fix."""
        if self.strategy not in STRATEGIES:
            raise ConfigError(
                f"--strategy must be one of {', '.join(STRATEGIES)}. "
                f"Received: {self.strategy!r}.")
        if self.tpu is not None and self.strategy not in ("auto", "tpu"):
            raise ConfigError(
                f"--tpu={self.tpu} asks for a TPU, but --strategy="
                f"{self.strategy} does not use one. Pass --strategy=tpu (or "
                "auto), or leave --tpu out.")
        for name in ("model_dir", "export_dir"):
            value = getattr(self, name)
            if value and "://" in value:
                raise ConfigError(
                    f"--{name}={value} must be a local directory: the "
                    "backup and the export are written with local file "
                    "operations. To keep them in Cloud Storage, mount the "
                    "bucket (e.g. with gcsfuse) and pass its mount point.")
            if value:
                check_directory(f"--{name}", value)
        recipe = self.recipe()
        for name in ("batch_size", "steps_per_execution"):
            check_positive(name, getattr(self, name))
        for name in ("epochs", "train_steps", "num_models"):
            if getattr(self, name) is not None:
                check_positive(name, getattr(self, name))
        if self.eval_steps is not None and (
                not_int(self.eval_steps) or self.eval_steps < 0):
            raise ConfigError(
                "--eval_steps must be an integer >= 0 (0: no validation). "
                f"Received: {self.eval_steps!r}.")
        if self.verbose not in (0, 1, 2, 3):
            raise ConfigError(
                "--verbose must be 0 (silent), 1 (progress bar), 2 (one "
                "line per epoch) or 3 (progress bar and TensorFlow's "
                f"start-up logging). Received: {self.verbose!r}.")
        if not_int(self.table_every) or self.table_every < 0:
            raise ConfigError(
                "--table_every must be an integer >= 0 (epochs between "
                "per-model tables; 0: only at the end). Received: "
                f"{self.table_every!r}.")
        if not_int(self.seed) or not 0 <= self.seed < 2**32:
            raise ConfigError(
                "--seed must be an integer from 0 to 2**32 - 1 (numpy's "
                f"seeds). Received: {self.seed!r}.")
        if self.train_steps is not None and (
                self.train_steps % self.steps_per_execution):
            raise ConfigError(
                f"--train_steps={self.train_steps} must be a multiple of "
                f"--steps_per_execution={self.steps_per_execution}: a "
                "compiled call always runs --steps_per_execution steps.")
        if self.eval_steps and self.eval_steps % self.steps_per_execution:
            raise ConfigError(
                f"--eval_steps={self.eval_steps} must be a multiple of "
                f"--steps_per_execution={self.steps_per_execution}.")
        if self.mixed_precision not in PRECISIONS:
            raise ConfigError(
                f"--mixed_precision must be one of {', '.join(PRECISIONS)}."
                f" Received: {self.mixed_precision!r}.")
        if self.schedule not in SCHEDULES:
            raise ConfigError(
                f"--schedule must be one of {', '.join(SCHEDULES)}. "
                f"Received: {self.schedule!r}.")
        unknown = sorted(set(self.schedule_args)
                         - set(SCHEDULE_ARGS[self.schedule]))
        if unknown:
            raise ConfigError(
                f"--schedule_args {unknown} are not arguments of the "
                f"{self.schedule!r} schedule; it takes "
                f"{', '.join(SCHEDULE_ARGS[self.schedule])}.")
        for key, value in self.schedule_args.items():
            if key == "staircase":
                if not isinstance(value, bool):
                    raise ConfigError(
                        "--schedule_args staircase must be true or false. "
                        f"Received: {value!r}.")
            elif not is_number(value) or value < 0:
                raise ConfigError(
                    f"--schedule_args {key} must be a number >= 0. "
                    f"Received: {value!r}.")
        if self.schedule_args.get("decay_epochs", 1) <= 0:
            raise ConfigError(
                "--schedule_args decay_epochs must be > 0 (the rate decays "
                "every decay_epochs epochs). Received: "
                f"{self.schedule_args['decay_epochs']!r}.")
        _check_builder_args("model_args", recipe.build, self.model_args,
                            self.model)
        self.array_plan()
        return self

    def recipe(self):
        """The zoo recipe of `model`."""
        if not isinstance(self.model, str) or not self.model:
            raise ConfigError(
                f"--model must be a zoo model name. Received: "
                f"{self.model!r}.")
        try:
            return recipes.get(self.model)
        except ValueError as error:
            raise ConfigError(f"--model: {error}") from None

    # -- the array ----------------------------------------------------------

    def optimizer_class(self):
        """The fused optimizer class of `optimizer` (or of the recipe)."""
        name = self.optimizer or self.recipe().optimizer
        try:
            return type(optimizers.get(name))
        except (ValueError, TypeError) as error:
            raise ConfigError(f"--optimizer: {error}") from None

    def array_plan(self):
        """How the array's models differ: `(num_models, per_model, shared)`,
        where `per_model` maps each per-model hyper-parameter to its B
        values and `shared` holds the optimizer's other arguments (the
        learning rate included, unless it is per model).

        Raises ConfigError for conflicting or mismatched values.
        """
        recipe = self.recipe()
        cls = self.optimizer_class()
        per_model_names = _hyperparameter_names(cls)
        allowed = _optimizer_arg_names(cls)
        for key in self.optimizer_args:
            if key not in allowed:
                raise ConfigError(
                    f"--optimizer_args {key!r} is not an argument of "
                    f"hftatf.optimizers.{cls.__name__}; it takes "
                    f"{', '.join(sorted(allowed))}.")
        if "learning_rate" in self.optimizer_args:
            raise ConfigError(
                "Give the learning rate with --learning_rate (or --grid), "
                "not --optimizer_args.")
        shared = {k: v for k, v in self.optimizer_args.items()
                  if not isinstance(v, list)}
        lists = {k: v for k, v in self.optimizer_args.items()
                 if isinstance(v, list)}
        rates = self.learning_rate
        if rates is not None and len(rates) > 1:
            lists = {"learning_rate": rates, **lists}
        for name in list(lists) + list(self.grid):
            if name not in per_model_names:
                raise ConfigError(
                    f"{name!r} cannot take one value per model: the "
                    f"per-model hyper-parameters of hftatf.optimizers."
                    f"{cls.__name__} are {', '.join(per_model_names)}.")
        if self.grid:
            if lists:
                described = ", ".join(describe(k, v)
                                      for k, v in lists.items())
                raise ConfigError(
                    f"--grid and per-model lists ({described}) cannot both "
                    "be given: put every varying hyper-parameter in the "
                    "grid, or give lists only.")
            both = sorted(set(self.grid) & (
                set(shared) | ({"learning_rate"} if rates else set())))
            if both:
                raise ConfigError(
                    f"{both} given both in --grid and as a single value; "
                    "give each hyper-parameter once.")
            combinations = list(itertools.product(*self.grid.values()))
            per_model = {name: [c[i] for c in combinations]
                         for i, name in enumerate(self.grid)}
            source = f"--grid gives {len(combinations)} combinations"
        elif lists:
            lengths = {name: len(values) for name, values in lists.items()}
            if len(set(lengths.values())) > 1:
                described = ", ".join(f"{name} has {n}"
                                      for name, n in lengths.items())
                raise ConfigError(
                    "Every per-model list needs one value per model, but "
                    f"{described} values. Give them the same length (or a "
                    "single value to share).")
            per_model = dict(lists)
            name, length = next(iter(lengths.items()))
            source = f"{describe(name, lists[name])} gives {length} models"
        else:
            per_model = {}
            source = None
        if per_model:
            num_models = len(next(iter(per_model.values())))
            if self.num_models is not None and self.num_models != num_models:
                raise ConfigError(
                    f"--num_models={self.num_models} does not match the "
                    f"per-model hyper-parameters: {source}. Leave "
                    "--num_models out, or make them agree.")
        elif self.num_models is not None:
            num_models = self.num_models
        else:
            num_models = len(DEFAULT_SWEEP)
            if rates is None:
                per_model = {"learning_rate": [
                    round_value(recipe.learning_rate * factor)
                    for factor in DEFAULT_SWEEP]}
        if "learning_rate" not in per_model:
            shared["learning_rate"] = (rates[0] if rates
                                       else recipe.learning_rate)
        for name, values in per_model.items():
            for value in values:
                if not is_number(value):
                    raise ConfigError(
                        f"Per-model values of {name!r} must be numbers. "
                        f"Received: {values!r}.")
        for value in per_model.get("learning_rate", [shared.get(
                "learning_rate")]):
            if not value > 0:
                raise ConfigError(
                    f"Every learning rate must be positive. Received: "
                    f"{per_model.get('learning_rate', value)!r}.")
        try:
            # Constructing the optimizer checks every value's range.
            with _scratch_graph():
                cls(**shared, **per_model)
        except (TypeError, ValueError) as error:
            raise ConfigError(
                f"hftatf.optimizers.{cls.__name__} refuses the "
                f"hyper-parameters: {error}") from None
        return num_models, per_model, shared

    def resolved(self):
        """A copy with the recipe's defaults filled in (optimizer, epochs,
        the per-model learning rates, the output directories), as written
        to `model_dir`: rerunning it trains the same array."""
        recipe = self.recipe()
        _, per_model, shared = self.array_plan()
        changes = {
            "optimizer": self.optimizer or recipe.optimizer,
            "epochs": self.epochs or recipe.epochs,
            "model_dir": self.model_dir or str(
                pathlib.Path("runs") / self.model),
        }
        if "learning_rate" in self.grid:
            pass  # The grid holds the rates.
        elif "learning_rate" in per_model:
            changes["learning_rate"] = per_model["learning_rate"]
        else:
            changes["learning_rate"] = [shared["learning_rate"]]
        if self.export_dir is None:
            changes["export_dir"] = str(
                pathlib.Path(changes["model_dir"]) / "export")
        return dataclasses.replace(self, **changes)

    # -- files --------------------------------------------------------------

    def write(self, directory):
        """Writes the config to `directory/config.yaml` (`config.json`
        without PyYAML); returns the path. An `export_dir` that is
        `model_dir/export` is written as None, so that rerunning the file
        with another `--model_dir` exports there, not over this run's
        export."""
        directory = pathlib.Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        values = self.to_dict()
        if values["export_dir"] and values["model_dir"] and (
                pathlib.Path(values["export_dir"])
                == pathlib.Path(values["model_dir"]) / "export"):
            values["export_dir"] = None
        try:
            import yaml
        except ImportError:
            path = directory / CONFIG_JSON
            text = json.dumps(values, indent=2) + "\n"
        else:
            path = directory / CONFIG_YAML
            text = yaml.safe_dump(values, sort_keys=False)
        temporary = path.with_name(f".{path.name}.tmp")
        temporary.write_text(text)
        temporary.replace(path)
        return path


def check_directory(flag, value):
    """Raises a ConfigError where the directory `value` of `flag` cannot be
    made or written: it, or the nearest of its parents that exists, is a
    file, or making it fails (the directories made to find out are
    removed again: nothing is left written)."""
    path = pathlib.Path(value).expanduser()
    existing = next((p for p in (path, *path.parents) if p.exists()), None)
    if existing is not None and not existing.is_dir():
        raise ConfigError(
            f"{flag}={value} must be a directory, but {existing} is a "
            "file. Pass a directory path.")
    if is_remote(value):
        return  # refused or written by TensorFlow's file system
    error = unwritable_directory_error(path, keep=False)
    if error is not None:
        raise ConfigError(
            f"{flag}={value} is not a directory this run can write to "
            f"({error.strerror}: {error.filename or path}). Pass another "
            "directory.")


def field_names():
    """The names of the configuration's fields, in order."""
    return [field.name for field in dataclasses.fields(Config)]


def _hyperparameter_names(cls):
    """The per-model (float) hyper-parameters of a fused optimizer class."""
    with _scratch_graph():
        return tuple(cls().hyperparameter_names)


def _scratch_graph():
    """A throwaway graph for the variables that checking an optimizer
    creates on TensorFlow: validation leaves no eager state behind (a TPU
    is connected to, and its system initialised, after it). Other
    backends' variables hold no such state."""
    if keras.backend.backend() != "tensorflow":
        return contextlib.nullcontext()
    import tensorflow as tf

    return tf.Graph().as_default()


def _optimizer_arg_names(cls):
    parameters = inspect.signature(cls).parameters.values()
    names = {p.name for p in parameters
             if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    names.update(BASE_OPTIMIZER_ARGS)
    names.discard("name")
    names.discard("num_models")
    return names


def _check_builder_args(flag, function, values, model):
    """Unknown arguments of a builder, where its signature tells."""
    parameters = inspect.signature(function).parameters.values()
    if any(p.kind == p.VAR_KEYWORD for p in parameters):
        return
    names = {p.name for p in parameters}
    unknown = sorted(set(values) - names)
    if unknown:
        raise ConfigError(
            f"--{flag} {unknown} are not arguments of model {model!r}; it "
            f"takes {', '.join(sorted(names))}.")
