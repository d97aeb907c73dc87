"""Trains an array with hftatf's BackupAndRestore, optionally killing its
own process with SIGKILL at a given epoch and batch. Run by
test_backup.py: `python resume_training.py BACKUP_DIR OUT KILL_EPOCH
KILL_BATCH` (a negative KILL_EPOCH trains to the end); the final weights
go to OUT (.npz)."""

import os
import signal
import sys

import keras
import numpy as np

import hftatf
from hftatf.backup import BackupAndRestore

backup_dir, out, kill_epoch, kill_batch = (
    sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
if keras.backend.backend() == "tensorflow":
    # (JAX's computations on a CPU are deterministic already.)
    import tensorflow as tf

    tf.config.experimental.enable_op_determinism()
keras.utils.set_random_seed(0)


class KillAt(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self.epoch == kill_epoch and batch == kill_batch:
            os.kill(os.getpid(), signal.SIGKILL)


x_in = keras.Input((6,))
h = keras.layers.Dense(16, activation="relu")(x_in)
h = keras.layers.Dropout(0.3)(h)
h = keras.layers.BatchNormalization()(h)
model = keras.Model(x_in, keras.layers.Dense(3)(h))
array = hftatf.fuse(model, 3)
array.compile(
    optimizer=hftatf.optimizers.Adam([0.01, 0.003, 0.03]),
    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    metrics=["accuracy"])
rng = np.random.default_rng(0)
x = rng.normal(size=(64, 6)).astype("float32")
y = rng.integers(0, 3, 64)
array.fit(x, y, batch_size=8, epochs=4, shuffle=False, verbose=0,
          callbacks=[BackupAndRestore(backup_dir), KillAt()])
np.savez(out, *[np.asarray(w) for w in array.weights],
         *[np.asarray(v) for v in array.optimizer.variables])
