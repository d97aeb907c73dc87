"""The one decorator that publishes a symbol as serializable under `hftatf`."""

import keras

PACKAGE = "hftatf"


def hftatf_export(obj):
    """Registers `obj` with Keras serialization under the package `hftatf`.

    Every layer, optimizer, schedule and model class of the library carries
    it, so `.keras` files that hold them load with `keras.saving.load_model`
    once `hftatf` is imported.
    """
    return keras.saving.register_keras_serializable(package=PACKAGE)(obj)
