"""Fused normalization layers.

`BatchNormalization`, `LayerNormalization`, `GroupNormalization` and the
preprocessing layer `Normalization`, vectorised over the model axis. Every
activation is `[batch, B, ...]`; every weight, moving statistics included,
is `[B, *stock weight shape]`. Statistics are always taken per model: the
model axis is never normalised over.

Axis arguments keep their stock meaning: they name axes of the stock input
(`[batch, ...]`). Stock axis 0 (the batch) is fused axis 0, stock axis
`a >= 1` is fused axis `a + 1`, and a negative stock axis is resolved against
the stock rank first (so `-ndim` is still the batch axis).
"""

import warnings

import keras
import numpy as np
from keras import ops

from hftatf.api import hftatf_export
from hftatf.core.axis import pieces_if_stacked, stack_models
from hftatf.core.devices import compiling_with_xla
from hftatf.core.validation import check_model_axis
from hftatf.layers import registry
from hftatf.layers.base import FusedLayer
from hftatf.layers.kernels import as_one_sample, batch_matmul

__all__ = [
    "FusedBatchNormalization",
    "FusedGroupNormalization",
    "FusedLayerNormalization",
    "FusedNormalization",
    "FusedRMSNormalization",
]


def stock_shape(shape, model_axis=1):
    """The stock layer's input shape: `shape` without its model axis."""
    return (shape[1 - model_axis], *shape[2:])


def resolve_axis(layer_name, axis, ndim):
    """Stock `axis` of a rank-`ndim` stock input as a non-negative int."""
    if not -ndim <= axis < ndim:
        raise ValueError(
            f"Axis {axis} of layer '{layer_name}' is out of bounds for a "
            f"stock input of rank {ndim} (the fused input without its model "
            f"axis). Expected an axis in [{-ndim}, {ndim}).")
    return axis % ndim


def fused_axis(axis):
    """The fused axis of non-negative stock `axis`: the model axis is 1."""
    return axis if axis == 0 else axis + 1


def to_model_broadcast(weight, stock_broadcast_shape, model_axis=1):
    """`[B, *w]` -> a tensor that broadcasts against `[batch, B, ...]`
    (against `[B, batch, ...]` with `model_axis=0`).

    Each slice is reshaped as the stock layer reshapes its weight (to
    `stock_broadcast_shape`, a shape of the stock rank), then the model axis
    is moved to `model_axis`.
    """
    per_model = ops.reshape(weight, (-1, *stock_broadcast_shape))
    return ops.moveaxis(per_model, 0, model_axis)


def from_model_broadcast(statistic, weight_shape, model_axis=1):
    """Inverse of `to_model_broadcast`: keep-dims statistics -> `[B, *w]`."""
    return ops.reshape(ops.moveaxis(statistic, model_axis, 0),
                       (-1, *weight_shape))


def _rows(inputs, num_models):
    """`[batch, B, *s, C]` -> `[batch, B, S, C]`, `S` = the product of `s`
    (1 when there is none): a reshape, no copy."""
    shape = ops.shape(inputs)
    return ops.reshape(inputs, (shape[0], num_models, -1, shape[-1]))


def _stock_rows(inputs):
    """One model's `[batch, 1, *s, C]` (or `[1, batch, *s, C]`, the same
    memory) -> `[batch * S, C]`: the stock layer's reductions and
    broadcasts, a reshape away."""
    return ops.reshape(inputs, (-1, ops.shape(inputs)[-1]))


def _per_sample(statistic, rows):
    """`[B, C]` -> `[B, S, C]`, repeated over the `S` positions of `rows`
    (`[batch, B, S, C]`): one sample (`as_one_sample`), in `rows`' dtype."""
    return as_one_sample(
        ops.expand_dims(ops.cast(statistic, rows.dtype), 1), rows)


