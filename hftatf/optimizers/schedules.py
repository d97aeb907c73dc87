"""Per-model learning-rate schedules: one schedule, a `[B]` vector of rates.

Each schedule here is the stock `keras.optimizers.schedules` schedule of the
same name (or, for `StepDecay` and `LinearWarmup`, the schedule its
docstring writes out), vectorised over the models of an array: every float
parameter is a float (shared by the B models) or a length-B sequence (one
value per model), and `schedule(step)` returns a `[B]` float32 vector whose
entry `b` is what the stock schedule with model b's parameters returns at
`step`. `step` is a scalar (the optimizer's iteration count, shared by the
models) or a `[B]` vector (one step count per model); either way the
schedule is evaluated elementwise, so a model's rate depends only on its
own parameters and its own step.

Give one of these to a fused optimizer as its `learning_rate`:

    schedule = hftatf.optimizers.schedules.CosineDecay(
        initial_learning_rate=[0.1, 0.05, 0.01], decay_steps=1000,
        warmup_target=[1.0, 0.5, 0.1], warmup_steps=[100, 50, 0])
    optimizer = hftatf.optimizers.SGD(learning_rate=schedule, momentum=0.9)
"""

import math

import keras
import numpy as np
from keras import ops

from hftatf.api import hftatf_export
from hftatf.core.validation import (
    ModelCount,
    check_num_models,
    is_number,
    shared,
)

__all__ = [
    "FusedSchedule",
    "CosineDecay",
    "ExponentialDecay",
    "StepDecay",
    "PiecewiseConstantDecay",
    "LinearWarmup",
]

Schedule = keras.optimizers.schedules.LearningRateSchedule


@hftatf_export
class FusedSchedule(ModelCount, Schedule):
    """Base class of per-model schedules.

    Subclasses declare each per-model parameter with `_parameter` in
    `__init__` and compute the `[B]` rates in `_rates(step)` from the
    parameters as tensors (`_tensor`), elementwise.

    Args:
        num_models: the number of models `B`. Optional: it is taken from the
            length of any per-model parameter. Where every parameter is
            shared and `num_models` is not given, the schedule returns a
            scalar for a scalar `step` (a rate shared by the models, as a
            stock schedule returns), and a `[B]` vector for a `[B]` step.
        name: the name scope of the schedule's operations.
    """

    def __init__(self, num_models=None, name=None):
        super().__init__()
        self.name = name
        if num_models is not None:
            self._set_num_models(check_num_models(num_models),
                                 f"num_models={num_models}")

    def _parameter(self, name, value, low=None, low_open=False,
                   allow_none=False):
        """Standardises parameter `name` to a float or a list of floats (one
        per model), checks that every value is >= `low` (> `low` where
        `low_open`), and records its length as the number of models."""
        items = _per_model_items(name, value, allow_none)
        if isinstance(items, list):
            self._set_num_models(len(items),
                                 f"`{name}` has {len(items)} values")
            if not hasattr(self, "_per_model_parameters"):
                self._per_model_parameters = []
            self._per_model_parameters.append(name)
        if low is not None:
            for item in items if isinstance(items, list) else [items]:
                if item is not None and (item <= low if low_open
                                         else item < low):
                    relation = ">" if low_open else ">="
                    raise ValueError(
                        f"Argument `{name}` must be {relation} {low} for "
                        f"every model. Received: {name}={value!r}."
                    )
        return items

    def _tensor(self, value, dtype="float32"):
        """A parameter as a scalar or `[B]` tensor."""
        return ops.convert_to_tensor(np.asarray(value, dtype=dtype))

    def __call__(self, step):
        with keras.name_scope(self.name or type(self).__name__):
            rates = self._rates(ops.convert_to_tensor(step))
            if self.num_models is None:
                return rates
            return ops.broadcast_to(rates, (self.num_models,))

    def _rates(self, step):
        raise NotImplementedError(
            f"Schedule '{type(self).__name__}' must implement `_rates`.")

    def get_config(self):
        return {"name": self.name, "num_models": self.num_models}

    def select(self, indices):
        """The schedule of the models `indices` only (e.g. for
        `FusedModel.select`)."""
        return type(self).from_config(self._selected_config(indices))

    def stock_schedule(self, index):
        """Model `index`'s schedule as the stock Keras schedule of the same
        name, with that model's parameters (e.g. for a stock optimizer of
        one model of the array: `hftatf.optimizers.stock_optimizer`).

        Raises:
            TypeError: for a schedule with no stock Keras form
                (`LinearWarmup`, or a subclass of the user's own).
        """
        stock_class = getattr(keras.optimizers.schedules,
                              type(self).__name__, None)
        if type(self).__module__ != __name__ or not isinstance(stock_class,
                                                               type):
            raise TypeError(
                f"Schedule '{self.name}' ({type(self).__name__}) has no "
                "stock Keras form, so a stock optimizer cannot follow it.")
        return stock_class.from_config(self._stock_config(index))

    def _stock_config(self, index):
        """The config of model `index` alone, its per-model parameters as
        plain numbers."""
        config = self._selected_config([index])
        config.pop("num_models", None)
        for name in getattr(self, "_per_model_parameters", ()):
            key, _, position = name.partition("[")
            if position:
                config[key][int(position[:-1])] = config[key][
                    int(position[:-1])][0]
            else:
                config[key] = config[key][0]
        return config

    def _selected_config(self, indices):
        config = self.get_config()
        for name in getattr(self, "_per_model_parameters", ()):
            # "key" or "key[i]", as given to `_parameter`.
            key, _, position = name.partition("[")
            if position:
                entries = list(config[key])
                i = int(position[:-1])
                entries[i] = [entries[i][j] for j in indices]
                config[key] = entries
            else:
                config[key] = [config[key][j] for j in indices]
        if self.num_models is not None:
            config["num_models"] = len(indices)
        return config


