"""Fused layers: stock Keras layers vectorised over a model axis.

Activations are `[batch, B, ...]`; weights are `[B, *stock weight shape]`.
Importing a family module registers its fused forms (see `registry`);
`resolve` decides which form a stock layer takes. What differs per Keras
backend (TensorFlow's kernel choices and sparse gradients) is in
`backends`, one module per backend.
"""

from hftatf.layers import registry, resolve
from hftatf.layers.activation import FusedActivityRegularization, FusedPReLU
from hftatf.layers.applications import FusedLayerScale
from hftatf.layers.attention import (
    FusedAdditiveAttention,
    FusedAttention,
    FusedGroupedQueryAttention,
    FusedGroupQueryAttention,
    FusedMultiHeadAttention,
)
from hftatf.layers.base import FusedLayer
from hftatf.layers.convolutional import (
    FusedBaseConv,
    FusedBaseConvTranspose,
    FusedBaseDepthwiseConv,
    FusedBaseSeparableConv,
    FusedConv1D,
    FusedConv1DTranspose,
    FusedConv2D,
    FusedConv2DTranspose,
    FusedConv3D,
    FusedConv3DTranspose,
    FusedDepthwiseConv1D,
    FusedDepthwiseConv2D,
    FusedSeparableConv1D,
    FusedSeparableConv2D,
)
from hftatf.layers.dense import FusedDense
from hftatf.layers.einsum_dense import FusedEinsumDense
from hftatf.layers.embedding import FusedEmbedding
from hftatf.layers.fold import PER_SAMPLE_LAYERS, FusedFold, FusedRandomCrop
from hftatf.layers.model_axis import (
    BroadcastToModels,
    FoldModelAxis,
    SwapModelAxis,
    UnfoldModelAxis,
)
from hftatf.layers.normalization import (
    FusedBatchNormalization,
    FusedGroupNormalization,
    FusedLayerNormalization,
    FusedNormalization,
    FusedRMSNormalization,
)
from hftatf.layers.per_model import PER_BATCH_LAYERS, FusedPerModel
from hftatf.layers.recurrent import (
    FusedConvLSTM1D,
    FusedConvLSTM2D,
    FusedConvLSTM3D,
    FusedGRU,
    FusedLSTM,
    FusedRNN,
    FusedSimpleRNN,
)
from hftatf.layers.wrappers import (
    FusedBidirectional,
    FusedSpectralNormalization,
    FusedTimeDistributed,
)

__all__ = [
    "BroadcastToModels",
    "FoldModelAxis",
    "FusedActivityRegularization",
    "FusedAdditiveAttention",
    "FusedAttention",
    "FusedBaseConv",
    "FusedBaseConvTranspose",
    "FusedBaseDepthwiseConv",
    "FusedBaseSeparableConv",
    "FusedBatchNormalization",
    "FusedBidirectional",
    "FusedConv1D",
    "FusedConv1DTranspose",
    "FusedConv2D",
    "FusedConv2DTranspose",
    "FusedConv3D",
    "FusedConv3DTranspose",
    "FusedConvLSTM1D",
    "FusedConvLSTM2D",
    "FusedConvLSTM3D",
    "FusedDense",
    "FusedDepthwiseConv1D",
    "FusedDepthwiseConv2D",
    "FusedEinsumDense",
    "FusedEmbedding",
    "FusedFold",
    "FusedGroupedQueryAttention",
    "FusedGroupNormalization",
    "FusedGroupQueryAttention",
    "FusedGRU",
    "FusedLayer",
    "FusedLayerNormalization",
    "FusedLayerScale",
    "FusedLSTM",
    "FusedMultiHeadAttention",
    "FusedNormalization",
    "FusedPerModel",
    "FusedPReLU",
    "FusedRandomCrop",
    "FusedRMSNormalization",
    "FusedRNN",
    "FusedSeparableConv1D",
    "FusedSeparableConv2D",
    "FusedSimpleRNN",
    "FusedSpectralNormalization",
    "FusedTimeDistributed",
    "PER_BATCH_LAYERS",
    "PER_SAMPLE_LAYERS",
    "registry",
    "resolve",
    "SwapModelAxis",
    "UnfoldModelAxis",
]
