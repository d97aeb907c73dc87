"""Fused `SimpleRNN`, `LSTM`, `GRU` and `RNN` (`FusedRecurrent` holds the
logic)."""

import keras

from hftatf.api import hftatf_export
from hftatf.layers import registry
from hftatf.layers.base import FusedForm
from hftatf.layers.recurrent.base_rnn import (
    FusedRecurrent,
    cell_property,
    check_use_cudnn,
)
from hftatf.layers.recurrent.cells import (
    FusedGRUCell,
    FusedLSTMCell,
    FusedSimpleRNNCell,
)


@hftatf_export
@registry.register(keras.layers.SimpleRNN)
class FusedSimpleRNN(FusedRecurrent):
    """`keras.layers.SimpleRNN` for an array of `num_models` models.

    Layout: see `FusedRecurrent` (`[batch, B, timesteps, features]` in,
    `[batch, B, (timesteps,) units]` out, states `[batch, B, units]`).
    Weights: `kernel` `[B, features, units]`, `recurrent_kernel`
    `[B, units, units]`, `bias` `[B, units]`. Model `b` computes what the
    stock layer computes with weights `w[b]` on `x[:, b]`.

    Args:
        num_models: the number of models `B` in the array.
        units, ..., seed: the arguments of `keras.layers.SimpleRNN`, with
            its defaults; see `FusedRecurrent` for how initializers,
            regularizers, constraints and dropout act per model.
    """

    cell_class = FusedSimpleRNNCell
    cell_name = "simple_rnn_cell"

    def __init__(self, num_models, units, activation="tanh", use_bias=True,
                 kernel_initializer="glorot_uniform",
                 recurrent_initializer="orthogonal", bias_initializer="zeros",
                 kernel_regularizer=None, recurrent_regularizer=None,
                 bias_regularizer=None, activity_regularizer=None,
                 kernel_constraint=None, recurrent_constraint=None,
                 bias_constraint=None, dropout=0.0, recurrent_dropout=0.0,
                 return_sequences=False, return_state=False,
                 go_backwards=False, stateful=False, unroll=False, seed=None,
                 **kwargs):
        super().__init__(
            num_models,
            dict(units=units, activation=activation, use_bias=use_bias,
                 kernel_initializer=kernel_initializer,
                 recurrent_initializer=recurrent_initializer,
                 bias_initializer=bias_initializer,
                 kernel_regularizer=kernel_regularizer,
                 recurrent_regularizer=recurrent_regularizer,
                 bias_regularizer=bias_regularizer,
                 kernel_constraint=kernel_constraint,
                 recurrent_constraint=recurrent_constraint,
                 bias_constraint=bias_constraint, dropout=dropout,
                 recurrent_dropout=recurrent_dropout, seed=seed),
            return_sequences=return_sequences, return_state=return_state,
            go_backwards=go_backwards, stateful=stateful, unroll=unroll,
            activity_regularizer=activity_regularizer, **kwargs)


