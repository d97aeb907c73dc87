"""`FusedModel.summary`: the user's layers with one model's shapes and
parameters; the fused layout on request."""

import keras
import pytest

import hftatf


def printed_summary(array, **kwargs):
    lines = []
    array.summary(print_fn=lines.append, **kwargs)
    return "\n".join(lines)


def test_summary_shows_the_users_layers_per_model():
    inputs = keras.Input((8,), name="features")
    hidden = keras.layers.Dense(16, activation="relu", name="hidden")(inputs)
    hidden = keras.layers.BatchNormalization(name="norm")(hidden)
    outputs = keras.layers.Dense(3, name="classes")(hidden)
    stock = keras.Model(inputs, outputs, name="digits")
    array = hftatf.fuse(stock, num_models=4)
    text = printed_summary(array)
    assert '4 models of "digits"' in text
    for name in ("hidden (Dense)", "norm (BatchNormalization)",
                 "classes (Dense)", "(None, 16)", "(None, 3)"):
        assert name in text, name
    assert "Fused" not in text and "(None, 4," not in text
    assert f"Total params per model: {stock.count_params():,}" in text
    assert f"Params of the array's 4 models: {4 * stock.count_params():,}" \
        in text
    fused = printed_summary(array, fused=True)
    assert "FusedDense" in fused and "(None, 4, 16)" in fused


def test_an_array_without_a_stock_model_points_to_the_fused_summary():
    inputs = keras.Input((2, 8))
    outputs = hftatf.layers.FusedDense(2, 3)(inputs)
    array = hftatf.FusedModel(inputs, outputs, num_models=2,
                              shared_inputs=False)
    with pytest.raises(ValueError, match="summary\\(fused=True\\)"):
        array.summary()
    assert "FusedDense" in printed_summary(array, fused=True)
