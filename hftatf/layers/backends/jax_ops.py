"""The fused layers' operations on JAX (see `hftatf.layers.backends`), as
stock Keras computes on JAX: everything compiled by XLA, embedding
gradients dense, no graph to inspect. Other backends Keras runs on take
them too; only the grouped transposed convolution needs JAX itself."""

import contextlib

import keras
from keras import ops

from hftatf.core import compat
from hftatf.core.axis import fold_models, swap_model_axis, unfold_models


def compiling_with_xla():
    """JAX compiles every computation with XLA, traced or eager."""
    return True


def runs_on_accelerator():
    """Whether the first device Keras distributes over is a GPU or TPU."""
    device = keras.distribution.list_devices()[0]
    return device.split(":")[0].lower() in ("gpu", "tpu")


def gather_clamps_ids():
    """`jnp.take` fills the rows of out-of-range ids (with NaN), as the stock
    `Embedding` on JAX, and drops them from the gradient."""
    return False


def batch_matmul(a, b, adjoint_a=False, adjoint_b=False):
    """`a @ b` for `a` `[..., M, K]` and `b` `[..., K, N]`, each operand
    transposed first where its adjoint flag is set (real dtypes only)."""
    if adjoint_a:
        a = ops.swapaxes(a, -1, -2)
    if adjoint_b:
        b = ops.swapaxes(b, -1, -2)
    return ops.matmul(a, b)


def run_with_xla(function, *args):
    """`function(*args)`: XLA compiles it with the rest."""
    return function(*args)


def conv_transpose_grouped(inputs, kernel, output_shape, strides, padding,
                           dilation_rate):
    """The transposed convolution of `inputs` (`[batch, *spatial, G * C]`)
    by `kernel` (`[*k, F, G * C]`) to `output_shape` (`[batch,
    *new_spatial, G * F]`), group `g` of the channels by its own `[*k, F,
    C]` slice: the gradient with respect to its input of the grouped
    convolution of `kernel`, as TensorFlow defines a transposed
    convolution (`jax.lax.conv_transpose` takes no groups)."""
    import jax

    def convolve(outputs):
        return ops.conv(outputs, kernel, strides, padding,
                        dilation_rate=dilation_rate)

    _, transpose = jax.vjp(convolve, ops.zeros(output_shape, inputs.dtype))
    return transpose(inputs)[0]


def adds_vectors_as_biases():
    """`keras.ops.add` on JAX broadcasts, as NumPy does."""
    return False


def with_unknown_batch(folded):
    """`folded`: no backend but TensorFlow adds a column as a bias."""
    return folded


def dropout_models_first(layer, inputs, num_models, training):
    """The stock `Dropout` `layer` on `inputs` with the models first, `[B,
    batch, ...]`: the stock layer on the batch folded with the models
    second, so each model draws the mask it draws in that layout."""
    folded = fold_models(swap_model_axis(inputs))
    return swap_model_axis(unfold_models(
        layer(folded, training=training), num_models))


def look_up(embeddings, ids):
    """`embeddings` (`[B, input_dim, output_dim]`) flattened to
    `[B * input_dim, output_dim]`, at the flat `ids`; a dense gradient, as
    the stock `Embedding` on JAX takes."""
    rows = embeddings.shape[0] * embeddings.shape[1]
    return ops.take(ops.reshape(embeddings, (rows, embeddings.shape[2])),
                    ids, axis=0)


def holds_outside_state(value):
    """JAX arrays are values: a layer's state outside Keras variables would
    be a TensorFlow variable, which a layer on JAX does not use."""
    del value
    return False


def executing_eagerly():
    """Whether ops run now: inside `jax.jit` (or another trace) every op,
    even on constants, is staged as a tracer."""
    import jax

    return not isinstance(ops.zeros(()), jax.core.Tracer)


def custom_gradient(function):
    """`keras.ops.custom_gradient`: JAX keeps nothing once a trace is
    done."""
    return ops.custom_gradient(function)


def init_scope():
    """JAX variables are made outside any trace already."""
    return contextlib.nullcontext()


def trace(function, specs):
    """Traces `function` on symbolic tensors of `specs` (Keras tensors'
    shapes and dtypes), without running it."""
    compat.compute_output_spec(function, *specs)


def read_after_assignment(value, read):
    """What a trainable weight read `read` gives after a call assigns it
    `value`: `value` itself. Stock Keras on JAX differentiates through the
    computation of `value` (a variable is a value of the step there), and
    its step keeps no assignment of a trainable weight."""
    del read
    return value