@hftatf_export
@registry.register(keras.layers.LSTM)
class FusedLSTM(FusedRecurrent):
    """`keras.layers.LSTM` for an array of `num_models` models.

    Layout: see `FusedRecurrent` (`[batch, B, timesteps, features]` in,
    `[batch, B, (timesteps,) units]` out, states `h, c` `[batch, B, units]`
    each). Weights, gates in the stock order `i, f, c, o`: `kernel`
    `[B, features, 4 * units]`, `recurrent_kernel` `[B, units, 4 * units]`,
    `bias` `[B, 4 * units]`. Model `b` computes what the stock layer computes
    with weights `w[b]` on `x[:, b]`, always with the generic loop (never
    cuDNN).

    Args:
        num_models: the number of models `B` in the array.
        units, ..., recurrent_activation, unit_forget_bias: the arguments of
            `keras.layers.LSTM`, with its defaults; see `FusedRecurrent`
            for how initializers, regularizers, constraints and dropout act
            per model.
        use_cudnn: `"auto"` or `False`; `True` is refused (no cuDNN kernel
            takes per-model weights).
    """

    cell_class = FusedLSTMCell
    cell_name = "lstm_cell"

    def __init__(self, num_models, units, activation="tanh",
                 recurrent_activation="sigmoid", use_bias=True,
                 kernel_initializer="glorot_uniform",
                 recurrent_initializer="orthogonal", bias_initializer="zeros",
                 unit_forget_bias=True, kernel_regularizer=None,
                 recurrent_regularizer=None, bias_regularizer=None,
                 activity_regularizer=None, kernel_constraint=None,
                 recurrent_constraint=None, bias_constraint=None,
                 dropout=0.0, recurrent_dropout=0.0, seed=None,
                 return_sequences=False, return_state=False,
                 go_backwards=False, stateful=False, unroll=False,
                 use_cudnn="auto", **kwargs):
        super().__init__(
            num_models,
            dict(units=units, activation=activation,
                 recurrent_activation=recurrent_activation, use_bias=use_bias,
                 kernel_initializer=kernel_initializer,
                 recurrent_initializer=recurrent_initializer,
                 bias_initializer=bias_initializer,
                 unit_forget_bias=unit_forget_bias,
                 kernel_regularizer=kernel_regularizer,
                 recurrent_regularizer=recurrent_regularizer,
                 bias_regularizer=bias_regularizer,
                 kernel_constraint=kernel_constraint,
                 recurrent_constraint=recurrent_constraint,
                 bias_constraint=bias_constraint, dropout=dropout,
                 recurrent_dropout=recurrent_dropout, seed=seed,
                 implementation=kwargs.pop("implementation", 2)),
            return_sequences=return_sequences, return_state=return_state,
            go_backwards=go_backwards, stateful=stateful, unroll=unroll,
            activity_regularizer=activity_regularizer, **kwargs)
        self.use_cudnn = check_use_cudnn(use_cudnn)

    recurrent_activation = cell_property("recurrent_activation")
    unit_forget_bias = cell_property("unit_forget_bias")


@hftatf_export
@registry.register(keras.layers.GRU)
class FusedGRU(FusedRecurrent):
    """`keras.layers.GRU` for an array of `num_models` models.

    Layout: see `FusedRecurrent` (`[batch, B, timesteps, features]` in,
    `[batch, B, (timesteps,) units]` out, state `[batch, B, units]`).
    Weights, gates in the stock order `z, r, h`: `kernel`
    `[B, features, 3 * units]`, `recurrent_kernel` `[B, units, 3 * units]`,
    `bias` `[B, 2, 3 * units]` (input and recurrent biases) with
    `reset_after=True`, else `[B, 3 * units]`. Model `b` computes what the
    stock layer computes with weights `w[b]` on `x[:, b]`, always with the
    generic loop (never cuDNN).

    Args:
        num_models: the number of models `B` in the array.
        units, ..., recurrent_activation, reset_after: the arguments of
            `keras.layers.GRU`, with its defaults; see `FusedRecurrent`
            for how initializers, regularizers, constraints and dropout act
            per model.
        use_cudnn: `"auto"` or `False`; `True` is refused (no cuDNN kernel
            takes per-model weights).
    """

    cell_class = FusedGRUCell
    cell_name = "gru_cell"

    def __init__(self, num_models, units, activation="tanh",
                 recurrent_activation="sigmoid", use_bias=True,
                 kernel_initializer="glorot_uniform",
                 recurrent_initializer="orthogonal", bias_initializer="zeros",
                 kernel_regularizer=None, recurrent_regularizer=None,
                 bias_regularizer=None, activity_regularizer=None,
                 kernel_constraint=None, recurrent_constraint=None,
                 bias_constraint=None, dropout=0.0, recurrent_dropout=0.0,
                 seed=None, return_sequences=False, return_state=False,
                 go_backwards=False, stateful=False, unroll=False,
                 reset_after=True, use_cudnn="auto", **kwargs):
        super().__init__(
            num_models,
            dict(units=units, activation=activation,
                 recurrent_activation=recurrent_activation, use_bias=use_bias,
                 kernel_initializer=kernel_initializer,
                 recurrent_initializer=recurrent_initializer,
                 bias_initializer=bias_initializer,
                 kernel_regularizer=kernel_regularizer,
                 recurrent_regularizer=recurrent_regularizer,
                 bias_regularizer=bias_regularizer,
                 kernel_constraint=kernel_constraint,
                 recurrent_constraint=recurrent_constraint,
                 bias_constraint=bias_constraint, dropout=dropout,
                 recurrent_dropout=recurrent_dropout, seed=seed,
                 reset_after=reset_after,
                 implementation=kwargs.pop("implementation", 2)),
            return_sequences=return_sequences, return_state=return_state,
            go_backwards=go_backwards, stateful=stateful, unroll=unroll,
            activity_regularizer=activity_regularizer, **kwargs)
        self.use_cudnn = check_use_cudnn(use_cudnn)

    recurrent_activation = cell_property("recurrent_activation")
    reset_after = cell_property("reset_after")