def _channels_last_moments(inputs, num_models):
    """Each model's mean and variance over the batch and every axis but the
    model and (last) channel axes, `[B, C]` each, as `tf.nn.moments`
    computes them: the mean, then the mean squared difference from it.

    Sums are taken over the batch first, then over the positions of a
    sample: one reduction over axes `(0, 2, ...)` of `[batch, B, ..., C]`
    is several times slower for TensorFlow's CPU kernels. For those, the
    sum over the batch is a product with a row of ones (their reduction of
    a leading axis is slower still); XLA compiles the plain sums well.
    """
    if num_models == 1:
        mean, variance = ops.moments(_stock_rows(inputs), axes=[0])
        return mean[None], variance[None]
    rows = _rows(inputs, num_models)
    shape = ops.shape(rows)
    count = ops.cast(shape[0] * shape[2], rows.dtype)
    xla = compiling_with_xla()

    def mean(values):
        if xla:
            over_batch = ops.sum(values, axis=0)
        else:
            ones = ops.ones((1, shape[0]), values.dtype)
            over_batch = ops.reshape(
                ops.matmul(ones, ops.reshape(values, (shape[0], -1))),
                shape[1:])
        return ops.sum(over_batch, axis=1) / count

    average = mean(rows)
    centred = rows - _per_sample(ops.stop_gradient(average), rows)
    return average, mean(ops.square(centred))


def _models_first_rows(inputs, num_models):
    """`[B, batch, *s, C]` -> `[B, batch * S, C]`: a reshape, no copy."""
    return ops.reshape(inputs, (num_models, -1, ops.shape(inputs)[-1]))


def _models_first_moments(inputs, num_models):
    """`_channels_last_moments` of activations with the models first,
    `[B, batch, *s, C]`: each model's rows are contiguous, and their sums
    are one batched product with a row of ones (TensorFlow's CPU kernels
    reduce a middle axis more slowly; XLA compiles the plain sums well)."""
    rows = _models_first_rows(inputs, num_models)
    count = ops.shape(rows)[1]
    xla = compiling_with_xla()

    def mean(values):
        if xla:
            total = ops.sum(values, axis=1)
        else:
            total = ops.squeeze(batch_matmul(
                ops.ones((1, 1, count), values.dtype), values), 1)
        return total / ops.cast(count, values.dtype)

    average = mean(rows)
    centred = rows - ops.expand_dims(ops.stop_gradient(average), 1)
    return average, mean(ops.square(centred))


class AffineNormalization(FusedLayer):
    """Base of the fused normalizations with a learned scale and offset.

    Holds what `BatchNormalization`, `LayerNormalization` and
    `GroupNormalization` share: `epsilon`, the optional `gamma` (scale) and
    `beta` (offset) weights, each `[B, *stock shape]`, with their
    initializers, regularizers and constraints (applied per model slice).
    Like the stock layers, every weight is read in its own dtype (float32)
    under a mixed precision policy, never autocast to the compute dtype.
    """

    def __init__(
        self,
        num_models,
        axis,
        epsilon,
        center,
        scale,
        beta_initializer,
        gamma_initializer,
        beta_regularizer,
        gamma_regularizer,
        beta_constraint,
        gamma_constraint,
        **kwargs,
    ):
        super().__init__(num_models, **kwargs)
        self.axis = axis
        self.epsilon = epsilon
        self.center = center
        self.scale = scale
        self.beta_initializer = keras.initializers.get(beta_initializer)
        self.gamma_initializer = keras.initializers.get(gamma_initializer)
        self.beta_regularizer = keras.regularizers.get(beta_regularizer)
        self.gamma_regularizer = keras.regularizers.get(gamma_regularizer)
        self.beta_constraint = keras.constraints.get(beta_constraint)
        self.gamma_constraint = keras.constraints.get(gamma_constraint)
        self.supports_masking = True
        self.gamma = None
        self.beta = None

    def add_model_weight(self, *args, autocast=False, **kwargs):
        # The stock layers create every weight with `autocast=False`: under
        # mixed precision they compute in float32 from float32 weights.
        return super().add_model_weight(*args, autocast=autocast, **kwargs)

    def _stock_input_shape(self, input_shape):
        check_model_axis(self.name, self.num_models, input_shape,
                         self.model_axis)
        return stock_shape(input_shape, self.model_axis)

    def _add_affine_weights(self, shape, scale, center):
        if scale:
            self.gamma = self.add_model_weight(
                shape,
                name="gamma",
                initializer=self.gamma_initializer,
                regularizer=self.gamma_regularizer,
                constraint=self.gamma_constraint,
            )
        if center:
            self.beta = self.add_model_weight(
                shape,
                name="beta",
                initializer=self.beta_initializer,
                regularizer=self.beta_regularizer,
                constraint=self.beta_constraint,
            )

    def _broadcast_weight(self, weight, dtype, stock_broadcast_shape, like):
        """`weight` (`[B, *w]`) as one sample of `like` (`[batch, B,
        ...]`), in `dtype`."""
        if weight is None:
            return None
        return as_one_sample(ops.cast(
            to_model_broadcast(weight, stock_broadcast_shape), dtype), like)

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        config = super().get_config()
        config.update({
            "axis": self.axis,
            "epsilon": self.epsilon,
            "center": self.center,
            "scale": self.scale,
            "beta_initializer": keras.initializers.serialize(
                self.beta_initializer),
            "gamma_initializer": keras.initializers.serialize(
                self.gamma_initializer),
            "beta_regularizer": keras.regularizers.serialize(
                self.beta_regularizer),
            "gamma_regularizer": keras.regularizers.serialize(
                self.gamma_regularizer),
            "beta_constraint": keras.constraints.serialize(
                self.beta_constraint),
            "gamma_constraint": keras.constraints.serialize(
                self.gamma_constraint),
        })
        return config


