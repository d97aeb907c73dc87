"""Fused convolutions: `ConvND`, `ConvNDTranspose`, `DepthwiseConvND` and
`SeparableConvND` for an array of B models, one family per module
(`base_conv` holds what they share and the choice of kernel)."""

from hftatf.layers.convolutional.base_conv import (
    IMPLEMENTATIONS,
    channels_last,
    is_convolution,
    per_model_conv,
)
from hftatf.layers.convolutional.conv import (
    FusedBaseConv,
    FusedConv1D,
    FusedConv2D,
    FusedConv3D,
)
from hftatf.layers.convolutional.conv_transpose import (
    FusedBaseConvTranspose,
    FusedConv1DTranspose,
    FusedConv2DTranspose,
    FusedConv3DTranspose,
)
from hftatf.layers.convolutional.depthwise_conv import (
    FusedBaseDepthwiseConv,
    FusedDepthwiseConv1D,
    FusedDepthwiseConv2D,
)
from hftatf.layers.convolutional.separable_conv import (
    FusedBaseSeparableConv,
    FusedSeparableConv1D,
    FusedSeparableConv2D,
)

__all__ = [
    "IMPLEMENTATIONS",
    "FusedBaseConv",
    "FusedBaseConvTranspose",
    "FusedBaseDepthwiseConv",
    "FusedBaseSeparableConv",
    "FusedConv1D",
    "FusedConv1DTranspose",
    "FusedConv2D",
    "FusedConv2DTranspose",
    "FusedConv3D",
    "FusedConv3DTranspose",
    "FusedDepthwiseConv1D",
    "FusedDepthwiseConv2D",
    "FusedSeparableConv1D",
    "FusedSeparableConv2D",
    "channels_last",
    "is_convolution",
    "per_model_conv",
]
