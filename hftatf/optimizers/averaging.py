"""Gradient accumulation and moving averages of the weights, per model.

Both follow each model's own step count: model `b` updates with its
accumulated mean gradient on every `gradient_accumulation_steps`-th of its
own steps, and its moving average starts from its weights on its own first
step, with its own `ema_momentum[b]`.
"""

from keras import ops

from hftatf.core import compat
from hftatf.core.axis import to_model_rank
from hftatf.optimizers import scopes


class PerModelAveraging:
    """The gradient-accumulation and EMA part of `FusedOptimizer` (which
    provides `_update`, `_masked`, `_broadcasts`, `_hyper` and
    `model_iterations`)."""

    def _accumulate_or_update(self, grads, trainable_variables):
        """Stock gradient accumulation, per model: model `b` updates with
        its accumulated mean gradient on every `gradient_accumulation_steps`
        -th of its own steps, and accumulates on the others."""
        steps = self.gradient_accumulation_steps
        due = ops.equal(ops.mod(self._model_iterations + 1, steps), 0)
        # Accumulated gradients are dense (as stock, which adds a sparse
        # gradient to its accumulator and to the accumulated sum).
        grads = [None if g is None else self._summed(g, v)
                 for g, v in zip(grads, trainable_variables)]
        accumulators = [
            compat.accumulated_gradients(self)[
                compat.variable_index(self, v)]
            for v in trainable_variables]
        self._for_models(due, lambda: self._update(
            [(g + a) / steps for g, a in zip(grads, accumulators)],
            trainable_variables))
        for gradient, accumulator in zip(grads, accumulators):
            reset = to_model_rank(due, len(accumulator.shape))
            self.assign(accumulator, ops.where(
                reset, ops.zeros(accumulator.shape, accumulator.dtype),
                accumulator + gradient))

    def _for_models(self, due, update):
        """Runs `update` for the models where the `[B]` boolean `due` holds
        (and that the step applies to); the others are left untouched.

        Every step computes the update and selects, per model, between it
        and the old values (`_masked`), rather than branching on `due`: a
        branch that assigns variables leaks tracers on JAX, and under
        tf.distribute a replica-context cond may not hold the merge_call
        of the updates."""
        with self._masked(due), self._broadcasts():
            update()

    # -- moving averages of the weights, per model ---------------------------

    @compat.optimizer_hook
    def _update_model_variables_moving_average(self, trainable_variables):
        """The stock EMA update, with model `b`'s momentum and step count:
        the average is the weights themselves on the model's first step."""
        if not self.use_ema:
            return
        not_first_step = ops.not_equal(self.model_iterations, 0)
        for variable, average in zip(trainable_variables,
                                     compat.moving_averages(self)):
            if average is None:
                continue
            momentum = ops.multiply(
                self._per_model(not_first_step, variable),
                self._hyper("ema_momentum", variable))
            self.assign(average,
                        ops.multiply(momentum, average)
                        + ops.multiply(ops.subtract(1, momentum), variable))

    @compat.optimizer_hook
    def _overwrite_model_variables_with_average_value(
            self, trainable_variables):
        """Copies the moving averages into the weights (of the models a
        partial step applies to)."""
        averages = compat.moving_averages(self)
        if len(trainable_variables) != len(averages):
            raise ValueError(
                f"The optimizer holds moving averages of {len(averages)} "
                f"variables but was given {len(trainable_variables)}. Pass "
                "the variables the optimizer was built with.")
        for variable, average in zip(trainable_variables, averages):
            if average is not None:
                self.assign(variable, scopes.read(average))
