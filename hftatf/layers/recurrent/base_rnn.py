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

from hftatf.core.axis import fold_models, unfold_models
from hftatf.core.validation import check_model_axis
from hftatf.layers.base import FusedLayer, keep_stock_initializers


def cell_property(name):
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

    units = cell_property("units")
    activation = cell_property("activation")
    use_bias = cell_property("use_bias")
    kernel_initializer = cell_property("kernel_initializer")
    recurrent_initializer = cell_property("recurrent_initializer")
    bias_initializer = cell_property("bias_initializer")
    kernel_regularizer = cell_property("kernel_regularizer")
    recurrent_regularizer = cell_property("recurrent_regularizer")
    bias_regularizer = cell_property("bias_regularizer")
    kernel_constraint = cell_property("kernel_constraint")
    recurrent_constraint = cell_property("recurrent_constraint")
    bias_constraint = cell_property("bias_constraint")
    dropout = cell_property("dropout")
    recurrent_dropout = cell_property("recurrent_dropout")

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
        self._check_stateful_batch(sequences)
        if initial_state is not None:
            initial_state = self._fold_initial_state(initial_state)
        outputs = super().call(
            fold_models(sequences), initial_state=initial_state,
            mask=self._fold_mask(mask, sequences), training=training)
        return keras.tree.map_structure(
            lambda y: unfold_models(y, self.num_models), outputs)

    def _check_stateful_batch(self, sequences):
        """As the stock layer's check of a stateful layer's batch size,
        in the sizes the user gave (the states hold the folded batch)."""
        expected = getattr(self, "_expected_batch_size", None)
        received = sequences.shape[0]
        if (self.stateful and expected is not None and received is not None
                and received * self.num_models != expected):
            per_model = expected // self.num_models
            raise ValueError(
                f"Layer '{self.name}' is stateful, so the batch size of its "
                f"input sequences must be the one it was built for, as for "
                f"the stock layer: its states hold {per_model} "
                f"samples per model. Received a batch of {received} samples "
                f"(inputs of shape {tuple(sequences.shape)}). Pass "
                f"`batch_size={per_model}` to `fit`, "
                f"`evaluate` and `predict`, with a sample count that it "
                f"divides.")

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
