"""Fused forms of the layers that `keras.applications` defines itself."""

import keras

from hftatf.api import hftatf_export
from hftatf.core import compat
from hftatf.core.validation import check_model_axis
from hftatf.layers import registry
from hftatf.layers.base import FusedLayer
from hftatf.layers.fold import FusedFold

# InceptionResNetV2's residual merge, `inputs[0] + inputs[1] * scale`: no
# weights, each sample on its own, so it folds like a stock merge.
registry.register(compat.CustomScaleLayer)(FusedFold)

__all__ = ["FusedLayerScale"]


@hftatf_export
@registry.register(compat.LayerScale)
class FusedLayerScale(FusedLayer):
    """ConvNeXt's `LayerScale` for an array: a learned per-channel scale.

    Layout: input `[batch, B, ..., projection_dim]` -> output of the same
    shape; gamma `[B, projection_dim]`, each slice initialised to
    `init_values` as in the stock layer. Model `b` computes `x[:, b] *
    gamma[b]`.

    Args:
        num_models: the number of models `B` in the array.
        init_values, projection_dim: as in
            `keras.applications.compat.LayerScale`.
    """

    def __init__(self, num_models, init_values, projection_dim, **kwargs):
        super().__init__(num_models, **kwargs)
        self.init_values = init_values
        self.projection_dim = projection_dim

    def build(self, input_shape):
        check_model_axis(self.name, self.num_models, input_shape)
        self.gamma = self.add_model_weight(
            (self.projection_dim,), name="gamma",
            initializer=keras.initializers.Constant(self.init_values))

    def call(self, inputs):
        inner = (1,) * (len(inputs.shape) - 3)
        return inputs * keras.ops.reshape(
            self.gamma, (self.num_models, *inner, self.projection_dim))

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        config = super().get_config()
        config.update(init_values=self.init_values,
                      projection_dim=self.projection_dim)
        return config
