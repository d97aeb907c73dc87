"""Layers that move the model axis: `hftatf.fuse` inserts them where a
layout changes (a shared input meets per-model layers, raw operations run
on the folded batch, the models-first layout begins or ends)."""


import keras

from hftatf.api import hftatf_export
from hftatf.core.axis import (
    fold_models,
    model_axis_of,
    rearranged,
    repeat_models,
    swap_model_axis,
    unfold_models,
)
from hftatf.core.validation import check_model_axis, check_num_models

# Stock layers without weights that treat every sample on its own.
from hftatf.layers.fold import fold_for_stock


@hftatf_export
class BroadcastToModels(keras.layers.Layer):
    """Gives every model of the array the same input batch.

    Layout: input `[batch, ...]` (shared by all models) -> output
    `[batch, B, ...]` (`[B, batch, ...]` with `models_first=True`). No
    weights. `hftatf.fuse` inserts it where a shared input first meets a
    layer that needs per-model activations; in the backward pass the models'
    gradients are summed, as they should be for a shared input.
    """

    def __init__(self, num_models, models_first=False, **kwargs):
        # It moves values and never casts them: a float32 tensor of a
        # mixed-precision model stays float32.
        super().__init__(autocast=False, **kwargs)
        self.num_models = check_num_models(num_models)
        self.models_first = bool(models_first)
        self.supports_masking = True

    def _repeat(self, tensor):
        return repeat_models(tensor, self.num_models,
                             model_axis_of(self.models_first))

    def call(self, inputs):
        return self._repeat(inputs)

    def compute_mask(self, inputs, mask=None):
        if mask is None:
            return None
        return self._repeat(mask)

    def compute_output_shape(self, input_shape):
        if self.models_first:
            return (self.num_models, *input_shape)
        return (input_shape[0], self.num_models, *input_shape[1:])

    def compute_output_spec(self, inputs):
        # The input's dtype: integer ids stay integers for the layers that
        # take them (Keras gives a layer's symbolic output its compute
        # dtype).
        return keras.KerasTensor(self.compute_output_shape(inputs.shape),
                                 dtype=inputs.dtype)

    def get_config(self):
        config = super().get_config()
        config["num_models"] = self.num_models
        if self.models_first:
            config["models_first"] = True
        return config


@hftatf_export
class FoldModelAxis(keras.layers.Layer):
    """`[batch, B, ...]` -> `[batch * B, ...]`: the models' samples side by
    side in one batch, for an operation that treats every sample alike.

    `hftatf.fuse` puts raw `keras.ops` nodes of a functional model (e.g.
    `ops.tanh(x)`, `ops.concatenate([a, b], axis=-1)`) between a
    `FoldModelAxis` and an `UnfoldModelAxis`, so the operation runs once for
    all models with its axis arguments unchanged. An operation that reduces
    or indexes the batch axis would mix the models; write it as a layer.
    """

    def __init__(self, num_models, **kwargs):
        # It moves values and never casts them: a float32 tensor of a
        # mixed-precision model stays float32.
        super().__init__(autocast=False, **kwargs)
        self.num_models = check_num_models(num_models)
        self.supports_masking = True

    def call(self, inputs):
        check_model_axis(self.name, self.num_models, tuple(inputs.shape))
        return rearranged(fold_for_stock, inputs)

    def compute_mask(self, inputs, mask=None):
        return None if mask is None else fold_models(mask)

    def compute_output_shape(self, input_shape):
        batch = input_shape[0]
        return (None if batch is None else batch * self.num_models,
                *input_shape[2:])

    def get_config(self):
        config = super().get_config()
        config["num_models"] = self.num_models
        return config


@hftatf_export
class UnfoldModelAxis(keras.layers.Layer):
    """`[batch * B, ...]` -> `[batch, B, ...]`, the inverse of
    `FoldModelAxis`."""

    def __init__(self, num_models, **kwargs):
        # It moves values and never casts them: a float32 tensor of a
        # mixed-precision model stays float32.
        super().__init__(autocast=False, **kwargs)
        self.num_models = check_num_models(num_models)
        self.supports_masking = True

    def call(self, inputs):
        return unfold_models(inputs, self.num_models)

    def compute_mask(self, inputs, mask=None):
        return None if mask is None else unfold_models(
            mask, self.num_models)

    def compute_output_shape(self, input_shape):
        batch = input_shape[0]
        return (None if batch is None else batch // self.num_models,
                self.num_models, *input_shape[1:])

    def get_config(self):
        config = super().get_config()
        config["num_models"] = self.num_models
        return config


@hftatf_export
class SwapModelAxis(keras.layers.Layer):
    """`[batch, B, ...]` <-> `[B, batch, ...]`: swaps the batch and model
    axes (and those of a mask), moving activations into or out of the
    models-first layout.

    `hftatf.fuse` inserts it where a tensor with the models first meets a
    layer that computes with them second (a layer normalization,
    an output of the array), or the reverse. No weights.

    Args:
        models_first: the layout of the output: True for `[B, batch, ...]`
            (moving into the models-first layout), False for `[batch, B,
            ...]`, None where not known (the swap is the same either way;
            `hftatf.passes` reads it to size one model's activations).
    """

    def __init__(self, models_first=None, **kwargs):
        # It moves values and never casts them: a float32 tensor of a
        # mixed-precision model stays float32.
        super().__init__(autocast=False, **kwargs)
        self.supports_masking = True
        self.models_first = None if models_first is None else bool(
            models_first)

    def call(self, inputs):
        return swap_model_axis(inputs)

    def compute_mask(self, inputs, mask=None):
        return None if mask is None else swap_model_axis(mask)

    def compute_output_shape(self, input_shape):
        return (input_shape[1], input_shape[0], *input_shape[2:])

    def get_config(self):
        config = super().get_config()
        if self.models_first is not None:
            config["models_first"] = self.models_first
        return config
