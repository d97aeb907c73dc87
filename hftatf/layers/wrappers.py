"""Fused layer wrappers over a model axis: TimeDistributed, Bidirectional
and SpectralNormalization.

They wrap fused layers: `from_stock` fuses the stock wrapper's inner layers
through the registry, so any layer with a fused form can be time-distributed
(or spectrally normalized, given a kernel) and any fused recurrent layer
made bidirectional. Their weights are those of the inner fused layers (and
the wrapper's own), in the stock wrapper's `get_weights()` order. A stock
wrapper of a layer that runs once per model (a layer of your own) runs once
per model as a whole (`hftatf.layers.FusedPerModel`).
"""

import keras
from keras import ops

from hftatf.api import hftatf_export
from hftatf.core import compat
from hftatf.core.validation import check_model_axis, check_num_models
from hftatf.layers import registry, resolve
from hftatf.layers.base import (
    FusedForm,
    ModelActivityRegularization,
    StackedInitializer,
)
from hftatf.layers.recurrent import FusedRecurrent

__all__ = ["FusedBidirectional", "FusedSpectralNormalization",
           "FusedTimeDistributed", "couples_batch"]


def _per_model_inner(*inner):
    """Why a stock wrapper of the `inner` layers has no fused form (one of
    them runs once per model, so the whole wrapper does), or None."""
    for layer in inner:
        if resolve.runs_per_model(layer):
            return (f"it wraps layer '{layer.name}' "
                    f"({type(layer).__name__}), which runs once per model")
    return None


def couples_batch(layer):
    """Whether `layer` in training computes with the whole batch rather
    than sample by sample: a trainable layer in it holds non-trainable
    weights of its own (a batch normalization's moving statistics)."""
    return any(inner.trainable and inner._non_trainable_variables
               for inner in compat.inner_layers(layer, include_self=True))


def _check_inner(wrapper, role, layer, num_models):
    inner = getattr(layer, "num_models", None)
    if inner is not None and inner != num_models:
        raise ValueError(
            f"{wrapper} for an array of {num_models} models needs a fused "
            f"`{role}` of {num_models} models. Received layer "
            f"'{layer.name}' with num_models={inner}.")


