"""Fused recurrent layers."""

from hftatf.layers.recurrent.base_rnn import (
    FusedRecurrent,
)
from hftatf.layers.recurrent.conv_lstm import (
    FusedConvLSTM1D,
    FusedConvLSTM2D,
    FusedConvLSTM3D,
)
from hftatf.layers.recurrent.rnn import (
    FusedGRU,
    FusedLSTM,
    FusedRNN,
    FusedSimpleRNN,
)

__all__ = [
    "FusedConvLSTM1D",
    "FusedConvLSTM2D",
    "FusedConvLSTM3D",
    "FusedGRU",
    "FusedLSTM",
    "FusedRNN",
    "FusedRecurrent",
    "FusedSimpleRNN",
]