def _per_model_items(name, value, allow_none):
    """A float (or None), or a list of them; a TypeError otherwise."""
    def valid(item):
        return is_number(item) or (allow_none and item is None)

    if valid(value):
        return None if value is None else float(value)
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if isinstance(value, (list, tuple)) and value and all(
            valid(item) for item in value):
        return [None if item is None else float(item) for item in value]
    expected = "a number or a non-empty sequence of numbers (one per model)"
    if allow_none:
        expected += ", None allowed"
    raise TypeError(f"Argument `{name}` must be {expected}. Received: "
                    f"{name}={value!r}.")


@hftatf_export
class CosineDecay(FusedSchedule):
    """`keras.optimizers.schedules.CosineDecay` with per-model parameters,
    linear warm-up included.

    Entry `b` of `schedule(step)` (a `[B]` vector) is what the stock schedule
    with model b's parameters returns: without warm-up (`warmup_target`
    None),

        step = min(step, decay_steps)
        cosine_decay = 0.5 * (1 + cos(pi * step / decay_steps))
        rate = initial_learning_rate * ((1 - alpha) * cosine_decay + alpha)

    and with warm-up the rate rises linearly from `initial_learning_rate` to
    `warmup_target` over `warmup_steps`, then decays from `warmup_target` as
    above over the next `decay_steps`.

    Args:
        initial_learning_rate, decay_steps, alpha, warmup_steps: as in
            Keras, each a number or a length-B sequence.
        warmup_target: None (no warm-up), a number, or a length-B sequence
            whose None entries turn warm-up off for those models.
        name: as in Keras.
        num_models: the number of models `B` (optional where some parameter
            is a sequence).
    """

    def __init__(self, initial_learning_rate, decay_steps, alpha=0.0,
                 name="CosineDecay", warmup_target=None, warmup_steps=0,
                 num_models=None):
        super().__init__(num_models=num_models, name=name)
        self.initial_learning_rate = self._parameter(
            "initial_learning_rate", initial_learning_rate)
        self.decay_steps = self._parameter("decay_steps", decay_steps, low=0,
                                           low_open=True)
        self.alpha = self._parameter("alpha", alpha)
        self.warmup_target = self._parameter("warmup_target", warmup_target,
                                             allow_none=True)
        self.warmup_steps = self._parameter("warmup_steps", warmup_steps,
                                            low=0)

    def _rates(self, step):
        initial = self._tensor(self.initial_learning_rate)
        decay_steps = self._tensor(self.decay_steps)
        step = ops.cast(step, "float32")
        shape = (self.num_models or 1,)
        targets = np.broadcast_to(np.asarray(self.warmup_target, object),
                                  shape)
        no_warmup = np.array([target is None for target in targets])
        if no_warmup.all():
            return self._decay(ops.minimum(step, decay_steps), decay_steps,
                               initial)
        # A model without warm-up is a model whose warm-up ends at step 0
        # on its initial rate: the stock schedule's two paths agree there.
        warmup_steps = self._tensor(np.where(
            no_warmup, 0.0, np.broadcast_to(self.warmup_steps, shape)))
        warmup_target = self._tensor(np.where(
            no_warmup, np.broadcast_to(self.initial_learning_rate, shape),
            targets).astype("float64"))
        step = ops.minimum(step, decay_steps + warmup_steps)
        # Elementwise where the stock schedule takes one branch: the models
        # may be on different sides of their warm-up. The warm-up branch
        # divides by 1 where there is no warm-up, as it is not taken there.
        safe_warmup = ops.where(warmup_steps > 0, warmup_steps, 1.0)
        warming = (warmup_target - initial) * (step / safe_warmup) + initial
        decaying = self._decay(step - warmup_steps, decay_steps,
                               warmup_target)
        return ops.where(step < warmup_steps, warming, decaying)

    def _decay(self, step, decay_steps, decay_from):
        # 1 - alpha and alpha as the stock schedule has them: Python floats
        # rounded to float32, not a float32 subtraction.
        alpha = np.asarray(self.alpha, dtype="float64")
        one_minus_alpha = self._tensor(1.0 - alpha)
        completed_fraction = step / decay_steps
        cosine_decayed = 0.5 * (1.0 + ops.cos(math.pi * completed_fraction))
        decayed = one_minus_alpha * cosine_decayed + self._tensor(alpha)
        return decay_from * decayed

    def get_config(self):
        return {
            **super().get_config(),
            "initial_learning_rate": self.initial_learning_rate,
            "decay_steps": self.decay_steps,
            "alpha": self.alpha,
            "warmup_target": self.warmup_target,
            "warmup_steps": self.warmup_steps,
        }


