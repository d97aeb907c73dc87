"""Helpers shared by the tests: the stock-Keras oracle and tolerances."""

import collections
import contextlib
import weakref

import keras
import numpy as np
import pytest

BACKEND = keras.backend.backend()

# float32 arithmetic done in another order (einsum vs matmul, XLA vs not):
# differences are a few units in the last place of the values involved.
ATOL = 1e-5
RTOL = 1e-5

# `jit_compile` for a test's compiled step without XLA where the backend
# has one: TensorFlow's graph (XLA compiles a zoo model's step slowly on a
# CPU). JAX compiles a step with XLA only: `jit_compile=False` runs each
# operation eagerly there, each compiled on its own, which takes longer.
STEP_JIT = BACKEND == "jax"

# A test of a stock zoo network alone (its layers, shapes and parameter
# counts, or that it is keras.applications' network), with no array: no
# backend changes what it checks, and the array tests build and train each
# zoo network on each backend. It runs on the default backend only.
STOCK_NETWORK = pytest.mark.backends(
    "tensorflow", reason="checks a stock network's structure, the same on "
    "every backend; the array tests run each zoo network on each")

# TensorFlow's batched matmuls: oneDNN's on a CPU, and the Eigen kernel
# `hftatf.layers.backends.tensorflow_ops.batch_matmul` picks for small products.
BATCHED_MATMULS = frozenset({"BatchMatMulV2", "BatchMatMulV3"})


def moment_tolerance(a, b, num_sd=4.0):
    """Tolerance on `var(a) / var(b) - 1` for two independent samples of
    zero-mean values: `num_sd` standard deviations of the estimate, from each
    sample's own fourth moment (Var(s^2) ~ (m4 - m2^2) / n)."""
    def relative_var_of_var(v):
        m2 = np.mean(v ** 2)
        return (np.mean(v ** 4) / m2 ** 2 - 1.0) / v.size
    return num_sd * np.sqrt(relative_var_of_var(a) + relative_var_of_var(b))


def assert_close(actual, expected, atol=ATOL, rtol=RTOL, err_msg=""):
    np.testing.assert_allclose(np.asarray(actual), np.asarray(expected),
                               atol=atol, rtol=rtol, err_msg=err_msg)


# -- fused optimizers against B stock optimizers (the oracle) ---------------


def per_model_arrays(rng, shapes, num_models, scale=1.0):
    """Random float32 arrays `[num_models, *shape]`, one for each shape."""
    return [(scale * rng.standard_normal((num_models, *shape)))
            .astype("float32") for shape in shapes]


def stock_variables(values, model, names=None):
    """Stock `keras.Variable`s holding slice `model` of each `[B, ...]` value.

    `names` (one per value) lets weight-decay exclusion by name act on the
    stock variables as on the fused ones.
    """
    import keras

    names = names or [None] * len(values)
    return [keras.Variable(value[model], name=name)
            for value, name in zip(values, names)]


def apply_per_model(optimizers, variables, grads):
    """Stock optimizer `b` applies slice `b` of every `[B, ...]` gradient to
    `variables[b]`, its own copy of model b's variables."""
    for model, (optimizer, model_variables) in enumerate(
            zip(optimizers, variables)):
        optimizer.apply_gradients(
            zip([grad[model] for grad in grads], model_variables))


def assert_slices_match(fused, stock, atol=ATOL, rtol=RTOL, err_msg=""):
    """Asserts slice `b` of `fused[i]` equals `stock[b][i]` for every `b`, `i`.

    `fused` is a list of `[B, ...]` variables (or arrays); `stock[b]` is model
    b's list of stock variables in the same order.
    """
    for model, model_values in enumerate(stock):
        for index, (fused_value, stock_value) in enumerate(
                zip(fused, model_values)):
            assert_close(np.asarray(fused_value)[model], stock_value,
                         atol=atol, rtol=rtol,
                         err_msg=f"{err_msg} model {model}, variable {index}")


def max_slice_difference(fused, stock):
    """The largest `|fused[i][b] - stock[b][i]|` over all models, variables."""
    return max(
        float(np.max(np.abs(np.asarray(fused_value)[model]
                            - np.asarray(stock_value))))
        for model, model_values in enumerate(stock)
        for fused_value, stock_value in zip(fused, model_values))


# -- fused layers against B stock layers (the oracle) -----------------------


