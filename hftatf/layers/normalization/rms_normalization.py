"""Fused `RMSNormalization`."""
import keras
from keras import ops

from hftatf.api import hftatf_export
from hftatf.core.validation import check_model_axis
from hftatf.layers import registry
from hftatf.layers.base import FusedLayer
from hftatf.layers.normalization.base_normalization import (
    fused_axis,
    resolve_axis,
    stock_shape,
)


@hftatf_export
@registry.register(keras.layers.RMSNormalization)
class FusedRMSNormalization(FusedLayer):
    """`keras.layers.RMSNormalization` for an array of `num_models` models.

    Layout: input `[batch, B, ...]` -> output of the same shape; scale
    `[B, *stock scale shape]` (the sizes of the normalised axes). Model `b`
    computes `x * rsqrt(mean(x**2 over axis) + epsilon) * scale[b]`, in at
    least float32, with the scale broadcast against the trailing axes as in
    the stock layer.

    Args:
        num_models: the number of models `B` in the array.
        axis, epsilon: as in `keras.layers.RMSNormalization`; stock axes
            count the stock input's axes (the model axis is not one of them).
    """

    def __init__(self, num_models, axis=-1, epsilon=1e-6, **kwargs):
        super().__init__(num_models, **kwargs)
        self.axis = axis
        self.epsilon = epsilon

    def build(self, input_shape):
        check_model_axis(self.name, self.num_models, input_shape)
        shape = stock_shape(input_shape)
        axes = self.axis if isinstance(self.axis, (list, tuple)) else [
            self.axis]
        self.axis = sorted(axes) if isinstance(self.axis, (list, tuple)) else [
            self.axis]
        resolved = [resolve_axis(self.name, a, len(shape)) for a in self.axis]
        self._norm_axes = [fused_axis(a) for a in resolved]
        self._scale_shape = tuple(shape[a] for a in self.axis)
        self.scale = self.add_model_weight(self._scale_shape, name="scale",
                                           initializer="ones")

    def call(self, inputs):
        original_dtype = keras.backend.standardize_dtype(inputs.dtype)
        dtype = keras.backend.result_type(inputs.dtype, "float32")
        x = ops.cast(inputs, dtype)
        rrms = ops.rsqrt(ops.mean(ops.square(x), axis=self._norm_axes,
                                  keepdims=True) + self.epsilon)
        # As the stock layer, the scale aligns with the trailing axes; the
        # model axis of the scale aligns with the activations' axis 1.
        padding = (1,) * (len(inputs.shape) - 2 - len(self._scale_shape))
        scale = ops.reshape(ops.cast(self.scale, dtype),
                            (self.num_models, *padding, *self._scale_shape))
        return ops.cast(x * rrms * scale, original_dtype)

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        return {**super().get_config(), "axis": self.axis,
                "epsilon": self.epsilon}