@hftatf_export
class ExponentialDecay(FusedSchedule):
    """`keras.optimizers.schedules.ExponentialDecay` with per-model
    parameters.

    Entry `b` of `schedule(step)` (a `[B]` vector) is

        initial_learning_rate * decay_rate ** (step / decay_steps)

    with model b's parameters; the exponent is rounded down when
    `staircase` is true.

    Args:
        initial_learning_rate, decay_steps, decay_rate: numbers or length-B
            sequences.
        staircase: whether to decay at discrete intervals (shared by all
            models).
        name: as in Keras.
        num_models: the number of models `B` (optional where some parameter
            is a sequence).
    """

    def __init__(self, initial_learning_rate, decay_steps, decay_rate,
                 staircase=False, name="ExponentialDecay", num_models=None):
        super().__init__(num_models=num_models, name=name)
        self.initial_learning_rate = self._parameter(
            "initial_learning_rate", initial_learning_rate)
        self.decay_steps = self._parameter("decay_steps", decay_steps, low=0,
                                           low_open=True)
        self.decay_rate = self._parameter("decay_rate", decay_rate)
        self.staircase = bool(shared("staircase", staircase))

    def _rates(self, step):
        p = ops.cast(step, "float32") / self._tensor(self.decay_steps)
        if self.staircase:
            p = ops.floor(p)
        return self._tensor(self.initial_learning_rate) * ops.power(
            self._tensor(self.decay_rate), p)

    def get_config(self):
        return {
            **super().get_config(),
            "initial_learning_rate": self.initial_learning_rate,
            "decay_steps": self.decay_steps,
            "decay_rate": self.decay_rate,
            "staircase": self.staircase,
        }


@hftatf_export
class StepDecay(ExponentialDecay):
    """Step decay with per-model parameters: the rate is multiplied by
    `decay_rate` every `decay_steps` steps,

        initial_learning_rate * decay_rate ** floor(step / decay_steps),

    which is `keras.optimizers.schedules.ExponentialDecay` with
    `staircase=True`. For decays at irregular steps (say at epochs 30, 60
    and 80), use `PiecewiseConstantDecay`.

    Args:
        initial_learning_rate, decay_steps: numbers or length-B sequences.
        decay_rate: a number or a length-B sequence; defaults to 0.1.
        name: the name scope.
        num_models: the number of models `B` (optional where some parameter
            is a sequence).
    """

    def __init__(self, initial_learning_rate, decay_steps, decay_rate=0.1,
                 name="StepDecay", num_models=None):
        super().__init__(initial_learning_rate, decay_steps, decay_rate,
                         staircase=True, name=name, num_models=num_models)

    def get_config(self):
        config = super().get_config()
        del config["staircase"]
        return config

    def stock_schedule(self, index):
        """Model `index`'s schedule as the stock
        `keras.optimizers.schedules.ExponentialDecay(staircase=True)`."""
        return keras.optimizers.schedules.ExponentialDecay(
            **self._stock_config(index), staircase=True)