def randomize_weights(layer, rng, scale=1.0):
    """Gives every weight of a built stock layer random values (biases,
    normalization offsets and statistics too), so no weight can hide behind
    a zero or one initialisation. Variances stay positive."""
    values = []
    for weight in layer.weights:
        value = scale * rng.standard_normal(weight.shape)
        if "variance" in weight.name:
            value = 0.5 + np.abs(value)
        values.append(value.astype(weight.dtype))
    layer.set_weights(values)


def stacked_weights(stock_layers):
    """The `[B, ...]` weights holding stock layer `b`'s weights at `b`."""
    return [np.stack(ws) for ws in
            zip(*(layer.get_weights() for layer in stock_layers))]


def stock_and_fused_embeddings(num_models, input_dim, output_dim, rng,
                               **kwargs):
    """B stock `keras.layers.Embedding`s with random tables, and the
    `FusedEmbedding` of the same tables."""
    from hftatf.layers import FusedEmbedding

    stock = []
    for _ in range(num_models):
        layer = keras.layers.Embedding(input_dim, output_dim, **kwargs)
        layer.build()
        randomize_weights(layer, rng)
        stock.append(layer)
    fused = FusedEmbedding(num_models, input_dim, output_dim, **kwargs)
    fused.build((None, num_models))
    fused.set_weights(stacked_weights(stock))
    return stock, fused


def compiled_call(model, x, training=False):
    """`model(x, training=training)` as NumPy, compiled on JAX: one program
    for the whole network (an eager call compiles each operation's own,
    which takes longer for a deep network), traced once per model and
    `training` (calls on inputs of one shape reuse it); the variables the
    call assigns (moving statistics) are assigned as the eager call
    assigns them. On TensorFlow, the eager call."""
    if BACKEND != "jax":
        return np.asarray(model(x, training=training))
    calls = _COMPILED_CALLS.setdefault(model, {})
    if training not in calls:
        calls[training] = _compiled_stateless_call(weakref.ref(model),
                                                   training)
    outputs, non_trainable = calls[training](
        [v.value for v in model.trainable_variables],
        [v.value for v in model.non_trainable_variables], x)
    for variable, value in zip(model.non_trainable_variables, non_trainable):
        variable.assign(value)
    return np.asarray(outputs)


# Per model (held weakly), `compiled_call`'s programs by `training`.
_COMPILED_CALLS = weakref.WeakKeyDictionary()


def _compiled_stateless_call(model_ref, training):
    import jax

    @jax.jit
    def call(trainable, non_trainable, x):
        return model_ref().stateless_call(trainable, non_trainable, x,
                                          training=training)

    return call


@contextlib.contextmanager
def compiled_programs(caplog):
    """Yields a list that, after the block, holds the number of operands
    of each program JAX compiled within it (from `jax.log_compiles`, in
    order); on TensorFlow it stays empty."""
    operands = []
    if BACKEND != "jax":
        yield operands
        return
    import jax

    with caplog.at_level("WARNING"), jax.log_compiles():
        start = len(caplog.records)
        yield operands
    operands.extend(r.getMessage().count("ShapedArray(")
                    for r in caplog.records[start:]
                    if r.getMessage().startswith("Compiling"))


def jaxpr_equations(jaxpr):
    """Every equation of the JAX program `jaxpr`, those of the programs it
    nests (a `cond`'s branches, a `jit` inside it) included."""
    from jax.extend import core

    for equation in jaxpr.eqns:
        yield equation
        for value in equation.params.values():
            for inner in value if isinstance(value, (list, tuple)) else [
                    value]:
                if isinstance(inner, core.ClosedJaxpr):
                    yield from jaxpr_equations(inner.jaxpr)
                elif isinstance(inner, core.Jaxpr):
                    yield from jaxpr_equations(inner)


