"""Fused activation layers with weights.

Activation layers without weights (`ReLU`, `Softmax`, ...) fold the model axis
into the batch (`hftatf.layers.fold`); only `PReLU` learns a weight.
"""

import keras

from hftatf.api import hftatf_export
from hftatf.core.validation import check_model_axis
from hftatf.layers import registry
from hftatf.layers.base import FusedLayer

__all__ = ["FusedActivityRegularization", "FusedPReLU"]


@hftatf_export
@registry.register(keras.layers.PReLU)
class FusedPReLU(FusedLayer):
    """`keras.layers.PReLU` for an array of `num_models` models.

    Layout:
        input and output: `[batch, B, ...]`; a mask passes through.
        alpha: `[B, *s]`, where `s` is the stock alpha shape: the stock
            input shape without its batch axis, with size 1 on every axis of
            `shared_axes`.

    Model `b` computes `relu(x) - alpha[b] * relu(-x)` on `x[:, b]`, exactly
    the stock layer with weight `alpha[b]`.

    Args:
        num_models: the number of models `B` in the array.
        alpha_initializer, alpha_regularizer, alpha_constraint: as in
            `keras.layers.PReLU`; they act on each model's slice.
        shared_axes: as in `keras.layers.PReLU`: axes of the stock input
            (`1` is the first axis after the batch) along which every
            position shares one alpha. Stock axis `a` is fused axis `a + 1`.
    """

    def __init__(
        self,
        num_models,
        alpha_initializer="Zeros",
        alpha_regularizer=None,
        alpha_constraint=None,
        shared_axes=None,
        **kwargs,
    ):
        super().__init__(num_models, **kwargs)
        self.supports_masking = True
        self.alpha_initializer = keras.initializers.get(alpha_initializer)
        self.alpha_regularizer = keras.regularizers.get(alpha_regularizer)
        self.alpha_constraint = keras.constraints.get(alpha_constraint)
        if shared_axes is None:
            self.shared_axes = None
        elif not isinstance(shared_axes, (list, tuple)):
            self.shared_axes = [shared_axes]
        else:
            self.shared_axes = list(shared_axes)

    def build(self, input_shape):
        check_model_axis(self.name, self.num_models, input_shape)
        # The stock rules, applied to the stock input shape.
        shape = (input_shape[0], *input_shape[2:])
        alpha_shape = list(shape[1:])
        for axis in self.shared_axes or ():
            alpha_shape[axis - 1] = 1
        self.alpha = self.add_model_weight(
            alpha_shape,
            name="alpha",
            initializer=self.alpha_initializer,
            regularizer=self.alpha_regularizer,
            constraint=self.alpha_constraint,
        )
        axes = {1: self.num_models}
        if self.shared_axes:
            for axis in range(1, len(shape)):
                if axis not in self.shared_axes:
                    axes[axis + 1] = shape[axis]
        self.input_spec = keras.layers.InputSpec(ndim=len(input_shape),
                                                 axes=axes)

    def call(self, inputs):
        # alpha `[B, *s]` lines up with the trailing axes `[B, ...]` of the
        # input, so each model's slice meets its own alpha.
        positive = keras.activations.relu(inputs)
        negative = -self.alpha * keras.activations.relu(-inputs)
        return positive + negative

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        config = super().get_config()
        config.update({
            "alpha_initializer": keras.initializers.serialize(
                self.alpha_initializer),
            "alpha_regularizer": keras.regularizers.serialize(
                self.alpha_regularizer),
            "alpha_constraint": keras.constraints.serialize(
                self.alpha_constraint),
            "shared_axes": self.shared_axes,
        })
        return config


@hftatf_export
@registry.register(keras.layers.ActivityRegularization)
class FusedActivityRegularization(FusedLayer):
    """`keras.layers.ActivityRegularization` for an array: the identity, plus
    an L1/L2 penalty on its input counted per model.

    Layout: input `[batch, B, ...]` -> the same tensor. No weights. Model
    `b`'s loss gains `(l1 * sum|x[:, b]| + l2 * sum x[:, b]**2) / batch`,
    as the stock layer adds to a stock model's loss.

    Args:
        num_models: the number of models `B` in the array.
        l1, l2: as in `keras.layers.ActivityRegularization`.
    """

    def __init__(self, num_models, l1=0.0, l2=0.0, **kwargs):
        kwargs.pop("activity_regularizer", None)
        super().__init__(
            num_models,
            activity_regularizer=keras.regularizers.L1L2(l1=l1, l2=l2),
            **kwargs)
        self.supports_masking = True
        self.l1 = l1
        self.l2 = l2

    def call(self, inputs):
        return inputs

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        config = super().get_config()
        config.pop("activity_regularizer", None)
        return {**config, "l1": self.l1, "l2": self.l2}
