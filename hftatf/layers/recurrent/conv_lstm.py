"""Fused `ConvLSTM1D`, `ConvLSTM2D` and `ConvLSTM3D`."""

import keras
from keras import ops

from hftatf.api import hftatf_export
from hftatf.core import compat
from hftatf.layers import registry
from hftatf.layers.convolutional import channels_last, per_model_conv
from hftatf.layers.recurrent.base_rnn import FusedRecurrent, cell_property
from hftatf.layers.recurrent.cells import FusedLSTMCell


class FusedConvLSTMCell(FusedLSTMCell):
    """`keras.layers.ConvLSTM*D`'s cell for B models (folded layout, see
    `FusedRecurrentCell`): the LSTM cell whose products are convolutions.

    Step input `[batch * B, *spatial, channels]`, states `[batch * B,
    *spatial', filters]` each. Weights, gates `i, f, c, o` as in the stock
    cell: `kernel` `[B, *kernel_size, channels, 4 * filters]`,
    `recurrent_kernel` `[B, *kernel_size, filters, 4 * filters]`, `bias`
    `[B, 4 * filters]`. The input convolution takes the layer's `strides`,
    `padding` and `dilation_rate`; the recurrent one strides 1 and "same"
    padding, as in the stock cell. Each gate draws its own dropout masks,
    as the stock cell does. Channels last only.
    """

    def __init__(self, num_models, rank, filters, kernel_size, strides=1,
                 padding="valid", data_format=None, dilation_rate=1,
                 **kwargs):
        kwargs.pop("implementation", None)
        super().__init__(num_models, filters, implementation=1, **kwargs)
        self.rank = rank
        self.filters = filters
        self.kernel_size = compat.standardize_tuple(
            kernel_size, rank, "kernel_size")
        self.strides = compat.standardize_tuple(strides, rank, "strides",
                                         allow_zero=True)
        self.padding = compat.standardize_padding(padding)
        self.data_format = channels_last(type(self).__name__, data_format)
        self.dilation_rate = compat.standardize_tuple(
            dilation_rate, rank, "dilation_rate")
        if max(self.strides) > 1 and max(self.dilation_rate) > 1:
            raise ValueError(
                "Specifying `strides > 1` is not compatible with "
                "`dilation_rate > 1`. Please provide `strides=1` or "
                "`dilation_rate=1`. "
                f"Received: strides={self.strides} and "
                f"dilation_rate={self.dilation_rate}")
        self.spatial_dims = None
        self.input_dim = None

    def build(self, input_shape):
        self.spatial_dims = tuple(input_shape[1:-1])
        if None in self.spatial_dims:
            raise ValueError(
                "ConvLSTM layers only support static input shapes for the "
                "spatial dimension. Received invalid input shape: "
                f"input_shape={input_shape}")
        if input_shape[-1] is None:
            raise ValueError(
                "The channel dimension of the inputs (last axis) should be "
                "defined. Found None. Full input shape received: "
                f"input_shape={input_shape}")
        self.input_dim = input_shape[-1]
        width = 4 * self.filters
        self.kernel = self.add_model_weight(
            (*self.kernel_size, self.input_dim, width), name="kernel",
            initializer=self.kernel_initializer,
            regularizer=self.kernel_regularizer,
            constraint=self.kernel_constraint)
        self.recurrent_kernel = self.add_model_weight(
            (*self.kernel_size, self.filters, width),
            name="recurrent_kernel",
            initializer=self.recurrent_initializer,
            regularizer=self.recurrent_regularizer,
            constraint=self.recurrent_constraint)
        self.bias = None
        if self.use_bias:
            self.bias = self.add_model_weight(
                (width,), name="bias",
                initializer=self.bias_weight_initializer(),
                regularizer=self.bias_regularizer,
                constraint=self.bias_constraint)

    def _convolution(self, strides, padding, dilation_rate):
        def product(x, kernel):
            return per_model_conv(
                self.unfold(x), kernel, strides=strides, padding=padding,
                dilation_rate=dilation_rate, data_format="channels_last")

        return product

    def project_inputs(self, inputs, training):
        return self.project(
            inputs, self.input_mask(inputs, training), self.kernel,
            self._convolution(self.strides, self.padding,
                              self.dilation_rate))

    def project_state(self, state, training):
        return self.project(
            state, self.recurrent_mask(state, training),
            self.recurrent_kernel, self._convolution(1, "same", 1))

    def compute_output_shape(self, inputs_shape, states_shape=None):
        output = compat.compute_conv_output_shape(
            inputs_shape, self.filters, self.kernel_size,
            strides=self.strides, padding=self.padding,
            data_format="channels_last", dilation_rate=self.dilation_rate)
        return output, [output, output]

    def get_initial_state(self, batch_size=None):
        shape = self.compute_output_shape(
            (batch_size, *self.spatial_dims, self.input_dim))[0]
        return [ops.zeros(shape, dtype=self.compute_dtype),
                ops.zeros(shape, dtype=self.compute_dtype)]

    def arg_config(self):
        config = super().arg_config()
        del config["units"], config["implementation"]
        config.update(
            filters=self.filters, kernel_size=self.kernel_size,
            strides=self.strides, padding=self.padding,
            data_format=self.data_format, dilation_rate=self.dilation_rate)
        return config

    def get_config(self):
        config = super().get_config()
        config["rank"] = self.rank
        return config