@hftatf_export
class PiecewiseConstantDecay(FusedSchedule):
    """`keras.optimizers.schedules.PiecewiseConstantDecay` with per-model
    boundaries and values.

    Entry `b` of `schedule(step)` (a `[B]` vector) is `values[0][b]` while
    `step <= boundaries[0][b]`, `values[i][b]` while
    `boundaries[i-1][b] < step <= boundaries[i][b]`, and `values[-1][b]`
    after the last boundary.

    Args:
        boundaries: a list of K entries, each a number (shared) or a length-B
            sequence (one boundary per model), increasing. As in Keras, they
            are compared with the step in the step's dtype (rounded toward
            zero for an integer step).
        values: a list of K + 1 entries, each a number or a length-B
            sequence: the rates, computed in float32.
        name: as in Keras.
        num_models: the number of models `B` (optional where some entry is
            a sequence).
    """

    def __init__(self, boundaries, values, name="PiecewiseConstant",
                 num_models=None):
        super().__init__(num_models=num_models, name=name)
        for arg, value in (("boundaries", boundaries), ("values", values)):
            if not isinstance(value, (list, tuple)):
                raise TypeError(
                    f"Argument `{arg}` must be a list whose entries are "
                    "numbers or length-B sequences. Received: "
                    f"{arg}={value!r}.")
        if len(boundaries) != len(values) - 1:
            raise ValueError(
                "The length of boundaries should be 1 less than the length "
                f"of values. Received: boundaries={boundaries} of length "
                f"{len(boundaries)}, and values={values} of length "
                f"{len(values)}."
            )
        if not boundaries:
            raise ValueError(
                "`boundaries` must have at least one entry (and `values` "
                "two). For a constant rate pass floats as `learning_rate`.")
        self.boundaries = [self._parameter(f"boundaries[{i}]", b)
                           for i, b in enumerate(boundaries)]
        self.values = [self._parameter(f"values[{i}]", v)
                       for i, v in enumerate(values)]

    def _rates(self, step):
        # The stock schedule's sum of indicators, elementwise.
        boundaries = [ops.cast(ops.convert_to_tensor(np.asarray(b)),
                               step.dtype) for b in self.boundaries]
        values = [self._tensor(v) for v in self.values]
        result = ops.cast(step <= boundaries[0], "float32") * values[0]
        result = result + ops.cast(step > boundaries[-1],
                                   "float32") * values[-1]
        for low, high, value in zip(boundaries[:-1], boundaries[1:],
                                    values[1:-1]):
            in_range = ops.logical_and(step > low, step <= high)
            result = result + ops.cast(in_range, "float32") * value
        return result

    def get_config(self):
        return {**super().get_config(), "boundaries": self.boundaries,
                "values": self.values}


