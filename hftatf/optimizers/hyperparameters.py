"""Per-model hyper-parameters of fused optimizers: `[B]` vectors as data.

Every float hyper-parameter is a float (shared by the B models) or a
length-B sequence (one value per model); either way it lives in a `[B]`
optimizer variable, broadcast as `[B, 1, ..., 1]` against each `[B, ...]`
variable. So hyper-parameters are checkpointed with the optimizer and can
be changed between steps (from a callback, say) without retracing.
"""

import contextlib
import inspect

import keras
import numpy as np
from keras import ops

from hftatf.core import compat
from hftatf.core.axis import to_model_rank
from hftatf.core.validation import LEARNING_RATE, Range, check_range, is_number
from hftatf.optimizers import backend, scopes

Schedule = keras.optimizers.schedules.LearningRateSchedule

_CLIP = Range(0.0, why=" (0 turns clipping off for that model)")
_BETA = Range(0.0, 1.0, high_open=True,
              why=" (at 1 a bias correction, 1 - beta**step, is 0: a "
              "division by zero)")

# What every fused optimizer accepts for its hyper-parameters of these
# names; a class replaces or adds entries in `hyperparameter_ranges`, and
# any other float hyper-parameter must be finite. The stock optimizers take
# values outside silently; these are the values that cannot be right.
RANGES = {
    "learning_rate": LEARNING_RATE,
    "weight_decay": Range(0.0, why=" (a negative decay grows the weights)"),
    "clipnorm": _CLIP,
    "clipvalue": _CLIP,
    "global_clipnorm": _CLIP,
    "epsilon": Range(0.0, why=" (it keeps a denominator off 0, which a "
                     "negative one can reach)"),
    "beta_1": _BETA,
    "beta_2": _BETA,
    "momentum": Range(0.0, 1.0),
    "ema_momentum": Range(0.0, 1.0),
    "initial_accumulator_value": Range(
        0.0, why=" (the accumulator is a sum of squares)"),
}

# The attributes of a learning-rate schedule, stock or hftatf, that hold
# learning rates (a number, or one per model).
_SCHEDULE_RATES = ("initial_learning_rate", "warmup_target",
                   "end_learning_rate")


