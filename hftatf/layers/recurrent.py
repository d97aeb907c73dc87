"""Fused recurrent layers: SimpleRNN, LSTM and GRU over a model axis.

The time loop is the stock one. A fused recurrent layer folds the model axis
into the batch (`[batch, B, T, F]` -> `[batch * B, T, F]`, row `i * B + b`
is sample `i` of model `b`) and runs Keras's own `RNN` machinery on it:
masks (`[batch * B, T]`), `go_backwards`, `unroll`, `stateful`, initial
states and dropout-mask caching all behave as in the stock layer. Only the
cell differs: at every step it unfolds `[batch * B, F]` to `[batch, B, F]`,
applies each model's weights with an einsum, and folds the result back.

The stock `LSTM` and `GRU` may run a cuDNN kernel on a GPU; the fused layers
always run the generic loop (the cuDNN kernel has no per-model weights), so
`use_cudnn=True` is refused.

A stock `RNN` over one stock `SimpleRNNCell`, `LSTMCell` or `GRUCell` is the
same computation as the `SimpleRNN`, `LSTM` or `GRU` layer of that cell, and
fuses as that layer (`FusedRNN`).
"""

import keras
from keras import ops
from keras.src.layers.rnn import conv_lstm
from keras.src.layers.rnn.dropout_rnn_cell import DropoutRNNCell
from keras.src.ops.operation_utils import compute_conv_output_shape
from keras.src.utils.argument_validation import (
    standardize_padding,
    standardize_tuple,
)

from hftatf.api import hftatf_export
from hftatf.core.axis import fold_models, unfold_models
from hftatf.core.validation import check_model_axis
from hftatf.layers import registry
from hftatf.layers.base import FusedLayer, keep_stock_initializers
from hftatf.layers.convolutional import channels_last, per_model_conv

__all__ = ["FusedConvLSTM1D", "FusedConvLSTM2D", "FusedConvLSTM3D",
           "FusedGRU", "FusedLSTM", "FusedRNN", "FusedSimpleRNN"]


class UnitForgetBias(keras.initializers.Initializer):
    """The stock LSTM bias with `unit_forget_bias=True`, for one model.

    Draws `initializer` for the input gate, ones for the forget gate and
    `initializer` again for the cell and output gates, as `keras.layers.LSTM`
    does. Its config carries the inner initializer's seed, so that
    `StackedInitializer` gives every model slice its own seed.
    """

    def __init__(self, initializer, units):
        self.initializer = keras.initializers.get(initializer)
        self.units = units

    def __call__(self, shape, dtype=None):
        units = self.units
        return ops.concatenate([
            self.initializer((units,), dtype=dtype),
            ops.ones((units,), dtype=dtype),
            self.initializer((2 * units,), dtype=dtype),
        ])

    def get_config(self):
        config = {
            "initializer": keras.initializers.serialize(self.initializer),
            "units": self.units,
        }
        inner = getattr(self.initializer, "get_config", dict)()
        if "seed" in inner:
            config["seed"] = inner["seed"]
        return config

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        initializer = keras.initializers.deserialize(config["initializer"])
        if "seed" in config:
            initializer = type(initializer).from_config(
                {**initializer.get_config(), "seed": config["seed"]})
        return cls(initializer, config["units"])


