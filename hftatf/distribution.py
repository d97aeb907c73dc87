"""Laying an array out over devices with `keras.distribution` (JAX).

On the JAX backend an array trains under Keras's own distribution API,
as a stock model does:

* `keras.distribution.DataParallel(devices)`: every device holds the whole
  array and a slice of each batch;
* `ModelAxisParallel(num_models, devices)` (a `keras.distribution.
  ModelParallel`): the model axis `B` of every `[B, ...]` variable (each
  model's weights, optimizer slots, per-model hyper-parameters and
  metrics) is split over the devices, so that each device holds and trains
  `B / devices` whole models; with a `"batch"` axis in the mesh, each
  batch is split too.

Set the distribution before the array is made (its variables are placed
when they are created): `keras.distribution.set_distribution(...)`, or
build the array inside `distribution.scope()`. On a TPU pod slice, call
`keras.distribution.initialize()` first on every host.
`distribution_from_name` builds either from a launcher's flag.
"""

import keras

# The mesh axes `ModelAxisParallel` uses.
BATCH_AXIS = "batch"
MODELS_AXIS = "models"


def _devices(devices):
    """`devices`, or every device Keras sees."""
    if devices is None:
        devices = keras.distribution.list_devices()
    if not devices:
        raise ValueError("Keras lists no devices to lay the array out on.")
    return list(devices)


