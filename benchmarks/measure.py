"""Measuring tools of the training benchmark: epoch timing, peak memory,
the device's matmul peak, and the FLOPs of a training step read from XLA.
"""

import re
import resource
import statistics
import sys
import time

import keras
import numpy as np
import tensorflow as tf


class EpochTimer(keras.callbacks.Callback):
    """Records the wall-clock and processor time of every epoch of a `fit`.

    Processor time is what all threads of this process used
    (`time.process_time`). On a shared or throttled machine, where
    wall-clock times come in coarse steps, it is the steadier measure of
    the work an epoch needed.
    """

    def __init__(self):
        super().__init__()
        self.starts, self.ends = [], []
        self.cpu_starts, self.cpu_ends = [], []

    def on_epoch_begin(self, epoch, logs=None):
        self.starts.append(time.perf_counter())
        self.cpu_starts.append(time.process_time())

    def on_epoch_end(self, epoch, logs=None):
        self.cpu_ends.append(time.process_time())
        self.ends.append(time.perf_counter())

    @property
    def durations(self):
        """Wall-clock seconds of each epoch."""
        return [end - start for start, end in zip(self.starts, self.ends)]

    @property
    def cpu_durations(self):
        """Processor seconds (all threads) of each epoch."""
        return [end - start
                for start, end in zip(self.cpu_starts, self.cpu_ends)]


def timed_fit(model, dataset, steps, epochs, warmup_steps):
    """Trains `model` for `warmup_steps` (tracing and compiling happen
    there, untimed), then for `epochs` epochs of `steps` steps, each timed.

    Returns:
        The `EpochTimer` of the timed epochs.
    """
    # The data are batches cycled from memory: nothing to shuffle.
    model.fit(dataset, epochs=1, steps_per_epoch=warmup_steps, verbose=0,
              shuffle=False)
    timer = EpochTimer()
    model.fit(dataset, epochs=epochs, steps_per_epoch=steps, verbose=0,
              callbacks=[timer], shuffle=False)
    return timer


def peak_rss_mb():
    """The peak resident memory of this process so far, in MiB."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes.
    return peak / (2**20 if sys.platform == "darwin" else 2**10)


def matmul_peak(size=2048, seconds=2.0):
    """The device's measured float32 matmul rate (FLOP/s): the best of
    repeated `size x size` products, with and without XLA, on the device
    TensorFlow places them on.

    Returns:
        `(flops_per_second, details)`, details naming the best setting.
    """
    rng = np.random.default_rng(0)
    a = tf.constant(rng.standard_normal((size, size)), "float32")
    b = tf.constant(rng.standard_normal((size, size)), "float32")
    flops = 2.0 * size**3
    best = {}
    for jit in (False, True):
        product = tf.function(lambda x, y: tf.reduce_sum(tf.matmul(x, y)),
                              jit_compile=jit)
        product(a, b).numpy()
        times, deadline = [], time.perf_counter() + seconds / 2
        while time.perf_counter() < deadline or len(times) < 3:
            start = time.perf_counter()
            product(a, b).numpy()
            times.append(time.perf_counter() - start)
        best[jit] = flops / min(times)
    jit = max(best, key=best.get)
    return best[jit], f"{size}x{size} float32 matmul, xla={jit}"


# -- FLOPs from XLA ----------------------------------------------------------

_DEFINITION = re.compile(r"%([\w.\-]+)\s*=\s*\w+\[([\d,]*)\]")
_OPERATION = re.compile(
    r"%[\w.\-]+\s*=\s*\w+\[([\d,]*)\]\S*\s+(dot|convolution)\(([^)]*)\)"
    r"(.*)")
_OPERAND = re.compile(r"(?:\w+\[([\d,]*)\]\S*\s+)?%([\w.\-]+)")


def _dims(text):
    return [int(d) for d in text.split(",") if d]


_INSTRUCTION = re.compile(r"\s*(ROOT\s+)?%([\w.\-]+)\s*=\s*(.*)")


def _live_instructions(hlo_text):
    """The lines of the instructions some computation's result depends on.

    TensorFlow lowers every op of a traced step, gradients nobody asked for
    included (a convolution's input gradient on the data, say); XLA drops
    those when it optimises, and so does this count.
    """
    definitions, roots = {}, []
    for line in hlo_text.splitlines():
        match = _INSTRUCTION.match(line)
        if not match:
            continue
        root, name, rest = match.groups()
        definitions[name] = (line, re.findall(r"%([\w.\-]+)", rest))
        if root:
            roots.append(name)
    live, pending = set(), roots
    while pending:
        name = pending.pop()
        if name in live or name not in definitions:
            continue
        live.add(name)
        pending.extend(definitions[name][1])
    return [definitions[name][0] for name in live]


def hlo_flops(hlo_text):
    """Floating-point operations of the live dots and convolutions of an
    HLO module's text, as XLA prints it before optimising: 2 per
    multiply-add of what the model asks for (operand shapes are read from
    the operands, or from their definitions where XLA does not print them).

    Elementwise work is not counted; a loop body is counted once, however
    many times it runs.
    """
    shapes = {name: _dims(dims)
              for name, dims in _DEFINITION.findall(hlo_text)}
    total = 0
    for line in _live_instructions(hlo_text):
        match = _OPERATION.search(line)
        if not match:
            continue
        out, kind, operands, attributes = match.groups()
        operands = [_dims(dims) if dims else shapes.get(name)
                    for dims, name in _OPERAND.findall(operands)][:2]
        if len(operands) != 2 or None in operands:
            continue
        (lhs, rhs), out = operands, _dims(out)
        if kind == "dot":
            contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}",
                                    attributes)
            depth = np.prod([lhs[i] for i in _dims(contracting.group(1))]
                            ) if contracting else 1
        else:
            labels = re.search(r"dim_labels=\w+_(\w+)->", attributes)
            # Every output element sums the kernel's spatial window times
            # its input features (per group): all kernel axes but `o`.
            depth = np.prod(rhs) // rhs[labels.group(1).index("o")]
        total += 2 * int(np.prod(out)) * int(depth)
    return total


def train_step_flops(model, batch):
    """The FLOPs of one `model.train_step(batch)` (forward, the gradients
    the step uses, and the optimizer's matmuls if any) read from the XLA
    lowering of the step, or None where the step cannot be lowered.

    These are the FLOPs the model asks for, before XLA rewrites them (on
    CPU it computes a depthwise kernel gradient as a dense one, for one).
    `model` must be compiled and built (trained for a step, say).
    """
    step = tf.function(model.train_step, jit_compile=True)
    try:
        hlo = step.experimental_get_compiler_ir(batch)(stage="hlo")
    except Exception:  # noqa: BLE001 - any failure means "unknown".
        return None
    return hlo_flops(hlo)


def summarize(values):
    """`(median, min, max)` of a non-empty list."""
    return statistics.median(values), min(values), max(values)