@hftatf_export
@registry.register(keras.layers.TimeDistributed)
class FusedTimeDistributed(FusedForm, ModelActivityRegularization,
                           keras.layers.Wrapper):
    """`keras.layers.TimeDistributed` for an array of `num_models` models.

    Layout:
        input: `[batch, B, timesteps, *inner input shape]`.
        output: `[batch, B, timesteps, *inner output shape]`.
        mask: `[batch, B, timesteps]`, passed through unchanged (and, folded
            like the input, to an inner layer that takes a mask).
        weights: the fused inner layer's, `[B, *stock shape]` each.

    The time axis is folded into the batch: the fused inner layer runs once
    on `[batch * timesteps, B, ...]`, and its output is unfolded. In
    training, an inner layer whose result depends on the whole batch
    (a `BatchNormalization`, or any trainable layer inside it with
    non-trainable weights: `couples_batch`) instead runs once per timestep,
    as in the stock wrapper: each timestep is normalized by its own
    statistics, and the moving statistics move once per timestep. As in
    the stock wrapper, the inner layer is applied through its `call` (so
    its activity regularizer does not run) and receives `training`.

    Args:
        layer: a fused layer of `num_models` models (e.g. a `FusedDense`, or
            any fused form from `hftatf.layers.resolve.fuse_layer`).
        num_models: the number of models `B` in the array.
    """

    model_axis = 1

    def __init__(self, layer, num_models, activity_regularizer=None,
                 **kwargs):
        super().__init__(layer, **kwargs)
        self.num_models = check_num_models(num_models)
        _check_inner("FusedTimeDistributed", "layer", layer, self.num_models)
        self.supports_masking = True
        self.model_activity_regularizer = keras.regularizers.get(
            activity_regularizer)

    @classmethod
    def refusal(cls, layer):
        """Why the stock `TimeDistributed` `layer` has no fused form, or
        None (it then runs once per model)."""
        return _per_model_inner(layer.layer)

    @classmethod
    def from_stock(cls, layer, num_models):
        """Fuses a stock `TimeDistributed`, its inner layer by the registry
        (weights not copied)."""
        return cls(resolve.fuse_layer(layer.layer, num_models), num_models,
                   activity_regularizer=layer.activity_regularizer,
                   name=layer.name, dtype=layer.dtype_policy,
                   trainable=layer.trainable)

    @classmethod
    def from_config(cls, config, custom_objects=None):
        # The stock `Wrapper.from_config` pops "layer" from the caller's
        # dict; work on a copy.
        return super().from_config(dict(config), custom_objects)

    def _child_input_shape(self, input_shape):
        if len(input_shape) < 4:
            raise ValueError(
                f"Layer '{self.name}' expects inputs of shape [batch, "
                "num_models, timesteps, ...] (at least 4 dimensions). "
                f"Received input shape {tuple(input_shape)}.")
        check_model_axis(self.name, self.num_models, input_shape)
        batch, _, steps = input_shape[:3]
        folded = None if batch is None or steps is None else batch * steps
        return (folded, self.num_models, *input_shape[3:])

    def build(self, input_shape):
        super().build(self._child_input_shape(input_shape))

    def compute_output_shape(self, input_shape):
        child = self.layer.compute_output_shape(
            self._child_input_shape(input_shape))
        return (input_shape[0], self.num_models, input_shape[2], *child[2:])

    @staticmethod
    def _fold_time(x):
        """`[batch, B, T, *s]` -> `[batch * T, B, *s]`."""
        shape = ops.shape(x)
        x = ops.transpose(x, (0, 2, 1, *range(3, len(x.shape))))
        return ops.reshape(x, (-1, shape[1], *shape[3:]))

    @staticmethod
    def _unfold_time(y, steps):
        """`[batch * T, B, *s]` -> `[batch, B, T, *s]`."""
        shape = ops.shape(y)
        y = ops.reshape(y, (-1, steps, *shape[1:]))
        return ops.transpose(y, (0, 2, 1, *range(3, len(y.shape))))

    def call(self, inputs, training=None, mask=None):
        self._child_input_shape(tuple(inputs.shape))
        steps = inputs.shape[2]
        if steps is None:
            steps = ops.shape(inputs)[2]
        kwargs = {}
        if compat.call_takes_mask(self.layer) and mask is not None:
            if len(mask.shape) < 3:
                raise ValueError(
                    f"Layer '{self.name}' expects a mask of shape [batch, "
                    "num_models, timesteps, ...]. Received a mask of shape "
                    f"{tuple(mask.shape)} for inputs of shape "
                    f"{tuple(inputs.shape)}.")
            kwargs["mask"] = mask
        if compat.call_takes_training(self.layer):
            kwargs["training"] = training
        if training and couples_batch(self.layer):
            return self._call_per_step(inputs, kwargs)
        if "mask" in kwargs:
            kwargs["mask"] = self._fold_time(kwargs["mask"])
        outputs = self.layer.call(self._fold_time(inputs), **kwargs)
        return self._unfold_time(outputs, steps)

    def _call_per_step(self, inputs, kwargs):
        """The inner layer called on each timestep in turn (a Python loop
        over a known number of timesteps, else `ops.vectorized_map`, as in
        the stock wrapper)."""
        mask = kwargs.pop("mask", None)

        def step(x, m):
            return self.layer.call(
                x, **kwargs, **({} if m is None else {"mask": m}))

        if inputs.shape[2] is not None:
            return ops.stack([
                step(inputs[:, :, i], None if mask is None else mask[:, :, i])
                for i in range(inputs.shape[2])], axis=2)

        def time_major(x):
            return ops.moveaxis(x, 2, 0)

        elements = [time_major(inputs)]
        if mask is not None:
            elements.append(time_major(mask))
        outputs = ops.vectorized_map(
            lambda e: step(e[0], e[1] if len(e) > 1 else None), elements)
        return ops.moveaxis(outputs, 0, 2)

    def get_config(self):
        config = super().get_config()
        config["num_models"] = self.num_models
        return self.with_activity_config(config)


