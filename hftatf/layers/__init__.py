"""Fused layers: stock Keras layers vectorised over a model axis.

Activations are `[batch, B, ...]`; weights are `[B, *stock weight shape]`.
"""

from hftatf.layers import registry
from hftatf.layers.base import FusedLayer
from hftatf.layers.dense import FusedDense, FusedEinsumDense
from hftatf.layers.fold import (
    PER_SAMPLE_LAYERS,
    BroadcastToModels,
    FoldModelAxis,
    FusedFold,
    UnfoldModelAxis,
)

# Each family module registers its fused forms when imported.
from hftatf.layers.activation import *  # noqa: E402,F401,F403
from hftatf.layers.applications import *  # noqa: E402,F401,F403
from hftatf.layers.attention import *  # noqa: E402,F401,F403
from hftatf.layers.convolutional import *  # noqa: E402,F401,F403
from hftatf.layers.embedding import *  # noqa: E402,F401,F403
from hftatf.layers.normalization import *  # noqa: E402,F401,F403
from hftatf.layers.recurrent import *  # noqa: E402,F401,F403
from hftatf.layers.wrappers import *  # noqa: E402,F401,F403

__all__ = [
    "BroadcastToModels",
    "FusedDense",
    "FusedEinsumDense",
    "FoldModelAxis",
    "FusedFold",
    "UnfoldModelAxis",
    "FusedLayer",
    "PER_SAMPLE_LAYERS",
    "registry",
]
