"""The progress bar of an array: one terminal line at any number of models.

Keras' progress bar prints every log entry, so an array of B models fills
its line with `loss`, `loss_0` ... `loss_{B-1}` for every metric. The bar
here prints, for each quantity, the mean over the models and the best and
worst model with their values (`loss 0.412 [0.031 m3 … 1.87 m11]`), and
how many models diverged or were frozen; it shortens the line to the
terminal's width (`COLUMNS`). `FusedModel.fit` and `evaluate` use it at
`verbose=1` (a line per update) and `verbose=2` (a line per epoch); the
logs that callbacks receive are unchanged.

Pass `hftatf.progress.ProgbarLogger(per_model=True)` in `callbacks` to see
every model's value too: at the end of each epoch, a line per quantity
lists them in model order.
"""

import math
import os
import re
import shutil
import sys
import time

import keras
import numpy as np
from absl import logging

from hftatf.core.logs import monitor_direction, ordered_names, split_logs

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_SEPARATOR = " - "
_ELLIPSIS = "…"


# The width of a line written to a file or a pipe: a log keeps every
# quantity the line has room for on a wide terminal, and its best and
# worst models.
LOG_WIDTH = 240


def terminal_width():
    """The terminal's width in characters (`COLUMNS` where it is set);
    `LOG_WIDTH` where the output is no terminal."""
    if "COLUMNS" not in os.environ and not _is_terminal(sys.stdout):
        return LOG_WIDTH
    return shutil.get_terminal_size((80, 24)).columns


def _is_terminal(stream):
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # No stream, or a closed one.
        return False


def visible_length(text):
    """The characters of `text` a terminal shows (colour codes left out)."""
    return len(_ANSI.sub("", text))


def _scalar(value):
    """A log value as a float (a vector-valued metric as its mean)."""
    try:
        return float(np.mean(np.asarray(value, dtype="float64")))
    except (TypeError, ValueError):
        return math.nan


def format_value(value):
    """A logged value in 3 significant digits (`0.412`, `1.87e-05`)."""
    return f"{value:.3g}"


class Quantity:
    """One logged quantity of an array, as the progress bar shows it.

    Attributes:
        name: the log name (`loss`, `val_accuracy`, ...).
        mean: the array's value (`logs[name]`: the mean over the models
            that have not diverged).
        values: each model's value in model order, or None for a quantity
            that is not per model.
        best, worst: `(value, model index)` of the best and worst finite
            value by the quantity's direction, or None (one model, or no
            finite value).
    """

    def __init__(self, name, mean, values=None, best=None, worst=None):
        self.name = name
        self.mean = mean
        self.values = values
        self.best = best
        self.worst = worst

    def short_text(self):
        return f"{self.name} {format_value(self.mean)}"

    def full_text(self):
        if self.best is None:
            return self.short_text()
        (best, b), (worst, w) = self.best, self.worst
        return (f"{self.short_text()} [{format_value(best)} m{b} "
                f"{_ELLIPSIS} {format_value(worst)} m{w}]")


def quantities(logs, num_models, direction=None):
    """The `Quantity` of each entry of an array's `logs`, in reading order
    (`hftatf.core.logs.ordered_names`): the per-model ones, then the
    others.

    Args:
        logs: the logs a `FusedModel` gives its callbacks.
        num_models: the number of models B.
        direction: `name -> "up" | "down"`: which way the quantity
            improves (default: down). Best is the highest value for "up".
    """
    direction = direction or (lambda name: "down")
    per_model, shared = split_logs(logs, num_models)
    found = []
    for name in ordered_names(per_model):
        values = [_scalar(value) for value in per_model[name]]
        finite = [(value, b) for b, value in enumerate(values)
                  if math.isfinite(value)]
        mean = _scalar(logs[name]) if name in logs else (
            float(np.mean([value for value, _ in finite])) if finite
            else math.nan)
        best = worst = None
        if num_models > 1 and finite:
            low = min(finite, key=lambda pair: pair[0])
            high = max(finite, key=lambda pair: pair[0])
            best, worst = (high, low) if direction(name) == "up" else (
                low, high)
        found.append(Quantity(name, mean, values, best, worst))
    found += [Quantity(name, _scalar(shared[name]))
              for name in ordered_names(shared)]
    return found


