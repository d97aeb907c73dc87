"""Fused LARS: momentum SGD with a per-model, per-variable trust ratio."""

import re

from keras import ops

from hftatf.api import hftatf_export
from hftatf.core import compat
from hftatf.core.validation import Range, shared
from hftatf.optimizers.base import FusedOptimizer
from hftatf.optimizers.lamb import check_required, model_norm, trust_ratio

__all__ = ["Lars"]


@hftatf_export
class Lars(FusedOptimizer):
    """Layer-wise adaptive rate scaling (You, Gitman and Ginsburg 2017,
    arXiv 1708.03888) for an array, with per-model hyper-parameters.

    Keras has no LARS; this is the paper's algorithm with momentum. For
    model `b` and each variable `w` (its slice `w[b]`, gradient `g[b]`):

        local_lr = eta * ||w|| / (||g|| + weight_decay * ||w|| + epsilon)
        local_lr = 1                 where ||w|| = 0 or ||g|| = 0
        g' = g + weight_decay * w
        v = momentum * v + learning_rate * local_lr * g'
        w = w - v                                      # nesterov=False
        w = w - (momentum * v + learning_rate * local_lr * g')  # nesterov

    Norms are L2 norms of each model's slice of the variable, never across
    models, so one model's weights or gradients never change another
    model's step. Weight decay is part of the gradient (as in the paper),
    not decoupled as in `keras.optimizers.Optimizer`; gradient clipping, if
    set, acts before. Slot `_momentums` (`v`) has the variables' shapes.

    Excluding variables. As in common implementations, variables can be
    excluded from weight decay (`exclude_from_weight_decay`, the Keras
    method: by variable or by name) and from layer adaptation
    (`exclude_from_layer_adaptation`, the same arguments: such a variable
    takes `local_lr = 1`, i.e. momentum SGD). Until
    `exclude_from_layer_adaptation` is called, the variables excluded from
    weight decay are also excluded from layer adaptation, which is how
    biases and normalization weights are usually handled:

        optimizer.exclude_from_weight_decay(var_names=["bias", "gamma",
                                                       "beta"])

    Both must be called before the optimizer is built; like Keras's, the
    exclusions are not part of the config.

    Args:
        learning_rate: a float, a length-B sequence, a
            `LearningRateSchedule`, or a length-B sequence of schedules.
            Defaults to 0.01.
        momentum: a float in [0, 1] or a length-B sequence. Defaults to 0.9.
        eta: the trust coefficient, a float >= 0 or a length-B sequence.
            Defaults to 0.001, as in the paper.
        epsilon: a float >= 0 or a length-B sequence, added to the
            denominator of `local_lr`. Defaults to 1e-8.
        nesterov: whether to apply Nesterov momentum (shared by all models).
        weight_decay: None (no weight decay), a float or a length-B
            sequence.
        **kwargs: the other arguments of `hftatf.optimizers.FusedOptimizer`
            (`clipnorm`, `clipvalue`, `global_clipnorm`, `use_ema`, ...,
            `name`, `num_models`).
    """

    hyperparameter_ranges = {"eta": Range(0.0)}

    def __init__(self, learning_rate=0.01, momentum=0.9, eta=0.001,
                 epsilon=1e-8, nesterov=False, weight_decay=None, **kwargs):
        check_required(self, momentum=momentum, eta=eta, epsilon=epsilon)
        super().__init__(
            learning_rate=learning_rate,
            hyperparameters={"momentum": momentum, "eta": eta,
                             "epsilon": epsilon},
            weight_decay=weight_decay,
            **kwargs,
        )
        self.nesterov = bool(shared("nesterov", nesterov))
        self._exclude_from_layer_adaptation = None
        self._exclude_from_layer_adaptation_pattern = None

    def exclude_from_layer_adaptation(self, var_list=None, var_names=None):
        """Excludes variables from layer adaptation: they take
        `local_lr = 1`.

        Must be called before the optimizer is built. Replaces the default
        (the variables excluded from weight decay).

        Args:
            var_list: a list of variables to exclude.
            var_names: a list of strings; a variable whose name contains
                one of them is excluded.
        """
        if self.built:
            raise ValueError(
                "`exclude_from_layer_adaptation()` can only be configured "
                f"before the optimizer is built; optimizer '{self.name}' is "
                "built. Call it before the first `apply_gradients`.")
        self._exclude_from_layer_adaptation = set(
            compat.variable_key(self, variable) for variable in var_list or [])
        self._exclude_from_layer_adaptation_pattern = (
            re.compile("|".join(set(var_names))) if var_names else None)

    def _use_layer_adaptation(self, variable):
        if self._exclude_from_layer_adaptation is None:
            return compat.uses_weight_decay(self, variable)
        if (compat.variable_key(self, variable)
                in self._exclude_from_layer_adaptation):
            return False
        pattern = self._exclude_from_layer_adaptation_pattern
        return pattern is None or re.search(pattern, variable.name) is None

    def build(self, variables):
        if self.built:
            return
        super().build(variables)
        self._momentums = self.add_optimizer_variables(variables, "momentum")

    @compat.optimizer_hook
    def _apply_weight_decay(self, variables):
        # LARS decays inside `update_step`, through the gradient and the
        # trust ratio, not before it as Keras's decoupled weight decay does.
        return

    def update_step(self, gradient, variable, learning_rate):
        lr = self._per_model(learning_rate, variable)
        gradient = ops.cast(gradient, variable.dtype)
        momentum = self._hyper("momentum", variable)
        v = self._momentums[compat.variable_index(self, variable)]

        if self.weight_decay is not None and compat.uses_weight_decay(
                self, variable):
            weight_decay = self._hyper("weight_decay", variable)
            gradient_decayed = gradient + weight_decay * variable
        else:
            weight_decay = None
            gradient_decayed = gradient
        if self._use_layer_adaptation(variable):
            w_norm = model_norm(variable)
            g_norm = model_norm(gradient)
            # `+`, not ops.add: on TensorFlow, ops.add turns into bias_add
            # (along the last axis) whenever the shapes allow it.
            denominator = g_norm
            if weight_decay is not None:
                denominator = denominator + weight_decay * w_norm
            denominator = denominator + self._hyper("epsilon", variable)
            local_lr = trust_ratio(w_norm, g_norm,
                                   self._hyper("eta", variable) * w_norm,
                                   denominator)
            scaled_lr = lr * local_lr
        else:
            scaled_lr = lr
        step = scaled_lr * gradient_decayed
        self.assign(v, momentum * v + step)
        if self.nesterov:
            self.assign_sub(variable, momentum * v + step)
        else:
            self.assign_sub(variable, v)

    def get_config(self):
        config = super().get_config()
        config["nesterov"] = self.nesterov
        return config