def value_and_gradients(function, tensors, variables=(), state=()):
    """`function(*tensors)` (returning `(outputs, scalar)`) and the
    gradients of `scalar` with respect to each of `tensors` and each
    Keras variable in `variables`, on the backend the suite runs on (a
    `tf.GradientTape` on TensorFlow, `jax.grad` over the variables' values
    in a `keras.StatelessScope` on JAX, after which the values `function`
    assigned to the variables in `state` and `variables` are assigned to
    them). Unconnected gradients are zeros.

    Returns `(outputs, tensor_gradients, variable_gradients)`; gradients of
    embedding tables are dense.
    """
    variables = list(variables)
    if BACKEND == "jax":
        import jax

        trained = {id(v) for v in variables}
        state = [v for v in state if id(v) not in trained]

        def scalar_of(tensors, values, state_values):
            mapping = list(zip(variables, values)) + list(
                zip(state, state_values))
            with keras.StatelessScope(state_mapping=mapping) as scope:
                outputs, scalar = function(*tensors)
            return scalar, (outputs, [scope.get_current_value(v)
                                      for v in state + variables])

        # Compiled as one program: run op by op, each operation of a new
        # shape is compiled on its own, which takes longer.
        (_, (outputs, updated)), (dx, dw) = jax.jit(jax.value_and_grad(
            scalar_of, argnums=(0, 1), has_aux=True))(
                [keras.ops.convert_to_tensor(t) for t in tensors],
                [v.value for v in variables], [v.value for v in state])
        # What the call assigned, trained variables too (a spectral
        # normalization's kernel), as TensorFlow's eager call leaves it.
        for variable, value in zip(state + variables, updated):
            variable.assign(value)
        return outputs, [np.asarray(g) for g in dx], [
            np.asarray(g) for g in dw]
    import tensorflow as tf

    from hftatf import sparse

    tensors = [tf.constant(t) for t in tensors]
    with tf.GradientTape() as tape:
        tape.watch(tensors)
        outputs, scalar = function(*tensors)
    grads = tape.gradient(scalar, [*tensors, *variables],
                          unconnected_gradients="zero")
    # (A fused embedding's sparse gradient is of its flattened table.)
    grads = [np.asarray(sparse.dense(g, x.shape))
             for g, x in zip(grads, [*tensors, *variables])]
    return outputs, grads[:len(tensors)], grads[len(tensors):]


def layer_outputs_and_gradients(layer, inputs, cotangents, training=None,
                                **call_kwargs):
    """`layer(*inputs)` and the gradients of `sum(output_i * cotangent_i)`
    with respect to every input and every trainable weight.

    Returns `(outputs, input_gradients, weight_gradients)` as NumPy lists.
    """
    kwargs = dict(call_kwargs)
    if training is not None:
        kwargs["training"] = training
    floating = [i for i, x in enumerate(inputs)
                if np.issubdtype(np.asarray(x).dtype, np.floating)]

    def forward(*tensors):
        given = list(inputs)
        for i, tensor in zip(floating, tensors):
            given[i] = tensor
        flat = keras.tree.flatten(layer(*given, **kwargs))
        scalar = sum(keras.ops.sum(keras.ops.cast(o, "float32") * c)
                     for o, c in zip(flat, tensors[len(floating):]))
        return flat, scalar

    # The cotangents are arguments too, not constants of the program: on
    # JAX, B stock layers of one shape then run one compiled program.
    flat, dx, dw = value_and_gradients(
        forward, [inputs[i] for i in floating] + [
            np.asarray(c, "float32") for c in cotangents],
        layer.trainable_weights, state=layer.non_trainable_weights)
    return [np.asarray(o) for o in flat], dx[:len(floating)], dw


def compare_layer_with_stock(stock_layers, fused, inputs, rng, training=None,
                             atol=ATOL, rtol=RTOL, shared=None,
                             **call_kwargs):
    """Asserts that model `b` of `fused` computes what `stock_layers[b]`
    computes: outputs, input gradients, weight gradients and, after the
    call, every weight (so moving statistics updated in training match).

    `inputs` are the fused layer's inputs, `[batch, B, ...]` each (or
    `[batch, ...]` where `shared[i]` is true, whose gradient must then be
    the sum of the models' gradients); model `b` is fed `x[:, b]`. `fused`
    must hold `stacked_weights(stock_layers)`. Returns the fused outputs.
    """
    import keras

    shared = list(shared or [False] * len(inputs))
    # The cotangents need the output shapes, which a symbolic call gives
    # (on JAX, a call op by op would compile each operation on its own).
    kwargs = dict(call_kwargs)
    if training is not None:
        kwargs["training"] = training
    specs = fused(*[keras.KerasTensor(
        np.shape(x), keras.backend.standardize_dtype(np.asarray(x).dtype))
        for x in inputs], **kwargs)
    cotangents = [rng.standard_normal(o.shape).astype("float32")
                  for o in keras.tree.flatten(specs)]
    y, dx, dw = layer_outputs_and_gradients(
        fused, inputs, cotangents, training=training, **call_kwargs)
    after = fused.get_weights()
    floating = [i for i, x in enumerate(inputs)
                if np.issubdtype(np.asarray(x).dtype, np.floating)]
    shared_sums = {i: 0.0 for i in floating if shared[i]}
    for b, layer in enumerate(stock_layers):
        model_inputs = [x if s else x[:, b] for x, s in zip(inputs, shared)]
        y_b, dx_b, dw_b = layer_outputs_and_gradients(
            layer, model_inputs, [c[:, b] for c in cotangents],
            training=training, **call_kwargs)
        for i, (out, out_b) in enumerate(zip(y, y_b)):
            assert_close(out[:, b], out_b, atol, rtol,
                         err_msg=f"output {i} of model {b}")
        for i, grad, grad_b in zip(floating, dx, dx_b):
            if shared[i]:
                shared_sums[i] = shared_sums[i] + grad_b
            else:
                assert_close(grad[:, b], grad_b, atol, rtol,
                             err_msg=f"gradient of input {i}, model {b}")
        assert len(dw) == len(dw_b)
        for grad, grad_b, weight in zip(dw, dw_b, layer.trainable_weights):
            assert_close(grad[b], grad_b, atol, rtol,
                         err_msg=f"gradient of {weight.name}, model {b}")
        for value, value_b, weight in zip(after, layer.get_weights(),
                                          layer.weights):
            assert_close(value[b], value_b, atol, rtol,
                         err_msg=f"{weight.name} after the call, model {b}")
    for i, grad in zip(floating, dx):
        if shared[i]:
            assert_close(grad, shared_sums[i], atol, rtol,
                         err_msg=f"gradient of shared input {i}")
    return y


