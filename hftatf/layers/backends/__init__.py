"""The fused layers' operations that differ per Keras backend, as Keras
keeps its own per backend (`keras/src/backend/<name>/`).

Every module here implements the same functions; this package exports the
one of the backend Keras runs on (fixed when Keras is imported):

    compiling_with_xla   whether the computation being traced is compiled
                         by XLA (always on JAX)
    runs_on_accelerator  whether it runs on a GPU or TPU
    gather_clamps_ids    whether an out-of-range row id of a gather is
                         clamped (TensorFlow under XLA) rather than filled
    batch_matmul         `a @ b` with adjoint flags, on the kernel the
                         device runs fastest
    run_with_xla         a function run compiled by XLA
    conv_transpose_grouped
                         a transposed convolution of `groups` groups
    adds_vectors_as_biases
                         whether `keras.ops.add` adds an operand that
                         squeezes to a vector as a bias on axis 1 or -1
                         where that axis has its length (TensorFlow's
                         `bias_add`), rather than broadcasting it
    with_unknown_batch   a traced tensor whose batch size is left unknown
    dropout_models_first a stock `Dropout` on `[B, batch, ...]`, drawing
                         the masks it draws with the models second
    look_up              rows of a `[B, rows, n]` table flattened, with the
                         stock layer's gradient (sparse on TensorFlow)
    holds_outside_state  whether a layer attribute is state kept outside
                         Keras variables
    executing_eagerly    whether ops run now (no graph is being traced)
    trace                a function traced on symbolic tensors, never
                         run (to find what it would assign)
    init_scope           a block whose variables are made outside any
                         traced graph
    custom_gradient      a function with a gradient of its own (TensorFlow
                         lets each traced graph go, see
                         `hftatf.core.tensorflow_compat.custom_gradient`)
    read_after_assignment
                         what reads of a trainable weight give after a
                         call assigns it, differentiated as stock Keras
                         differentiates them

TensorFlow's module holds its CPU-kernel choices and sparse gradients; the
JAX module (any other backend too) computes as stock Keras on that backend
computes, with `keras.ops`.
"""

import keras

if keras.backend.backend() == "tensorflow":
    from hftatf.layers.backends import tensorflow_ops as _backend
else:
    from hftatf.layers.backends import jax_ops as _backend

compiling_with_xla = _backend.compiling_with_xla
runs_on_accelerator = _backend.runs_on_accelerator
gather_clamps_ids = _backend.gather_clamps_ids
batch_matmul = _backend.batch_matmul
run_with_xla = _backend.run_with_xla
conv_transpose_grouped = _backend.conv_transpose_grouped
adds_vectors_as_biases = _backend.adds_vectors_as_biases
with_unknown_batch = _backend.with_unknown_batch
dropout_models_first = _backend.dropout_models_first
look_up = _backend.look_up
holds_outside_state = _backend.holds_outside_state
executing_eagerly = _backend.executing_eagerly
trace = _backend.trace
init_scope = _backend.init_scope
custom_gradient = _backend.custom_gradient
read_after_assignment = _backend.read_after_assignment
