"""Fusing per-sample layers without weights, and sharing one input batch.

A layer without weights that treats every sample on its own (activations,
dropout, pooling, reshapes, merges, ...) needs no fused implementation: the
model axis is folded into the batch axis, the stock layer runs once on
`[batch * B, ...]`, and the result is unfolded to `[batch, B, ...]`. Axis
arguments of the stock layer keep their meaning, since the folded tensor has
the stock rank.
"""

import keras
from keras import ops

from hftatf.api import hftatf_export
from hftatf.layers import registry
from hftatf.validation import check_model_axis, check_num_models

# Stock layers without weights that treat every sample on its own.
PER_SAMPLE_LAYERS = tuple(getattr(keras.layers, name) for name in (
    # Activations.
    "Activation", "ReLU", "LeakyReLU", "ELU", "Softmax",
    # Regularisation by noise: each model draws its own mask.
    "Dropout", "SpatialDropout1D", "SpatialDropout2D", "SpatialDropout3D",
    "GaussianNoise", "GaussianDropout", "AlphaDropout",
    # Shapes.
    "Flatten", "Reshape", "Permute", "RepeatVector", "Identity",
    "Cropping1D", "Cropping2D", "Cropping3D",
    "ZeroPadding1D", "ZeroPadding2D", "ZeroPadding3D",
    "UpSampling1D", "UpSampling2D", "UpSampling3D",
    # Pooling.
    "MaxPooling1D", "MaxPooling2D", "MaxPooling3D",
    "AveragePooling1D", "AveragePooling2D", "AveragePooling3D",
    "GlobalMaxPooling1D", "GlobalMaxPooling2D", "GlobalMaxPooling3D",
    "GlobalAveragePooling1D", "GlobalAveragePooling2D",
    "GlobalAveragePooling3D",
    # Merges.
    "Add", "Subtract", "Multiply", "Average", "Maximum", "Minimum",
    "Concatenate", "Dot",
    # Preprocessing and masking.
    "Rescaling", "Resizing", "CenterCrop", "Masking", "UnitNormalization",
))


def fold_model_axis(x):
    """`[batch, B, *s]` -> `[batch * B, *s]`."""
    return ops.reshape(x, (-1, *ops.shape(x)[2:]))


def unfold_model_axis(x, num_models):
    """`[batch * B, *s]` -> `[batch, B, *s]`."""
    return ops.reshape(x, (-1, num_models, *ops.shape(x)[1:]))


def has_random_state(layer):
    """Whether `layer` draws random numbers (dropout, noise, ...)."""
    return any(isinstance(value, keras.random.SeedGenerator)
               for value in vars(layer).values())


@hftatf_export
@registry.register(*PER_SAMPLE_LAYERS)
class FusedFold(keras.layers.Wrapper):
    """Applies a stock per-sample layer without weights to every model.

    Layout: each input `[batch, B, ...]` (the stock layer's input with a
    model axis at 1) -> output `[batch, B, ...]`; masks likewise. No weights.

    Random layers (`Dropout`, `GaussianNoise`, ...) draw over the folded batch,
    so every model gets its own independent mask, as B separate jobs would.

    Args:
        layer: the stock Keras layer. It must have no weights and must treat
            every sample independently.
        num_models: the number of models `B` in the array.
    """

    def __init__(self, layer, num_models, **kwargs):
        super().__init__(layer, **kwargs)
        self.num_models = check_num_models(num_models)
        self.supports_masking = getattr(layer, "supports_masking", False)

    @classmethod
    def from_stock(cls, layer, num_models):
        copy = type(layer).from_config(layer.get_config())
        return cls(copy, num_models, name=layer.name)

    def build(self, input_shape):
        if not self.layer.built:
            self.layer.build(keras.tree.map_shape_structure(
                self._fold_shape, input_shape))
        if self.layer.weights:
            raise ValueError(
                f"FusedFold can only wrap layers without weights; layer "
                f"'{self.layer.name}' has {len(self.layer.weights)}. Use the "
                "layer's fused form from hftatf.layers instead."
            )
        self.built = True

    def _fold_shape(self, shape):
        check_model_axis(self.name, self.num_models, shape)
        batch = None if shape[0] is None else shape[0] * self.num_models
        return (batch, *shape[2:])

    def _unfold_shape(self, shape):
        batch = None if shape[0] is None else shape[0] // self.num_models
        return (batch, self.num_models, *shape[1:])

    def call(self, inputs, training=None, mask=None):
        # Checked on every call: a wrong model axis would otherwise fold
        # samples of different models together without an error.
        for x in keras.tree.flatten(inputs):
            check_model_axis(self.name, self.num_models, tuple(x.shape))
        kwargs = {}
        if self.layer._call_has_training_arg and training is not None:
            kwargs["training"] = training
        if mask is not None and self.layer._call_has_mask_arg:
            kwargs["mask"] = keras.tree.map_structure(
                lambda m: None if m is None else fold_model_axis(m), mask)
        outputs = self.layer(
            keras.tree.map_structure(fold_model_axis, inputs), **kwargs)
        return keras.tree.map_structure(
            lambda y: unfold_model_axis(y, self.num_models), outputs)

    def compute_mask(self, inputs, mask=None):
        if not self.supports_masking and mask is None:
            return None
        folded_mask = None if mask is None else keras.tree.map_structure(
            lambda m: None if m is None else fold_model_axis(m), mask)
        folded = self.layer.compute_mask(
            keras.tree.map_structure(fold_model_axis, inputs), folded_mask)
        if folded is None:
            return None
        return keras.tree.map_structure(
            lambda m: unfold_model_axis(m, self.num_models), folded)

    def compute_output_shape(self, input_shape):
        folded = self.layer.compute_output_shape(keras.tree.map_shape_structure(
            self._fold_shape, input_shape))
        return keras.tree.map_shape_structure(self._unfold_shape, folded)

    def get_config(self):
        config = super().get_config()
        config["num_models"] = self.num_models
        return config


@hftatf_export
class BroadcastToModels(keras.layers.Layer):
    """Gives every model of the array the same input batch.

    Layout: input `[batch, ...]` (shared by all models) -> output
    `[batch, B, ...]`. No weights. `hftatf.fuse` inserts it where a shared
    input first meets a layer that needs per-model activations; in the
    backward pass the models' gradients are summed, as they should be for a
    shared input.
    """

    def __init__(self, num_models, **kwargs):
        super().__init__(**kwargs)
        self.num_models = check_num_models(num_models)
        self.supports_masking = True

    def call(self, inputs):
        return ops.repeat(ops.expand_dims(inputs, 1), self.num_models, axis=1)

    def compute_mask(self, inputs, mask=None):
        if mask is None:
            return None
        return ops.repeat(ops.expand_dims(mask, 1), self.num_models, axis=1)

    def compute_output_shape(self, input_shape):
        return (input_shape[0], self.num_models, *input_shape[1:])

    def get_config(self):
        config = super().get_config()
        config["num_models"] = self.num_models
        return config
