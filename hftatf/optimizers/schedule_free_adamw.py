"""Fused Schedule-Free AdamW."""

from keras import ops

from hftatf.api import hftatf_export
from hftatf.core import compat
from hftatf.core.validation import Range
from hftatf.optimizers import backend
from hftatf.optimizers.base import FusedOptimizer

__all__ = ["ScheduleFreeAdamW"]


def _value_of(variable):
    """An initializer giving `variable`'s present value, read outside any
    traced function (so that the new variable's creation can be lifted out
    of one)."""
    with backend.outside_traced_functions():
        value = ops.convert_to_numpy(variable)
    return lambda shape, dtype: ops.cast(value, dtype)


@hftatf_export
class ScheduleFreeAdamW(FusedOptimizer):
    """`keras.optimizers.ScheduleFreeAdamW` for an array: per-model
    hyper-parameters.

    Every variable is `[B, ...]`; model `b`'s slice is updated exactly as
    the stock optimizer with `learning_rate[b]`, `beta_1[b]`, `beta_2[b]`
    and `epsilon[b]` would update it, on model `b`'s own step count: the
    gradient step goes to the `momentum` sequence (initialised to the
    weights, as in the stock optimizer), whose running average `x` is
    interpolated with it (`beta_1`) into the weights; the learning rate
    ramps up linearly over the first `warmup_steps` steps of each model.

    One difference from stock `fit`: Keras builds the optimizer of `fit`
    where the stock optimizer's assignment of the weights to its momentum
    does not run, so the stock momentum starts at zero there, and the first
    step moves every weight to about plus or minus the learning rate. Here
    the momentum starts at the weights wherever the optimizer is built, as
    the stock optimizer does when it is built outside `fit`.

    Args:
        learning_rate: a float, a length-B sequence, a
            `LearningRateSchedule`, or a length-B sequence of schedules.
            Defaults to 0.0025.
        beta_1, beta_2, epsilon: floats or length-B sequences; defaults
            0.9, 0.999 and 1e-8, as in Keras.
        warmup_steps: as in the stock optimizer, shared by all models.
        **kwargs: the other arguments of `hftatf.optimizers.FusedOptimizer`
            (`weight_decay`, `clipnorm`, `clipvalue`, `global_clipnorm`,
            `use_ema`, ..., `name`, `num_models`).
    """

    applies_sparse_gradients = True

    # The step divides by beta_1 (the weights from the averaged iterate);
    # at 1 it steps on the averaged iterate alone.
    hyperparameter_ranges = {
        "beta_1": Range(0.0, 1.0, low_open=True,
                        why=" (the update divides by beta_1)")}

    def __init__(self, learning_rate=0.0025, beta_1=0.9, beta_2=0.999,
                 epsilon=1e-8, warmup_steps=0, **kwargs):
        super().__init__(
            learning_rate=learning_rate,
            hyperparameters={"beta_1": beta_1, "beta_2": beta_2,
                             "epsilon": epsilon},
            **kwargs,
        )
        self.warmup_steps = warmup_steps

    def build(self, variables):
        if self.built:
            return
        super().build(variables)
        # The momentum sequence starts at the weights: by an initializer,
        # which also runs where the optimizer is built symbolically (an
        # assignment, as in the stock `build`, would not run there).
        self._momentums = [
            None if variable.overwrite_with_gradient
            else self.add_variable_from_reference(
                variable, name="momentum",
                initializer=_value_of(variable))
            for variable in variables]
        self._velocities = self.add_optimizer_variables(variables,
                                                        "velocity")

    def update_step(self, gradient, variable, learning_rate):
        lr = self._per_model(learning_rate, variable)
        gradient = ops.cast(gradient, variable.dtype)
        # A sparse gradient's occurrences are squared one by one, as stock.
        squared = self._summed(ops.square(gradient), variable)
        gradient = self._summed(gradient, variable)
        local_step = self._local_step(variable)
        beta_1 = self._hyper("beta_1", variable)
        beta_2 = self._hyper("beta_2", variable)
        epsilon = self._hyper("epsilon", variable)
        if self.warmup_steps > 0:
            lr = lr * ops.minimum(local_step / float(self.warmup_steps), 1.0)
        index = compat.variable_index(self, variable)
        momentum = self._momentums[index]
        velocity = self._velocities[index]
        momentum_old = momentum.value

        bias_correction_2 = 1 - ops.power(beta_2, local_step)
        self.assign_add(velocity, ops.multiply(
            ops.subtract(squared, velocity), 1 - beta_2))
        # `+`, not ops.add, where a per-model value meets a variable (see
        # Adam).
        denominator = ops.sqrt(velocity / bias_correction_2) + epsilon
        self.assign_sub(momentum, lr * gradient / denominator)

        weight = 1.0 / local_step
        x_old = (variable - (1 - beta_1) * momentum_old) / beta_1
        x_new = (1 - weight) * x_old + weight * momentum
        self.assign(variable, (1 - beta_1) * momentum + beta_1 * x_new)

    def get_config(self):
        config = super().get_config()
        config["warmup_steps"] = self.warmup_steps
        return config
