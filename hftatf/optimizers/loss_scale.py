"""Dynamic loss scaling for an array, one loss scale per model."""

import keras
from keras import ops

from hftatf import sparse
from hftatf.api import hftatf_export
from hftatf.core import compat, hooks
from hftatf.core.axis import to_model_rank
from hftatf.optimizers import backend
from hftatf.optimizers.base import FusedOptimizer

__all__ = ["LossScaleOptimizer"]


@hftatf_export
class LossScaleOptimizer(keras.optimizers.LossScaleOptimizer, FusedOptimizer):
    """`keras.optimizers.LossScaleOptimizer` for an array: a loss scale per
    model.

    Each model `b` has its own dynamic loss scale `dynamic_scale[b]` and
    growth counter `step_counter[b]` (both `[B]` variables), and is treated
    exactly as the stock optimizer treats a single model:

    - its loss is multiplied by its scale (`scale_model_losses`), so each
      slice `g[b]` of each `[B, ...]` gradient is divided by `scale[b]`;
    - if any of model `b`'s gradient slices holds an inf or a NaN, model
      `b`'s step is skipped (its variables, slots, moving averages and step
      count stay as they are), its scale is halved and its counter reset;
    - otherwise the inner optimizer updates model `b`, and its scale doubles
      after `dynamic_growth_steps` such steps in a row.

    One model overflowing never skips, rescales or otherwise changes another
    model. `iterations` counts the steps applied to at least one model;
    `model_iterations` (`[B]`) each model's applied steps.

    Compile an array that uses the `mixed_float16` dtype policy with it:
    `array.compile(hftatf.optimizers.LossScaleOptimizer(opt), ...)`. It is
    a `keras.optimizers.LossScaleOptimizer` (and an
    `hftatf.optimizers.FusedOptimizer`), so `keras.Model.compile` does not
    wrap it again, and Keras callbacks that look for `inner_optimizer` find
    it.

    Layout: gradients and variables are `[B, ...]`; `dynamic_scale`
    (float32) and `step_counter` (int) are `[B]`.

    Args:
        inner_optimizer: the fused optimizer to wrap (an
            `hftatf.optimizers.FusedOptimizer`), or anything
            `hftatf.optimizers.get` converts to one (a name, an unbuilt stock
            optimizer).
        initial_scale: float, the initial loss scale of every model.
            Defaults to `2**15`, as in Keras.
        dynamic_growth_steps: int, after how many finite steps in a row a
            model's scale doubles. Defaults to 2000, as in Keras.
        name: the optimizer's name.
        **kwargs: only the stock optimizer's defaults, accepted for configs
            of older versions; set the base optimizer arguments
            (`clipnorm`, `use_ema`, ...) on the inner optimizer.
    """

    # Non-finite gradients are overflows here, not divergence: this
    # optimizer skips those steps itself, per model (read by FusedModel).
    skips_nonfinite_steps = True

    def __init__(self, inner_optimizer, initial_scale=2.0**15,
                 dynamic_growth_steps=2000, name=None, **kwargs):
        if not isinstance(inner_optimizer, FusedOptimizer):
            # `hftatf.optimizers.get`: the package imports this module.
            inner_optimizer = hooks.call("optimizers.get", inner_optimizer)
        super().__init__(inner_optimizer, initial_scale=initial_scale,
                         dynamic_growth_steps=dynamic_growth_steps,
                         name=name, **kwargs)

    # -- the model axis and hyper-parameters: the inner optimizer's ---------

    @property
    def num_models(self):
        """The number of models `B`: the inner optimizer's."""
        return self.inner_optimizer.num_models

    @num_models.setter
    def num_models(self, num_models):
        self.inner_optimizer.num_models = num_models

    @property
    def hyperparameter_names(self):
        return self.inner_optimizer.hyperparameter_names

    def get_hyperparameter(self, name):
        """The inner optimizer's hyper-parameter `name`, `[B]`."""
        return self.inner_optimizer.get_hyperparameter(name)

    def set_hyperparameter(self, name, value):
        """Sets the inner optimizer's hyper-parameter `name`."""
        self.inner_optimizer.set_hyperparameter(name, value)

    @property
    def model_iterations(self):
        return self.inner_optimizer.model_iterations

    # -- building -----------------------------------------------------------

    @compat.no_automatic_dependency_tracking
    def build(self, var_list):
        if not self.inner_optimizer.built:
            self.inner_optimizer.build(var_list)
        shape = (self.num_models,)
        # Replicas update these alike (the finite check is summed over
        # replicas), so the first replica's values are everyone's.
        self.step_counter = self.add_variable(
            shape, dtype="int", initializer="zeros",
            aggregation="only_first_replica", name="step_counter")
        self.dynamic_scale = self.add_variable(
            shape, dtype="float32",
            initializer=keras.initializers.Constant(self.initial_scale),
            aggregation="only_first_replica", name="dynamic_scale")
        # The plain optimizer's build: this one has no hyper-parameters of
        # its own to store.
        keras.optimizers.Optimizer.build(self, var_list)

    def rescales_models(self):
        """`[B]` booleans: the models whose non-finite steps this optimizer
        still treats as overflows (skipping the step and halving the scale,
        as stock Keras does): those whose scale is at least 1. A scale
        halved below 1 no longer scales the loss up: the model's own values
        overflow, and the array freezes it as diverged."""
        if not self.built:
            return ops.full((self.num_models,), self.initial_scale >= 1)
        return ops.greater_equal(self.dynamic_scale, 1.0)

    # -- scaling ------------------------------------------------------------

    def scale_model_losses(self, losses):
        """`sum_b losses[b] * scale[b]`: the scalar the array differentiates
        from its `[B]` losses, so that model `b`'s gradients carry its own
        scale."""
        return ops.sum(self.scale_loss(losses))

    def scale_loss(self, loss):
        """Scales a `[B]` vector of per-model losses, entry `b` by model
        `b`'s scale."""
        loss = ops.convert_to_tensor(loss)
        if tuple(loss.shape) != (self.num_models,):
            raise ValueError(
                "A fused LossScaleOptimizer scales each model's loss by that "
                f"model's scale, so it needs the [num_models] = "
                f"[{self.num_models}] vector of per-model losses. Received "
                f"shape {tuple(loss.shape)}. Pass the per-model losses, or "
                "use `scale_model_losses(losses)` for the scalar to "
                "differentiate.")
        scale = self.dynamic_scale if self.built else self.initial_scale
        return ops.multiply(loss, scale)

    def check_finite(self, grads):
        """`[B]` booleans: whether all of model `b`'s gradient slices are
        finite, on every replica."""
        finite = [sparse.finite_per_model(g, self.num_models)
                  for g in grads if g is not None]
        finite = ops.all(ops.stack(finite), axis=0)
        if backend.replicas_in_sync() <= 1:
            return finite
        # The inner optimizer sums gradients over replicas: a non-finite
        # slice on any replica makes that model's summed gradient so.
        overflows = backend.sum_over_replicas(
            ops.cast(ops.logical_not(finite), "float32"))
        return ops.equal(overflows, 0)

    # -- applying -----------------------------------------------------------

    def apply(self, grads, trainable_variables=None, model_mask=None):
        """Unscales each model's gradients by its scale and applies the
        inner optimizer to the models whose gradients are all finite (and
        in `model_mask`, when given); then updates each model's scale."""
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(trainable_variables)
            self.built = True
        variables = trainable_variables or compat.trained_variables(self)
        finite = self.check_finite(grads)
        model_mask = self._standardize_model_mask(model_mask)
        applied = finite if model_mask is None else ops.logical_and(
            finite, model_mask)
        unscaled = [
            g if g is None or v.overwrite_with_gradient
            else self._unscaled(g) for g, v in zip(grads, variables)]
        self.inner_optimizer.apply(unscaled, trainable_variables,
                                   model_mask=applied)
        self._update_scales(finite, model_mask)

    def _unscaled(self, gradient):
        """`gradient` divided by each model's scale."""
        if sparse.is_sparse(gradient):
            scale = sparse.at_rows(to_model_rank(
                self.dynamic_scale, len(gradient.values.shape)), gradient,
                self.num_models)
            return sparse.with_values(gradient,
                                      ops.divide(gradient.values, scale))
        return ops.divide(gradient, to_model_rank(
            self.dynamic_scale, len(gradient.shape)))

    def _update_scales(self, finite, model_mask):
        """The stock update of the scale and growth counter, per model."""
        counter = ops.convert_to_tensor(self.step_counter)
        scale = ops.convert_to_tensor(self.dynamic_scale)
        grow = ops.logical_and(
            finite, ops.equal(counter, self.dynamic_growth_steps - 1))
        new_counter = ops.where(
            ops.logical_and(finite, ops.logical_not(grow)), counter + 1,
            ops.zeros_like(counter))
        new_scale = ops.where(grow, ops.multiply(scale, 2.0), ops.where(
            finite, scale, ops.multiply(scale, 0.5)))
        if model_mask is not None:
            new_counter = ops.where(model_mask, new_counter, counter)
            new_scale = ops.where(model_mask, new_scale, scale)
        self.step_counter.assign(new_counter)
        self.dynamic_scale.assign(new_scale)

    def stateless_apply(self, optimizer_variables, grads,
                        trainable_variables, model_mask=None):
        """As `FusedOptimizer.stateless_apply`: `apply` (per-model finite
        checks and scales) on the values given, over this optimizer's
        variables and the inner optimizer's (`variables`)."""
        return FusedOptimizer.stateless_apply(
            self, optimizer_variables, grads, trainable_variables,
            model_mask=model_mask)
