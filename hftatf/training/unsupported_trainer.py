"""The trainer of an array on a Keras backend hftatf cannot train on yet:
the array builds, predicts and saves, but refuses to train."""

import keras


class UnsupportedBackendTrainer:
    """Mixin of `FusedModel` in place of a backend trainer (see
    `hftatf.training.tensorflow_trainer` for what one provides)."""

    def make_train_function(self, force=False):
        raise ValueError(
            "hftatf trains arrays on Keras's TensorFlow and JAX backends; "
            f"Keras runs on '{keras.backend.backend()}', for which hftatf "
            "has no trainer. Set KERAS_BACKEND=tensorflow or "
            "KERAS_BACKEND=jax before importing Keras.")

    def _uses_replica_jit(self, jit_compile, run_eagerly):
        return False
