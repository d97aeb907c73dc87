"""Training an array in passes of a few models at a time.

By default an array's training step computes its B models in one pass: one
fused op per layer, over all models at once. That is what fills an
accelerator. On a CPU it can lose: when one model's activations already
outgrow the processor's last-level cache (a PointNet, a Transformer), B
models' outgrow it B times over, every fused op streams them from memory,
and XLA's CPU code for batched per-model products adds transposes around
them. The step can instead compute the models in passes of
`models_per_pass`: the same fused layers, built for that many models, run on
their slices of the array's weights and state, one pass after the other,
inside the one compiled step.

Every model computes exactly what it computes in one pass: its weights,
inputs, labels, losses and gradients are its own either way; only the order
of the work changes. Per kind of state:

* weights and per-model state (`[B, ...]`, e.g. moving statistics): each pass
  reads and updates its models' slice;
* state without a model axis (random seed generators): carried from pass to
  pass, so every pass draws fresh randomness, as B separate jobs would;
* the optimizer step: one, after the last pass, for the whole array.

The passes are traced one after the other, so a step's graph grows with
their number, and so does the time XLA takes to compile it. Where a step is
compiled with XLA, three or more passes of the same size run instead as one
`tf.while_loop` over a pass traced once (`looped_passes`): the first pass
is traced on its own, and its outputs give the dtypes and shapes that every
pass writes at its index of a `tf.TensorArray`; a shorter last pass is
traced after the loop. (Random draws inside the loop take their keys
straight from their seeds, `hftatf.seeds`: XLA's CPU code recomputed the
seed's hash for every number drawn there, which made Transformer arrays
with dropout 5x slower.) Without XLA the loop measured no faster per step
(0.97-0.98x for a Transformer, 1.00-1.02x for PointNet), so passes stay
traced one by one there.

`compile(models_per_pass="auto")` (the default) uses passes only where they
were measured to pay (`benchmarks/README.md`): on a CPU, in a step compiled
with XLA or for an array without convolutions (with or without XLA), a pass
holds as many models as fit their activations together in the cache
(the last-level cache's share of the cores the process runs on), at least
one. Everywhere else the array is one pass,
and so it is where no array of fewer models can be built from the array's
config (a subclass whose constructor takes more than its config holds).
Evaluation and prediction run in one pass: passes measured no faster
there.
"""

import glob
import logging
import os
import re

import keras
import numpy as np
from keras import ops

from hftatf import sparse
from hftatf.core import compat
from hftatf.core.axis import take_models
from hftatf.core.devices import runs_on_accelerator

# Assumed when the system does not say (a common server CPU's L3).
DEFAULT_CACHE_BYTES = 32 * 2**20
# The most cache one core is credited with. Server CPUs have 1.5-4 MiB of
# last-level cache per core (a few cache-stacked parts more), but a virtual
# machine may report its host's whole L3 as shared by its few cores alone
# (480 MiB for 2 cores, measured): the share of a process's cores is what
# its passes can count on.
MAX_CACHE_BYTES_PER_CORE = 4 * 2**20
# Assumed when the training step's batch size is not static.
DEFAULT_BATCH_SIZE = 32

_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}


def last_level_cache_bytes():
    """The size of this machine's largest CPU cache in bytes (Linux
    `/sys`), or `DEFAULT_CACHE_BYTES` where it cannot be read."""
    sizes = []
    for path in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        try:
            with open(path) as file:
                text = file.read().strip()
        except OSError:
            continue
        match = re.fullmatch(r"(\d+)\s*([KMG]?)", text)
        if match:
            sizes.append(int(match.group(1)) * _UNITS[match.group(2)])
    return max(sizes, default=DEFAULT_CACHE_BYTES)


def usable_cores():
    """The number of CPU cores this process's operations run on: those it
    may run on, at most TensorFlow's intra-op threads where they are set
    (`tf.config.threading.set_intra_op_parallelism_threads`)."""
    import tensorflow as tf

    if hasattr(os, "sched_getaffinity"):
        cores = len(os.sched_getaffinity(0))
    else:
        cores = os.cpu_count() or 1
    threads = tf.config.threading.get_intra_op_parallelism_threads()
    return max(1, min(cores, threads) if threads > 0 else cores)


def cache_bytes():
    """The cache the models of one pass can share: the last-level cache,
    at most `MAX_CACHE_BYTES_PER_CORE` per core this process may use."""
    return min(last_level_cache_bytes(),
               usable_cores() * MAX_CACHE_BYTES_PER_CORE)