def _check_renorm_clipping(renorm_clipping):
    keys = ["rmax", "rmin", "dmax"]
    if set(renorm_clipping) - set(keys):
        raise ValueError(
            "Received invalid keys for `renorm_clipping` argument: "
            f"{renorm_clipping}. Supported values: {keys}.")
    rmax = renorm_clipping.get("rmax")
    rmin = renorm_clipping.get("rmin")
    dmax = renorm_clipping.get("dmax")
    if rmax is not None and rmin is not None and rmax < rmin:
        raise ValueError(
            "rmax should be greater than rmin in the `renorm_clipping` "
            f"argument. Received: rmax={rmax}, rmin={rmin}.")
    if dmax is not None and dmax < 0:
        raise ValueError(
            "dmax should be non-negative in the `renorm_clipping` argument. "
            f"Received: dmax={dmax}.")


@hftatf_export
@registry.register(keras.layers.BatchNormalization)
class FusedBatchNormalization(AffineNormalization):
    """`keras.layers.BatchNormalization` for an array of `num_models` models.

    Layout (`C` = size of the normalised stock axis):
        input and output: `[batch, B, ...]`; mask (optional):
            `[batch, B, ...]`, one axis less than the input.
        gamma, beta, moving_mean, moving_variance: `[B, C]`; with
            `renorm=True` also moving_stddev, renorm_mean, renorm_stddev:
            `[B, C]`. Same order as the stock layer's `get_weights()`.

    Model `b` computes exactly what the stock layer computes with weights
    `w[b]` on `x[:, b]`. In training (`training=True` and the layer
    trainable) each model normalises with the moments of its own batch, taken
    over the batch and every axis but the model axis and `axis` (masked
    moments when a mask is given, as the stock layer computes them), and
    updates its own moving statistics as a stock layer would. Otherwise
    (`training` False or None, or `trainable=False`, as in Keras 3) it
    normalises with its moving statistics. With `synchronized=True` the
    moments of each model are taken across replicas of a `tf.distribute`
    strategy, exactly as the stock layer takes them.

    Args:
        num_models: the number of models `B` in the array.
        axis: as in `keras.layers.BatchNormalization`: one axis of the stock
            input (an int); stock axis `a >= 1` is fused axis `a + 1`.
        momentum, epsilon, center, scale, beta_initializer,
        gamma_initializer, moving_mean_initializer,
        moving_variance_initializer, beta_regularizer, gamma_regularizer,
        beta_constraint, gamma_constraint, renorm, renorm_clipping,
        renorm_momentum, synchronized: as in
            `keras.layers.BatchNormalization`; initializers, regularizers and
            constraints act on each model's slice.
        models_first: whether inputs, outputs and masks have the models
            first, `[B, batch, ...]`.
    """

    supports_models_first = True

    @classmethod
    def takes_models_first(cls, layer):
        # Where the channels are last, each model's rows are contiguous with
        # the models first: its moments are a reshape and a product away.
        try:
            ndim = len(layer.input.shape)
        except (AttributeError, ValueError):
            ndim = None
        return layer.axis == -1 or (ndim is not None
                                    and layer.axis == ndim - 1)

    def __init__(
        self,
        num_models,
        axis=-1,
        momentum=0.99,
        epsilon=1e-3,
        center=True,
        scale=True,
        beta_initializer="zeros",
        gamma_initializer="ones",
        moving_mean_initializer="zeros",
        moving_variance_initializer="ones",
        beta_regularizer=None,
        gamma_regularizer=None,
        beta_constraint=None,
        gamma_constraint=None,
        renorm=False,
        renorm_clipping=None,
        renorm_momentum=0.99,
        synchronized=False,
        **kwargs,
    ):
        if isinstance(axis, (list, tuple)):
            raise TypeError(
                "keras.layers.BatchNormalization normalises over one axis, "
                f"an int. Received: axis={axis!r}. Pass a single axis, or "
                "reshape the input so that the normalised axes form one.")
        super().__init__(
            num_models,
            axis=int(axis),
            epsilon=float(epsilon),
            center=center,
            scale=scale,
            beta_initializer=beta_initializer,
            gamma_initializer=gamma_initializer,
            beta_regularizer=beta_regularizer,
            gamma_regularizer=gamma_regularizer,
            beta_constraint=beta_constraint,
            gamma_constraint=gamma_constraint,
            **kwargs,
        )
        if synchronized and keras.backend.backend() != "tensorflow":
            raise ValueError(
                "Argument synchronized=True is only supported with the "
                "TensorFlow backend.")
        self.synchronized = synchronized
        self.momentum = float(momentum)
        self.moving_mean_initializer = keras.initializers.get(
            moving_mean_initializer)
        self.moving_variance_initializer = keras.initializers.get(
            moving_variance_initializer)
        self.renorm = renorm
        if renorm:
            renorm_clipping = renorm_clipping or {}
            _check_renorm_clipping(renorm_clipping)
        self.renorm_clipping = renorm_clipping
        self.renorm_momentum = renorm_momentum
        self.moving_mean = None
        self.moving_variance = None

    def build(self, input_shape):
        shape = self._stock_input_shape(input_shape)
        axis = resolve_axis(self.name, self.axis, len(shape))
        channels = shape[axis]
        if channels is None:
            raise ValueError(
                f"Axis {self.axis} of the input of layer '{self.name}' must "
                f"have a known size. Received input shape "
                f"{tuple(input_shape)}.")
        self._channel_axis = fused_axis(axis)
        self._reduction_axes = [
            a for a in range(len(input_shape))
            if a not in (self.model_axis, self._channel_axis)]
        self._stock_broadcast_shape = [1] * len(shape)
        self._stock_broadcast_shape[axis] = channels
        weight_shape = (channels,)
        self._add_affine_weights(weight_shape, self.scale, self.center)
        self.moving_mean = self.add_model_weight(
            weight_shape, name="moving_mean",
            initializer=self.moving_mean_initializer, trainable=False)
        self.moving_variance = self.add_model_weight(
            weight_shape, name="moving_variance",
            initializer=self.moving_variance_initializer, trainable=False)
        if self.renorm:
            # Batch renormalization tracks standard deviations, which start
            # at the square root of the moving variance's initial value.
            def moving_stddev_initializer(shape, dtype=None):
                return ops.sqrt(
                    self.moving_variance_initializer(shape, dtype=dtype))

            self.moving_stddev = self.add_model_weight(
                weight_shape, name="moving_stddev",
                initializer=moving_stddev_initializer, trainable=False)
            self.renorm_mean = self.add_model_weight(
                weight_shape, name="renorm_mean",
                initializer=self.moving_mean_initializer, trainable=False)
            self.renorm_stddev = self.add_model_weight(
                weight_shape, name="renorm_stddev",
                initializer=moving_stddev_initializer, trainable=False)
        self.input_spec = keras.layers.InputSpec(
            ndim=len(input_shape),
            axes={self.model_axis: self.num_models,
                  self._channel_axis: channels})

    def call(self, inputs, training=None, mask=None):
        if mask is not None and len(mask.shape) != len(inputs.shape) - 1:
            raise ValueError(
                "The mask provided should be one dimension less than the "
                f"inputs. Received: mask.shape={mask.shape}, "
                f"inputs.shape={inputs.shape}")
        # The stock layer computes in (at least) float32: half-precision
        # moments overflow.
        dtype = keras.backend.result_type(inputs.dtype, "float32")
        inputs = ops.cast(inputs, dtype)
        moving_mean = ops.cast(self.moving_mean, dtype)
        moving_variance = ops.cast(self.moving_variance, dtype)
        gamma = None if self.gamma is None else ops.cast(self.gamma, dtype)
        beta = None if self.beta is None else ops.cast(self.beta, dtype)
        if training and self.trainable:
            mean, variance = self._moments(inputs, mask)
            if self.renorm:
                r, d = self._renorm_correction(mean, variance)
                gamma, beta = self._compose_transforms(
                    r, d, gamma, beta, dtype)
                self._update_renorm_statistics(mean, variance)
            else:
                self.moving_mean.assign(
                    moving_mean * self.momentum
                    + mean * (1.0 - self.momentum))
                self.moving_variance.assign(
                    moving_variance * self.momentum
                    + variance * (1.0 - self.momentum))
        else:
            mean, variance = moving_mean, moving_variance
        outputs = self._normalize(inputs, mean, variance, gamma, beta)
        return ops.cast(outputs, self.compute_dtype)

    def _broadcast(self, value):
        return to_model_broadcast(value, self._stock_broadcast_shape,
                                  self.model_axis)

    def _channels_last(self, inputs):
        return self._channel_axis == len(inputs.shape) - 1

    def _pieces(self, inputs):
        """Each model's `[batch, ..., C]` where a per-model layer stacked
        `inputs` from them (`pieces_if_stacked`): the stock layer's arithmetic
        then runs on each, with no stacked copy of the activations."""
        if not self._channels_last(inputs) or self.synchronized:
            return None
        return pieces_if_stacked(inputs, self.num_models, self.model_axis)

    def _normalize(self, inputs, mean, variance, gamma, beta):
        # The arithmetic of `tf.nn.batch_normalization`, which the stock
        # layer calls, on `[B, C]` statistics.
        inv = ops.rsqrt(variance + self.epsilon)
        if gamma is not None:
            inv = inv * gamma
        shift = -mean * inv if beta is None else beta - mean * inv
        pieces = self._pieces(inputs)
        if pieces is not None:
            return stack_models([
                ops.reshape(_stock_rows(piece) * scale + offset,
                            ops.shape(piece))
                for piece, scale, offset in zip(
                    pieces, ops.unstack(inv), ops.unstack(shift))],
                self.model_axis)
        if self._channels_last(inputs) and self.num_models == 1:
            outputs = _stock_rows(inputs) * inv[0] + shift[0]
            return ops.reshape(outputs, ops.shape(inputs))
        if self._channels_last(inputs) and self.models_first:
            rows = _models_first_rows(inputs, self.num_models)
            outputs = (rows * ops.expand_dims(inv, 1)
                       + ops.expand_dims(shift, 1))
            return ops.reshape(outputs, ops.shape(inputs))
        if self._channels_last(inputs):
            rows = _rows(inputs, self.num_models)
            outputs = (rows * _per_sample(inv, rows)
                       + _per_sample(shift, rows))
            return ops.reshape(outputs, ops.shape(inputs))
        return inputs * self._broadcast(inv) + self._broadcast(shift)

    def _moments(self, inputs, mask):
        """Each model's batch mean and variance, `[B, C]` each."""
        axes = self._reduction_axes
        pieces = None if mask is not None else self._pieces(inputs)
        if pieces is not None:
            moments = [ops.moments(_stock_rows(piece), axes=[0])
                       for piece in pieces]
            return tuple(ops.stack(statistic) for statistic in zip(*moments))
        if mask is None and not self.synchronized and self._channels_last(
                inputs):
            if self.models_first and self.num_models > 1:
                return _models_first_moments(inputs, self.num_models)
            return _channels_last_moments(inputs, self.num_models)
        if mask is None:
            mean, variance = ops.moments(
                inputs, axes=axes, keepdims=True,
                synchronized=self.synchronized)
        else:
            mask = ops.expand_dims(mask, axis=-1)
            mask = ops.cast(ops.broadcast_to(mask, ops.shape(inputs)), "bool")
            total = ops.sum(ops.where(mask, inputs, 0), axes, keepdims=True)
            count = ops.sum(ops.cast(mask, inputs.dtype), axes,
                            keepdims=True)
            mean = total / (count + keras.backend.epsilon())
            squares = ops.square(ops.where(mask, inputs - mean, 0))
            variance = ops.sum(squares, axes, keepdims=True) / (
                count + keras.backend.epsilon())
        weight_shape = tuple(self.moving_mean.shape[1:])
        return (from_model_broadcast(mean, weight_shape, self.model_axis),
                from_model_broadcast(variance, weight_shape,
                                     self.model_axis))

    def _renorm_correction(self, mean, variance):
        """The batch renormalization corrections `(r, d)`, `[B, C]` each."""
        stddev = ops.sqrt(variance + self.epsilon)
        renorm_mean = ops.cast(self.renorm_mean, mean.dtype)
        # A floor on the divisor avoids dividing by zero early in training.
        renorm_stddev = ops.maximum(
            ops.cast(self.renorm_stddev, mean.dtype),
            ops.sqrt(ops.cast(self.epsilon, mean.dtype)))
        r = ops.divide(stddev, renorm_stddev)
        d = ops.divide(ops.subtract(mean, renorm_mean), renorm_stddev)
        rmin = self.renorm_clipping.get("rmin")
        rmax = self.renorm_clipping.get("rmax")
        dmax = self.renorm_clipping.get("dmax")
        if rmin is not None:
            r = ops.maximum(r, rmin)
        if rmax is not None:
            r = ops.minimum(r, rmax)
        if dmax is not None:
            d = ops.clip(d, -dmax, dmax)
        return r, d

    def _compose_transforms(self, r, d, gamma, beta, dtype):
        # (x * r + d) * gamma + beta = x * (r * gamma) + (d * gamma + beta);
        # the corrections are constants for the gradient, as in the stock
        # layer.
        r = ops.stop_gradient(r)
        d = ops.stop_gradient(d)
        if gamma is not None:
            effective_gamma = ops.multiply(r, gamma)
            effective_beta = ops.multiply(d, gamma)
        else:
            effective_gamma = ops.cast(r, dtype)
            effective_beta = ops.cast(d, dtype)
        if beta is not None:
            effective_beta = ops.add(effective_beta, beta)
        return effective_gamma, effective_beta

    def _update_renorm_statistics(self, mean, variance):
        stddev = ops.sqrt(variance + self.epsilon)
        renorm_mean = ops.cast(self.renorm_mean, mean.dtype)
        renorm_stddev = ops.cast(self.renorm_stddev, mean.dtype)
        self.renorm_mean.assign(
            renorm_mean * self.renorm_momentum
            + mean * (1.0 - self.renorm_momentum))
        self.renorm_stddev.assign(
            renorm_stddev * self.renorm_momentum
            + stddev * (1.0 - self.renorm_momentum))
        moving_mean = ops.cast(self.moving_mean, mean.dtype)
        moving_stddev = ops.cast(self.moving_stddev, mean.dtype)
        self.moving_mean.assign(
            moving_mean * self.momentum + mean * (1.0 - self.momentum))
        new_moving_stddev = (moving_stddev * self.momentum
                             + stddev * (1.0 - self.momentum))
        self.moving_stddev.assign(new_moving_stddev)
        # ReLU: rounding could make the derived variance slightly negative.
        self.moving_variance.assign(
            ops.relu(new_moving_stddev * new_moving_stddev - self.epsilon))

    def get_config(self):
        config = super().get_config()
        config.update({
            "momentum": self.momentum,
            "moving_mean_initializer": keras.initializers.serialize(
                self.moving_mean_initializer),
            "moving_variance_initializer": keras.initializers.serialize(
                self.moving_variance_initializer),
            "synchronized": self.synchronized,
            "renorm": self.renorm,
            "renorm_clipping": self.renorm_clipping,
            "renorm_momentum": self.renorm_momentum,
        })
        return config


