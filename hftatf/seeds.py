"""Random draws in an array's training step: keys straight from their seeds.

Stock Keras draws every random number (dropout masks, noise) with a
stateless TensorFlow op: `tf.random.stateless_uniform(shape, seed)` first
hashes the `[2]` seed into a Philox key and counter
(`StatelessRandomGetKeyCounter`, one Philox block: about a hundred scalar
operations), then draws. Compiled with XLA for a CPU, the hash is fused
into the loop over the numbers drawn and recomputed for each of them: an
attention-dropout mask of 64 x 4 x 64 x 64 took 350 ms instead of 20 ms
inside a loop over passes (`hftatf.passes`), and a Transformer array's
step 10% longer where its passes were traced one by one.

An array's training step therefore draws with the seed's bits as the key
(`keys_from_seeds`) and counts from zero, as TensorFlow's ThreeFry draws
and JAX's keys do: Philox gives unrelated streams for distinct keys, and
every draw of a step has its own seed (a `keras.random.SeedGenerator`
advances with each), so masks stay independent between layers, steps,
passes and models. Only which numbers a seed draws changes: an array's
training step and a stock model's with the same seed drew different masks
already (an array draws one mask over the batches of all its models).
"""

import contextlib
import functools
import threading

from hftatf.core import tensorflow_compat
from hftatf.core.optional import tensorflow

# Philox's counter is two 64-bit words; ThreeFry uses the first.
_COUNTER_WORDS = 2
_lock = threading.RLock()
_depth = 0


@functools.cache
def _tensorflow_parts():
    """TensorFlow's module that turns a `[2]` seed into a key and counter
    for its stateless random ops, the function of it that does, the `alg`
    it hashes for (the default, "auto_select"), and the function that packs
    two 32-bit words into one 64-bit key. Any of the last three is None in
    a TensorFlow version without it: draws then keep the hash."""
    random_ops_util = tensorflow_compat.random_ops_util()
    return (random_ops_util,
            getattr(random_ops_util, "_get_key_counter", None),
            getattr(random_ops_util, "_uint32s_to_uint64", None),
            getattr(getattr(random_ops_util, "Algorithm", None),
                    "AUTO_SELECT", None))


def key_counter_from_seed(seed):
    """The key and counter a stateless draw takes from a `[2]` integer
    seed, without a hash: the seed's two 32-bit words as one 64-bit key,
    and a zero counter."""
    tf = tensorflow("Drawing with TensorFlow's stateless random ops")
    words = tf.cast(seed, tf.uint32)
    key = tf.reshape(_tensorflow_parts()[2](words), [1])
    return key, tf.zeros([_COUNTER_WORDS], tf.uint64)


def _key_counter(seed, alg):
    _, key_counter, _, auto_select = _tensorflow_parts()
    if alg == auto_select.value:
        return key_counter_from_seed(seed)
    return key_counter(seed, alg)


def supported():
    """Whether this TensorFlow lets `keys_from_seeds` change how draws
    take their keys."""
    return None not in _tensorflow_parts()[1:]


@contextlib.contextmanager
def keys_from_seeds():
    """Within this context, stateless random ops created with TensorFlow's
    default algorithm (every `keras.random` draw on the TensorFlow
    backend) take their key from their seed's bits
    (`key_counter_from_seed`) instead of hashing it. Use it around the
    tracing of a training step; a no-op where not `supported()`."""
    global _depth
    if not supported():
        yield
        return
    random_ops_util, key_counter = _tensorflow_parts()[:2]
    with _lock:
        if _depth == 0:
            random_ops_util._get_key_counter = _key_counter
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                random_ops_util._get_key_counter = key_counter