@hftatf_export
class LinearWarmup(FusedSchedule):
    """Linear-epoch gradual warm-up, per model, in front of another schedule.

    The warm-up of large-batch training (Goyal et al. 2017, arXiv
    1706.02677; You et al.): over the first `warmup_epochs` epochs the rate
    of model `b` rises linearly from `initial_learning_rate[b]` to the rate
    its base schedule reaches at the end of warm-up, after which it is the
    base schedule's rate, at the same (global) step:

        W = warmup_epochs * steps_per_epoch
        rate = initial_learning_rate + (after(W) - initial_learning_rate)
               * step / W                                   if step < W
        rate = after(step)                                  otherwise

    Every parameter is per model, so models may warm up for different
    numbers of epochs.

    Args:
        after: the base schedule: a number or a length-B sequence (a
            constant rate), an hftatf schedule (per model), a stock
            `LearningRateSchedule` (shared by the models), or a length-B
            sequence of stock schedules (one per model).
        warmup_epochs: a number >= 0 or a length-B sequence; 0 turns warm-up
            off for that model.
        steps_per_epoch: a number > 0 or a length-B sequence: the optimizer
            steps of one epoch.
        initial_learning_rate: the rate at step 0; a number or a length-B
            sequence. Defaults to 0.
        name: the name scope.
        num_models: the number of models `B` (optional where some parameter
            is a sequence).
    """

    def __init__(self, after, warmup_epochs, steps_per_epoch,
                 initial_learning_rate=0.0, name="LinearWarmup",
                 num_models=None):
        super().__init__(num_models=num_models, name=name)
        self.after = self._base_schedule(after)
        self.warmup_epochs = self._parameter("warmup_epochs", warmup_epochs,
                                             low=0)
        self.steps_per_epoch = self._parameter(
            "steps_per_epoch", steps_per_epoch, low=0, low_open=True)
        self.initial_learning_rate = self._parameter(
            "initial_learning_rate", initial_learning_rate)

    def _base_schedule(self, after):
        if isinstance(after, FusedSchedule):
            if after.num_models is not None:
                self._set_num_models(after.num_models,
                                     f"`after` is for {after.num_models}")
            return after
        if isinstance(after, Schedule):
            return after
        if isinstance(after, (list, tuple)) and after and all(
                isinstance(s, Schedule) and not isinstance(s, FusedSchedule)
                for s in after):
            self._set_num_models(len(after),
                                 f"`after` has {len(after)} schedules")
            return list(after)
        try:
            return self._parameter("after", after)
        except TypeError:
            raise TypeError(
                "Argument `after` must be a number, a length-B sequence of "
                "numbers, a LearningRateSchedule (an hftatf schedule or a "
                "stock one shared by the models) or a length-B sequence of "
                f"stock schedules. Received: after={after!r}.") from None

    def _evaluate_after(self, step):
        """The base schedule's rates at `step` (scalar or `[B]`)."""
        after = self.after
        if isinstance(after, FusedSchedule):
            return after(step)
        if isinstance(after, Schedule) and len(step.shape) == 0:
            return ops.cast(after(step), "float32")
        if isinstance(after, Schedule) or (
                isinstance(after, list) and isinstance(after[0], Schedule)):
            # A stock schedule takes one step: one call per model.
            if self.num_models is None:
                raise ValueError(
                    f"Schedule '{self.name}' evaluates its base schedule "
                    "at a different step for each model, so it needs the "
                    "number of models: pass `num_models`.")
            schedules = after if isinstance(after, list) else (
                [after] * self.num_models)
            steps = ops.broadcast_to(step, (self.num_models,))
            return ops.stack([ops.cast(s(steps[b]), "float32")
                              for b, s in enumerate(schedules)])
        return self._tensor(after)

    def _rates(self, step):
        warmup_steps = self._tensor(
            np.multiply(self.warmup_epochs, self.steps_per_epoch))
        start = self._tensor(self.initial_learning_rate)
        target = self._evaluate_after(warmup_steps)
        # The base schedule sees the step as given (an integer iteration
        # count, say), as it would without warm-up.
        after = self._evaluate_after(step)
        step = ops.cast(step, "float32")
        safe_warmup = ops.where(warmup_steps > 0, warmup_steps, 1.0)
        warming = start + (target - start) * (step / safe_warmup)
        return ops.where(step < warmup_steps, warming, after)

    def get_config(self):
        after = self.after
        if isinstance(after, Schedule):
            after = keras.saving.serialize_keras_object(after)
        elif isinstance(after, list) and isinstance(after[0], Schedule):
            after = [keras.saving.serialize_keras_object(s) for s in after]
        return {
            **super().get_config(),
            "after": after,
            "warmup_epochs": self.warmup_epochs,
            "steps_per_epoch": self.steps_per_epoch,
            "initial_learning_rate": self.initial_learning_rate,
        }

    def _selected_config(self, indices):
        config = super()._selected_config(indices)
        after = self.after
        if isinstance(after, FusedSchedule):
            config["after"] = keras.saving.serialize_keras_object(
                after.select(indices))
        elif isinstance(after, list) and isinstance(after[0], Schedule):
            config["after"] = [config["after"][j] for j in indices]
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        after = config["after"]
        if isinstance(after, dict):
            config["after"] = keras.saving.deserialize_keras_object(
                after, custom_objects=custom_objects)
        elif isinstance(after, list) and isinstance(after[0], dict):
            config["after"] = [keras.saving.deserialize_keras_object(
                s, custom_objects=custom_objects) for s in after]
        return cls(**config)