@hftatf_export
@registry.register(keras.layers.Bidirectional)
class FusedBidirectional(FusedForm, ModelActivityRegularization,
                         keras.layers.Bidirectional):
    """`keras.layers.Bidirectional` for an array of `num_models` models.

    Layout:
        input: `[batch, B, timesteps, features]`; mask `[batch, B,
            timesteps]` (or `[batch, timesteps]` shared).
        output: the forward and backward outputs (`[batch, B, (timesteps,)
            units]` each; the backward sequence flipped back to forward
            time) merged by `merge_mode` (`"concat"` on the last axis,
            `"sum"`, `"mul"`, `"ave"`, or `None` for both); with
            `return_state`, followed by the forward then backward final
            states, `[batch, B, units]` each.
        initial_state: forward states then backward states, `[batch, B,
            units]` each.
        weights: the forward layer's, then the backward layer's, as the
            stock `get_weights()`; each `[B, *stock shape]`.

    Args:
        layer: a fused recurrent layer (`FusedLSTM`, `FusedGRU`,
            `FusedSimpleRNN`) of `num_models` models; copied, as by the
            stock wrapper, into the forward layer and (reversed) the backward
            layer.
        num_models: the number of models `B` in the array.
        merge_mode, weights, backward_layer: as in the stock wrapper;
            `backward_layer` must be a fused recurrent layer too.
    """

    model_axis = 1

    def __init__(self, layer, num_models, merge_mode="concat", weights=None,
                 backward_layer=None, activity_regularizer=None, **kwargs):
        num_models = check_num_models(num_models)
        for role, rnn in (("layer", layer), ("backward_layer",
                                             backward_layer)):
            if rnn is None and role == "backward_layer":
                continue
            if not isinstance(rnn, FusedRecurrent):
                raise TypeError(
                    f"FusedBidirectional needs a fused recurrent layer "
                    f"(FusedLSTM, FusedGRU, FusedSimpleRNN) as `{role}`. "
                    f"Received: {rnn!r} of type {type(rnn).__name__}. Fuse "
                    "the stock layer first (FusedBidirectional.from_stock "
                    "does it for a stock Bidirectional).")
            _check_inner("FusedBidirectional", role, rnn, num_models)
        super().__init__(layer, merge_mode=merge_mode, weights=weights,
                         backward_layer=backward_layer, **kwargs)
        self.num_models = num_models
        self.model_activity_regularizer = keras.regularizers.get(
            activity_regularizer)

    @classmethod
    def refusal(cls, layer):
        """Why the stock `Bidirectional` `layer` has no fused form, or None
        (it then runs once per model)."""
        return _per_model_inner(layer.forward_layer, layer.backward_layer)

    @classmethod
    def from_stock(cls, layer, num_models):
        """Fuses a stock `Bidirectional`, its forward and backward layers by
        the registry (weights not copied)."""
        return cls(
            resolve.fuse_layer(layer.forward_layer, num_models), num_models,
            merge_mode=layer.merge_mode,
            backward_layer=resolve.fuse_layer(layer.backward_layer,
                                               num_models),
            activity_regularizer=layer.activity_regularizer,
            name=layer.name, dtype=layer.dtype_policy,
            trainable=layer.trainable)

    def call(self, sequences, initial_state=None, mask=None, training=None):
        # The stock call, except that time is axis 2 of fused sequences (the
        # stock one flips axis 1, which is the model axis here) and that the
        # stock cuDNN shortcuts do not apply.
        kwargs = {}
        if compat.call_takes_training(self.forward_layer):
            kwargs["training"] = training
        if compat.call_takes_mask(self.forward_layer):
            kwargs["mask"] = mask
        forward_state = backward_state = None
        if initial_state is not None:
            half = len(initial_state) // 2
            forward_state = initial_state[:half]
            backward_state = initial_state[half:]
        y = self.forward_layer(sequences, initial_state=forward_state,
                               **kwargs)
        y_rev = self.backward_layer(sequences, initial_state=backward_state,
                                    **kwargs)
        if self.return_state:
            states = tuple(y[1:]) + tuple(y_rev[1:])
            y, y_rev = y[0], y_rev[0]
        y = ops.cast(y, self.compute_dtype)
        y_rev = ops.cast(y_rev, self.compute_dtype)
        if self.return_sequences:
            y_rev = ops.flip(y_rev, axis=2)
        if self.merge_mode == "concat":
            output = ops.concatenate([y, y_rev], axis=-1)
        elif self.merge_mode == "sum":
            output = y + y_rev
        elif self.merge_mode == "ave":
            output = (y + y_rev) / 2
        elif self.merge_mode == "mul":
            output = y * y_rev
        else:
            output = (y, y_rev)
        if self.return_state:
            if self.merge_mode is None:
                return output + states
            return (output,) + states
        return output

    def get_config(self):
        config = super().get_config()
        config["num_models"] = self.num_models
        return self.with_activity_config(config)


