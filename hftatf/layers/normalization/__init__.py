"""Fused normalization layers."""

from hftatf.layers.normalization.base_normalization import (
    AffineNormalization,
)
from hftatf.layers.normalization.batch_normalization import (
    FusedBatchNormalization,
)
from hftatf.layers.normalization.group_normalization import (
    FusedGroupNormalization,
)
from hftatf.layers.normalization.layer_normalization import (
    FusedLayerNormalization,
)
from hftatf.layers.normalization.normalization import (
    FusedNormalization,
)
from hftatf.layers.normalization.rms_normalization import (
    FusedRMSNormalization,
)

__all__ = [
    "AffineNormalization",
    "FusedBatchNormalization",
    "FusedGroupNormalization",
    "FusedLayerNormalization",
    "FusedNormalization",
    "FusedRMSNormalization",
]
