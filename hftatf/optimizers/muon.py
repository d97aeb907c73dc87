"""Fused Muon: orthogonalized momentum for matrices, Adam for the rest."""

import re

import keras
from keras import ops

from hftatf.api import hftatf_export
from hftatf.core import compat
from hftatf.core.validation import shared
from hftatf.optimizers.adam import adam_step
from hftatf.optimizers.base import FusedOptimizer
from hftatf.optimizers.hyperparameters import RANGES

__all__ = ["Muon"]


@hftatf_export
class Muon(FusedOptimizer):
    """`keras.optimizers.Muon` for an array: per-model hyper-parameters.

    Every variable is `[B, ...]`; model `b`'s slice is updated exactly as
    the stock optimizer with model `b`'s hyper-parameters would update the
    stock variable, and which rule updates it is decided on the stock
    variable (its shape without the model axis, and its path), as the stock
    optimizer decides:

    * a matrix (a 2-D stock variable) that is no embedding (with
      `exclude_embeddings`) and matches no `exclude_layers` pattern takes a
      Muon step: the momentum `m = momentum * m + g`, its Nesterov
      look-ahead orthogonalized by `ns_steps` Newton-Schulz iterations (per
      model, on the last two axes), scaled by `sqrt(max(rows, columns)) *
      rms_rate` and by the learning rate;
    * any other variable (biases, normalization scales, convolution
      kernels, embeddings) takes an Adam step with `learning_rate *
      adam_lr_ratio`, each model on its own step count;
    * weight decay is decoupled, `w = w - w * decay * learning_rate`, with
      `weight_decay` for the Muon variables and `adam_weight_decay` for the
      others (variables excluded by `exclude_from_weight_decay` keep
      theirs).

    Args:
        learning_rate: a float, a length-B sequence, a
            `LearningRateSchedule`, or a length-B sequence of schedules.
        adam_beta_1, adam_beta_2, adam_weight_decay, epsilon, weight_decay,
        adam_lr_ratio, momentum: floats or length-B sequences, with the
            stock defaults (a decay of None turns it off).
        muon_a, muon_b, muon_c, ns_steps, nesterov, rms_rate,
        exclude_layers, exclude_embeddings: as in the stock optimizer,
            shared by all models (`rms_rate=None` leaves updates unscaled).
        **kwargs: the other arguments of `hftatf.optimizers.FusedOptimizer`
            (`clipnorm`, `clipvalue`, `global_clipnorm`, `use_ema`, ...,
            `name`, `num_models`).
    """

    applies_sparse_gradients = True

    # The stock Newton-Schulz iteration works on the last two axes of a
    # batch of matrices: each model's on its own.
    transpose_last_axis = keras.optimizers.Muon.transpose_last_axis
    zeropower_via_newtonschulz5 = (
        keras.optimizers.Muon.zeropower_via_newtonschulz5)

    complemented_hyperparameters = ("adam_beta_1", "adam_beta_2")

    hyperparameter_ranges = {"adam_beta_1": RANGES["beta_1"],
                             "adam_beta_2": RANGES["beta_2"],
                             "adam_weight_decay": RANGES["weight_decay"]}

    def __init__(self, learning_rate=0.001, adam_beta_1=0.9,
                 adam_beta_2=0.999, adam_weight_decay=0.004, epsilon=1e-7,
                 weight_decay=0.004, clipnorm=None, clipvalue=None,
                 global_clipnorm=None, use_ema=False, ema_momentum=0.99,
                 ema_overwrite_frequency=None, loss_scale_factor=None,
                 gradient_accumulation_steps=None, name=None,
                 exclude_layers=None, exclude_embeddings=True,
                 muon_a=3.4445, muon_b=-4.7750, muon_c=2.0315,
                 adam_lr_ratio=1, momentum=0.95, ns_steps=5, nesterov=True,
                 rms_rate=0.2, **kwargs):
        hyperparameters = {"adam_beta_1": adam_beta_1,
                           "adam_beta_2": adam_beta_2,
                           "epsilon": epsilon,
                           "adam_lr_ratio": adam_lr_ratio,
                           "momentum": momentum}
        if adam_weight_decay is not None:
            hyperparameters["adam_weight_decay"] = adam_weight_decay
        super().__init__(
            learning_rate=learning_rate, hyperparameters=hyperparameters,
            weight_decay=weight_decay, clipnorm=clipnorm,
            clipvalue=clipvalue, global_clipnorm=global_clipnorm,
            use_ema=use_ema, ema_momentum=ema_momentum,
            ema_overwrite_frequency=ema_overwrite_frequency,
            loss_scale_factor=loss_scale_factor,
            gradient_accumulation_steps=gradient_accumulation_steps,
            name=name, **kwargs)
        self.muon_a = shared("muon_a", muon_a)
        self.muon_b = shared("muon_b", muon_b)
        self.muon_c = shared("muon_c", muon_c)
        self.ns_steps = shared("ns_steps", ns_steps)
        self.nesterov = shared("nesterov", nesterov)
        self.rms_rate = shared("rms_rate", rms_rate)
        self.exclude_layers = list(exclude_layers or [])
        self.exclude_embeddings = shared("exclude_embeddings",
                                         exclude_embeddings)

    def uses_adam(self, variable):
        """Whether `variable` (`[B, ...]`) takes Adam steps: as the stock
        optimizer decides for the stock variable."""
        if len(variable.shape) - 1 != 2:
            return True
        if self.exclude_embeddings and "embedding" in variable.path.lower():
            return True
        return any(re.search(pattern, variable.path)
                   for pattern in self.exclude_layers)

    def build(self, variables):
        if self.built:
            return
        super().build(variables)
        self.momentums = self.add_optimizer_variables(variables, "momentum")
        self.adam_velocities = [
            self.add_variable_from_reference(variable, name="velocity")
            if momentum is not None and self.uses_adam(variable) else None
            for variable, momentum in zip(variables, self.momentums)]

    def update_step(self, gradient, variable, learning_rate):
        lr = self._per_model(learning_rate, variable)
        gradient = ops.cast(gradient, variable.dtype)
        index = compat.variable_index(self, variable)
        m = self.momentums[index]
        if self.adam_velocities[index] is not None:
            adam_step(self, gradient, variable,
                      lr * self._hyper("adam_lr_ratio", variable), m,
                      self.adam_velocities[index],
                      ("adam_beta_1", "adam_beta_2"),
                      self._hyper("epsilon", variable))
            return
        # (Only the AdamW steps take a sparse gradient as it is.)
        gradient = self._summed(gradient, variable)
        momentum = self._hyper("momentum", variable)
        self.assign_add(m, gradient + m * (momentum - 1))
        g = gradient + momentum * m if self.nesterov else m
        update = self.zeropower_via_newtonschulz5(g, self.ns_steps)
        if self.rms_rate is not None:
            # The stock scale, from the stock matrix's shape.
            update = update * ops.sqrt(float(max(variable.shape[1:]))) * (
                self.rms_rate)
        self.assign_sub(variable, lr * update)

    @compat.optimizer_hook
    def _apply_weight_decay(self, variables):
        for variable in variables:
            if not compat.uses_weight_decay(self, variable):
                continue
            name = ("adam_weight_decay" if self.uses_adam(variable)
                    else "weight_decay")
            if self._hyper_values.get(name) is None:
                continue
            learning_rate = self._per_model(self.learning_rate, variable)
            self.assign_sub(variable, variable * self._hyper(
                name, variable) * learning_rate)

    def get_config(self):
        config = super().get_config()
        config.setdefault("adam_weight_decay", None)
        config.update(
            muon_a=self.muon_a, muon_b=self.muon_b, muon_c=self.muon_c,
            ns_steps=self.ns_steps, nesterov=self.nesterov,
            rms_rate=self.rms_rate, exclude_layers=self.exclude_layers,
            exclude_embeddings=self.exclude_embeddings)
        return config
