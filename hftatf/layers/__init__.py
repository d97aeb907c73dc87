"""Fused layers: stock Keras layers vectorised over a model axis.

Activations are `[batch, B, ...]`; weights are `[B, *stock weight shape]`.
"""

from hftatf.layers import registry
from hftatf.layers.base import FusedLayer
from hftatf.layers.dense import FusedDense
from hftatf.layers.fold import PER_SAMPLE_LAYERS, BroadcastToModels, FusedFold

__all__ = [
    "BroadcastToModels",
    "FusedDense",
    "FusedFold",
    "FusedLayer",
    "PER_SAMPLE_LAYERS",
    "registry",
]
