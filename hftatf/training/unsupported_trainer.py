"""The trainer of an array on a Keras backend hftatf cannot train on yet:
the array builds, predicts and saves, but refuses to train."""

import keras


class UnsupportedBackendTrainer:
    """Mixin of `FusedModel` in place of a backend trainer (see
    `hftatf.training.tensorflow_trainer` for what one provides)."""

    def make_train_function(self, force=False):
        raise ValueError(
            "hftatf trains arrays on the TensorFlow backend; Keras runs on "
            f"'{keras.backend.backend()}', for which hftatf has no trainer "
            "yet. Set KERAS_BACKEND=tensorflow before importing Keras.")

    def _uses_replica_jit(self, jit_compile, run_eagerly):
        return False
