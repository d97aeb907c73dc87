"""Whether a computation treats every sample of its batch on its own, as
one folded over the models must (a raw `keras.ops` node, a `Lambda`)."""

import contextlib
import random

import keras
import numpy as np
from keras import ops

from hftatf.core import compat
from hftatf.layers.backends import executing_eagerly

# Stock layers without weights that treat every sample on its own.


# What to tell a user whose operation or `Lambda` mixes the samples.
PER_SAMPLE_ADVICE = (
    "Folded over the models, it would mix the models' samples. Compute it "
    "per sample, or in a layer of its own (hftatf runs a layer without a "
    "fused form once per model, on that model's batch: "
    "hftatf.layers.FusedPerModel).")

# The shape probe's batch sizes: two, so that a size taken from the batch
# shows as one that changes.
_SHAPE_PROBE_BATCHES = (7, 11)
# The size the value probe gives axes of unknown size, and the most values
# it draws (beyond, it cannot tell cheaply).
_VALUE_PROBE_SIZE = 5
_VALUE_PROBE_LIMIT = 2**24


def sample_mixing(call, output_spec, arguments):
    """How `call` reaches across the batch axis, in words, or None where it
    treats every sample on its own, as a computation folded over the models
    must (a raw `keras.ops` node, a `Lambda`'s function).

    Two probes, each refusing nothing where it cannot tell:

    * shapes: `output_spec` (the call's `compute_output_spec`) at two batch
      sizes; every output must keep that batch size first and its other
      axes (a transpose, an `einsum` or an index of the batch axis, a
      reshape of the whole batch fail). A spec that fails tells nothing.
    * values: `call` on a batch of two random float samples, then with
      either sample drawn anew; the other sample's result must not
      change. Inputs that are not float (indices, masks), a call that
      fails and a call that draws random numbers (two calls differ:
      dropout, noise) tell nothing.

    Args:
        call: the computation, called as `call(*args, **kwargs)`.
        output_spec: its `compute_output_spec`, called alike.
        arguments: `(args, kwargs)` of the stock call, with a
            `keras.KerasTensor` of the stock shape (batch first) for every
            tensor.
    """
    return (_shape_mixing(output_spec, arguments)
            or _value_mixing(call, arguments))


def _with_batch(arguments, batch):
    """`arguments` with every `keras.KerasTensor` given the batch size
    `batch`."""
    def resize(x):
        if isinstance(x, keras.KerasTensor) and x.shape:
            return keras.KerasTensor((batch, *x.shape[1:]), dtype=x.dtype,
                                     sparse=x.sparse)
        return x

    return keras.tree.map_structure(resize, arguments)


def _shape_mixing(output_spec, arguments):
    """The shape probe of `sample_mixing`."""
    found = []
    for batch in _SHAPE_PROBE_BATCHES:
        args, kwargs = _with_batch(arguments, batch)
        try:
            spec = output_spec(*args, **kwargs)
        except Exception:
            # A spec that cannot take the probe tells nothing.
            return None
        shapes = [tuple(t.shape) for t in keras.tree.flatten(spec)
                  if isinstance(t, keras.KerasTensor)]
        for shape in shapes:
            if not shape or shape[0] not in (batch, None):
                return (f"does not keep the batch axis first: on a batch of "
                        f"{batch} it returns shape {shape}")
        found.append(shapes)
    small, large = found
    if [s[1:] for s in small] != [s[1:] for s in large]:
        return (f"sizes other axes of its output by the batch: it returns "
                f"shape {small[0] if len(small) == 1 else small} on a batch "
                f"of {_SHAPE_PROBE_BATCHES[0]} and "
                f"{large[0] if len(large) == 1 else large} on a batch of "
                f"{_SHAPE_PROBE_BATCHES[1]}")
    return None


