"""TensorFlow, where an hftatf feature needs it.

On the JAX backend hftatf runs without TensorFlow. The features that
TensorFlow alone provides (SavedModel export and serving, `tf.data` and
TFRecord input, `tf.distribute` strategies, TensorBoard's summary writer,
remote paths through `tf.io.gfile`) import it when they are used, through
`tensorflow(feature)`, and fail at once, naming the feature and the fix,
where it is not installed. `import hftatf` itself never imports it on a
backend other than TensorFlow.
"""

import importlib
import importlib.util
import sys

import keras


def tensorflow(feature):
    """The `tensorflow` module, imported for `feature` (what the user asked
    for, e.g. "SavedModel export"); an ImportError naming `feature` and
    the fix where TensorFlow is not installed."""
    try:
        return importlib.import_module("tensorflow")
    except ImportError as error:
        raise ImportError(
            f"{feature} needs TensorFlow, which is not installed here "
            f"(Keras backend: {keras.backend.backend()!r}). Install it "
            "(`pip install tensorflow`, or `pip install hftatf` with its "
            "default dependencies), or leave this feature out: hftatf "
            "trains, saves `.keras` files and exports in the 'keras' "
            "format on JAX without TensorFlow.") from error


def tensorflow_backend(feature):
    """The `tensorflow` module for `feature`, which trains on Keras's
    TensorFlow backend only (a `tf.distribute` strategy, a TF
    checkpoint); a ValueError naming the fix on another backend."""
    backend = keras.backend.backend()
    if backend != "tensorflow":
        raise ValueError(
            f"{feature} works on Keras's TensorFlow backend only, and this "
            f"process runs the {backend!r} backend. Set "
            "KERAS_BACKEND=tensorflow before Keras is imported, or use "
            "what this backend offers (on JAX: keras.distribution for "
            "devices, the 'keras' format for files).")
    return tensorflow(feature)


def tensorflow_installed():
    """Whether TensorFlow can be imported here (without importing it)."""
    try:
        return importlib.util.find_spec("tensorflow") is not None
    except ValueError:
        # A module in sys.modules without a spec: importable as it is.
        return True


def imported_tensorflow():
    """The `tensorflow` module where this process has imported it, else
    None: a value can be a TensorFlow object (a `tf.IndexedSlices`) only
    then."""
    return sys.modules.get("tensorflow")
