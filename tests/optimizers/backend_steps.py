"""Steps of a fused optimizer on the Keras backend this process runs on:
partial steps (`model_mask`), gradient accumulation and EMA overwrite, the
updates that select per model instead of branching. On JAX the steps run
jitted and stateless, as a JAX trainer runs them. Run by
test_backends.py: `KERAS_BACKEND=jax python backend_steps.py` prints the
final weights as JSON."""

import json

import keras
import numpy as np

from hftatf import optimizers

MASKS = [[True, True], [True, False], [False, True], [True, True],
         [False, False], [True, True], [True, False]]


def compiled(step, optimizer=None, variables=(), jit_compile=None):
    """`step(*tensors)`, which applies `optimizer` to the Keras
    `variables` (or, without them, only computes), compiled as the
    backend's trainer compiles a train step; it returns what `step`
    returns.

    On TensorFlow, a `tf.function` (XLA where `jit_compile`), which builds
    the optimizer on its first trace. On JAX, a `jax.jit` of `step` made
    stateless (a `keras.StatelessScope` over the values of the optimizer's
    variables and `variables`), after which the new values are assigned;
    the optimizer is built first, as the JAX trainer builds it. Either way
    `step`'s Python code runs once per trace.
    """
    if keras.backend.backend() != "jax":
        import tensorflow as tf

        return tf.function(step, jit_compile=jit_compile)
    import jax

    def state():
        held = list(variables)
        return held if optimizer is None else optimizer.variables + held

    def stateless(values, *tensors):
        with keras.StatelessScope(
                state_mapping=list(zip(state(), values))) as scope:
            outputs = step(*tensors)
        return outputs, [scope.get_current_value(v) for v in state()]

    jitted = jax.jit(stateless)

    def run(*tensors):
        if optimizer is not None and not optimizer.built:
            optimizer.build(variables)
        held = state()
        outputs, values = jitted([v.value for v in held], *tensors)
        for variable, value in zip(held, values):
            variable.assign(value)
        return outputs

    return run


def apply_stock(optimizer, grads, variables):
    """Stock `optimizer` applies `grads` to `variables` as the backend's
    trainer applies it: `apply_gradients` on TensorFlow, `stateless_apply`
    on JAX, where the stock `LossScaleOptimizer`'s `apply` branches with
    conds that assign variables, which JAX cannot trace."""
    if keras.backend.backend() != "jax":
        optimizer.apply_gradients(zip(grads, variables))
        return
    if not optimizer.built:
        optimizer.build(variables)
    new_variables, new_state = optimizer.stateless_apply(
        [v.value for v in optimizer.variables], list(grads),
        [v.value for v in variables])
    for variable, value in zip([*variables, *optimizer.variables],
                               [*new_variables, *new_state]):
        variable.assign(value)


def apply_stock_per_model(optimizers, variables, grads):
    """As `testing.apply_per_model` (stock optimizer `b` applies slice `b`
    of every gradient to `variables[b]`), through `apply_stock`."""
    for model, (optimizer, model_variables) in enumerate(
            zip(optimizers, variables)):
        apply_stock(optimizer, [grad[model] for grad in grads],
                    model_variables)


def run():
    """The `[2, 3]` weights after the steps, as a NumPy array."""
    optimizer = optimizers.Adam(
        [0.1, 0.01], beta_1=[0.9, 0.5], gradient_accumulation_steps=2,
        use_ema=True, ema_momentum=[0.9, 0.5], ema_overwrite_frequency=3)
    weights = keras.Variable(np.ones((2, 3), "float32"))
    optimizer.build([weights])
    grads = [np.arange(6, dtype="float32").reshape(2, 3) * (i - 2.5)
             for i in range(len(MASKS))]
    if keras.backend.backend() != "jax":
        for gradient, mask in zip(grads, MASKS):
            optimizer.apply([gradient], [weights], model_mask=np.array(mask))
        return keras.ops.convert_to_numpy(weights)
    import jax

    def step(state, gradient, mask):
        variables = optimizer.variables + [weights]
        with keras.StatelessScope(
                state_mapping=list(zip(variables, state))) as scope:
            optimizer.apply([gradient], [weights], model_mask=mask)
        return [scope.get_current_value(v) for v in variables]

    step = jax.jit(step)
    state = [v.value for v in optimizer.variables + [weights]]
    for gradient, mask in zip(grads, MASKS):
        state = step(state, gradient, np.array(mask))
    return np.asarray(state[-1])


if __name__ == "__main__":
    print(json.dumps({"backend": keras.backend.backend(),
                      "weights": run().tolist()}))