def _value_mixing(call, arguments):
    """The value probe of `sample_mixing`: on a batch of two random
    samples, then with either sample drawn anew, the other sample's result
    must stay (a batch of one size throughout, so that a `squeeze` of axes
    of size one does what it does in the stock model)."""
    tensors = [x for x in keras.tree.flatten(arguments)
               if isinstance(x, keras.KerasTensor)]
    if not tensors or not executing_eagerly() or any(
            not x.shape or x.sparse or not keras.backend.is_float_dtype(
                x.dtype) for x in tensors):
        return None
    # Three random samples of each input, of both signs.
    shapes = [(3, *(_VALUE_PROBE_SIZE if d is None else d
                    for d in x.shape[1:])) for x in tensors]
    if sum(int(np.prod(shape)) for shape in shapes) > _VALUE_PROBE_LIMIT:
        return None
    rng = np.random.default_rng(0)
    draws = [rng.random(shape, dtype=np.float32) * 4 - 2 for shape in shapes]

    def run(samples):
        """`call` on the batch of the drawn `samples` of every input."""
        values = iter([ops.convert_to_tensor(draw[samples], dtype=x.dtype)
                       for x, draw in zip(tensors, draws)])
        args, kwargs = keras.tree.map_structure(
            lambda x: next(values) if isinstance(x, keras.KerasTensor)
            else x, arguments)
        return [ops.convert_to_numpy(y if keras.backend.standardize_dtype(
            y.dtype) == "float64" else ops.cast(y, "float32"))
                for y in keras.tree.flatten(call(*args, **kwargs))
                if ops.is_tensor(y)]

    # Sample 0 with sample 1 drawn anew, and sample 1 with sample 0.
    kept = {0: [0, 2], 1: [2, 1]}
    with _random_state_kept():
        try:
            outputs = run([0, 1])
            if not _all_close(outputs, run([0, 1]), tensors):
                # It draws random numbers: nothing to compare.
                return None
            changed = {i: run(samples) for i, samples in kept.items()}
        except Exception:
            # A call that cannot take random inputs tells nothing.
            return None
    for output in outputs:
        if output.ndim == 0 or output.shape[0] != 2:
            return (f"does not keep the batch axis first: on a batch of 2 "
                    f"it returns shape {tuple(output.shape)}")
    for i, others in changed.items():
        if not _all_close([y[i] for y in others], [y[i] for y in outputs],
                          tensors):
            return (f"computes a sample's result from the other samples of "
                    f"its batch too (on random inputs, sample {i}'s result "
                    f"changes where the other sample of its batch of 2 "
                    f"changes)")
    return None


def _all_close(ours, theirs, tensors):
    """Whether the outputs `ours` and `theirs` agree to the precision of
    the inputs `tensors`, relative to each output's largest value."""
    half = any(keras.backend.standardize_dtype(x.dtype) in (
        "float16", "bfloat16") for x in tensors)
    rtol = 1e-2 if half else 1e-5
    if len(ours) != len(theirs):
        return False
    for a, b in zip(ours, theirs):
        if a.shape != b.shape:
            return False
        if np.array_equal(a, b, equal_nan=True):
            continue
        finite = np.abs(b[np.isfinite(b)])
        scale = finite.max() if finite.size and finite.max() > 0 else 1.0
        if not np.allclose(a, b, rtol=0, atol=rtol * scale, equal_nan=True):
            return False
    return True


@contextlib.contextmanager
def _random_state_kept():
    """Leaves the random state that a probe's calls may draw from (Python's,
    and Keras's global seed generator, which unseeded draws advance) as it
    was: probing must not change what the layers fused after it draw."""
    python_state = random.getstate()
    generator = compat.global_seed_generator()
    seed_state = None if generator is None else ops.convert_to_numpy(
        generator.state)
    try:
        yield
    finally:
        random.setstate(python_state)
        if generator is None:
            compat.reset_global_seed_generator()
        else:
            generator.state.assign(seed_state)


def check_lambda_acts_per_sample(layer):
    """Refuses the stock `Lambda` `layer` where its function reaches across
    the batch axis (`sample_mixing`, at every call of the layer in a
    graph): folded over the models, it would mix their samples."""
    for node in compat.inbound_nodes(layer):
        mixing = sample_mixing(
            layer.call, layer.compute_output_spec,
            (node.arguments.args, node.arguments.kwargs))
        if mixing:
            raise ValueError(
                f"hftatf cannot fuse layer '{layer.name}' (Lambda): its "
                f"function {mixing}. A Lambda, like a raw operation, runs "
                "on the samples of all models folded into one batch, so its "
                "function must treat every sample on its own. "
                f"{PER_SAMPLE_ADVICE}")