# -- graphs ------------------------------------------------------------------


def optimized_ops(function, *args):
    """The op types TensorFlow's graph optimizer leaves in the graphs of
    `function` (a `tf.function`, first called here with `args`), counted."""
    from tensorflow.python.eager import context

    context.export_run_metadata()  # Drops what earlier calls left.
    context.enable_graph_collection()
    try:
        function(*args)
        metadata = context.export_run_metadata()
    finally:
        context.disable_graph_collection()
    return collections.Counter(
        node.op for graph in metadata.function_graphs
        for node in graph.post_optimization_graph.node)


def optimized_transposes(function, *args):
    """How many transposes `optimized_ops` finds."""
    return sum(count for op, count in optimized_ops(function, *args).items()
               if "Transpose" in op)


def trains_like_stock(model, x, y, num_models=2):
    """Asserts that each model of the array of `model` has its stock twin's
    loss and, after two SGD steps, its weights."""
    import keras

    import hftatf

    array = hftatf.fuse(model, num_models)
    stock = array.unfuse()
    array.compile(hftatf.optimizers.SGD(0.1), loss="mse")
    logs = array.evaluate(x, y, batch_size=len(x), verbose=0,
                          return_dict=True)
    array.fit(x, y, batch_size=len(x) // 2, epochs=1, shuffle=False,
              verbose=0)
    trained = array.unfuse(compile=False)
    for b, twin in enumerate(stock):
        twin.compile(keras.optimizers.SGD(0.1), loss="mse")
        expected = twin.evaluate(x, y, batch_size=len(x), verbose=0)
        assert_close(logs[f"loss_{b}"], expected, err_msg=f"model {b}")
        twin.fit(x, y, batch_size=len(x) // 2, epochs=1, shuffle=False,
                 verbose=0)
        for got, want in zip(trained[b].get_weights(),
                             twin.get_weights()):
            assert_close(got, want, err_msg=f"model {b}")


# -- simulated devices -------------------------------------------------------

# XLA's CPU runtime runs a process's simulated host devices
# (`--xla_force_host_platform_device_count`) as its threads, and aborts the
# process when they do not all reach a collective within 40 s, which a
# loaded test machine can delay. The tests' processes allow 300 s: a
# program whose devices really wait on each other still aborts. (JAX's XLA
# only: TensorFlow's refuses the flag.)
JAX_COLLECTIVE_TIMEOUT = (
    "--xla_cpu_collective_call_terminate_timeout_seconds=300")


def with_xla_flags(env, *flags):
    """The process environment `env` with `flags` after its XLA_FLAGS."""
    return {**env, "XLA_FLAGS": " ".join(
        [env.get("XLA_FLAGS", ""), *flags]).strip()}


# -- interrupted runs --------------------------------------------------------


class Interrupt(keras.callbacks.Callback):
    """Stops a run with an exception (as a kill would, without the process
    ending) in the middle of epoch `epoch`."""

    def __init__(self, epoch):
        super().__init__()
        self.epoch = epoch

    def on_epoch_begin(self, epoch, logs=None):
        self.current = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self.current == self.epoch and batch == 1:
            raise KeyboardInterrupt
