"""The per-model step of fused optimizers: `apply`, step counts, masks.

Every model keeps its own step count (`model_iterations`), and a step can
be applied to some models only (`apply(..., model_mask=...)`): the models
left out keep every variable, slot, moving average, accumulator and step
count exactly as they were. `LossScaleOptimizer` uses this to skip, per
model, the steps whose gradients overflowed, as the stock loss-scale
optimizer skips the steps of a single model.
"""

import contextlib

import keras
from keras import ops

from hftatf import sparse
from hftatf.core import compat, tensorflow_compat
from hftatf.core.axis import select_models
from hftatf.optimizers import backend, scopes


class PerModelSteps:
    """The step part of `FusedOptimizer`: `apply`, per-model step counts,
    updates restricted to the models of a mask (through `assign`,
    `assign_add`, `assign_sub`), and the stock sequence of clipping, weight
    decay and update."""

    @property
    def model_iterations(self):
        """Each model's step count, `[B]`: what `iterations` is for a stock
        optimizer (divided by `gradient_accumulation_steps` when gradients
        are accumulated). Before the optimizer is built, `iterations`."""
        if self._model_iterations is None:
            return self.iterations
        counts = scopes.read(self._model_iterations)
        if self.gradient_accumulation_steps:
            counts = ops.floor_divide(counts,
                                      self.gradient_accumulation_steps)
        return counts

    def apply_gradients(self, grads_and_vars, model_mask=None):
        """As `keras.optimizers.Optimizer.apply_gradients`; `model_mask` as
        in `apply`."""
        grads, trainable_variables = zip(*grads_and_vars)
        self.apply(grads, trainable_variables, model_mask=model_mask)
        return compat.step_counter(self)

    def apply(self, grads, trainable_variables=None, model_mask=None):
        """Applies one step, as `keras.optimizers.Optimizer.apply`.

        Args:
            grads: one `[B, ...]` gradient per variable.
            trainable_variables: the `[B, ...]` variables; optional once the
                optimizer is built.
            model_mask: None to update every model, or a `[B]` boolean
                tensor: the models where it is False are left exactly as
                they are (variables, slots, moving averages, gradient
                accumulators, step counts), as if they had not taken this
                step.
        """
        if len(grads) == 0:
            return
        trainable_variables = self._variables_to_update(grads,
                                                        trainable_variables)
        mask = self._standardize_model_mask(model_mask)
        if (mask is None or backend.has_strategy()
                or compat.compiled_by_xla()):
            # (A replica-context cond may not hold the merge_call that
            # updates make under tf.distribute. XLA fuses the selects of
            # the masked update into it: no cost per step, and one update
            # to trace and compile, not two; and on JAX a cond whose
            # branches assign variables leaks tracers.)
            self._apply(grads, trainable_variables, mask)
        else:
            # Most steps update every model: those take the unmasked
            # update, without a select per variable and slot. Tracing both
            # costs time once; the selects would cost time every step.
            ops.cond(ops.all(mask),
                     lambda: self._apply(grads, trainable_variables, None),
                     lambda: self._apply(grads, trainable_variables, mask))

    def stateless_apply(self, optimizer_variables, grads,
                        trainable_variables, model_mask=None):
        """As `keras.optimizers.Optimizer.stateless_apply` (the step of
        Keras's JAX trainer), with `model_mask` as in `apply`.

        Args:
            optimizer_variables: the values of `self.variables`, in order.
            grads: one `[B, ...]` gradient per trained variable.
            trainable_variables: the values of the variables the optimizer
                was built on, in order.
            model_mask: None, or the `[B]` booleans of the models to update.

        Returns:
            `(trainable_variables, optimizer_variables)`: the new values.
        """
        if not self.built:
            raise ValueError(
                f"Optimizer '{self.name}' is not built: `stateless_apply` "
                "takes the values of its variables, which "
                "`optimizer.build(variables)` creates. Call it first.")
        trained = compat.trained_variables(self)
        for given, expected, what, order in (
                (optimizer_variables, self.variables, "optimizer_variables",
                 "`optimizer.variables`"),
                (trainable_variables, trained, "trainable_variables",
                 "the variables the optimizer was built on")):
            if len(given) != len(expected):
                raise ValueError(
                    f"`stateless_apply` of optimizer '{self.name}' takes one "
                    f"value per variable in `{what}`, {len(expected)} in "
                    f"all; received {len(given)}. Pass them in the order of "
                    f"{order}.")
        mapping = (list(zip(trained, trainable_variables))
                   + list(zip(self.variables, optimizer_variables)))
        with keras.StatelessScope(state_mapping=mapping) as scope:
            self.apply(grads, model_mask=model_mask)
        return ([scope.get_current_value(v) for v in trained],
                [scope.get_current_value(v) for v in self.variables])

    def _apply(self, grads, trainable_variables, mask):
        """`apply` to the built optimizer's `trainable_variables`, with the
        standardized `mask`."""
        with keras.name_scope(self.name, caller=self), self._masked(mask), \
                self._broadcasts():
            grads, trainable_variables = compat.filter_empty_gradients(
                self, grads, trainable_variables)
            grads, trainable_variables = (
                compat.overwrite_variables_with_gradients(
                    self, grads, trainable_variables))
            if grads:
                if self.loss_scale_factor is not None:
                    grads = [g if g is None else g / self.loss_scale_factor
                             for g in grads]
                self._backend_apply_gradients(grads, trainable_variables)
                for variable in trainable_variables:
                    if variable.constraint is not None:
                        self.assign(variable,
                                    variable.constraint(variable))
        if mask is None:
            self._model_iterations.assign_add(
                ops.ones((self.num_models,), self._model_iterations.dtype))
            compat.step_counter(self).assign_add(1)
        else:
            self._model_iterations.assign_add(
                ops.cast(mask, self._model_iterations.dtype))
            compat.step_counter(self).assign_add(
                ops.cast(ops.any(mask), compat.step_counter(self).dtype))

    def _variables_to_update(self, grads, trainable_variables):
        """Builds the optimizer if needed and returns the variables that
        `grads` belong to, with the checks of the stock `apply`."""
        if trainable_variables is None:
            if not self.built:
                raise ValueError(
                    "When passing `grads` without `variables`, the optimizer "
                    "must already be built on a list of variables. Call "
                    "`optimizer.build(trainable_variables)` first.")
            if len(grads) != len(compat.trained_variables(self)):
                raise ValueError(
                    f"Received {len(grads)} gradients, but the optimizer "
                    f"was built on {len(compat.trained_variables(self))} "
                    "variables. Pass one gradient per variable, in the "
                    "order of the variables it was built with.")
            return compat.trained_variables(self)
        trainable_variables = list(trainable_variables)
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(trainable_variables)
            self.built = True
        compat.check_variables_are_known(self, trainable_variables)
        return trainable_variables

    def _standardize_model_mask(self, model_mask):
        if model_mask is None:
            return None
        mask = ops.cast(model_mask, "bool")
        if tuple(mask.shape) != (self.num_models,):
            raise ValueError(
                f"`model_mask` must be a [num_models] = [{self.num_models}] "
                f"vector of booleans (True: update that model). Received "
                f"shape {tuple(mask.shape)}.")
        return mask

    @compat.optimizer_hook
    def _backend_apply_gradients(self, grads, trainable_variables):
        # The stock sequence (accumulate or update, then the moving
        # average), with each model's own step count deciding what is due.
        if self.gradient_accumulation_steps:
            self._accumulate_or_update(grads, trainable_variables)
        else:
            self._update(grads, trainable_variables)
        if self.use_ema:
            self._update_model_variables_moving_average(
                compat.trained_variables(self))
            if self.ema_overwrite_frequency:
                due = ops.equal(ops.mod(self.model_iterations + 1,
                                        self.ema_overwrite_frequency), 0)
                overwrite = self._overwrite_model_variables_with_average_value
                self._for_models(
                    due, lambda: overwrite(compat.trained_variables(self)))

    def _update(self, grads, trainable_variables):
        grads = self._clip_gradients(grads)
        if any(sparse.is_sparse(g) for g in grads):
            if not self.applies_sparse_gradients:
                grads = [None if g is None else self._summed(g, v)
                         for g, v in zip(grads, trainable_variables)]
            # All in the graph of the step being built, where some are
            # made: gradients of two graphs (a branch of a cond and the one
            # around it) cannot be summed over replicas together.
            grads = [None if g is None else sparse.identity(g)
                     for g in grads]
        self._apply_weight_decay(trainable_variables)
        merged = self._merged_by_clipping(grads)
        with scopes.set_for(scopes.MERGED, self, merged):
            self._backend_update_step(grads, trainable_variables,
                                      self.learning_rate)

    def _merged_by_clipping(self, grads):
        """The `[B]` models whose sparse gradients `global_clipnorm` made
        dense (None if none): replicas' sums of them must be merged too."""
        if self.global_clipnorm is None or not backend.has_strategy() or (
                not any(sparse.is_sparse(g) for g in grads)):
            return None
        return self._hyper_variables["global_clipnorm"] > 0

    @compat.optimizer_hook
    def _all_reduce_sum_gradients(self, grads_and_vars):
        # Stock replicas sum the dense gradients that global clipping made:
        # a row looked up on two replicas is one row of the sum.
        if backend.replicas_in_sync() > 1:
            grads_and_vars = super()._all_reduce_sum_gradients(
                grads_and_vars)
        else:
            # One replica's sum is its own gradients. (TensorFlow's
            # `all_reduce`, called in the frozen models' `cond`, would
            # register a gradient that keeps the traced step in memory;
            # see `tensorflow_compat.custom_gradient`.)
            grads_and_vars = list(grads_and_vars)
        merged = scopes.entry(scopes.MERGED, self)
        if merged is None:
            return grads_and_vars
        return [(sparse.merged(g, merged, self.num_models)
                 if sparse.is_sparse(g) else g, v) for g, v in grads_and_vars]

    # -- partial steps: updates restricted to some models --------------------

    @property
    def _model_mask(self):
        """The `[B]` mask of the models being updated, or None (all)."""
        return scopes.entry(scopes.MASKS, self)

    @contextlib.contextmanager
    def _masked(self, mask, replace=False):
        """Restricts updates to the models where `mask` holds (and where the
        enclosing mask holds, unless `replace`). Masks are kept per thread:
        tf.distribute runs each replica in a thread of its own."""
        previous = self._model_mask
        if mask is not None and previous is not None and not replace:
            mask = ops.logical_and(previous, mask)
        with scopes.set_for(scopes.MASKS, self, mask):
            yield

    def assign(self, variable, value):
        mask = self._model_mask
        if sparse.is_sparse(value) and (
                mask is not None
                or sparse.rows_per_model(value, variable.shape) > 1):
            # The rows given replace the variable's; the others stay.
            old = scopes.read(variable)
            value = ops.reshape(ops.scatter_update(
                ops.reshape(old, tuple(value.shape)),
                ops.expand_dims(value.indices, -1),
                ops.cast(value.values, old.dtype)), old.shape)
        if mask is None:
            return super().assign(variable, value)
        return super().assign(variable,
                              self._select(mask, variable, value))

    def assign_add(self, variable, value):
        mask = self._model_mask
        if mask is None:
            return super().assign_add(variable,
                                      scopes.rows_of(value, variable))
        return super().assign(variable, self._select(
            mask, variable,
            scopes.read(variable) + scopes.dense(value, variable)))

    def assign_sub(self, variable, value):
        mask = self._model_mask
        if mask is None:
            return super().assign_sub(variable,
                                      scopes.rows_of(value, variable))
        return super().assign(variable, self._select(
            mask, variable,
            scopes.read(variable) - scopes.dense(value, variable)))

    def _select(self, mask, variable, value):
        """`value` for the models in `mask`, `variable`'s own value for the
        others."""
        if len(variable.shape) == 0:
            raise ValueError(
                f"Optimizer '{self.name}' updated the scalar variable "
                f"'{variable.name}' during a step applied to some models "
                "only; only [num_models, ...] variables can be updated per "
                "model. Give the variable a leading model axis.")
        return select_models(
            mask, ops.cast(value, variable.dtype), scopes.read(variable))

    @compat.optimizer_hook
    def _backend_update_step(self, grads, trainable_variables, learning_rate):
        mask = self._model_mask
        if mask is None or not backend.has_strategy():
            # Without replicas the update runs in this thread, which holds
            # the mask (`_masked`).
            return super()._backend_update_step(grads, trainable_variables,
                                                learning_rate)
        # Under tf.distribute, as the TensorFlow optimizer does: gradients
        # summed over replicas, then each variable updated in a
        # cross-replica merge_call. The mask travels through the merge_call
        # as an argument, so that each copy of a variable is updated with
        # its own replica's mask.
        trainable_variables = [scopes.unwrap(v) for v in trainable_variables]
        grads_and_vars = self._all_reduce_sum_gradients(
            list(zip(grads, trainable_variables)))
        tensorflow_compat.maybe_merge_call(
            self._masked_update_step, compat.distribution_strategy(self),
            grads_and_vars, learning_rate, mask)

    def _masked_update_step(self, distribution, grads_and_vars,
                            learning_rate, mask):
        def update(variable, gradient, learning_rate, mask):
            with self._masked(mask, replace=True):
                return self.update_step(gradient, variable, learning_rate)

        for gradient, variable in grads_and_vars:
            distribution.extended.update(
                variable, update, args=(gradient, learning_rate, mask),
                group=False)
