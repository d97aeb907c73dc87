"""Fused layer wrappers: TimeDistributed and Bidirectional over a model axis.

Both wrap fused layers: `from_stock` fuses the stock wrapper's inner layers
through the registry, so any layer with a fused form can be time-distributed
and any fused recurrent layer made bidirectional. Their weights are those of
the inner fused layers, in the stock wrapper's `get_weights()` order.
"""

import keras
from keras import ops

from hftatf.api import hftatf_export
from hftatf.layers import registry
from hftatf.layers.recurrent import FusedRecurrent
from hftatf.validation import check_model_axis, check_num_models

__all__ = ["FusedBidirectional", "FusedTimeDistributed"]


def _check_inner(wrapper, role, layer, num_models):
    inner = getattr(layer, "num_models", None)
    if inner is not None and inner != num_models:
        raise ValueError(
            f"{wrapper} for an array of {num_models} models needs a fused "
            f"`{role}` of {num_models} models. Received layer "
            f"'{layer.name}' with num_models={inner}.")


@hftatf_export
@registry.register(keras.layers.TimeDistributed)
class FusedTimeDistributed(keras.layers.Wrapper):
    """`keras.layers.TimeDistributed` for an array of `num_models` models.

    Layout:
        input: `[batch, B, timesteps, *inner input shape]`.
        output: `[batch, B, timesteps, *inner output shape]`.
        mask: `[batch, B, timesteps]`, passed through unchanged (and, folded
            like the input, to an inner layer that takes a mask).
        weights: the fused inner layer's, `[B, *stock shape]` each.

    The time axis is folded into the batch: the fused inner layer runs once
    on `[batch * timesteps, B, ...]`, and its output is unfolded. As in the
    stock wrapper, the inner layer is applied through its `call` (so its
    activity regularizer does not run) and receives `training`.

    Args:
        layer: a fused layer of `num_models` models (e.g. a `FusedDense`, or
            any fused form from `hftatf.layers.registry.fuse_layer`).
        num_models: the number of models `B` in the array.
    """

    def __init__(self, layer, num_models, **kwargs):
        super().__init__(layer, **kwargs)
        self.num_models = check_num_models(num_models)
        _check_inner("FusedTimeDistributed", "layer", layer, self.num_models)
        self.supports_masking = True

    @classmethod
    def from_stock(cls, layer, num_models):
        """Fuses a stock `TimeDistributed`, its inner layer by the registry
        (weights not copied)."""
        return cls(registry.fuse_layer(layer.layer, num_models), num_models,
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
        if self.layer._call_has_mask_arg and mask is not None:
            if len(mask.shape) < 3:
                raise ValueError(
                    f"Layer '{self.name}' expects a mask of shape [batch, "
                    "num_models, timesteps, ...]. Received a mask of shape "
                    f"{tuple(mask.shape)} for inputs of shape "
                    f"{tuple(inputs.shape)}.")
            kwargs["mask"] = self._fold_time(mask)
        if self.layer._call_has_training_arg:
            kwargs["training"] = training
        outputs = self.layer.call(self._fold_time(inputs), **kwargs)
        return self._unfold_time(outputs, steps)

    def get_config(self):
        config = super().get_config()
        config["num_models"] = self.num_models
        return config


@hftatf_export
@registry.register(keras.layers.Bidirectional)
class FusedBidirectional(keras.layers.Bidirectional):
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

    def __init__(self, layer, num_models, merge_mode="concat", weights=None,
                 backward_layer=None, **kwargs):
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

    @classmethod
    def from_stock(cls, layer, num_models):
        """Fuses a stock `Bidirectional`, its forward and backward layers by
        the registry (weights not copied)."""
        return cls(
            registry.fuse_layer(layer.forward_layer, num_models), num_models,
            merge_mode=layer.merge_mode,
            backward_layer=registry.fuse_layer(layer.backward_layer,
                                               num_models),
            name=layer.name, dtype=layer.dtype_policy,
            trainable=layer.trainable)

    def call(self, sequences, initial_state=None, mask=None, training=None):
        # The stock call, except that time is axis 2 of fused sequences (the
        # stock one flips axis 1, which is the model axis here) and that the
        # stock cuDNN shortcuts do not apply.
        kwargs = {}
        if self.forward_layer._call_has_training_arg:
            kwargs["training"] = training
        if self.forward_layer._call_has_mask_arg:
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
        return config