class FusedRecurrentCell(FusedLayer, DropoutRNNCell):
    """Base class of the fused cells: one time step of B models.

    Layout (folded, as the stock RNN loop sees it): step input
    `[batch * B, features]`, states `[batch * B, units]` each; row `i * B + b`
    belongs to model `b`. Weights: `kernel` `[B, features, gates * units]`,
    `recurrent_kernel` `[B, units, gates * units]`, `bias`
    `[B, gates * units]` (the stock shapes with a model axis in front).

    Dropout masks are drawn over the folded batch by the stock
    `DropoutRNNCell` machinery, so every model (and every sample) gets its
    own mask, fixed over the time steps of one call as in the stock cell.
    Subclasses set `gates` and implement `step`.
    """

    gates = 1

    def __init__(self, num_models, units, activation="tanh", use_bias=True,
                 kernel_initializer="glorot_uniform",
                 recurrent_initializer="orthogonal", bias_initializer="zeros",
                 kernel_regularizer=None, recurrent_regularizer=None,
                 bias_regularizer=None, kernel_constraint=None,
                 recurrent_constraint=None, bias_constraint=None, dropout=0.0,
                 recurrent_dropout=0.0, seed=None, **kwargs):
        super().__init__(num_models, **kwargs)
        if isinstance(units, bool) or not isinstance(units, int) or units <= 0:
            raise ValueError(
                "Received an invalid value for argument `units`, expected a "
                f"positive integer. Received: units={units!r}")
        self.units = units
        self.activation = keras.activations.get(activation)
        self.use_bias = use_bias
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.recurrent_initializer = keras.initializers.get(
            recurrent_initializer)
        self.bias_initializer = keras.initializers.get(bias_initializer)
        self.kernel_regularizer = keras.regularizers.get(kernel_regularizer)
        self.recurrent_regularizer = keras.regularizers.get(
            recurrent_regularizer)
        self.bias_regularizer = keras.regularizers.get(bias_regularizer)
        self.kernel_constraint = keras.constraints.get(kernel_constraint)
        self.recurrent_constraint = keras.constraints.get(
            recurrent_constraint)
        self.bias_constraint = keras.constraints.get(bias_constraint)
        # Clipped to [0, 1] as the stock cells do.
        self.dropout = min(1.0, max(0.0, dropout))
        self.recurrent_dropout = min(1.0, max(0.0, recurrent_dropout))
        self.seed = seed
        self.seed_generator = keras.random.SeedGenerator(seed=seed)
        self.state_size = self.units
        self.output_size = self.units

    def _set_implementation(self, implementation):
        # As the stock LSTM and GRU cells: recurrent dropout needs one mask
        # per gate, which only implementation 1 draws.
        self.implementation = implementation
        if self.recurrent_dropout != 0.0:
            self.implementation = 1
        if self.implementation == 1:
            self.dropout_mask_count = self.gates

    def build(self, input_shape):
        width = self.gates * self.units
        self.kernel = self.add_model_weight(
            (input_shape[-1], width), name="kernel",
            initializer=self.kernel_initializer,
            regularizer=self.kernel_regularizer,
            constraint=self.kernel_constraint)
        self.recurrent_kernel = self.add_model_weight(
            (self.units, width), name="recurrent_kernel",
            initializer=self.recurrent_initializer,
            regularizer=self.recurrent_regularizer,
            constraint=self.recurrent_constraint)
        self.bias = None
        if self.use_bias:
            self.bias = self.add_model_weight(
                self.bias_shape(), name="bias",
                initializer=self.bias_weight_initializer(),
                regularizer=self.bias_regularizer,
                constraint=self.bias_constraint)

    def bias_shape(self):
        """The stock cell's bias shape (without the model axis)."""
        return (self.gates * self.units,)

    def bias_weight_initializer(self):
        """The initializer of one model's bias, as the stock cell draws it."""
        return self.bias_initializer

    def applies_dropout(self, rate, training):
        """Whether a dropout `rate` is applied, by the stock LSTM/GRU rule."""
        return bool(training) and 0.0 < rate < 1.0

    def input_mask(self, inputs, training):
        """`None`, one `[batch * B, features]` mask, or one per gate."""
        if self.applies_dropout(self.dropout, training):
            return self.get_dropout_mask(inputs)
        return None

    def recurrent_mask(self, state, training):
        """`None`, one `[batch * B, units]` mask, or one per gate."""
        if self.applies_dropout(self.recurrent_dropout, training):
            return self.get_recurrent_dropout_mask(state)
        return None

    def unfold(self, x):
        """`[batch * B, *s]` -> `[batch, B, *s]`."""
        return ops.reshape(x, (-1, self.num_models, *x.shape[1:]))

    def fold(self, x):
        """`[batch, B, *s]` -> `[batch * B, *s]`."""
        return ops.reshape(x, (-1, *x.shape[2:]))

    def project(self, x, mask, kernel, product=None):
        """Model `b`'s rows of the folded `x` times `kernel[b]`.

        `x` is `[batch * B, d]`, `kernel` `[B, d, k]`, the result
        `[batch, B, k]`. `mask` is `None`, one dropout mask for the whole
        kernel, or a list of masks, one per equal block of its columns (the
        stock implementation 1, which drops the input of each gate apart).
        `product(x, kernel)` replaces the matrix product (a convolution).
        """
        if isinstance(mask, (list, tuple)):
            blocks = ops.split(kernel, len(mask), axis=-1)
            return ops.concatenate(
                [self.project(x, m, k, product)
                 for m, k in zip(mask, blocks)], axis=-1)
        if mask is not None:
            x = x * mask
        if product is not None:
            return product(x, kernel)
        return ops.einsum("bmi,mio->bmo", self.unfold(x), kernel)

    def project_inputs(self, inputs, training):
        """The step's inputs, dropped out, times `kernel`: `[batch, B,
        ...]`."""
        return self.project(inputs, self.input_mask(inputs, training),
                            self.kernel)

    def project_state(self, state, training):
        """The previous output, dropped out, times `recurrent_kernel`."""
        return self.project(state, self.recurrent_mask(state, training),
                            self.recurrent_kernel)

    def add_bias(self, z):
        """`z` (`[batch, B, ..., k]`) plus each model's bias `[B, k]`."""
        if self.bias is None:
            return z
        shape = (self.num_models, *[1] * (len(z.shape) - 3), -1)
        return z + ops.reshape(self.bias, shape)

    def call(self, inputs, states, training=False):
        nested = isinstance(states, (list, tuple))
        states = list(states) if nested else [states]
        output, new_states = self.step(inputs, states, training)
        output = self.fold(output)
        new_states = [self.fold(s) for s in new_states]
        return output, (new_states if nested or len(new_states) > 1
                        else new_states[0])

    def step(self, inputs, states, training):
        """One step: folded `inputs` and `states` -> unfolded `[batch, B,
        units]` output and list of new states."""
        raise NotImplementedError

    def get_initial_state(self, batch_size=None):
        sizes = self.state_size if isinstance(
            self.state_size, (list, tuple)) else [self.state_size]
        return [ops.zeros((batch_size, d), dtype=self.compute_dtype)
                for d in sizes]

    def arg_config(self):
        """The constructor arguments shared with the stock recurrent layer."""
        return {
            "units": self.units,
            "activation": keras.activations.serialize(self.activation),
            "use_bias": self.use_bias,
            "kernel_initializer": keras.initializers.serialize(
                self.kernel_initializer),
            "recurrent_initializer": keras.initializers.serialize(
                self.recurrent_initializer),
            "bias_initializer": keras.initializers.serialize(
                self.bias_initializer),
            "kernel_regularizer": keras.regularizers.serialize(
                self.kernel_regularizer),
            "recurrent_regularizer": keras.regularizers.serialize(
                self.recurrent_regularizer),
            "bias_regularizer": keras.regularizers.serialize(
                self.bias_regularizer),
            "kernel_constraint": keras.constraints.serialize(
                self.kernel_constraint),
            "recurrent_constraint": keras.constraints.serialize(
                self.recurrent_constraint),
            "bias_constraint": keras.constraints.serialize(
                self.bias_constraint),
            "dropout": self.dropout,
            "recurrent_dropout": self.recurrent_dropout,
            "seed": self.seed,
        }

    def get_config(self):
        config = super().get_config()
        config.update(self.arg_config())
        return config


