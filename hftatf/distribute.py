"""Choosing the `tf.distribute` strategy an array trains under.

Arrays train under any strategy like stock Keras models: create the array
and compile it inside `strategy.scope()`. `strategy_from_name` builds the
usual ones from a string, as launchers take it from a flag, and fails fast
with a clear message where the hardware is missing (never a hang waiting
for a TPU that does not answer). Strategies are TensorFlow's, for Keras's
TensorFlow backend: TensorFlow is imported when one is made.
"""

import os
import socket
import urllib.parse

import keras

from hftatf.core.optional import tensorflow, tensorflow_backend
from hftatf.distribution import distribution_from_name

STRATEGIES = ("auto", "tpu", "mirrored", "cpu")

# How long to wait for a TPU worker's gRPC port before calling it
# unreachable.
CONNECT_TIMEOUT_S = 10.0


# On JAX, the `keras.distribution` (`hftatf.distribution`) each strategy
# name stands for.
JAX_DISTRIBUTIONS = {"auto": "auto", "tpu": "auto", "mirrored": "data",
                     "cpu": "none"}


def set_jax_distribution(name, num_models):
    """Sets, and returns, the `keras.distribution` that the strategy `name`
    stands for on JAX (`JAX_DISTRIBUTIONS`) for an array of `num_models`
    models (see `hftatf.distribution.distribution_from_name`).

    `"tpu"` first joins the hosts of a TPU pod slice
    (`keras.distribution.initialize()`, run by every host).

    Raises:
        ValueError: for an unknown name, hosts that cannot be joined, or
            devices that cannot hold the array that way.
    """
    if name not in STRATEGIES:
        raise ValueError(
            f"Unknown strategy {name!r}; expected one of "
            f"{', '.join(STRATEGIES)}.")
    if name == "tpu":
        try:
            keras.distribution.initialize()
        except (ValueError, RuntimeError) as error:
            raise ValueError(
                "Strategy 'tpu' on JAX joins the hosts of a TPU VM or pod "
                "slice (keras.distribution.initialize()), which failed "
                f"here: {str(error).rstrip('.')}. Run it on a TPU VM, on "
                "every host of the slice, or use strategy 'auto' on one "
                "machine.") from error
    distribution = distribution_from_name(JAX_DISTRIBUTIONS[name],
                                          num_models)
    keras.distribution.set_distribution(distribution)
    return distribution


def strategy_from_name(name="auto", tpu=None, zone=None, project=None,
                       num_models=1):
    """Returns the `tf.distribute.Strategy` called `name`.

    On the JAX backend, devices are Keras's to lay out: the name sets the
    `keras.distribution` it stands for (`JAX_DISTRIBUTIONS`; "auto" splits
    an array of `num_models` models over the devices where they divide
    it, see `hftatf.distribution.distribution_from_name`), and the
    strategy returned is TensorFlow's default one, under which `tf.data`
    input pipelines run as they are.

    Args:
        name: one of
            * `"tpu"`: a `TPUStrategy` on the TPU given by `tpu` (its name,
              a `grpc://host:port` address, or `"local"` on a TPU VM),
              connected and initialised;
            * `"mirrored"`: a `MirroredStrategy` over every local GPU (over
              the CPU where there is none);
            * `"cpu"`: a `OneDeviceStrategy` on the CPU;
            * `"auto"`: a TPU if `tpu` is given or this is a TPU VM, else
              mirrored over the GPUs if there are several, else the single
              GPU, else the CPU.
        tpu, zone, project: passed to `TPUClusterResolver` (`zone` and
            `project` only matter for a TPU given by name on Cloud).

    Raises:
        ValueError: for an unknown name, a TPU that cannot be reached, or a
            Keras backend other than TensorFlow.
        ImportError: where TensorFlow is not installed.
    """
    if name not in STRATEGIES:
        raise ValueError(
            f"Unknown strategy {name!r}; expected one of "
            f"{', '.join(STRATEGIES)}.")
    if keras.backend.backend() == "jax":
        set_jax_distribution(name, num_models)
        return tensorflow(
            "The tf.data input of a launcher").distribute.get_strategy()
    tf = _tensorflow(name)
    if name == "auto":
        if tpu is not None or _on_tpu_vm():
            return _tpu_strategy(tpu or "local", zone, project)
        gpus = tf.config.list_logical_devices("GPU")
        if len(gpus) > 1:
            return tf.distribute.MirroredStrategy()
        if gpus:
            return tf.distribute.OneDeviceStrategy(gpus[0].name)
        return tf.distribute.OneDeviceStrategy("/cpu:0")
    if name == "tpu":
        return _tpu_strategy(tpu, zone, project)
    if name == "mirrored":
        gpus = tf.config.list_logical_devices("GPU")
        if gpus:
            return tf.distribute.MirroredStrategy()
        cpus = [d.name for d in tf.config.list_logical_devices("CPU")]
        return tf.distribute.MirroredStrategy(cpus)
    return tf.distribute.OneDeviceStrategy("/cpu:0")


