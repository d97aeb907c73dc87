"""Fused recurrent cells: the step of each fused RNN layer."""

import keras
from keras import ops

from hftatf.core import compat
from hftatf.layers.base import FusedLayer


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


class FusedRecurrentCell(FusedLayer, compat.DropoutRNNCell):
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
