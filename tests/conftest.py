"""Test configuration: quiet TensorFlow, deterministic seeds per test."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _seed():
    keras.utils.set_random_seed(1234)
    yield
