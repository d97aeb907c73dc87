"""keras-tuner tuners that train trials as fused arrays.

`FusedTuner` is a `keras_tuner.Tuner` whose search asks the oracle for up
to `num_models` trials at once, builds each trial's model with the user's
ordinary `build(hp)`, groups the trials whose models can share an array
(`hftatf.tuning.arrays`), trains each group as one `FusedModel` and reports
each trial's metrics back to the oracle, as a stock tuner reports one
trial's. Trial directories, checkpoints, `get_best_models()`,
`get_best_hyperparameters()`, `results_summary()`, reloading a project and
keras-tuner's distributed mode all behave as with stock keras-tuner.
"""

import collections
import dataclasses
import os
import sys
import time
import traceback

import keras
import keras_tuner
from keras_tuner.src import config as tuner_config
from keras_tuner.src import errors as tuner_errors
from keras_tuner.src import utils as tuner_utils_io
from keras_tuner.src.distribute import utils as dist_utils
from keras_tuner.src.engine import trial as trial_module
from keras_tuner.src.engine import tuner as tuner_module
from keras_tuner.src.engine import tuner_utils

from hftatf.core.devices import has_accelerator
from hftatf.tuning import arrays, sizing
from hftatf.tuning.trial_callbacks import TrialRecorder, for_array

__all__ = ["FusedBayesianOptimization", "FusedHyperband", "FusedRandomSearch",
           "FusedTuner"]

_RUNNING = trial_module.TrialStatus.RUNNING
_STOPPED = trial_module.TrialStatus.STOPPED
_COMPLETED = trial_module.TrialStatus.COMPLETED

# Hyperband's entries in a trial's hyper-parameters.
_PAST_TRIAL = "tuner/trial_id"
_EPOCHS = "tuner/epochs"
_INITIAL_EPOCH = "tuner/initial_epoch"


@dataclasses.dataclass
class _Member:
    """One model of an array: one execution of one trial."""

    trial: object
    execution: int
    model: keras.Model
    optimizer: object
    fit: dict
    key: str
    source: tuple = None  # (array, index) of a trained model to continue


