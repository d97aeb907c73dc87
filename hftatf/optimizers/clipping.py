"""Per-model norms, clipping and weight decay of fused optimizers.

`clipnorm` is taken over each variable's model slice, `global_clipnorm`
over all of one model's gradients, never across models; a value of 0
turns clipping off for that model. Sparse gradients are clipped as stock
optimizers clip an IndexedSlices: over the occurrences of the rows looked
up.
"""

from keras import ops

from hftatf import sparse
from hftatf.core import compat
from hftatf.core.axis import to_model_rank
from hftatf.optimizers import backend


class PerModelClipping:
    """The clipping and weight-decay part of `FusedOptimizer` (which
    provides `_hyper`, `_hyper_variables`, `_per_model` and
    `num_models`)."""

    @compat.optimizer_hook
    def _clip_gradients(self, grads):
        if self.clipnorm is not None:
            return [None if g is None else self._clip_by_model_norm(g)
                    for g in grads]
        if self.global_clipnorm is not None:
            return self._clip_by_model_global_norm(grads)
        if self.clipvalue is not None:
            return [None if g is None else self._clip_by_model_value(g)
                    for g in grads]
        return grads

    def _clip_by_model_norm(self, gradient):
        # tf.clip_by_norm's formula, over each model's slice (a sparse
        # gradient's: over its occurrences, as tf.clip_by_norm over an
        # IndexedSlices' values).
        clipnorm = self._hyper("clipnorm", gradient)
        if sparse.is_sparse(gradient):
            values = gradient.values
            l2sum = self._at_rows(to_model_rank(
                sparse.sum_per_model(gradient, self.num_models,
                                     ops.square(values)), 2), gradient)
            clipnorm = self._at_rows(clipnorm, gradient)
        else:
            values = gradient
            l2sum = ops.sum(ops.square(gradient),
                            axis=tuple(range(1, len(gradient.shape))),
                            keepdims=True)
        positive = l2sum > 0
        l2sum_safe = ops.where(positive, l2sum, ops.ones_like(l2sum))
        l2norm = ops.where(positive, ops.sqrt(l2sum_safe), l2sum)
        clipped = ops.divide(ops.multiply(values, clipnorm),
                             ops.maximum(l2norm, clipnorm))
        return sparse.with_values(
            gradient, ops.where(clipnorm > 0, clipped, values))

    def _clip_by_model_global_norm(self, grads):
        # keras.optimizers' clip_by_global_norm, over each model's gradients.
        squares = [
            sparse.sum_per_model(g, self.num_models, ops.square(g.values))
            if sparse.is_sparse(g)
            else ops.sum(ops.square(g), axis=tuple(range(1, len(g.shape))))
            for g in grads if g is not None]
        norms = ops.sqrt(ops.sum(ops.stack(squares), axis=0))
        clipnorm = ops.cast(self._hyper_variables["global_clipnorm"],
                            norms.dtype)
        scale = clipnorm * ops.minimum(1.0 / norms, 1.0 / clipnorm)
        # Non-finite norms give NaN scales, as in Keras.
        scale = ops.where(clipnorm > 0, scale + (norms - norms), 1.0)
        return [None if g is None else self._scaled(g, scale, clipnorm > 0)
                for g in grads]

    def _scaled(self, gradient, scale, clipped):
        """`gradient`, model `b`'s part times `scale[b]`. The stock product
        of a sparse gradient and the scale is dense: a sparse gradient's
        occurrences of a row are summed for the `clipped` models (`[B]`
        booleans), which then take the dense update."""
        if not sparse.is_sparse(gradient):
            return gradient * self._per_model(scale, gradient)
        gradient = sparse.merged(gradient, clipped, self.num_models)
        return sparse.with_values(gradient, gradient.values * self._at_rows(
            self._per_model(scale, gradient), gradient))

    def _clip_by_model_value(self, gradient):
        # A sparse gradient's occurrence by occurrence, as tf.clip_by_value.
        value = self._hyper("clipvalue", gradient)
        values = gradient
        if sparse.is_sparse(gradient):
            value = self._at_rows(value, gradient)
            values = gradient.values
        clipped = ops.maximum(ops.minimum(values, value), -value)
        return sparse.with_values(
            gradient, ops.where(value > 0, clipped, values))

    # -- sparse gradients ---------------------------------------------------

    def _summed(self, value, variable):
        """A sparse `value` (a gradient, or an element-wise function of
        one) as a dense tensor of `variable`'s shape, each row's
        occurrences summed; a dense one unchanged."""
        return sparse.dense(value, variable.shape)

    def _at_rows(self, tensor, gradient):
        """The rows of `tensor` (`[B, ...]` like the variable, or a
        `[B, 1, ..., 1]` per-model value) at each occurrence of the sparse
        `gradient`, to combine with its values."""
        return sparse.at_rows(tensor, gradient, self.num_models)

    @compat.optimizer_hook
    def _apply_weight_decay(self, variables):
        if self.weight_decay is None:
            return
        for variable in variables:
            if compat.uses_weight_decay(
                    self, backend.weight_decay_subject(variable)):
                learning_rate = self._per_model(self.learning_rate, variable)
                weight_decay = self._hyper("weight_decay", variable)
                self.assign_sub(variable,
                                variable * weight_decay * learning_rate)