class PerModelHyperparameters:
    """The hyper-parameters part of `FusedOptimizer`: reading, setting,
    range checks, broadcasting, learning rates and their schedules, and the
    `[B]` variables that hold them (`_hyper_variables`, and
    `_complement_variables` for `complemented_hyperparameters`).

    Expects `_hyper_values` ({name: float, list or schedule}),
    `_hyper_ranges` and `num_models`, set by `FusedOptimizer.__init__`.
    """

    @property
    def hyperparameter_names(self):
        """The names of the per-model float hyper-parameters."""
        return tuple(self._hyper_values)

    def get_hyperparameter(self, name):
        """Returns hyper-parameter `name` as a `[B]` NumPy array of values.

        Learning-rate schedules are evaluated at each model's own step
        count.
        Returns None for an optional hyper-parameter that is not set.
        """
        self._check_hyper_name(name)
        if name == "learning_rate" and self._learning_rate_schedules():
            return ops.convert_to_numpy(self._get_current_learning_rate())
        if name in self._hyper_variables:
            return ops.convert_to_numpy(self._hyper_variables[name])
        value = self._hyper_values[name]
        if value is None:
            return None
        return np.broadcast_to(np.asarray(value, dtype="float32"),
                               (self.num_models or len(np.atleast_1d(value)),))

    def set_hyperparameter(self, name, value):
        """Sets hyper-parameter `name` to a float or a length-B sequence.

        Takes effect at the next step, without retracing the training step.
        """
        self._check_hyper_name(name)
        value = standardize(name, value)
        old = self._hyper_values[name]
        if value is None or old is None:
            raise ValueError(
                f"`{name}` can only be changed between values, not switched "
                f"on or off, after the optimizer is created. Received {name}="
                f"{value!r} where it was {old!r}."
            )
        if isinstance(value, Schedule) or (
                isinstance(value, list) and isinstance(value[0], Schedule)):
            raise ValueError(
                f"`{name}` cannot be replaced by a schedule after the "
                "optimizer is created; pass schedules to the constructor."
            )
        if name == "learning_rate" and self._learning_rate_schedules():
            raise TypeError(
                "This optimizer was created with learning-rate schedules, so "
                "its learning rate is not settable. Pass floats to the "
                "constructor to make it settable."
            )
        if name in self._hyper_ranges:
            self._check_range(name, self._hyper_ranges[name], value=value)
        if isinstance(value, list):
            self._set_num_models(len(value), f"`{name}` has {len(value)} "
                                 "values")
        self._hyper_values[name] = value
        if name in self._hyper_variables:
            for store, _, values in self._stored_values(name, value):
                store[name].assign(values)
        if name in self.__dict__:  # an attribute the stock base keeps
            super().__setattr__(name, value)

    def __getattr__(self, name):
        # Each hyper-parameter reads as an attribute, as in the stock
        # optimizer (`optimizer.beta_1`): a float, or one float per model.
        values = self.__dict__.get("_hyper_values")
        if values is not None and name in values:
            return self._hyper_config(name)
        raise AttributeError(
            f"'{type(self).__name__}' object has no attribute '{name}'")

    def __setattr__(self, name, value):
        # ... and is set as one (`optimizer.beta_1 = [0.8, 0.9]`), through
        # `set_hyperparameter`: checked, and read by the next step.
        values = self.__dict__.get("_hyper_values")
        if (values is not None and name in values
                and not isinstance(getattr(type(self), name, None),
                                   property)):
            self.set_hyperparameter(name, value)
            return
        super().__setattr__(name, value)

    def _check_hyperparameters(self):
        """Checks every float hyper-parameter against its range (`RANGES`,
        `hyperparameter_ranges`; finite for the others), and the rates of
        learning-rate schedules. `ema_momentum` is checked only with
        `use_ema`, as the stock optimizer checks it."""
        ranges = {**RANGES, **self.hyperparameter_ranges}
        for name, value in self._hyper_values.items():
            if value is not None and (name != "ema_momentum"
                                      or self.use_ema):
                self._check_range(name, ranges.get(name, Range()))
        for schedule in self._learning_rate_schedules():
            _check_schedule_rates(schedule)

    def _check_range(self, name, valid, value=None):
        """Raises a ValueError unless every value of `name` (or `value`) is
        a finite number in the `Range` `valid`; `valid` is checked again
        whenever `name` is set."""
        self._hyper_ranges[name] = valid
        if value is None:
            value = self._hyper_values[name]
        default = inspect.signature(type(self)).parameters.get(name)
        if not valid.fix and default is not None and is_number(
                default.default):
            valid = valid._replace(fix=(
                f"Pass {valid.expected()} (the default is "
                f"{default.default:g}), or one such number per model."))
        check_range(name, value, valid)

    def _check_hyper_name(self, name):
        if name not in self._hyper_values:
            raise ValueError(
                f"Optimizer '{self.name}' has no hyper-parameter '{name}'. "
                f"Its hyper-parameters are: {', '.join(self._hyper_values)}."
            )

    def _hyper(self, name, variable):
        """Hyper-parameter `name` as `[B, 1, ..., 1]`, in `variable`'s dtype."""
        return self._per_model(self._hyper_variables[name], variable)

    def _complement(self, name, variable):
        """`1 - hyper-parameter name` as `[B, 1, ..., 1]`, in `variable`'s
        dtype, computed from the Python floats as the stock optimizer
        computes it (`complemented_hyperparameters`)."""
        return self._per_model(self._complement_variables[name], variable)

    def _per_model(self, values, variable):
        """Broadcasts a `[B]` vector against a `[B, ...]` variable; once per
        rank and dtype in a step (`_broadcasts`)."""
        rank, dtype = len(variable.shape), variable.dtype
        cache = scopes.entry(scopes.BROADCASTS, self)
        key = (id(values), rank, dtype)
        if cache is not None and key in cache and cache[key][0] is values:
            return cache[key][1]
        result = to_model_rank(ops.cast(values, dtype), rank)
        if cache is not None:
            # The source is kept with its broadcast: its id stays its own.
            cache[key] = (values, result)
        return result

    @contextlib.contextmanager
    def _broadcasts(self):
        """Within, each `[B]` hyper-parameter (and step count) is cast and
        reshaped once per variable rank and dtype, not once per variable:
        on a CPU without XLA, a step of many small variables spends much
        of its time on those ops. Not under tf.distribute, where each
        variable's update runs on its own device."""
        # A fresh cache in each branch of a cond: a tensor made in one
        # branch cannot be read outside it.
        with scopes.set_for(scopes.BROADCASTS, self,
                      None if backend.has_strategy() else {}):
            yield

    def _local_step(self, variable):
        """Each model's number for the step being taken (1 for its first
        update), as `[B, 1, ..., 1]` in `variable`'s dtype. Optimizers whose
        math depends on the step (bias corrections, decays) read it here,
        never from `self.iterations`: a model whose step is skipped (a
        non-finite gradient under loss scaling) keeps its own count."""
        cache = scopes.entry(scopes.BROADCASTS, self)
        if cache is None:
            return self._per_model(self.model_iterations + 1, variable)
        if "step" not in cache:
            cache["step"] = self.model_iterations + 1
        return self._per_model(cache["step"], variable)

    @property
    def ema_momentum(self):
        """The EMA momentum: a float, or one float per model."""
        return self._hyper_config("ema_momentum")

    @ema_momentum.setter
    def ema_momentum(self, value):
        # The stock constructor sets a placeholder before the per-model
        # values exist; they are set from the constructor's argument.
        if getattr(self, "_hyper_values", None) is not None:
            self.set_hyperparameter("ema_momentum", value)

    def _learning_rate_schedules(self):
        value = self._hyper_values["learning_rate"]
        if isinstance(value, Schedule):
            return [value]
        if isinstance(value, list) and isinstance(value[0], Schedule):
            return value
        return []

    @property
    def learning_rate(self):
        """The current `[B]` learning rates."""
        return self._get_current_learning_rate()

    @learning_rate.setter
    def learning_rate(self, value):
        self.set_hyperparameter("learning_rate", value)

    @compat.optimizer_hook
    def _get_current_learning_rate(self):
        schedules = self._learning_rate_schedules()
        if schedules:
            return self._scheduled_learning_rates(schedules)
        if "learning_rate" in self._hyper_variables:
            return self._hyper_variables["learning_rate"]
        return self.get_hyperparameter("learning_rate")

    def _scheduled_learning_rates(self, schedules):
        """Model `b`'s rate is its schedule at its own raw step count, as a
        stock optimizer evaluates its schedule at its `_iterations`. A
        schedule may also return one rate per model (`[B]`)."""
        if self._model_iterations is None:
            # Not built: every model is at step `_iterations`.
            step = compat.step_counter(self)
            rates = [_as_vector(s(step)) for s in schedules]
            if len(rates) == 1:
                rates = rates[0]
            else:
                rates = ops.concatenate(rates)
            if self.num_models is None:
                return rates
            return ops.broadcast_to(rates, (self.num_models,))
        steps = scopes.read(self._model_iterations)
        rates = []
        for model in range(self.num_models):
            rate = schedules[model % len(schedules)](steps[model])
            rate = ops.cast(rate, "float32")
            rates.append(rate[model] if len(rate.shape) else rate)
        return ops.stack(rates)

    def _stored_values(self, name, value):
        """`(store, key, values)` for each `[B]` variable that holds
        hyper-parameter `name` (a float or a list): the value itself, in
        `_hyper_variables`, and for a complemented one `1 - value`,
        computed in double precision, in `_complement_variables`; `key` is
        the variable's name."""
        value = np.asarray(value, dtype="float64")
        found = [(self._hyper_variables, name, value)]
        if name in self.complemented_hyperparameters:
            found.append((self._complement_variables, f"one_minus_{name}",
                          1.0 - value))
        # In double precision: a float64 variable (`floatx="float64"`)
        # holds the value itself, as a stock optimizer's does.
        return [(store, key, np.broadcast_to(
            values, (self.num_models,)).copy())
            for store, key, values in found]

    def load_own_variables(self, store):
        # A file saved before the complements of hyper-parameters were
        # variables (`complemented_hyperparameters`) holds the others, in
        # the same order: they load, and the complements are set from the
        # hyper-parameters loaded. The stock base skips, with a warning,
        # a file whose count differs.
        complements = self._complements()
        variables = self.variables
        if complements and len(store.keys()) == (
                len(variables) - len(complements)):
            ids = {id(variable) for _, _, variable in complements}
            kept = [v for v in variables if id(v) not in ids]
            for index, variable in enumerate(kept):
                variable.assign(store[str(index)])
            for optimizer, name, variable in complements:
                variable.assign(optimizer._complement_of_loaded(name))
            return
        super().load_own_variables(store)

    def _complements(self):
        """`(optimizer, name, variable)` for each complement variable of
        this optimizer and of any it wraps (`inner_optimizer`)."""
        found = []
        for optimizer in (self, getattr(self, "inner_optimizer", None)):
            if isinstance(optimizer, PerModelHyperparameters):
                found.extend((optimizer, name, variable) for name, variable
                             in optimizer._complement_variables.items())
        return found

    def _complement_of_loaded(self, name):
        """`1 - name` for the value its variable holds: from the config's
        Python floats where the variable holds them, else from the
        variable's values."""
        loaded = ops.convert_to_numpy(self._hyper_variables[name])
        held = {key: values for _, key, values
                in self._stored_values(name, self._hyper_values[name])}
        if not np.array_equal(loaded, held[name].astype(loaded.dtype)):
            held = {key: values for _, key, values
                    in self._stored_values(name, loaded)}
        return held[f"one_minus_{name}"]

    def _hyper_config(self, name):
        schedules = self._learning_rate_schedules()
        if name == "learning_rate" and schedules:
            serialized = [keras.optimizers.schedules.serialize(s)
                          for s in schedules]
            value = self._hyper_values[name]
            return serialized if isinstance(value, list) else serialized[0]
        value = self._hyper_values[name]
        if name in self._hyper_variables:
            current = ops.convert_to_numpy(self._hyper_variables[name])
            # The floats given, while the variable holds them (a config
            # keeps the complements exact), else what it holds (restored).
            if value is not None and np.array_equal(
                    np.broadcast_to(np.float32(value), current.shape),
                    current):
                return value
            return [float(v) for v in current]
        return value