class FusedTuner(keras_tuner.Tuner):
    """A keras-tuner tuner that trains up to `num_models` trials at once, as
    fused arrays.

    Use it with any keras-tuner oracle (`RandomSearchOracle`,
    `HyperbandOracle`, `BayesianOptimizationOracle`, ...), or through
    `FusedRandomSearch`, `FusedHyperband` and `FusedBayesianOptimization`,
    which take the arguments of their stock namesakes.

    Each round of the search asks the oracle for up to `num_models`
    trials (one `create_trial` per slot, the way parallel stock tuners
    ask), builds each trial's model with `build(hp)` as a stock tuner does
    (without its `keras.backend.clear_session()` before every trial: give
    `build` a seed for reproducible initial weights), and groups the
    trials whose built models have the same architecture (layers,
    configurations and weight shapes, as `hftatf.fuse_models` compares
    them), the same compiled loss and metrics, optimizers of the same class
    and structure (only float hyper-parameters such as the learning rate
    may differ) and the same `fit` arguments. Each
    group trains as one array: model `b` starts from trial `b`'s built
    weights with trial `b`'s optimizer hyper-parameters, so it learns what
    the trial would learn alone. A hyper-parameter that changes shapes
    (widths, depth) thus splits trials into several arrays.

    Each trial's metrics (the best epoch of its objective, averaged over
    `executions_per_trial` executions, which train side by side in the
    array) go to the oracle as a stock tuner reports them; each trial's
    best-epoch weights are saved in its trial directory, so
    `get_best_models()` loads them as stock keras-tuner does.

    Successive halving (Hyperband): a trial that continues an earlier trial
    (`tuner/trial_id`) continues that trial's trained model, weights and
    optimizer state as they were at its last epoch, from the array it
    trained in: the winners of a round are taken out of their array with
    `FusedModel.select` (gathered from several arrays when needed) and
    trained on, the losers dropped, so a winner trains as if it had been
    given the longer budget from the start. (Stock keras-tuner restarts it
    from its best epoch's saved weights with a new optimizer state.) A
    model that is no longer in memory (see `keep_arrays`), or that another
    worker trained, starts as with stock keras-tuner.

    Callbacks given to `search` are copied for each array. A stock
    `keras.callbacks.EarlyStopping` becomes `hftatf.callbacks.EarlyStopping`
    with the same arguments, which stops each model on its own; a trial's
    history ends at the epoch its model stopped, as a stock trial's does.
    Stock `ReduceLROnPlateau` and `LearningRateScheduler` become their
    `hftatf.callbacks` forms likewise, which set each model's own rate.
    Other callbacks see the array's logs (`name` is the mean over models,
    `name_b` model `b`'s value; see `hftatf.callbacks`): use
    `hftatf.callbacks.TensorBoard` for one TensorBoard run per model. The
    tuner's `on_epoch_begin` and `on_epoch_end` hooks are called for each
    trial with the array and that trial's own logs; its batch hooks are not
    called.

    Distributed tuning: run the same script on every machine with
    keras-tuner's environment variables (`KERASTUNER_TUNER_ID`: `chief` for
    the oracle's process, a unique id per worker; `KERASTUNER_ORACLE_IP`,
    `KERASTUNER_ORACLE_PORT`); each worker trains arrays of the trials it
    gets. `hftatf.tuning.distributed` starts such processes.

    Args:
        oracle: a `keras_tuner.Oracle`.
        hypermodel: a `build(hp)` callable or a `keras_tuner.HyperModel`
            that returns a compiled, functional or Sequential Keras model.
            A `HyperModel` with its own `fit` cannot train arrays; give
            `fit` arguments that are hyper-parameters with `trial_fit_kwargs`
            instead.
        num_models: the largest array, in models (trials x executions; at
            least `executions_per_trial`), or `"auto"`: the size
            `hftatf.tuning.auto_num_models` finds for the first trial's
            model on this device (cached).
        trial_fit_kwargs: None, or a callable `hp -> dict` of `fit`
            arguments that are hyper-parameters, e.g.
            `lambda hp: {"batch_size": hp.Choice("batch_size", [32, 64])}`.
            Trials whose arguments differ train in different arrays.
        jit_compile: the arrays' `jit_compile`. "auto" compiles with XLA on
            accelerators and on the JAX backend (as `FusedModel.compile`
            does) but not on TensorFlow on a CPU: tuning trains many short
            jobs, and there XLA compilation costs more than the training it
            speeds up (`benchmarks/tuning.py --quick` ran 2x slower with XLA
            on 2 CPU cores). On JAX a step without XLA runs op by op (a
            search of 4 trials took 65 s against 9 s compiled).
        pad_arrays: whether an array is built for the whole batch
            (`num_models`) even when fewer trials of its group came in this
            round, the free models training copies of a trial whose results
            are dropped. A later round's trials of the same group then
            reuse the array (new weights, new optimizer state) without
            tracing or compiling its steps again, which is most of the cost
            of short trials, where their optimizer builds the same variables
            (an SGD whose models all had momentum 0 has no momentum slots);
            False builds arrays of the exact group size.
        keep_arrays: how many trained arrays to keep in memory: for
            Hyperband's successive halving to continue from (0: always load
            the saved weights), and for later rounds to reuse.
        sizing_kwargs: arguments for `auto_num_models` with
            `num_models="auto"` (`max_num_models`, `min_gain`,
            `memory_limit`, `cache`, `path`, ...).
        **kwargs: the arguments of `keras_tuner.Tuner` (`directory`,
            `project_name`, `overwrite`, `executions_per_trial`,
            `max_model_size`, `optimizer`, `loss`, `metrics`,
            `distribution_strategy`, `tuner_id`).
    """

    def __init__(self, oracle, hypermodel=None, num_models=4,
                 trial_fit_kwargs=None, jit_compile="auto", pad_arrays=True,
                 keep_arrays=8, sizing_kwargs=None, **kwargs):
        if hypermodel is None:
            raise ValueError(
                "FusedTuner builds every trial's model with `hypermodel`; "
                "received hypermodel=None. Pass a `build(hp)` function or a "
                "keras_tuner.HyperModel.")
        if num_models != "auto" and (
                isinstance(num_models, bool) or not isinstance(
                    num_models, int) or num_models < 1):
            raise ValueError(
                "`num_models` must be a positive int (the largest array) "
                f"or 'auto'. Received: num_models={num_models!r}.")
        if trial_fit_kwargs is not None and not callable(trial_fit_kwargs):
            raise TypeError(
                "`trial_fit_kwargs` must be a callable hp -> dict of fit "
                f"arguments. Received: {trial_fit_kwargs!r}.")
        if isinstance(keep_arrays, bool) or not isinstance(
                keep_arrays, int) or keep_arrays < 0:
            raise ValueError(
                "`keep_arrays` must be an int >= 0. Received: "
                f"keep_arrays={keep_arrays!r}.")
        self.num_models = num_models
        self.trial_fit_kwargs = trial_fit_kwargs
        self.jit_compile = _resolve_jit_compile(jit_compile)
        self.pad_arrays = bool(pad_arrays)
        self.keep_arrays = keep_arrays
        self.sizing_kwargs = dict(sizing_kwargs or {})
        super().__init__(oracle, hypermodel=hypermodel, **kwargs)
        if num_models != "auto" and num_models < self.executions_per_trial:
            raise ValueError(
                f"num_models={num_models} is below executions_per_trial="
                f"{self.executions_per_trial}: a trial's executions train "
                "side by side in one array, so the largest array must hold "
                "them all. Raise num_models (or leave it 'auto').")
        if type(self.hypermodel).fit is not keras_tuner.HyperModel.fit:
            raise TypeError(
                f"The hypermodel {type(self.hypermodel).__name__} overrides "
                "`fit`, which trains one model; FusedTuner trains arrays of "
                "trials with `FusedModel.fit`. Pass the fit arguments that "
                "are hyper-parameters as trial_fit_kwargs=lambda hp: "
                "{...} instead.")
        if type(self).run_trial is not FusedTuner.run_trial:
            # `search` trains many trials per array and never calls it.
            raise TypeError(
                f"{type(self).__name__} overrides `run_trial`, which a "
                "fused search does not call: it trains many trials per "
                "array. Pass the fit arguments that are hyper-parameters "
                "as trial_fit_kwargs=lambda hp: {...}, and build the "
                "rest in the hypermodel.")
        # Trained arrays that Hyperband's next rounds may continue.
        self._arrays = collections.OrderedDict()  # id -> array
        self._trained = {}  # (trial id, execution) -> (array id, index)
        # Trained arrays free for new trials of their group: traced and
        # compiled once, reloaded with new weights for every later group.
        self._pool = collections.OrderedDict()  # id -> (group key, array)
        self._capacities = {}  # group key -> array size ("auto")
        self._capacity = None  # the current batch's size, in models
        self._slots_used = 0

    # -- the search loop ----------------------------------------------------

    def _populate_initial_space(self):
        super()._populate_initial_space()
        if self.trial_fit_kwargs is not None and self.hypermodel is not None:
            # `fit` hyper-parameters join the space before the first trial,
            # so the oracle samples them from the start.
            hp = self.oracle.get_space()
            self.trial_fit_kwargs(hp)
            self.oracle.update_space(hp)

    def search(self, *fit_args, **fit_kwargs):
        """Searches as `keras_tuner.Tuner.search`, training up to
        `num_models` trials at a time as arrays.

        Args:
            *fit_args, **fit_kwargs: the arguments of every array's `fit`
                (training data, `epochs`, `validation_data`, `callbacks`,
                ...). Hyperband's trials set `epochs` and `initial_epoch`.
        """
        if dist_utils.is_chief_oracle():
            # The chief only serves the oracle, as in stock keras-tuner.
            return super().search(*fit_args, **fit_kwargs)
        if "verbose" in fit_kwargs and not self._is_worker():
            self.oracle.verbose = fit_kwargs["verbose"]
        self.on_search_begin()
        while True:
            self.pre_create_trial()
            batch, stopped = self._create_trials(fit_args, fit_kwargs)
            if batch:
                self._run_trials(batch, fit_args, fit_kwargs)
            elif stopped:
                break
            else:
                # The oracle waits for trials running elsewhere.
                time.sleep(1.0)
        self.on_search_end()

    def _slot_id(self, slot):
        # One oracle client id per array slot, as if each were a tuner: the
        # oracle hands each id at most one running trial.
        return f"{self.tuner_id}_{slot}"

    def _create_trials(self, fit_args, fit_kwargs):
        """Asks the oracle for up to a batch of trials and builds them.

        Returns `(batch, stopped)`: `batch` lists `(trial, members)`, and
        `stopped` tells that the oracle ended the search. Once it has, every
        slot id that ever asked is told so, which lets a chief oracle exit.
        """
        batch, stopped = [], False
        capacity = None if self.num_models == "auto" else self.num_models
        slot = 0
        while True:
            size = capacity or self.executions_per_trial
            wanted = max(1, size // self.executions_per_trial)
            if stopped:
                wanted = max(wanted, self._slots_used)
            if slot >= wanted:
                break
            trial = self.oracle.create_trial(self._slot_id(slot))
            slot += 1
            self._slots_used = max(self._slots_used, slot)
            if trial.status == _STOPPED:
                stopped = True
                continue
            if trial.status != _RUNNING:
                break  # IDLE: the oracle waits on running trials.
            self.on_trial_begin(trial)
            members = self._build_trial(trial)
            batch.append((trial, members))
            if capacity is None and members:
                capacity = self._auto_capacity(members[0], fit_args,
                                               fit_kwargs)
        self._capacity = capacity or self.executions_per_trial
        return batch, stopped

    def _run_trials(self, batch, fit_args, fit_kwargs):
        """Trains the batch's trials group by group, then reports and ends
        every trial."""
        results, failures = self._train_members(
            [m for _, members in batch for m in members], fit_args,
            fit_kwargs)
        for trial, members in batch:
            if members:
                error = failures.get(trial.trial_id)
                if error is None:
                    self._report(trial, results[trial.trial_id])
                else:
                    self._fail(trial, *error)
            self.on_trial_end(trial)

    def _report(self, trial, histories):
        objective = self.oracle.objective
        tuner_utils.validate_trial_results(histories, objective,
                                           "FusedTuner.run_trial()")
        _check_objective(objective, histories)
        self.oracle.update_trial(
            trial.trial_id,
            tuner_utils.convert_to_metrics_dict(histories, objective),
            step=tuner_utils.get_best_step(histories, objective))
        trial.status = _COMPLETED

    @staticmethod
    def _fail(trial, error, message):
        """Marks `trial` as stock keras-tuner marks a trial that raised,
        and prints the traceback `message` as stock keras-tuner prints it
        (unless `keras_tuner.config.DEBUG` is off)."""
        if isinstance(error, tuner_errors.FatalError):
            raise error
        if tuner_config.DEBUG:
            print(f"Trial {trial.trial_id} failed:\n{message}",
                  file=sys.stderr)
        trial.status = (trial_module.TrialStatus.FAILED if isinstance(
            error, tuner_errors.FailedTrialError)
            else trial_module.TrialStatus.INVALID)
        trial.message = message

    def run_trial(self, trial, *fit_args, **fit_kwargs):
        """Trains one trial (its executions as one array) and returns its
        histories, as `keras_tuner.Tuner.run_trial` does; `search` trains
        many trials per array instead."""
        members = self._build_trial(trial, raise_errors=True)
        results, failures = self._train_members(members, fit_args,
                                                fit_kwargs)
        if failures:
            raise failures[trial.trial_id][0]
        return results[trial.trial_id]

    # -- building -----------------------------------------------------------

    def _build_trial(self, trial, raise_errors=False):
        """One member per execution of `trial`; on an error, the trial is
        marked failed (as stock keras-tuner marks it) and [] returned."""
        try:
            return self._build_members(trial)
        except Exception as error:
            if raise_errors:
                raise
            self._fail(trial, error, traceback.format_exc())
            return []

    def _build_members(self, trial):
        hp = trial.hyperparameters
        fit = dict(self.trial_fit_kwargs(hp)) if self.trial_fit_kwargs else {}
        if _EPOCHS in hp.values:
            fit["epochs"] = hp.values[_EPOCHS]
            fit["initial_epoch"] = hp.values[_INITIAL_EPOCH]
        past = hp.values.get(_PAST_TRIAL)
        members = []
        for execution in range(self.executions_per_trial):
            model = self._build_model(hp)
            source = self._trained_model(past, execution)
            if past is not None and source is None:
                # Not in memory: the saved best epoch, as stock Hyperband.
                model.load_weights(self._get_checkpoint_fname(past))
            optimizer = arrays.trial_optimizer(model)
            key = arrays.group_key(model, optimizer, extra={"fit": fit})
            members.append(_Member(trial, execution, model, optimizer, fit,
                                   key, source))
        tuner_utils_io.save_json(
            self._get_build_config_fname(trial.trial_id),
            members[0].model.get_build_config())
        return members

    def _build_model(self, hp):
        """`keras_tuner.Tuner._try_build` without its
        `keras.backend.clear_session()`, which takes most of a second per
        trial and would not free the arrays this tuner keeps anyway."""
        model = self._build_hypermodel(hp)
        if not isinstance(model, keras.Model):
            raise tuner_errors.FatalTypeError(
                "Expected the model-building function, or HyperModel.build() "
                "to return a valid Keras Model instance. Received: "
                f"{model} of type {type(model)}.")
        size = tuner_module.maybe_compute_model_size(model)
        if self.max_model_size and size > self.max_model_size:
            raise tuner_errors.FailedTrialError(
                f"Oversized model: {size} parameters. Skip model.")
        return model

    def _trained_model(self, trial_id, execution):
        entry = self._trained.get((trial_id, execution))
        if entry is None or entry[0] not in self._arrays:
            return None
        array, index = self._arrays[entry[0]], entry[1]
        if array.diverged_models[index]:
            # Frozen where it diverged, after its best epoch: it goes on
            # from that epoch's saved weights, as in stock Hyperband.
            return None
        return array, index

    def _auto_capacity(self, member, fit_args, fit_kwargs):
        """The array size for `member`'s group, probed once per group."""
        if member.key not in self._capacities:
            x = fit_args[0] if fit_args else fit_kwargs.get("x")
            y = fit_args[1] if len(fit_args) > 1 else fit_kwargs.get("y")
            batch_size = member.fit.get("batch_size",
                                        fit_kwargs.get("batch_size"))
            config = arrays.compile_arguments(member.model)
            self._capacities[member.key] = sizing.auto_num_models(
                member.model, x, y, optimizer=member.optimizer,
                loss=config.get("loss"), metrics=config.get("metrics"),
                batch_size=batch_size, jit_compile=self.jit_compile,
                **self.sizing_kwargs)
        return self._capacities[member.key]

    # -- training -----------------------------------------------------------

    def _train_members(self, members, fit_args, fit_kwargs):
        """Trains `members` in one array per group.

        Returns `(results, failures)`: per trial id, the list of histories
        of its executions, or `(error, traceback text)`.
        """
        groups = collections.OrderedDict()
        for member in members:
            groups.setdefault(member.key, []).append(member)
        results = collections.defaultdict(
            lambda: [None] * self.executions_per_trial)
        failures = {}
        for group in groups.values():
            try:
                histories = self._train_group(group, fit_args, fit_kwargs)
            except tuner_errors.FatalError:
                raise
            except Exception as error:
                message = traceback.format_exc()
                for member in group:
                    failures[member.trial.trial_id] = (error, message)
                continue
            for member, history in zip(group, histories):
                results[member.trial.trial_id][member.execution] = history
        return dict(results), failures

    def _train_group(self, group, fit_args, fit_kwargs):
        array = self._array_for(group)
        kwargs = dict(fit_kwargs)
        kwargs.update(group[0].fit)
        runs = [os.path.join(str(m.trial.trial_id), f"execution{m.execution}")
                for m in group]
        runs += [None] * (array.num_models - len(group))  # padding copies
        callbacks = [for_array(c, runs) for c in self._deepcopy_callbacks(
            kwargs.pop("callbacks", None) or [])]
        recorder = TrialRecorder(self, group)
        array.fit(*fit_args, callbacks=[*callbacks, recorder], **kwargs)
        if _continuable(group):
            self._keep(array, group)
        else:
            self._release(array, group[0].key)
        return recorder.histories()

    def _array_for(self, group):
        """The array that trains `group`: a pooled array of its group
        reloaded, the continued models of earlier arrays, or a new array
        (for the whole batch when `pad_arrays`)."""
        models = [m.model for m in group]
        optimizers = [m.optimizer for m in group]
        if any(m.source is not None for m in group):
            return arrays.continue_models([m.source for m in group], models,
                                          optimizers, self.jit_compile)
        if self.pad_arrays and not _continuable(group):
            # Copies of the first model fill the free places.
            padding = max(0, (self._capacity or 0) - len(group))
            models += [models[0]] * padding
            optimizers += [optimizers[0]] * padding
        for index, (key, array) in self._pool.items():
            if key != group[0].key or array.num_models != len(models):
                continue
            fresh = arrays.reload_optimizer(array, optimizers)
            if fresh is not None:
                del self._pool[index]
                return arrays.reload(array, models, fresh)
        return arrays.fuse_trials(models, optimizers, self.jit_compile)

    def _release(self, array, key):
        """Pools a trained array for later groups of `key`."""
        if self.keep_arrays == 0 or not arrays.reusable(array):
            return
        self._pool[id(array)] = (key, array)
        while len(self._pool) > self.keep_arrays:
            self._pool.popitem(last=False)

    def _keep(self, array, group):
        """Keeps `array` for Hyperband's later rounds to continue from."""
        if self.keep_arrays == 0:
            return
        self._arrays[id(array)] = array
        for index, member in enumerate(group):
            self._trained[(member.trial.trial_id, member.execution)] = (
                id(array), index)
        while len(self._arrays) > self.keep_arrays:
            dropped, _ = self._arrays.popitem(last=False)
            # Its id may name a new array once it is freed.
            self._trained = {key: entry for key, entry in
                             self._trained.items() if entry[0] != dropped}

    def _save_trial_model(self, member, stacked, index):
        """Saves model `index` of an array as `member`'s trial checkpoint:
        the trial's own built model, holding the array model's weights."""
        arrays.set_model(member.model, stacked, index)
        member.model.save_weights(
            self._get_checkpoint_fname(member.trial.trial_id))


def _resolve_jit_compile(jit_compile):
    if jit_compile != "auto":
        return jit_compile
    # On JAX, XLA is the only compiler: a step without it runs op by op.
    if has_accelerator() or keras.backend.backend() == "jax":
        return "auto"
    return False


def _check_objective(objective, histories):
    """Raises a clear error where a trial's training never logged the
    objective (a misspelt metric name), which would fail every trial."""
    for history in histories:
        if history.history and not objective.has_value(history.history):
            raise tuner_errors.FatalValueError(
                f"The objective {objective.name!r} is not among the logs of "
                f"the trials' training: {', '.join(history.history)}. Pass "
                "one of these (or an `Objective` of them) as `objective`.")


def _continuable(group):
    """Whether later trials may continue the group's (Hyperband's)."""
    return any(_EPOCHS in m.trial.hyperparameters.values for m in group)


class FusedRandomSearch(keras_tuner.RandomSearch, FusedTuner):
    """`keras_tuner.RandomSearch` that trains its trials as arrays.

    Takes the arguments of `keras_tuner.RandomSearch` and those of
    `FusedTuner` (`num_models`, `trial_fit_kwargs`, `jit_compile`, ...).
    With the same seed and `max_trials`, it evaluates the configurations a
    stock `RandomSearch` evaluates, in the same order.
    """


class FusedBayesianOptimization(keras_tuner.BayesianOptimization,
                                FusedTuner):
    """`keras_tuner.BayesianOptimization` that trains its trials as arrays.

    Takes the arguments of `keras_tuner.BayesianOptimization` and those of
    `FusedTuner`. After its random initial points, the oracle proposes each
    trial of a round from the trials completed before the round (as it does
    for parallel stock tuners).
    """


class FusedHyperband(keras_tuner.Hyperband, FusedTuner):
    """`keras_tuner.Hyperband` that trains its trials as arrays and halves
    them by compaction.

    Takes the arguments of `keras_tuner.Hyperband` and those of
    `FusedTuner`. A round's trials start together as arrays; a trial
    promoted to the next round continues its model (weights and optimizer
    state) taken out of the array it trained in (see `FusedTuner`).
    """

    # Hyperband's own run_trial and model loading train one trial at a
    # time from checkpoints; the fused ones continue arrays.
    run_trial = FusedTuner.run_trial
    _build_hypermodel = keras_tuner.Tuner._build_hypermodel