def status_text(diverged, frozen):
    """`"2 diverged, 1 frozen"`, leaving out counts of zero."""
    parts = [f"{count} {what}" for count, what in
             ((diverged, "diverged"), (frozen, "frozen")) if count]
    return ", ".join(parts)


def compact_text(items, width, status=""):
    """The `status` and `items` (`Quantity`s) joined in at most `width`
    characters, in the order of `items`.

    Every quantity's mean where they all fit (else the least telling ones
    are left out, and `…` says so), then the best and worst model of as
    many as fit, the most telling first: validation before training, each
    in reading order. The status comes first, so it is never left out.
    """
    head = [status] if status else []

    def joined(forms):
        parts = head + [form for form in forms if form]
        if None in forms:
            parts.append(_ELLIPSIS)
        return _SEPARATOR.join(parts)

    rank = sorted(range(len(items)),
                  key=lambda i: (not items[i].name.startswith("val_"), i))
    forms = [None] * len(items)
    for making in (Quantity.short_text, Quantity.full_text):
        for i in rank:
            trial = forms[:i] + [making(items[i])] + forms[i + 1:]
            if len(joined(trial)) <= width:
                forms = trial
    text = joined(forms)
    return text if len(text) <= width else _SEPARATOR.join(head)[:width]


def per_model_lines(items, width):
    """Every model's value of each per-model quantity, in model order
    (`  loss  m0 0.412  m1 0.5 ...`), wrapped at `width`."""
    named = [item for item in items if item.values is not None]
    if not named:
        return []
    indent = 2 + max(len(item.name) for item in named) + 2
    lines = []
    for item in named:
        line = f"  {item.name.ljust(indent - 4)}"
        for b, value in enumerate(item.values):
            entry = f"  m{b} {format_value(value)}"
            if len(line) + len(entry) > width and len(line) > indent:
                lines.append(line)
                line = " " * (indent - 2)
            line += entry
        lines.append(line)
    return lines


def _write(text):
    """Writes `text` as Keras' progress bar does: to stdout, or to the
    absl log where Keras' interactive logging is off."""
    if keras.config.is_interactive_logging_enabled():
        sys.stdout.write(text)
        sys.stdout.flush()
    else:
        logging.info(text.strip("\r\n"))


