"""Fused `Normalization` (the preprocessing layer)."""
import keras
import numpy as np
from keras import ops

from hftatf.api import hftatf_export
from hftatf.core.validation import check_model_axis
from hftatf.layers import registry
from hftatf.layers.base import FusedLayer
from hftatf.layers.normalization.base_normalization import (
    stock_shape,
    to_model_broadcast,
)


@hftatf_export
@registry.register(keras.layers.Normalization)
class FusedNormalization(FusedLayer):
    """`keras.layers.Normalization` (preprocessing) for an array of models.

    Layout (`s` = the sizes of the stock kept `axis`, in sorted order):
        input and output: `[batch, B, ...]`; a mask passes through.
        Adapted form (built without `mean`/`variance`): non-trainable mean
            `[B, *s]`, variance `[B, *s]` and count `[B]` (int), the stock
            layer's weights per model.
        Constant form (`mean` and `variance` given): no weights, like the
            stock layer; the constants are shared by every model.

    Model `b` computes exactly what the stock layer computes with its
    statistics: `(x - mean) / max(sqrt(variance), epsilon)`, or with
    `invert=True`, `mean + x * max(sqrt(variance), epsilon)`, in the layer's
    compute dtype. The statistics are read at every call, so statistics set
    with `set_weights` (e.g. by `hftatf.fuse_models`) take effect at once.

    Args:
        num_models: the number of models `B` in the array.
        axis: the stock input axes that keep their own statistics (an int, a
            sequence, or None for one scalar statistic); stock axis `a >= 1`
            is fused axis `a + 1`. The model axis always keeps its own.
        mean, variance, invert: as in `keras.layers.Normalization`.
    """

    def __init__(self, num_models, axis=-1, mean=None, variance=None,
                 invert=False, **kwargs):
        super().__init__(num_models, **kwargs)
        if axis is None:
            axis = ()
        elif isinstance(axis, int):
            axis = (axis,)
        else:
            axis = tuple(axis)
        self.axis = axis
        self.input_mean = mean
        self.input_variance = variance
        self.invert = invert
        self.supports_masking = True
        if (mean is not None) != (variance is not None):
            raise ValueError(
                "When setting values directly, both `mean` and `variance` "
                f"must be set. Received: mean={mean} and variance={variance}")
        if mean is not None:
            if np.shape(mean) != np.shape(variance):
                raise ValueError(
                    "When setting values directly, `mean` and `variance` "
                    "must have the same shape. Received: mean shape "
                    f"{np.shape(mean)} and variance shape "
                    f"{np.shape(variance)}")
            if len(np.shape(mean)) > len(self.axis):
                raise ValueError(
                    "The rank of `mean` must be less than or equal to the "
                    f"number of axes ({len(self.axis)}). Received: mean "
                    f"shape {np.shape(mean)} for axis {self.axis}")
        self.adapt_mean = None
        self.adapt_variance = None
        self.count = None

    def build(self, input_shape):
        check_model_axis(self.name, self.num_models, input_shape)
        shape = stock_shape(input_shape)
        ndim = len(shape)
        if any(a < -ndim or a >= ndim for a in self.axis):
            raise ValueError(
                "All `axis` values must be in the range [-ndim, ndim), ndim "
                f"being the rank of the stock input (the fused input without "
                f"its model axis). Received inputs with ndim={ndim}, while "
                f"axis={self.axis}")
        keep = tuple(sorted(a % ndim for a in self.axis))
        for a in keep:
            if shape[a] is None:
                raise ValueError(
                    "All `axis` values to be kept must have a known shape. "
                    f"Received axis={self.axis}, inputs.shape="
                    f"{tuple(input_shape)}, with unknown stock axis {a}")
        self._stock_broadcast_shape = [shape[a] if a in keep else 1
                                       for a in range(ndim)]
        statistics_shape = tuple(shape[a] for a in keep)
        if self.input_mean is None:
            self.adapt_mean = self.add_model_weight(
                statistics_shape, name="mean", initializer="zeros",
                trainable=False)
            self.adapt_variance = self.add_model_weight(
                statistics_shape, name="variance", initializer="ones",
                trainable=False)
            self.count = self.add_model_weight(
                (), name="count", initializer="zeros", trainable=False,
                dtype="int")
        else:
            self._constant_mean, self._constant_variance = (
                self._constant_statistics(keep, ndim))

    def _constant_statistics(self, keep, ndim):
        """The stock layer's broadcast constants, with a model axis of 1."""
        statistics = []
        for value in (self.input_mean, self.input_variance):
            value = np.asarray(value, dtype="float32")
            expanded = [1] * ndim
            for i in range(1, value.ndim + 1):
                expanded[keep[-i]] = value.shape[-i]
            value = np.broadcast_to(np.reshape(value, expanded),
                                    self._stock_broadcast_shape)
            statistics.append(np.expand_dims(value, 1))
        return statistics

    def adapt(self, data):
        """Sets each model's statistics from its own data.

        Model `b` gets what the stock layer's `adapt` computes on `data[:, b]`.

        Args:
            data: a NumPy array or tensor `[batch, B, ...]`.
        """
        if self.input_mean is not None:
            raise ValueError(
                f"Layer '{self.name}' was given `mean` and `variance` "
                "values; it has no statistics to adapt. Construct it without "
                "them to adapt it.")
        data = ops.convert_to_numpy(data)
        check_model_axis(self.name, self.num_models, data.shape)
        if not self.built:
            self.build(data.shape)
        for b in range(self.num_models):
            stock = keras.layers.Normalization(axis=self.axis,
                                               dtype=self.dtype_policy)
            stock.adapt(data[:, b])
            self.set_model_weights(b, stock.get_weights())

    def call(self, inputs):
        inputs = ops.cast(inputs, self.compute_dtype)
        if self.input_mean is None:
            mean = to_model_broadcast(self.adapt_mean,
                                      self._stock_broadcast_shape)
            variance = to_model_broadcast(self.adapt_variance,
                                          self._stock_broadcast_shape)
        else:
            mean, variance = self._constant_mean, self._constant_variance
        mean = ops.cast(mean, self.compute_dtype)
        variance = ops.cast(variance, self.compute_dtype)
        stddev = ops.maximum(ops.sqrt(variance), keras.backend.epsilon())
        if self.invert:
            return ops.add(mean, ops.multiply(inputs, stddev))
        return ops.divide(ops.subtract(inputs, mean), stddev)

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        config = super().get_config()
        config.update({
            "axis": self.axis,
            "invert": self.invert,
            "mean": np.array(self.input_mean).tolist(),
            "variance": np.array(self.input_variance).tolist(),
        })
        return config