class FusedSimpleRNNCell(FusedRecurrentCell):
    """`keras.layers.SimpleRNNCell` for B models (folded layout, see the
    base class): `h = activation(x @ kernel + bias + h @ recurrent_kernel)`.
    Weights `[B, features, units]`, `[B, units, units]`, `[B, units]`."""

    def applies_dropout(self, rate, training):
        # The stock SimpleRNNCell drops whenever a mask exists (rate > 0).
        return bool(training) and rate > 0.0

    def step(self, inputs, states, training):
        h = self.add_bias(self.project_inputs(inputs, training))
        output = self.activation(h + self.project_state(states[0], training))
        return output, [output]


class FusedLSTMCell(FusedRecurrentCell):
    """`keras.layers.LSTMCell` for B models (folded layout, see the base
    class). Gate order `i, f, c, o` as in the stock cell: kernel
    `[B, features, 4 * units]`, recurrent kernel `[B, units, 4 * units]`,
    bias `[B, 4 * units]`; states `[h, c]`."""

    gates = 4

    def __init__(self, num_models, units, recurrent_activation="sigmoid",
                 unit_forget_bias=True, implementation=2, **kwargs):
        super().__init__(num_models, units, **kwargs)
        self.recurrent_activation = keras.activations.get(
            recurrent_activation)
        self.unit_forget_bias = unit_forget_bias
        self.state_size = [self.units, self.units]
        self._set_implementation(implementation)

    def bias_weight_initializer(self):
        if self.unit_forget_bias:
            return UnitForgetBias(self.bias_initializer, self.units)
        return self.bias_initializer

    def step(self, inputs, states, training):
        h_tm1, c_tm1 = states
        z = self.add_bias(self.project_inputs(inputs, training)
                          + self.project_state(h_tm1, training))
        z_i, z_f, z_c, z_o = ops.split(z, 4, axis=-1)
        i = self.recurrent_activation(z_i)
        f = self.recurrent_activation(z_f)
        c = f * self.unfold(c_tm1) + i * self.activation(z_c)
        o = self.recurrent_activation(z_o)
        h = o * self.activation(c)
        return h, [h, c]

    def arg_config(self):
        config = super().arg_config()
        config["recurrent_activation"] = keras.activations.serialize(
            self.recurrent_activation)
        config["unit_forget_bias"] = self.unit_forget_bias
        config["implementation"] = self.implementation
        return config