@hftatf_export
@registry.register(keras.layers.LayerNormalization)
class FusedLayerNormalization(AffineNormalization):
    """`keras.layers.LayerNormalization` for an array of `num_models` models.

    Layout:
        input and output: `[batch, B, ...]`; a mask passes through.
        gamma, beta: `[B, *s]`, where `s` is the stock weight shape (the
            sizes of the stock `axis`, in sorted order).

    Model `b` computes exactly what the stock layer computes with
    `(gamma[b], beta[b])` on `x[:, b]`: per sample, mean and variance over
    `axis`, in (at least) float32 whatever the input dtype, then
    `(x - mean) * rsqrt(variance + epsilon) * gamma + beta`. With the
    deprecated `rms_scaling=True`, as in the stock layer, the input is
    scaled by `rsqrt(variance + epsilon)` and `gamma` only (no `beta`).

    Args:
        num_models: the number of models `B` in the array.
        axis: an int or a list of ints, axes of the stock input; stock axis
            `a >= 1` is fused axis `a + 1`.
        epsilon, center, scale, rms_scaling, beta_initializer,
        gamma_initializer, beta_regularizer, gamma_regularizer,
        beta_constraint, gamma_constraint: as in
            `keras.layers.LayerNormalization`.
    """

    def __init__(
        self,
        num_models,
        axis=-1,
        epsilon=1e-3,
        center=True,
        scale=True,
        beta_initializer="zeros",
        gamma_initializer="ones",
        beta_regularizer=None,
        gamma_regularizer=None,
        beta_constraint=None,
        gamma_constraint=None,
        rms_scaling=False,
        **kwargs,
    ):
        if rms_scaling:
            warnings.warn(
                "You passed `rms_scaling=True`, which is deprecated. This "
                "argument incorrectly scales the input by the variance, not "
                "the root mean square. To correctly use RMS Normalization, "
                "please use `keras.layers.RMSNormalization` instead.",
                stacklevel=2)
        if isinstance(axis, (list, tuple)):
            axis = list(axis)
        elif not isinstance(axis, int):
            raise TypeError(
                "Expected an int or a list/tuple of ints for the argument "
                f"'axis', but received: {axis!r}")
        super().__init__(
            num_models,
            axis=axis,
            epsilon=epsilon,
            center=center,
            scale=scale,
            beta_initializer=beta_initializer,
            gamma_initializer=gamma_initializer,
            beta_regularizer=beta_regularizer,
            gamma_regularizer=gamma_regularizer,
            beta_constraint=beta_constraint,
            gamma_constraint=gamma_constraint,
            **kwargs,
        )
        self.rms_scaling = rms_scaling
        # As the stock layer: float inputs are not cast to the compute dtype.
        self.autocast = False

    def build(self, input_shape):
        shape = self._stock_input_shape(input_shape)
        # The stock layer keeps its axes as a sorted list once built.
        self.axis = sorted(self.axis) if isinstance(
            self.axis, list) else [self.axis]
        axes = [resolve_axis(self.name, a, len(shape)) for a in self.axis]
        weight_shape = tuple(shape[a] for a in axes)
        self._norm_axes = [fused_axis(a) for a in axes]
        self._stock_broadcast_shape = [1] * len(shape)
        for a in axes:
            self._stock_broadcast_shape[a] = shape[a]
        self._add_affine_weights(
            weight_shape, self.scale or self.rms_scaling,
            self.center and not self.rms_scaling)

    def call(self, inputs):
        original_dtype = inputs.dtype
        dtype = keras.backend.result_type(inputs.dtype, "float32")
        x = ops.cast(inputs, dtype)
        epsilon = (keras.backend.epsilon() if self.epsilon is None
                   else self.epsilon)
        gamma = self._broadcast_weight(self.gamma, dtype,
                                       self._stock_broadcast_shape, x)
        beta = self._broadcast_weight(self.beta, dtype,
                                      self._stock_broadcast_shape, x)
        if self.rms_scaling:
            variance = ops.var(x, axis=self._norm_axes, keepdims=True)
            outputs = x * ops.rsqrt(variance + epsilon)
            if gamma is not None:
                outputs = outputs * gamma
        else:
            mean, variance = ops.moments(x, axes=self._norm_axes,
                                         keepdims=True)
            inv = ops.rsqrt(variance + epsilon)
            if gamma is not None:
                inv = inv * gamma
            shift = -mean * inv
            if beta is not None:
                shift = shift + beta
            outputs = x * inv + shift
        outputs = ops.cast(outputs, original_dtype)
        return ops.cast(outputs, self.compute_dtype)

    def get_config(self):
        return {**super().get_config(), "rms_scaling": self.rms_scaling}


