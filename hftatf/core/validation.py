"""Checks on user input shared by layers, optimizers and models."""

import math
import numbers
import sys
import typing

import keras

# The Keras backend hftatf was imported on: its trainer and its layers'
# backend code were chosen for it.
IMPORTED_BACKEND = keras.backend.backend()


def check_backend():
    """Raises where Keras now runs on another backend than the one hftatf
    was imported on (`keras.config.set_backend` after `import hftatf`)."""
    current = sys.modules.get("keras")
    now = (current.backend.backend() if current is not None
           and hasattr(current, "backend") else IMPORTED_BACKEND)
    if now != IMPORTED_BACKEND:
        raise ValueError(
            f"hftatf was imported on Keras's {IMPORTED_BACKEND!r} backend, "
            f"and Keras now runs on {now!r} (`keras.config.set_backend` "
            "after `import hftatf`): arrays and their training steps are "
            "made for the backend hftatf was imported on. Pick the backend "
            "before anything imports Keras (KERAS_BACKEND, or "
            "~/.keras/keras.json), in a new process.")


def check_num_models(num_models):
    """Returns `num_models` as an int, or raises a ValueError that says why."""
    if isinstance(num_models, bool) or not isinstance(
        num_models, numbers.Integral
    ):
        raise TypeError(
            "`num_models` must be a positive integer (the number of models in "
            f"the array). Received: num_models={num_models!r} of type "
            f"{type(num_models).__name__}."
        )
    if num_models < 1:
        raise ValueError(
            "`num_models` must be a positive integer (the number of models in "
            f"the array). Received: num_models={num_models}. Use "
            "num_models=1 for a single model."
        )
    return int(num_models)


def is_number(value):
    """Whether `value` is a real number (a bool is not)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


class ModelCount:
    """Mixin: the number of models `B` of an object (an optimizer, a
    schedule) that several of its arguments may each imply; they must
    agree. The object has a `name`."""

    _num_models = None
    _num_models_source = None

    @property
    def num_models(self):
        """The number of models `B`, or None while it is not known."""
        return self._num_models

    def _set_num_models(self, num_models, source):
        """Records `num_models`, implied by `source` (a phrase such as
        "`beta_1` has 3 values"), or raises a ValueError if an earlier
        argument implied another number."""
        if self._num_models is None:
            self._num_models = num_models
            self._num_models_source = source
        elif num_models != self._num_models:
            raise ValueError(
                f"{type(self).__name__} '{self.name}' was configured for "
                f"{self._num_models} models ({self._num_models_source}) but "
                f"{source}. Give every per-model argument one value per "
                "model of the array (or a single value shared by all).")


def shared(name, value):
    """Returns `value`, an argument that every model of an array shares (a
    flag, a count); raises a ValueError for a sequence, which elsewhere in
    hftatf means one value per model."""
    if isinstance(value, (list, tuple)) or (
            hasattr(value, "shape") and len(value.shape) > 0):
        raise ValueError(
            f"`{name}` is shared by all models of an array: give one value, "
            f"not one per model. Received: {name}={value!r}. Models that "
            f"need different `{name}` train in arrays of their own.")
    return value


def check_model_axis(layer_name, num_models, shape, axis=1):
    """Raises a ValueError unless axis `axis` of `shape` (1, or 0 for
    activations with the models first) is a model axis of B."""
    if len(shape) < 2 or shape[axis] not in (None, num_models):
        layout = ("[num_models, batch, ...]" if axis == 0
                  else "[batch, num_models, ...]")
        raise ValueError(
            f"Layer '{layer_name}' of an array of {num_models} models expects "
            f"inputs of shape {layout} with "
            f"num_models={num_models} on axis {axis}. Received input shape "
            f"{tuple(shape)}."
        )


class Range(typing.NamedTuple):
    """An interval of numbers, with the reason values outside it cannot be
    right (`why`) and, optionally, how to fix such a value (`fix`)."""

    low: float = -math.inf
    high: float = math.inf
    low_open: bool = False
    high_open: bool = False
    why: str = ""
    fix: str = ""

    def holds(self, value):
        """Whether `value` is a finite number inside the interval."""
        if not is_number(value) or not math.isfinite(value):
            return False
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below

    def expected(self):
        """What the interval holds, as text: "a finite number in [0, 1)",
        "a finite number >= 0", ..., "a finite number"."""
        if self.low == -math.inf and self.high == math.inf:
            return "a finite number"
        if self.high == math.inf:
            bound = f"{'>' if self.low_open else '>='} {self.low:g}"
        elif self.low == -math.inf:
            bound = f"{'<' if self.high_open else '<='} {self.high:g}"
        else:
            bound = (f"in {'(' if self.low_open else '['}{self.low:g}, "
                     f"{self.high:g}{')' if self.high_open else ']'}")
        return f"a finite number {bound}"


# A learning rate of 0 is accepted, as stock Keras accepts it: that model's
# weights stay as they are.
LEARNING_RATE = Range(
    0.0, why=" (positive, or 0 to leave that model's weights unchanged)",
    fix="Pass a positive learning rate such as 0.001, or one per model.")


def check_range(name, value, valid):
    """Returns `value`, a number or a sequence of one number per model of
    an array, if each of its numbers is finite and inside `valid` (a
    `Range`); raises a ValueError naming the argument, the model, the
    value received, the interval expected and the fix otherwise. Entries
    that are not numbers (None, schedules) are left to other checks."""
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    for model, item in enumerate(values):
        if item is None or not is_number(item) or valid.holds(item):
            continue
        where = (f"model {model} has {name}={item!r} (received: "
                 f"{name}={list(value)!r})"
                 if isinstance(value, (list, tuple))
                 else f"received: {name}={item!r}")
        fix = valid.fix or (
            f"Pass {valid.expected()}, or one such number per model.")
        raise ValueError(
            f"`{name}` must be {valid.expected()}{valid.why} for every "
            f"model; {where}. {fix}")
    return value


def check_learning_rate(value, name="learning_rate"):
    """`check_range` for learning rates (finite, >= 0): the check of every
    learning rate an hftatf optimizer or launcher takes."""
    return check_range(name, value, LEARNING_RATE)