class ModelAxisParallel(keras.distribution.ModelParallel):
    """Splits the model axis of an array of `num_models` models over
    devices, and optionally each batch.

    Args:
        num_models: the `B` of the arrays made under this distribution; it
            must be a multiple of `model_devices`.
        devices: the devices (`keras.distribution.list_devices()` by
            default).
        model_devices: over how many devices the models are split (all of
            them by default); the others (`len(devices) / model_devices`)
            split each batch.
        layout_map: a `keras.distribution.LayoutMap` on a mesh of axes
            `("batch", "models")` for variables without the model axis, or
            None (they are replicated).

    Raises:
        ValueError: where `model_devices` does not divide the device count,
            or `num_models` is not a multiple of `model_devices`.
    """

    def __init__(self, num_models, devices=None, model_devices=None,
                 layout_map=None):
        devices = _devices(devices)
        model_devices = len(devices) if model_devices is None else int(
            model_devices)
        if model_devices < 1 or len(devices) % model_devices:
            raise ValueError(
                f"model_devices={model_devices} must divide the "
                f"{len(devices)} devices (each of the "
                f"{len(devices)} // model_devices batch slices holds every "
                "model once). Pass a divisor of the device count.")
        if num_models % model_devices:
            raise ValueError(
                f"An array of num_models={num_models} models cannot be "
                f"split evenly over {model_devices} devices: each device "
                "holds B / devices whole models. Use a multiple of "
                f"{model_devices} models, or model_devices= a divisor of "
                f"{num_models}.")
        self.num_models = num_models
        if layout_map is None:
            mesh = keras.distribution.DeviceMesh(
                (len(devices) // model_devices, model_devices),
                (BATCH_AXIS, MODELS_AXIS), devices)
            layout_map = keras.distribution.LayoutMap(mesh)
        super().__init__(layout_map=layout_map, batch_dim_name=BATCH_AXIS)

    @property
    def model_devices(self):
        """Over how many devices the model axis is split."""
        mesh = self.device_mesh
        return mesh.shape[mesh.axis_names.index(MODELS_AXIS)]

    def get_variable_layout(self, variable):
        """The layout map's layout of `variable` where it gives one, else
        its model axis split over the `"models"` mesh axis where it has
        one, else replicated."""
        layout = self._layout_map[variable.path]
        if layout is not None or getattr(variable, "_layout", None):
            return super().get_variable_layout(variable)
        shape = tuple(variable.shape)
        if shape and shape[0] == self.num_models:
            return keras.distribution.TensorLayout(
                (MODELS_AXIS,) + (None,) * (len(shape) - 1),
                self.device_mesh)
        return super().get_variable_layout(variable)

    def get_config(self):
        return {"num_models": self.num_models,
                "model_devices": self.model_devices}


DISTRIBUTIONS = ("auto", "data", "models", "none")


def distribution_from_name(name, num_models, devices=None):
    """The `keras.distribution` called `name` for an array of
    `num_models` models, or None (one device).

    Args:
        name: `"data"` (`keras.distribution.DataParallel`), `"models"`
            (`ModelAxisParallel` over all devices), `"none"`, or `"auto"`:
            the models split over the devices where there are several and
            they divide `num_models`, each batch split where they do not,
            none on one device.
        num_models: the array's `B`.
        devices: as for `ModelAxisParallel`.
    """
    if name not in DISTRIBUTIONS:
        raise ValueError(
            f"Unknown distribution {name!r}: expected one of "
            f"{', '.join(DISTRIBUTIONS)}.")
    devices = _devices(devices)
    if name == "none" or (name == "auto" and len(devices) == 1):
        return None
    if name == "data" or (name == "auto" and num_models % len(devices)):
        return keras.distribution.DataParallel(devices=devices)
    if num_models % len(devices):
        raise ValueError(
            f"The distribution 'models' splits the models over all "
            f"{len(devices)} devices, which num_models={num_models} models "
            f"cannot be split evenly over. Use a multiple of {len(devices)} "
            "models, 'auto' or 'data' (each batch split over the devices), "
            "or hftatf.distribution.ModelAxisParallel(num_models, "
            "model_devices=...) with a divisor of both.")
    return ModelAxisParallel(num_models, devices)


def check_distribution(num_models):
    """Raises where the `keras.distribution` set now splits a model axis of
    another size than `num_models` (an array made outside its scope)."""
    distribution = keras.distribution.distribution()
    if (isinstance(distribution, ModelAxisParallel)
            and num_models != distribution.num_models):
        raise ValueError(
            f"The array holds {num_models} models, but the distribution "
            f"set splits the model axis of arrays of num_models="
            f"{distribution.num_models} over "
            f"{distribution.model_devices} devices. Make the array and the "
            "distribution with the same number of models (a multiple of "
            "the model devices).")


def check_batch_split(what, size, batch_size):
    """Raises where the `keras.distribution` set splits each batch over
    devices and a batch of `size` samples (`sample_count`; None where
    unknown) in batches of `batch_size` (Keras's 32 by default) cannot be
    split evenly over them. JAX would fail at that batch, a last partial
    one after the others trained, with an error that names no fix."""
    devices = _batch_devices(keras.distribution.distribution())
    if devices <= 1 or size is None:
        return
    batch_size = batch_size or 32
    last = size % batch_size
    bad = (batch_size if batch_size % devices
           else last if last % devices else None)
    if bad is None:
        return
    raise ValueError(
        f"The keras.distribution set splits each batch over {devices} "
        f"devices, but {what} has a batch of {bad} samples ({size} samples "
        f"in batches of {batch_size}), which cannot be split evenly. Use a "
        f"batch_size that is a multiple of {devices} and a number of "
        f"samples that leaves a last batch that is one too (or none), or "
        "hftatf.distribution.ModelAxisParallel over all devices, which "
        "splits the models instead of the batch.")


def _batch_devices(distribution):
    """Over how many devices `distribution` splits each batch (1 for
    none)."""
    mesh = getattr(distribution, "device_mesh", None)
    name = getattr(distribution, "batch_dim_name", None)
    if mesh is None or name not in mesh.axis_names:
        return 1
    return mesh.shape[mesh.axis_names.index(name)]


def sample_count(x):
    """The number of samples of array-like `x` (or a structure of them);
    None for a dataset or generator, whose batches say it themselves."""
    leaves = keras.tree.flatten(x) if x is not None else []
    shape = getattr(leaves[0], "shape", None) if leaves else None
    if shape is None or not len(shape) or shape[0] is None:
        return None
    return int(shape[0])
