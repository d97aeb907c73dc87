"""Measuring tools of the training benchmark: epoch timing, peak memory
(the process's, and the accelerator's), the device's matmul peak, and the
FLOPs of a training step read from XLA.

The last three run on the Keras backend's own framework: they come from
`device_tensorflow` or `device_jax`, chosen here once.
"""

import resource
import sys
import time

import keras

from benchmarks.hlo import hlo_flops  # noqa: F401

if keras.backend.backend() == "tensorflow":
    from benchmarks.device_tensorflow import (  # noqa: F401
        matmul_peak,
        peak_device_mb,
        quiet,
        train_step_flops,
    )
else:
    from benchmarks.device_jax import (  # noqa: F401
        matmul_peak,
        peak_device_mb,
        quiet,
        train_step_flops,
    )


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
