"""Fused forms of the layers `keras.applications` defines itself, against
B stock layers: ConvNeXt's `LayerScale` (InceptionResNetV2's
`CustomScaleLayer` and ConvNeXt's `StochasticDepth` fold: test_fold.py)."""

import keras
import numpy as np
import pytest
from testing import (
    compare_layer_with_stock,
    randomize_weights,
    stacked_weights,
    trains_like_stock,
)

from hftatf.core import compat
from hftatf.layers import FusedLayerScale, resolve

NUM_MODELS = 3
CHANNELS = 4


@pytest.mark.parametrize("shape", [(CHANNELS,), (3, CHANNELS),
                                   (2, 3, CHANNELS)],
                         ids=["vector", "sequence", "image"])
def test_layer_scale_matches_stock(shape):
    rng = np.random.default_rng(0)
    stock = []
    for _ in range(NUM_MODELS):
        layer = compat.LayerScale(1e-6, CHANNELS)
        layer.build((None, *shape))
        randomize_weights(layer, rng)
        stock.append(layer)
    fused = resolve.fuse_layer(stock[0], NUM_MODELS)
    assert isinstance(fused, FusedLayerScale)
    fused.build((None, NUM_MODELS, *shape))
    fused.set_weights(stacked_weights(stock))
    x = rng.standard_normal((5, NUM_MODELS, *shape)).astype("float32")
    compare_layer_with_stock(stock, fused, [x], rng)


def test_layer_scale_in_a_model_trains_like_stock():
    # Each model learns its own scale, as its stock twin does.
    inputs = keras.Input((6, 6, 2))
    hidden = keras.layers.Conv2D(CHANNELS, 3)(inputs)
    hidden = compat.LayerScale(0.5, CHANNELS)(hidden)
    outputs = keras.layers.Dense(1)(keras.layers.Flatten()(hidden))
    rng = np.random.default_rng(1)
    x = rng.standard_normal((8, 6, 6, 2)).astype("float32")
    y = rng.standard_normal((8, 1)).astype("float32")
    trains_like_stock(keras.Model(inputs, outputs), x, y)