class FusedConvLSTM(FusedRecurrent):
    """`keras.layers.ConvLSTM1D/2D/3D` for an array of `num_models` models.

    Layout: sequences `[batch, B, timesteps, *spatial, channels]`; output
    `[batch, B, (timesteps,) *spatial', filters]`; with `return_state`,
    followed by the final states `h, c`, `[batch, B, *spatial', filters]`
    each; initial states likewise. Masks as `FusedRecurrent`.
    Weights: those of `FusedConvLSTMCell`, `[B, *stock shape]` each, in
    the stock order `kernel, recurrent_kernel, bias`. Model `b` computes
    what the stock layer computes with weights `w[b]` on `x[:, b]`; each
    model's convolutions are chosen for the device as the fused
    convolutions' are (B convolutions on a CPU, one grouped convolution on
    a GPU or TPU). Channels last only.

    Args:
        num_models: the number of models `B` in the array.
        filters, ..., stateful: the arguments of the stock layer, with its
            defaults; see `FusedRecurrent` for how initializers,
            regularizers, constraints and dropout act per model.
    """

    cell_class = FusedConvLSTMCell
    cell_name = "conv_lstm_cell"
    rank = None

    def __init__(self, num_models, filters, kernel_size, strides=1,
                 padding="valid", data_format=None, dilation_rate=1,
                 activation="tanh", recurrent_activation="sigmoid",
                 use_bias=True, kernel_initializer="glorot_uniform",
                 recurrent_initializer="orthogonal", bias_initializer="zeros",
                 unit_forget_bias=True, kernel_regularizer=None,
                 recurrent_regularizer=None, bias_regularizer=None,
                 activity_regularizer=None, kernel_constraint=None,
                 recurrent_constraint=None, bias_constraint=None,
                 dropout=0.0, recurrent_dropout=0.0, seed=None,
                 return_sequences=False, return_state=False,
                 go_backwards=False, stateful=False, unroll=False,
                 **kwargs):
        super().__init__(
            num_models,
            dict(rank=self.rank, filters=filters, kernel_size=kernel_size,
                 strides=strides, padding=padding, data_format=data_format,
                 dilation_rate=dilation_rate, activation=activation,
                 recurrent_activation=recurrent_activation,
                 use_bias=use_bias, kernel_initializer=kernel_initializer,
                 recurrent_initializer=recurrent_initializer,
                 bias_initializer=bias_initializer,
                 unit_forget_bias=unit_forget_bias,
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

    @classmethod
    def from_stock(cls, layer, num_models):
        if layer.data_format != "channels_last":
            raise ValueError(
                f"hftatf cannot fuse layer '{layer.name}' "
                f"({type(layer).__name__}) with data_format="
                f"{layer.data_format!r}: {cls.__name__} supports only "
                "'channels_last'.")
        return super().from_stock(layer, num_models)

    state_layout = "[batch, num_models, *spatial, filters]"

    @property
    def state_ndim(self):
        return 3 + self.rank

    def compute_output_shape(self, sequences_shape, initial_state_shape=None):
        shapes = compat.ConvLSTM.compute_output_shape(
            self, self._fold_shape(sequences_shape))
        if self.return_state:
            return tuple(self._unfold_shape(s) for s in shapes)
        return self._unfold_shape(shapes)

    filters = cell_property("filters")
    kernel_size = cell_property("kernel_size")
    strides = cell_property("strides")
    padding = cell_property("padding")
    data_format = cell_property("data_format")
    dilation_rate = cell_property("dilation_rate")
    recurrent_activation = cell_property("recurrent_activation")
    unit_forget_bias = cell_property("unit_forget_bias")


@hftatf_export
@registry.register(keras.layers.ConvLSTM1D)
class FusedConvLSTM1D(FusedConvLSTM):
    """`keras.layers.ConvLSTM1D` for an array of models (see
    `FusedConvLSTM`)."""

    rank = 1


@hftatf_export
@registry.register(keras.layers.ConvLSTM2D)
class FusedConvLSTM2D(FusedConvLSTM):
    """`keras.layers.ConvLSTM2D` for an array of models (see
    `FusedConvLSTM`)."""

    rank = 2


@hftatf_export
@registry.register(keras.layers.ConvLSTM3D)
class FusedConvLSTM3D(FusedConvLSTM):
    """`keras.layers.ConvLSTM3D` for an array of models (see
    `FusedConvLSTM`)."""

    rank = 3
