"""Fused AdamW: Adam with decoupled weight decay, per model."""

from hftatf.api import hftatf_export
from hftatf.optimizers.adam import Adam

__all__ = ["AdamW"]


@hftatf_export
class AdamW(Adam):
    """`keras.optimizers.AdamW` for an array: per-model hyper-parameters.

    Every variable is `[B, ...]`; model `b`'s slice is updated exactly as the
    stock optimizer with `learning_rate[b]`, `weight_decay[b]`, `beta_1[b]`,
    `beta_2[b]` and `epsilon[b]` would update it: first decayed,
    `w = w - w * weight_decay * learning_rate` (variables excluded with
    `exclude_from_weight_decay` are not), then an Adam step. The slots
    (`_momentums`, `_velocities`, `_velocity_hats`) are `[B, ...]` like
    their variables.

    Args:
        learning_rate: a float, a length-B sequence, a
            `LearningRateSchedule`, or a length-B sequence of schedules.
            Defaults to 0.001.
        weight_decay: a float or a length-B sequence (0 turns decay off for
            that model). Defaults to 0.004, as in Keras; it cannot be None.
        beta_1, beta_2, epsilon: floats or length-B sequences; defaults 0.9,
            0.999 and 1e-7.
        amsgrad: whether to apply AMSGrad (one bool shared by all models).
        **kwargs: the other arguments of `hftatf.optimizers.FusedOptimizer`
            (`clipnorm`, `clipvalue`, `global_clipnorm`, `use_ema`, ...,
            `name`, `num_models`).
    """

    def __init__(self, learning_rate=0.001, weight_decay=0.004, beta_1=0.9,
                 beta_2=0.999, epsilon=1e-7, amsgrad=False, **kwargs):
        if weight_decay is None:
            raise ValueError(
                "Argument `weight_decay` must be a float or a sequence of "
                "floats (one per model). Received: weight_decay=None. Pass 0 "
                "for the models that should not decay, or use "
                "hftatf.optimizers.Adam.")
        super().__init__(
            learning_rate=learning_rate,
            beta_1=beta_1,
            beta_2=beta_2,
            epsilon=epsilon,
            amsgrad=amsgrad,
            weight_decay=weight_decay,
            **kwargs,
        )