class ArrayProgbar(keras.utils.Progbar):
    """`keras.utils.Progbar` with the array's compact line.

    Args:
        target, verbose, interval, unit_name: as for `keras.utils.Progbar`.
        num_models: the number of models B.
        direction: `name -> "up" | "down"` (see `quantities`).
        status: a function returning the status text (`status_text`).
        per_model: whether each model's value is listed at the end of an
            epoch.
        columns: the line's width; default: the terminal's.
    """

    def __init__(self, target, num_models, verbose=1, interval=0.05,
                 unit_name="step", direction=None, status=None,
                 per_model=False, columns=None):
        super().__init__(target, verbose=verbose, interval=interval,
                         unit_name=unit_name)
        self.num_models = num_models
        self.direction = direction
        self.status = status or (lambda: "")
        self.per_model = per_model
        self.columns = columns

    def update(self, current, values=None, finalize=None):
        """Shows step `current` with `values`, the `(name, value)` log
        pairs of that step, as they are (Keras' loggers give running
        means)."""
        if finalize is None:
            finalize = self.target is not None and current >= self.target
        now = time.time()
        per_step = self._estimate_step_duration(current, now)
        self._seen_so_far = current
        if self.verbose == 1:
            if now - self._last_update < self.interval and not finalize:
                return
            self._show_bar(current, now, per_step, dict(values or []),
                           finalize)
        elif self.verbose == 2 and finalize:
            self._show_epoch(current, now, per_step, dict(values or []))
        self._last_update = now

    def _width(self):
        return self.columns or terminal_width()

    def _items(self, logs):
        return quantities(logs, self.num_models, self.direction)

    def _show_bar(self, current, now, per_step, logs, finalize):
        width = self._width()
        bar_width = max(1, min(self.width, (width - 40) // 4))
        if self.target:
            digits = int(math.log10(self.target)) + 1
            filled = int(bar_width * current / self.target)
            bar = (f"\x1b[1m{current:{digits}d}/{self.target}\x1b[0m "
                   f"\x1b[32m{'━' * filled}\x1b[0m"
                   f"\x1b[37m{'━' * (bar_width - filled)}\x1b[0m")
        else:
            bar = f"{current:7d}/Unknown"
        if self.target and not finalize:
            bar += f" \x1b[1m{_duration(per_step * (self.target - current))}"
        else:
            bar += f" \x1b[1m{now - self._start:.0f}s"
        bar += f"\x1b[0m{self._format_time(per_step, self.unit_name)}"
        room = width - visible_length(bar) - len(_SEPARATOR)
        tail = compact_text(self._items(logs), room, self.status())
        line = bar + (_SEPARATOR + tail if tail else "")
        shown = visible_length(line)
        text = "\r" if self._dynamic_display else "\n"
        text += line + " " * max(0, min(self._prev_total_width, width)
                                 - shown)
        self._prev_total_width = shown
        if finalize:
            text += "\n" + self._detail(logs, width)
        _write(text)

    def _show_epoch(self, current, now, per_step, logs):
        width = self._width()
        line = (f"{current}/{self.target} - {now - self._start:.0f}s -"
                f"{self._format_time(per_step, self.unit_name)}")
        room = width - len(line) - len(_SEPARATOR)
        tail = compact_text(self._items(logs), room, self.status())
        line += _SEPARATOR + tail if tail else ""
        _write(line + "\n" + self._detail(logs, width))

    def _detail(self, logs, width):
        if not self.per_model:
            return ""
        lines = per_model_lines(self._items(logs), width)
        return "".join(line + "\n" for line in lines)


def _duration(seconds):
    """`1:02:03`, `2:03` or `3s`, as Keras shows an ETA."""
    seconds = int(seconds)
    if seconds > 3600:
        return (f"{seconds // 3600}:{seconds % 3600 // 60:02d}:"
                f"{seconds % 60:02d}")
    if seconds > 60:
        return f"{seconds // 60}:{seconds % 60:02d}"
    return f"{seconds}s"


class ProgbarLogger(keras.callbacks.ProgbarLogger):
    """`keras.callbacks.ProgbarLogger` for arrays: the compact line of
    `ArrayProgbar`. `FusedModel.fit` and `evaluate` add one unless
    `callbacks` already holds a `ProgbarLogger`.

    Args:
        per_model: list each model's value of every quantity, in model
            order, at the end of each epoch (and of `evaluate`).
        columns: the width of the line; default: the terminal's
            (`COLUMNS`, else the terminal's own, else 80).
    """

    # Not beside asynchronously dispatched batches, as Keras runs its own:
    # this one reads which models diverged, from the state the next batch
    # takes over on JAX.
    async_safe = False

    def __init__(self, per_model=False, columns=None):
        super().__init__()
        self.per_model = per_model
        self.columns = columns
        self._directions = {}

    def _maybe_init_progbar(self):
        if self.progbar is None:
            self.progbar = ArrayProgbar(
                target=self.target, verbose=self.verbose,
                num_models=getattr(self.model, "num_models", 0),
                direction=self._direction, status=self._status,
                per_model=self.per_model, columns=self.columns)

    def _direction(self, name):
        if name not in self._directions:
            try:
                found = monitor_direction(self.model, name)
            except ValueError:
                found = "down"  # Unknown: lowest first.
            self._directions[name] = found
        return self._directions[name]

    def _status(self):
        """How many models diverged and how many were frozen otherwise."""
        model = self.model
        if not hasattr(model, "diverged_models"):
            return ""
        diverged = np.asarray(model.diverged_models)
        frozen = ~np.asarray(model.active_models) & ~diverged
        return status_text(int(diverged.sum()), int(frozen.sum()))


def with_progress_bar(callbacks, verbose="auto"):
    """`callbacks` (a list, or None) with an array `ProgbarLogger` added
    where Keras would add its own: `verbose` not 0 and no `ProgbarLogger`
    given. A `keras.callbacks.CallbackList` is left as it is (Keras adds
    nothing to one either)."""
    if verbose == 0 or isinstance(callbacks, keras.callbacks.CallbackList):
        return callbacks
    callbacks = list(callbacks or [])
    if any(isinstance(callback, keras.callbacks.ProgbarLogger)
           for callback in callbacks):
        return callbacks
    return [*callbacks, ProgbarLogger()]