@hftatf_export
@registry.register(keras.layers.GroupNormalization)
class FusedGroupNormalization(AffineNormalization):
    """`keras.layers.GroupNormalization` for an array of `num_models` models.

    Layout (`C` = size of the stock `axis`):
        input and output: `[batch, B, ...]`; a mask passes through.
        gamma, beta: `[B, C]`.

    Model `b` computes exactly what the stock layer computes with
    `(gamma[b], beta[b])` on `x[:, b]`: the `C` channels are split into
    `groups` groups, and each sample is normalised per group over the
    group's channels and every other non-batch axis, in (at least) float32.

    Args:
        num_models: the number of models `B` in the array.
        groups: as in `keras.layers.GroupNormalization` (`-1`: one group per
            channel, replaced by `C` when the layer is built).
        axis: one axis of the stock input (an int, not the batch axis);
            stock axis `a >= 1` is fused axis `a + 1`.
        epsilon, center, scale, beta_initializer, gamma_initializer,
        beta_regularizer, gamma_regularizer, beta_constraint,
        gamma_constraint: as in `keras.layers.GroupNormalization`.
    """

    def __init__(
        self,
        num_models,
        groups=32,
        axis=-1,
        epsilon=1e-3,
        center=True,
        scale=True,
        beta_initializer="zeros",
        gamma_initializer="ones",
        beta_regularizer=None,
        gamma_regularizer=None,
        beta_constraint=None,
        gamma_constraint=None,
        **kwargs,
    ):
        if not isinstance(groups, int) or (groups <= 0 and groups != -1):
            raise ValueError(
                "Received an invalid value for argument `groups`, expected "
                "a positive integer (or `-1` for instance normalization). "
                f"Received: groups={groups}")
        if isinstance(axis, bool) or not isinstance(axis, int):
            raise TypeError(
                "keras.layers.GroupNormalization takes one channel axis, an "
                f"int. Received: axis={axis!r}.")
        super().__init__(
            num_models,
            axis=axis,
            epsilon=epsilon,
            center=center,
            scale=scale,
            beta_initializer=beta_initializer,
            gamma_initializer=gamma_initializer,
            beta_regularizer=beta_regularizer,
            gamma_regularizer=gamma_regularizer,
            beta_constraint=beta_constraint,
            gamma_constraint=gamma_constraint,
            **kwargs,
        )
        self.groups = groups
        # As the stock layer: float inputs are not cast to the compute dtype.
        self.autocast = False

    def build(self, input_shape):
        shape = self._stock_input_shape(input_shape)
        axis = resolve_axis(self.name, self.axis, len(shape))
        if axis == 0:
            raise ValueError(
                f"Layer '{self.name}' cannot take the batch axis as its "
                f"channel axis. Received: axis={self.axis}. Pass the axis "
                "of the channels, e.g. axis=-1.")
        dim = shape[axis]
        if dim is None:
            raise ValueError(
                f"Axis {self.axis} of input tensor should have a defined "
                "dimension but the layer received an input with shape "
                f"{tuple(input_shape)}.")
        if self.groups == -1:
            self.groups = dim
        if dim < self.groups:
            raise ValueError(
                f"Number of groups ({self.groups}) cannot be more than the "
                f"number of channels ({dim}).")
        if dim % self.groups != 0:
            raise ValueError(
                f"Number of groups ({self.groups}) must be a multiple of the "
                f"number of channels ({dim}).")
        self._channel_axis = fused_axis(axis)
        self.input_spec = keras.layers.InputSpec(
            ndim=len(input_shape),
            axes={1: self.num_models, self._channel_axis: dim})
        # The stock weight broadcast: `[..., groups, dim // groups, ...]`.
        self._stock_broadcast_shape = [1] * len(shape)
        self._stock_broadcast_shape[axis] = dim // self.groups
        self._stock_broadcast_shape.insert(axis, self.groups)
        self._add_affine_weights((dim,), self.scale, self.center)

    def call(self, inputs):
        input_shape = ops.shape(inputs)
        group_shape = [-1, *input_shape[1:]]
        axis = self._channel_axis
        group_shape[axis] = input_shape[axis] // self.groups
        group_shape.insert(axis, self.groups)
        grouped = ops.reshape(inputs, group_shape)
        dtype = keras.backend.result_type(grouped.dtype, "float32")
        x = ops.cast(grouped, dtype)
        # Each group of each sample of each model: every axis but the batch,
        # model and group axes.
        reduction_axes = [a for a in range(2, len(group_shape)) if a != axis]
        mean, variance = ops.moments(x, axes=reduction_axes, keepdims=True)
        inv = ops.rsqrt(variance + self.epsilon)
        gamma = self._broadcast_weight(self.gamma, dtype,
                                       self._stock_broadcast_shape, x)
        beta = self._broadcast_weight(self.beta, dtype,
                                      self._stock_broadcast_shape, x)
        if gamma is not None:
            inv = inv * gamma
        shift = -mean * inv
        if beta is not None:
            shift = shift + beta
        outputs = ops.cast(x * inv + shift, grouped.dtype)
        outputs = ops.reshape(outputs, input_shape)
        return ops.cast(outputs, self.compute_dtype)

    def get_config(self):
        return {**super().get_config(), "groups": self.groups}


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
