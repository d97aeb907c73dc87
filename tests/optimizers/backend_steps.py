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
