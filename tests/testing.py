"""Helpers shared by the tests: the stock-Keras oracle and tolerances."""

import numpy as np

# float32 arithmetic done in another order (einsum vs matmul, XLA vs not):
# differences are a few units in the last place of the values involved.
ATOL = 1e-5
RTOL = 1e-5


def assert_close(actual, expected, atol=ATOL, rtol=RTOL, err_msg=""):
    np.testing.assert_allclose(np.asarray(actual), np.asarray(expected),
                               atol=atol, rtol=rtol, err_msg=err_msg)