def activation_bytes_per_model(array, batch_size):
    """Bytes of the layer outputs one model of `array` produces (or reads,
    for tensors all models share) in a forward pass of `batch_size`
    samples: the working set a training step keeps per model for its
    backward pass."""
    total = 0
    for layer in compat.inner_layers(array, include_self=False):
        for node in compat.inbound_nodes(layer):
            for tensor in keras.tree.flatten(node.output_tensors):
                shape = tuple(tensor.shape)[1:]
                if getattr(layer, "models_first", False):
                    shape = shape[1:]  # [B, batch, ...]: one model's slice
                elif shape and shape[0] == array.num_models:
                    shape = shape[1:]  # [batch, B, ...]: one model's slice
                if None in shape or tensor.dtype == "string":
                    continue  # (text holds no numbers a pass computes on)
                total += int(np.prod(shape)) * np.dtype(
                    tensor.dtype).itemsize
    return total * batch_size


def auto_models_per_pass(array, batch_size):
    """Models per pass for `models_per_pass="auto"` where it uses passes:
    as many as fit their activations in the cache (`cache_bytes`), at
    least one, at most all."""
    per_model = activation_bytes_per_model(
        array, batch_size or DEFAULT_BATCH_SIZE)
    fitting = cache_bytes() // max(per_model, 1)
    return int(min(array.num_models, max(1, fitting)))


def check_models_per_pass(value, num_models):
    """Validates `compile(models_per_pass=...)`."""
    if value is None or (isinstance(value, str) and value == "auto"):
        return value
    if isinstance(value, (bool, np.bool_)) or not isinstance(
            value, (int, np.integer)) or not 1 <= value <= num_models:
        raise ValueError(
            "`models_per_pass` must be 'auto', None (all models in one pass) "
            f"or an integer in [1, num_models={num_models}]. Received: "
            f"models_per_pass={value!r}.")
    return int(value)


def bounds(num_models, per_pass):
    """`(start, stop)` of each pass's models."""
    return [(start, min(start + per_pass, num_models))
            for start in range(0, num_models, per_pass)]


class PassModels:
    """The arrays of fewer models that run an array's passes, by model
    count: built once, they own no state of their own that training uses
    (each pass runs on slices of the full array's variables). Kept in a
    plain object so that Keras does not track them as the array's layers.
    """

    def __init__(self):
        self.models = {}


def variable_roles(full, part, count):
    """For each pair of `full` (the array's) and `part` (a pass array's)
    variables: True if it carries the model axis (sliced per pass), False
    if it is the same for all models (carried through the passes)."""
    if len(full) != len(part):
        raise ValueError(
            f"An array of {count} models built for a pass holds "
            f"{len(part)} variables where the array holds {len(full)}; "
            "use models_per_pass=None for this array.")
    roles = []
    for a, b in zip(full, part):
        whole, sliced = tuple(a.shape), tuple(b.shape)
        if whole == sliced:
            roles.append(False)
        elif whole[1:] == sliced[1:] and sliced[:1] == (count,):
            roles.append(True)
        else:
            raise ValueError(
                f"Variable '{a.path}' of shape {whole} has no model axis "
                f"matching '{b.path}' of shape {sliced} in a pass of "
                f"{count} models; use models_per_pass=None for this array.")
    return roles


def pass_values(values, roles, start, count):
    """Values for the pass of models `start:start + count`: the slices of
    those that carry the model axis (`variable_roles`), the others whole."""
    return [take_models(value, start, count) if sliced else value
            for value, sliced in zip(values, roles)]


def looped_passes(spans):
    """How many of the passes in `spans`, from the first, a training step
    runs as one loop (0 for none): those with as many models as the first,
    where there are at least three. The first is traced on its own before
    the loop (its outputs give the dtypes and shapes the loop writes), so
    a loop over fewer would trace as much as the passes themselves."""
    count = spans[0][1] - spans[0][0]
    same = 0
    while same < len(spans) and spans[same][1] - spans[same][0] == count:
        same += 1
    return same if same >= 3 else 0


def pass_outputs(part):
    """The tensors a pass (`FusedModel._one_pass`) ends with: its losses
    and gradients, for the next pass to wait on."""
    _, _, losses, gradients, _ = part
    return [g for g in gradients if g is not None] + [losses]


def spread_losses(losses, start, num_models):
    """The `[num_models]` vector holding a pass's `[count]` losses at its
    models' places and zeros elsewhere, for the optimizer's per-model loss
    scaling."""
    import tensorflow as tf

    count = losses.shape[0]
    if isinstance(start, int):
        return ops.concatenate([
            ops.zeros((start,), losses.dtype), losses,
            ops.zeros((num_models - start - count,), losses.dtype)])
    indices = tf.reshape(tf.cast(start, tf.int32) + tf.range(count), (-1, 1))
    return tf.scatter_nd(indices, losses, (num_models,))


def stacked(template, num_passes):
    """A `tf.TensorArray` for one tensor like `template` per pass."""
    import tensorflow as tf

    return tf.TensorArray(template.dtype, size=num_passes,
                          element_shape=template.shape)


def joined(array):
    """The passes' tensors in `array` (`stacked`) joined on their first
    axis: `[n, count, ...]` becomes `[n * count, ...]` (one copy)."""
    import tensorflow as tf

    joined = array.stack()
    shape = tf.shape(joined)
    merged = tf.reshape(joined, tf.concat([[-1], shape[2:]], axis=0))
    static = joined.shape
    models = (None if static[0] is None or static[1] is None
              else static[0] * static[1])
    merged.set_shape(tf.TensorShape([models]).concatenate(static[2:]))
    return merged