class FusedGRUCell(FusedRecurrentCell):
    """`keras.layers.GRUCell` for B models (folded layout, see the base
    class). Gate order `z, r, h` as in the stock cell: kernel
    `[B, features, 3 * units]`, recurrent kernel `[B, units, 3 * units]`,
    bias `[B, 2, 3 * units]` (input and recurrent biases) when
    `reset_after`, else `[B, 3 * units]`."""

    gates = 3

    def __init__(self, num_models, units, recurrent_activation="sigmoid",
                 reset_after=True, implementation=2, **kwargs):
        super().__init__(num_models, units, **kwargs)
        self.recurrent_activation = keras.activations.get(
            recurrent_activation)
        self.reset_after = reset_after
        self._set_implementation(implementation)

    def bias_shape(self):
        if self.reset_after:
            return (2, 3 * self.units)
        return (3 * self.units,)

    def step(self, inputs, states, training):
        units = self.units
        h_tm1 = states[0]
        input_bias = recurrent_bias = None
        if self.bias is not None:
            input_bias = self.bias[:, 0] if self.reset_after else self.bias
            recurrent_bias = self.bias[:, 1] if self.reset_after else None

        matrix_x = self.project(inputs, self.input_mask(inputs, training),
                                self.kernel)
        if input_bias is not None:
            matrix_x = matrix_x + input_bias
        x_z, x_r, x_h = ops.split(matrix_x, 3, axis=-1)

        rec_mask = self.recurrent_mask(h_tm1, training)
        per_gate = isinstance(rec_mask, (list, tuple))
        if self.reset_after:
            matrix_inner = self.project(h_tm1, rec_mask,
                                        self.recurrent_kernel)
            if recurrent_bias is not None:
                matrix_inner = matrix_inner + recurrent_bias
        else:
            # Update and reset gates only: the candidate's recurrent term
            # needs the reset gate first.
            matrix_inner = self.project(
                h_tm1, rec_mask[:2] if per_gate else rec_mask,
                self.recurrent_kernel[..., :2 * units])
        recurrent_z = matrix_inner[..., :units]
        recurrent_r = matrix_inner[..., units:2 * units]

        z = self.recurrent_activation(x_z + recurrent_z)
        r = self.recurrent_activation(x_r + recurrent_r)
        if self.reset_after:
            recurrent_h = r * matrix_inner[..., 2 * units:]
        else:
            h_tm1_h = self.unfold(h_tm1 * rec_mask[2] if per_gate else h_tm1)
            recurrent_h = ops.einsum("bmi,mio->bmo", r * h_tm1_h,
                                     self.recurrent_kernel[..., 2 * units:])
        hh = self.activation(x_h + recurrent_h)
        h = z * self.unfold(h_tm1) + (1 - z) * hh
        return h, [h]

    def arg_config(self):
        config = super().arg_config()
        config["recurrent_activation"] = keras.activations.serialize(
            self.recurrent_activation)
        config["reset_after"] = self.reset_after
        config["implementation"] = self.implementation
        return config


def _cell_property(name):
    return property(lambda self: getattr(self.cell, name),
                    doc=f"The cell's `{name}`, as on the stock layer.")