@registry.register(keras.layers.RNN)
class FusedRNN(FusedForm):
    """Fuses `keras.layers.RNN(cell)` for a stock `SimpleRNNCell`,
    `LSTMCell` or `GRUCell`.

    Such an RNN computes what the stock `SimpleRNN`, `LSTM` or `GRU` layer
    with the cell's arguments computes off cuDNN (each of those layers is
    the `RNN` of its cell), so its fused form is `FusedSimpleRNN`,
    `FusedLSTM` or `FusedGRU`, built from the RNN's arguments
    (`return_sequences`, `return_state`, `go_backwards`, `stateful`,
    `unroll`, `zero_output_for_mask`) and the cell's. Weights keep the
    stock order, `[B, *stock shape]` each, and `unfuse` gives back the
    stock `RNN` of its cell. Other cells (a cell of your own, a list of
    cells, `StackedRNNCells`) are refused with an error naming the cell.
    """

    @staticmethod
    def fused_layer_class(cell):
        """The fused layer for a stock `cell`, or None."""
        return {
            keras.layers.SimpleRNNCell: FusedSimpleRNN,
            keras.layers.LSTMCell: FusedLSTM,
            keras.layers.GRUCell: FusedGRU,
        }.get(type(cell))

    @classmethod
    def refusal(cls, layer):
        """Why the stock `RNN` `layer` has no fused form, or None (it then
        runs once per model: `hftatf.layers.FusedPerModel`)."""
        if cls.fused_layer_class(layer.cell) is not None:
            return None
        return (
            "a keras.layers.RNN fuses over one stock SimpleRNNCell, LSTMCell "
            f"or GRUCell; its cell is {type(layer.cell).__module__}."
            f"{type(layer.cell).__name__}. Stacked recurrent layers (one RNN "
            "per cell) fuse where stacked cells do not")

    @classmethod
    def from_stock(cls, layer, num_models):
        """Builds the fused layer of the stock `RNN` `layer` (weights not
        copied)."""
        fused_class = cls.fused_layer_class(layer.cell)
        if fused_class is None:
            raise ValueError(
                f"hftatf cannot fuse layer '{layer.name}': "
                f"{cls.refusal(layer)}")
        config = layer.get_config()
        del config["cell"]
        cell_config = layer.cell.get_config()
        for key in ("name", "trainable", "dtype"):
            cell_config.pop(key, None)
        config.update(cell_config)
        config["activity_regularizer"] = keras.regularizers.serialize(
            layer.activity_regularizer)
        config["num_models"] = num_models
        implementation = getattr(layer.cell, "implementation", None)
        if implementation is not None:
            config["implementation"] = implementation
        return fused_class.from_config(config)