@hftatf_export
@registry.register(keras.layers.SpectralNormalization)
class FusedSpectralNormalization(FusedForm, ModelActivityRegularization,
                                 keras.layers.Wrapper):
    """`keras.layers.SpectralNormalization` for an array of `num_models`
    models.

    Layout: the wrapped fused layer's (inputs, outputs, and the models
    first or a shared input where it takes them).
    Weights: as the stock wrapper's, in its order: the wrapped layer's
    kernel (or embeddings), `vector_u` (`[B, 1, units]`, not trainable),
    then the wrapped layer's other weights; `[B, *stock shape]` each.

    In training, as the stock wrapper, each call first estimates each
    model's largest singular value of its kernel (reshaped to `[-1,
    units]`) by `power_iterations` steps of power iteration from that
    model's `vector_u`, then assigns the kernel divided by it and the new
    `vector_u`; a model whose kernel is all zeros keeps both. The wrapped
    layer then computes with the normalized kernel, and the gradient is
    that of the normalized kernel, as in the stock layer. Since the call
    assigns a trainable weight, an array with this layer trains in one
    pass (`models_per_pass`).

    Args:
        layer: a fused layer of `num_models` models with a `kernel` or
            `embeddings` weight (a `FusedDense`, a fused convolution, ...).
        num_models: the number of models `B` in the array.
        power_iterations: as in the stock wrapper.
    """

    # A forward pass in training assigns the kernel: the array snapshots it
    # for frozen models and does not split its step into passes.
    assigns_weights_in_training = True

    def __init__(self, layer, num_models, power_iterations=1,
                 activity_regularizer=None, **kwargs):
        super().__init__(layer, **kwargs)
        self.num_models = check_num_models(num_models)
        self.model_activity_regularizer = keras.regularizers.get(
            activity_regularizer)
        _check_inner("FusedSpectralNormalization", "layer", layer,
                     self.num_models)
        if power_iterations <= 0:
            raise ValueError(
                "`power_iterations` should be greater than zero. Received: "
                f"`power_iterations={power_iterations}`")
        self.power_iterations = power_iterations

    @classmethod
    def refusal(cls, layer):
        """Why the stock `SpectralNormalization` `layer` has no fused form,
        or None (it then runs once per model)."""
        return _per_model_inner(layer.layer)

    @classmethod
    def from_stock(cls, layer, num_models, **kwargs):
        """Fuses a stock `SpectralNormalization`, its inner layer by the
        registry (weights not copied); `kwargs` (`shared_input`,
        `models_first`) go to the inner layer."""
        return cls(resolve.fuse_layer(layer.layer, num_models, **kwargs),
                   num_models, power_iterations=layer.power_iterations,
                   activity_regularizer=layer.activity_regularizer,
                   name=layer.name, dtype=layer.dtype_policy,
                   trainable=layer.trainable)

    @property
    def model_axis(self):
        return getattr(self.layer, "model_axis", 1)

    @classmethod
    def takes_models_first(cls, layer):
        return resolve.takes_models_first(layer.layer)

    @classmethod
    def fuses_shared_input(cls, layer):
        return resolve.takes_shared_input(layer.layer)

    @classmethod
    def prefers_models_first(cls, layer):
        return resolve.prefers_models_first(layer.layer)

    @classmethod
    def from_config(cls, config, custom_objects=None):
        # The stock `Wrapper.from_config` pops "layer" from the caller's
        # dict; work on a copy.
        return super().from_config(dict(config), custom_objects)

    def build(self, input_shape):
        super().build(input_shape)
        if hasattr(self.layer, "kernel"):
            self.kernel = self.layer.kernel
        elif hasattr(self.layer, "embeddings"):
            self.kernel = self.layer.embeddings
        else:
            raise ValueError(
                f"{type(self.layer).__name__} object has no attribute "
                "'kernel' nor 'embeddings'")
        self.vector_u = self.add_weight(
            shape=(self.num_models, 1, self.kernel.shape[-1]),
            initializer=StackedInitializer(
                keras.initializers.TruncatedNormal(stddev=0.02),
                self.num_models),
            trainable=False,
            name="vector_u",
            dtype=self.kernel.dtype,
        )

    def call(self, inputs, training=False):
        if training:
            new_vector_u, new_kernel = self.normalized_weights()
            self.vector_u.assign(new_vector_u)
            self.kernel.assign(new_kernel)
        output = self.layer(inputs)
        return ops.cast(output, inputs.dtype)

    def compute_output_shape(self, input_shape):
        return self.layer.compute_output_shape(input_shape)

    def normalized_weights(self):
        """Each model's spectrally normalized kernel and new `vector_u`
        (the stock computation, batched over the model axis)."""
        kernel = self.kernel.value
        per_model = (self.num_models, 1) + (1,) * (len(kernel.shape) - 2)
        weights = ops.reshape(
            kernel, (self.num_models, -1, kernel.shape[-1]))
        vector_u = self.vector_u.value
        for _ in range(self.power_iterations):
            vector_v = ops.normalize(ops.matmul(
                vector_u, ops.swapaxes(weights, 1, 2)), axis=(1, 2))
            vector_u = ops.normalize(
                ops.matmul(vector_v, weights), axis=(1, 2))
        vector_u = ops.stop_gradient(vector_u)
        vector_v = ops.stop_gradient(vector_v)
        sigma = ops.matmul(ops.matmul(vector_v, weights),
                           ops.swapaxes(vector_u, 1, 2))
        normalized = ops.divide(kernel, ops.reshape(sigma, per_model))
        # A model whose kernel is all zeros keeps its weights, as the
        # stock layer's `cond` does for the whole kernel.
        zero = ops.all(ops.equal(kernel, 0),
                       axis=tuple(range(1, len(kernel.shape))))
        new_vector_u = ops.where(ops.reshape(zero, (-1, 1, 1)),
                                 self.vector_u.value, vector_u)
        new_kernel = ops.where(ops.reshape(zero, per_model), kernel,
                               normalized)
        return (ops.cast(new_vector_u, self.vector_u.dtype),
                ops.cast(new_kernel, self.kernel.dtype))

    def get_config(self):
        config = super().get_config()
        config["power_iterations"] = self.power_iterations
        config["num_models"] = self.num_models
        return self.with_activity_config(config)
