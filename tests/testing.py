"""Helpers shared by the tests: the stock-Keras oracle and tolerances."""

import numpy as np

# float32 arithmetic done in another order (einsum vs matmul, XLA vs not):
# differences are a few units in the last place of the values involved.
ATOL = 1e-5
RTOL = 1e-5


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