def check_use_cudnn(use_cudnn):
    """Validates `use_cudnn` as the stock LSTM/GRU do, refusing `True`."""
    if use_cudnn not in ("auto", True, False):
        raise ValueError(
            "Invalid value received for argument `use_cudnn`. Expected one "
            f"of {{'auto', True, False}}. Received: use_cudnn={use_cudnn!r}")
    if use_cudnn is True:
        raise ValueError(
            "Fused recurrent layers run the generic recurrent loop: cuDNN "
            "has no kernel with per-model weights. Received: use_cudnn=True. "
            "Pass use_cudnn='auto' or False.")
    return use_cudnn


class FusedRecurrent(FusedLayer, keras.layers.RNN):
    """Base class of the fused recurrent layers (see the module docstring).

    Layout:
        sequences: `[batch, B, timesteps, features]`.
        output: `[batch, B, timesteps, units]` with `return_sequences`, else
            `[batch, B, units]`; with `return_state`, followed by the final
            states, `[batch, B, units]` each.
        initial_state: a list of `[batch, B, units]` tensors, one per state.
        mask: `[batch, B, timesteps]` (each model its own mask), or
            `[batch, timesteps]` shared by all models.
        weights: those of the cell, `[B, *stock shape]`, in the stock order
            `kernel, recurrent_kernel, bias`.

    Per model: each slice of a weight is initialised as a separate stock
    layer would be (its own seed; `unit_forget_bias` as in the stock LSTM);
    regularizers give `[B]` losses, and constraints and the activity
    regularizer act on each model's slice. Masked steps carry the state and
    output forward, as in the stock layer.

    Dropout: `dropout` and `recurrent_dropout` masks are drawn over the
    folded batch from one generator seeded with `seed`, so they are
    independent for every model and sample and fixed over the time steps of
    one call (as in the stock layer), but are not the stream a stock layer
    with that seed would draw.

    State: with `stateful=True` the state variables keep the folded layout
    `[batch * B, units]` (row `i * B + b` is sample `i` of model `b`);
    `reset_state()` zeroes them.

    Subclasses set `cell_class` and pass their cell arguments in
    `cell_kwargs`.
    """

    cell_class = None
    cell_name = None

    def __init__(self, num_models, cell_kwargs, return_sequences=False,
                 return_state=False, go_backwards=False, stateful=False,
                 unroll=False, activity_regularizer=None, **kwargs):
        cell = self.cell_class(
            num_models, dtype=kwargs.get("dtype"),
            trainable=kwargs.get("trainable", True), name=self.cell_name,
            **cell_kwargs)
        super().__init__(
            num_models, activity_regularizer=activity_regularizer, cell=cell,
            return_sequences=return_sequences, return_state=return_state,
            go_backwards=go_backwards, stateful=stateful, unroll=unroll,
            **kwargs)
        self.input_spec = keras.layers.InputSpec(ndim=self.state_ndim + 1)

    units = _cell_property("units")
    activation = _cell_property("activation")
    use_bias = _cell_property("use_bias")
    kernel_initializer = _cell_property("kernel_initializer")
    recurrent_initializer = _cell_property("recurrent_initializer")
    bias_initializer = _cell_property("bias_initializer")
    kernel_regularizer = _cell_property("kernel_regularizer")
    recurrent_regularizer = _cell_property("recurrent_regularizer")
    bias_regularizer = _cell_property("bias_regularizer")
    kernel_constraint = _cell_property("kernel_constraint")
    recurrent_constraint = _cell_property("recurrent_constraint")
    bias_constraint = _cell_property("bias_constraint")
    dropout = _cell_property("dropout")
    recurrent_dropout = _cell_property("recurrent_dropout")

    # The layout of each state.
    state_layout = "[batch, num_models, units]"

    @property
    def state_ndim(self):
        """The rank of a state, `[batch, B, units]`."""
        return 3

    @classmethod
    def from_stock(cls, layer, num_models):
        """Builds the fused form of the stock `layer` (weights not copied).

        The stock config omits the cell's `implementation` (which fixes how
        many dropout masks are drawn); it is taken from the cell.
        """
        config = {**layer.get_config(), "num_models": num_models}
        implementation = getattr(layer.cell, "implementation", None)
        if implementation is not None:
            config["implementation"] = implementation
        return keep_stock_initializers(cls.from_config(config), layer)

    def _fold_shape(self, shape):
        batch = None if shape[0] is None else shape[0] * self.num_models
        return (batch, *shape[2:])

    def _unfold_shape(self, shape):
        batch = None if shape[0] is None else shape[0] // self.num_models
        return (batch, self.num_models, *shape[1:])

    def build(self, sequences_shape, initial_state_shape=None):
        check_model_axis(self.name, self.num_models, sequences_shape)
        super().build(self._fold_shape(sequences_shape))
        self.input_spec = keras.layers.InputSpec(
            ndim=self.state_ndim + 1,
            axes={1: self.num_models, -1: sequences_shape[-1]})

    def compute_output_shape(self, sequences_shape, initial_state_shape=None):
        shapes = super().compute_output_shape(
            self._fold_shape(sequences_shape))
        if self.return_state:
            return tuple(self._unfold_shape(s) for s in shapes)
        return self._unfold_shape(shapes)

    def _fold_mask(self, mask, sequences):
        mask = keras.tree.flatten(mask)[0]
        if mask is None:
            return None
        if len(mask.shape) == 2:  # One mask shared by all models.
            mask = ops.repeat(ops.expand_dims(mask, 1), self.num_models, 1)
        if len(mask.shape) != 3:
            raise ValueError(
                f"Layer '{self.name}' expects a mask of shape [batch, "
                f"num_models, timesteps] (or [batch, timesteps] shared by "
                f"all models) for inputs of shape {tuple(sequences.shape)}. "
                f"Received a mask of shape {tuple(mask.shape)}.")
        return fold_models(mask)

    def _fold_initial_state(self, initial_state):
        states = keras.tree.flatten(initial_state)
        if len(states) != len(self.state_size):
            raise ValueError(
                f"Layer '{self.name}' has {len(self.state_size)} state(s); "
                f"received {len(states)} initial state tensor(s). Pass one "
                f"{self.state_layout} tensor per state.")
        for state in states:
            shape = tuple(state.shape)
            if (len(shape) != self.state_ndim
                    or shape[1] not in (None, self.num_models)):
                raise ValueError(
                    f"Layer '{self.name}' expects initial states of shape "
                    f"{self.state_layout} with num_models="
                    f"{self.num_models}. Received an initial state of shape "
                    f"{shape}.")
        return [fold_models(ops.convert_to_tensor(s)) for s in states]

    def call(self, sequences, initial_state=None, mask=None, training=False):
        # Checked on every call: a wrong model axis would otherwise fold
        # samples of different models together without an error.
        check_model_axis(self.name, self.num_models, tuple(sequences.shape))
        if initial_state is not None:
            initial_state = self._fold_initial_state(initial_state)
        outputs = super().call(
            fold_models(sequences), initial_state=initial_state,
            mask=self._fold_mask(mask, sequences), training=training)
        return keras.tree.map_structure(
            lambda y: unfold_models(y, self.num_models), outputs)

    def get_config(self):
        config = super().get_config()
        del config["cell"]
        config.update(self.cell.arg_config())
        if hasattr(self, "use_cudnn"):
            config["use_cudnn"] = self.use_cudnn
        return config

    @classmethod
    def from_config(cls, config):
        return cls(**config)


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

    recurrent_activation = _cell_property("recurrent_activation")
    unit_forget_bias = _cell_property("unit_forget_bias")


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

    recurrent_activation = _cell_property("recurrent_activation")
    reset_after = _cell_property("reset_after")


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
        self.kernel_size = standardize_tuple(kernel_size, rank, "kernel_size")
        self.strides = standardize_tuple(strides, rank, "strides",
                                         allow_zero=True)
        self.padding = standardize_padding(padding)
        self.data_format = channels_last(type(self).__name__, data_format)
        self.dilation_rate = standardize_tuple(
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
        output = compute_conv_output_shape(
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
        shapes = conv_lstm.ConvLSTM.compute_output_shape(
            self, self._fold_shape(sequences_shape))
        if self.return_state:
            return tuple(self._unfold_shape(s) for s in shapes)
        return self._unfold_shape(shapes)

    filters = _cell_property("filters")
    kernel_size = _cell_property("kernel_size")
    strides = _cell_property("strides")
    padding = _cell_property("padding")
    data_format = _cell_property("data_format")
    dilation_rate = _cell_property("dilation_rate")
    recurrent_activation = _cell_property("recurrent_activation")
    unit_forget_bias = _cell_property("unit_forget_bias")


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


@registry.register(keras.layers.RNN)
class FusedRNN:
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