def concat_gradients(parts, starts, shape):
    """One `[B, ...]` gradient from the passes' `[k, ...]` ones (None where
    no pass has one). Sparse ones (`hftatf.sparse`) stay sparse: their
    rows move by each pass's first model."""
    import tensorflow as tf

    if all(g is None for g in parts):
        return None
    rows = {sparse.rows_per_model(g, shape) for g in parts
            if sparse.is_sparse(g)}
    if rows:
        (rows,) = rows
        some = next(g for g in parts if sparse.is_sparse(g))
        tail = tuple(shape[len(shape) - len(some.values.shape) + 1:])
        dtype = some.indices.dtype
        values, indices = [], []
        for gradient, start in zip(parts, starts):
            if gradient is None:
                continue
            if not sparse.is_sparse(gradient):
                gradient = tf.reshape(gradient, (-1,) + tail)
                gradient = tf.IndexedSlices(
                    gradient, tf.range(tf.shape(gradient)[0],
                                       dtype=dtype),
                    tf.shape(gradient, out_type=tf.int64))
            values.append(gradient.values)
            indices.append(gradient.indices + ops.cast(
                start * rows, gradient.indices.dtype))
        return tf.IndexedSlices(
            tf.concat(values, 0), tf.concat(indices, 0),
            dense_shape=tf.constant((shape[0] * rows,) + tail, tf.int64))
    return ops.concatenate(parts, axis=0)


class PassPlanning:
    """Mixin of `FusedModel`: how many models a pass of its training step
    computes (`compile(models_per_pass=...)`), decided once per `compile`.

    Reads `_models_per_pass` (the `compile` setting),
    `_resolved_models_per_pass` (None until decided), `_pass_models` and
    the backend trainer's `_built_pass_model`.
    """

    @property
    def models_per_pass(self):
        """Models per forward and backward pass of the training step: the
        `compile` setting, resolved (`"auto"` to a number) once a training
        step has been traced."""
        if self._resolved_models_per_pass is not None:
            return self._resolved_models_per_pass
        if self._models_per_pass is None:
            return self.num_models
        return self._models_per_pass

    def _models_per_pass_for(self, x):
        """The resolved `models_per_pass` (decided once per `compile`)."""
        if self._resolved_models_per_pass is None:
            setting = self._models_per_pass
            if setting is None:
                count = self.num_models
            elif setting != "auto":
                count = setting
            elif (not self.AUTO_PASSES or self._distributed()
                  or runs_on_accelerator()
                  or self._weights_assigned_in_training()
                  # Convolutional arrays without XLA: passes measured no
                  # faster (benchmarks/README.md).
                  or (not self.jit_compile and self._has_convolutions())):
                count = self.num_models
            else:
                count = self._checked_auto_models_per_pass(
                    auto_models_per_pass(
                        self, keras.tree.flatten(x)[0].shape[0]))
            self._resolved_models_per_pass = count
        return self._resolved_models_per_pass

    def _checked_auto_models_per_pass(self, count):
        """`count`, or all models if an array of `count` models cannot be
        built from this array's config (e.g. a subclass whose constructor
        takes more than its config holds): `"auto"` only speeds up."""
        if count >= self.num_models:
            return count
        try:
            for size in {stop - start for start, stop in bounds(
                    self.num_models, count)}:
                self._pass_model(size)
        except (ValueError, TypeError, NotImplementedError) as error:
            logging.info(
                "Array '%s' trains in one pass: an array of %d of its models "
                "cannot be built for passes (%s).", self.name, count, error)
            return self.num_models
        return count

    def _pass_model(self, count):
        """The array of `count` models whose layers run a pass (made by
        the backend trainer's `_built_pass_model`), and the role of each
        variable (`variable_roles`)."""
        if count not in self._pass_models.models:
            self._pass_models.models[count] = self._built_pass_model(count)
        model = self._pass_models.models[count]
        for layer, twin in zip(
                compat.inner_layers(self, include_self=False),
                compat.inner_layers(model, include_self=False)):
            twin.trainable = layer.trainable
        roles = (variable_roles(self.trainable_variables,
                                model.trainable_variables, count),
                 variable_roles(self.non_trainable_variables,
                                model.non_trainable_variables, count))
        return model, roles

    def _loops_passes(self):
        """Whether the step runs its passes of equal size as a loop
        (`passes.looped_passes`): where it is compiled with XLA, which then
        compiles one pass instead of each. Not for arrays of several
        outputs: a loop's passes share one compiled loss, so they cannot
        update each model's own per-output loss trackers."""
        return bool((self.jit_compile is True or self._replica_jit_compile)
                    and len(keras.tree.flatten(self.outputs)) == 1)
