"""Fused attention layers: multi-head, grouped-query, dot-product and
additive attention."""

from hftatf.layers.attention.attention import (
    FusedAdditiveAttention,
    FusedAttention,
)
from hftatf.layers.attention.base_attention import (
    FusedAttentionBase,
)
from hftatf.layers.attention.grouped_query_attention import (
    FusedGroupedQueryAttention,
    FusedGroupQueryAttention,
)
from hftatf.layers.attention.multi_head_attention import (
    FusedMultiHeadAttention,
)

__all__ = [
    "FusedAdditiveAttention",
    "FusedAttention",
    "FusedAttentionBase",
    "FusedGroupQueryAttention",
    "FusedGroupedQueryAttention",
    "FusedMultiHeadAttention",
]