def _check_schedule_rates(schedule):
    """Raises a ValueError for a learning rate of `schedule` that is not a
    finite number >= 0: its initial rate (and the others it holds, a
    `PiecewiseConstantDecay`'s values, a warm-up's base schedule)."""
    owner = type(schedule).__name__
    for attribute in _SCHEDULE_RATES:
        check_range(f"{owner}.{attribute}",
                    getattr(schedule, attribute, None), LEARNING_RATE)
    values = getattr(schedule, "values", None)
    for index, value in enumerate(values if isinstance(values, list)
                                  else []):
        check_range(f"{owner}.values[{index}]", value, LEARNING_RATE)
    after = getattr(schedule, "after", None)
    for base in after if isinstance(after, list) else [after]:
        if isinstance(base, Schedule):
            _check_schedule_rates(base)
    if after is not None and not isinstance(after, Schedule):
        check_range(f"{owner}.after", after, LEARNING_RATE)


def _as_vector(rate):
    return ops.reshape(ops.cast(rate, "float32"), (-1,))



def standardize(name, value):
    """Returns a float, a list of floats (or of schedules), a schedule, or
    None; raises a TypeError/ValueError that says what was expected."""
    if value is None:
        if name == "learning_rate":
            raise ValueError("`learning_rate` cannot be None.")
        return None
    if isinstance(value, Schedule):
        if name != "learning_rate":
            raise TypeError(f"Only `learning_rate` may be a schedule; "
                            f"received {name}={value!r}.")
        return value
    if is_number(value):
        return float(value)
    if isinstance(value, (np.ndarray, list, tuple)):
        items = list(np.asarray(value, dtype=object).reshape(-1)) if (
            isinstance(value, np.ndarray)) else list(value)
        if not items:
            raise ValueError(f"`{name}` is an empty sequence; give one value "
                             "per model.")
        if all(is_number(v) for v in items):
            return [float(v) for v in items]
        if name == "learning_rate" and all(isinstance(v, Schedule)
                                           for v in items):
            return items
    expected = ("a float, a sequence of floats (one per model), a "
                "LearningRateSchedule or a sequence of them"
                if name == "learning_rate"
                else "a float or a sequence of floats (one per model)")
    raise TypeError(f"`{name}` must be {expected}. Received: {name}="
                    f"{value!r}.")