def _tensorflow(name):
    return tensorflow_backend(
        f"The tf.distribute strategy {name!r} (hftatf.distribute)")


def _on_tpu_vm():
    """Whether this machine has TPU chips attached (a TPU VM)."""
    return bool(os.environ.get("TPU_NAME")) or any(
        os.path.exists(path) for path in ("/dev/accel0", "/dev/vfio/0"))


def _tpu_strategy(tpu, zone, project):
    if tpu is None:
        tpu = os.environ.get("TPU_NAME")
    if tpu is None:
        raise ValueError(
            "strategy 'tpu' needs a TPU: pass tpu=<name>, "
            "tpu='grpc://host:port' or tpu='local' on a TPU VM (the "
            "launchers' --tpu flag), or set TPU_NAME.")
    if tpu == "local" and not _on_tpu_vm():
        raise ValueError(
            "tpu='local' asks for the TPU chips of this machine, but it has "
            "none (no /dev/accel* device). Run on a TPU VM, or pass the "
            "TPU's name or grpc:// address.")
    if tpu.startswith("grpc://"):
        _check_reachable(tpu)
    resolver = _tpu_resolver(tpu, zone, project)
    tf = _tensorflow("tpu")
    try:
        tf.config.experimental_connect_to_cluster(resolver)
        tf.tpu.experimental.initialize_tpu_system(resolver)
    except (ValueError, RuntimeError, tf.errors.OpError) as error:
        raise ValueError(
            f"Could not connect to the TPU {tpu!r}: {error}") from error
    return tf.distribute.TPUStrategy(resolver)


def _tpu_resolver(tpu, zone, project):
    """The `TPUClusterResolver` of `tpu`; a name that does not resolve is a
    ValueError naming it, not the bare network error of the resolver's
    look-up (off Cloud, the metadata server and the TPU API are not
    there)."""
    tf = _tensorflow("tpu")
    try:
        return tf.distribute.cluster_resolver.TPUClusterResolver(
            tpu=tpu, zone=zone, project=project)
    except (OSError, ValueError, RuntimeError) as error:
        where = ", ".join(f"{name}={value!r}" for name, value in
                          (("zone", zone), ("project", project)) if value)
        raise ValueError(
            f"The TPU {tpu!r} could not be resolved"
            f"{f' in {where}' if where else ''} ({error}). A TPU name is "
            "looked up on Google Cloud (pass zone= and project=, the "
            "launchers' --zone and --project, where the VM's own are not "
            "the TPU's); elsewhere pass tpu='grpc://host:port' of the TPU "
            "worker, or tpu='local' on a TPU VM.") from None


def _check_reachable(address):
    parsed = urllib.parse.urlparse(address)
    try:
        with socket.create_connection((parsed.hostname, parsed.port),
                                      timeout=CONNECT_TIMEOUT_S):
            pass
    except (OSError, TypeError, ValueError) as error:
        raise ValueError(
            f"The TPU worker at {address} is not reachable ({error}). Check "
            "the address and that the TPU is running.") from None
