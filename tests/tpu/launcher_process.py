"""Runs the launcher in a fresh process, for the tests that need one.

    python launcher_process.py REPLICAS SUMMARY [LAUNCHER FLAGS]
        [--strategies=mirrored,cpu] [--kill_at=EPOCH:BATCH]
        [--weights_out=PATH.npz]

REPLICAS CPU devices are configured before the backend starts: logical
devices of TensorFlow (as a MirroredStrategy over CPUs needs), or XLA host
devices of JAX (`KERAS_BACKEND=jax`; DataParallel over them). The config
of the launcher flags is run once per strategy of `--strategies` (in
`model_dir/<strategy>` when there are several), and a JSON summary of each
run (or of its error) is written to SUMMARY. `--kill_at` kills the process
with SIGKILL after that batch of that epoch; `--weights_out` saves the
array's weights and optimizer state after the last run.
"""

import dataclasses
import json
import os
import signal
import sys

REPLICAS = int(sys.argv.pop(1))
SUMMARY = sys.argv.pop(1)
if os.environ.get("KERAS_BACKEND") == "jax":
    os.environ["XLA_FLAGS"] = " ".join([
        os.environ.get("XLA_FLAGS", ""),
        f"--xla_force_host_platform_device_count={REPLICAS}"])
else:
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * REPLICAS)

import keras  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

from hftatf.tpu import train  # noqa: E402
from hftatf.tpu.config import ConfigError  # noqa: E402

train.define_flags()
flags.DEFINE_list("strategies", None, "Strategies to run the config under.")
flags.DEFINE_string("kill_at", None, "EPOCH:BATCH after which to SIGKILL.")
flags.DEFINE_string("weights_out", None, "Where to save the final state.")
FLAGS = flags.FLAGS


class KillAt(keras.callbacks.Callback):
    def __init__(self, epoch, batch):
        super().__init__()
        self.epoch, self.batch = epoch, batch

    def on_epoch_begin(self, epoch, logs=None):
        self.current = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self.current == self.epoch and batch == self.batch:
            os.kill(os.getpid(), signal.SIGKILL)


def main(argv):
    del argv
    config = train.config_from_flags()
    callbacks = []
    if FLAGS.kill_at:
        callbacks.append(KillAt(*map(int, FLAGS.kill_at.split(":"))))
    strategies = FLAGS.strategies or [config.strategy]
    summary = []
    for strategy in strategies:
        run_config = dataclasses.replace(config, strategy=strategy)
        if len(strategies) > 1:
            run_config = dataclasses.replace(
                run_config, model_dir=os.path.join(config.model_dir,
                                                   strategy))
        try:
            run = train.train(run_config, callbacks=callbacks)
        except ConfigError as error:
            summary.append({"strategy": strategy, "error": str(error),
                            "model_dir_exists": os.path.exists(
                                run_config.model_dir)})
            continue
        summary.append({
            "strategy": strategy,
            "num_replicas": run.num_replicas,
            "initial_epoch": run.initial_epoch,
            "results": run.results,
            "history": run.history,
            "weights": [np.asarray(w).tolist()
                        for w in run.array.get_weights()],
        })
        if FLAGS.weights_out:
            np.savez(FLAGS.weights_out,
                     *[np.asarray(w) for w in run.array.weights],
                     *[np.asarray(v) for v in run.array.optimizer.variables])
    with open(SUMMARY, "w") as file:
        json.dump(summary, file)


if __name__ == "__main__":
    app.run(main)
