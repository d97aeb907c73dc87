"""Fused `BatchNormalization`."""

import keras
from keras import ops

from hftatf.api import hftatf_export
from hftatf.core.axis import pieces_if_stacked, stack_models
from hftatf.layers import registry
from hftatf.layers.backends import compiling_with_xla
from hftatf.layers.kernels import as_one_sample, batch_matmul
from hftatf.layers.normalization.base_normalization import (
    AffineNormalization,
    from_model_broadcast,
    fused_axis,
    resolve_axis,
    to_model_broadcast,
)


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
