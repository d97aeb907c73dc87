"""The base class of fused optimizers: per-model hyper-parameters as data.

Every variable a fused optimizer updates is `[B, ...]` (the model axis
first, DESIGN.md §1). Every float hyper-parameter is a float (shared by the
B models) or a length-B sequence (one value per model); either way it lives
in a `[B]` optimizer variable, broadcast as `[B, 1, ..., 1]` against each
variable. So hyper-parameters are checkpointed with the optimizer, can be
changed between steps (from a callback, say) without retracing, and every
model is updated exactly as a stock Keras optimizer with its own values
would update it. Anything that takes a norm (`clipnorm`, `global_clipnorm`)
takes it per model, never across models.
"""

import numbers

import keras
import numpy as np
from keras import ops

from hftatf.layers.base import broadcast_to_models
from hftatf.validation import check_num_models

Schedule = keras.optimizers.schedules.LearningRateSchedule


def _is_number(value):
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


class FusedOptimizer(keras.optimizers.Optimizer):
    """Base class of fused optimizers.

    Subclasses pass their own float hyper-parameters to `__init__` as
    `hyperparameters`, and implement `build`, `update_step` (reading each
    hyper-parameter with `self._hyper(name, variable)`) and `get_config`, as
    stock Keras optimizers do.

    Args:
        learning_rate: a float, a length-B sequence of floats, a
            `keras.optimizers.schedules.LearningRateSchedule` (shared), or a
            length-B sequence of schedules (one per model).
        hyperparameters: dict of the subclass's float hyper-parameters, each
            a float or a length-B sequence.
        weight_decay, clipnorm, clipvalue, global_clipnorm: as in
            `keras.optimizers.Optimizer`, each a float or a length-B
            sequence. Norms are taken per model: `clipnorm` over each
            variable's model slice, `global_clipnorm` over all of one model's
            gradients. A value of 0 disables clipping for that model.
        use_ema, ema_momentum, ema_overwrite_frequency, loss_scale_factor,
        gradient_accumulation_steps, name: as in `keras.optimizers.Optimizer`
            (they act elementwise, so they never mix models).
        num_models: the number of models `B`. Optional: it is taken from the
            length of any per-model sequence, from `FusedModel.compile`, or
            from the variables the optimizer is built on.
    """

    def __init__(
        self,
        learning_rate,
        hyperparameters=None,
        weight_decay=None,
        clipnorm=None,
        clipvalue=None,
        global_clipnorm=None,
        num_models=None,
        **kwargs,
    ):
        values = {"learning_rate": learning_rate}
        values.update(hyperparameters or {})
        values.update(weight_decay=weight_decay, clipnorm=clipnorm,
                      clipvalue=clipvalue, global_clipnorm=global_clipnorm)
        values = {name: _standardize(name, value)
                  for name, value in values.items()}
        lengths = {name: len(value) for name, value in values.items()
                   if isinstance(value, list)}
        # The stock optimizer sees a placeholder learning rate: the real one
        # is per model and handled by `_get_current_learning_rate`.
        super().__init__(
            learning_rate=_placeholder_learning_rate,
            weight_decay=weight_decay,
            clipnorm=clipnorm,
            clipvalue=clipvalue,
            global_clipnorm=global_clipnorm,
            **kwargs,
        )
        self._hyper_values = values
        self._hyper_variables = {}
        self._hyper_ranges = {}
        self._num_models = None
        if num_models is not None:
            self.num_models = num_models
        for name, length in lengths.items():
            self._set_num_models(length, f"`{name}` has {length} values")

    # -- the model axis -----------------------------------------------------

    @property
    def num_models(self):
        """The number of models `B`, or None while it is not known yet."""
        return self._num_models

    @num_models.setter
    def num_models(self, num_models):
        self._set_num_models(check_num_models(num_models),
                             f"num_models={num_models}")

    def _set_num_models(self, num_models, source):
        if self._num_models is None:
            self._num_models = num_models
            self._num_models_source = source
        elif num_models != self._num_models:
            raise ValueError(
                f"Optimizer '{self.name}' was configured for "
                f"{self._num_models} models ({self._num_models_source}) but "
                f"{source}. Give every per-model hyper-parameter one value per "
                "model of the array (or a single float shared by all)."
            )

    # -- hyper-parameters ---------------------------------------------------

    @property
    def hyperparameter_names(self):
        """The names of the per-model float hyper-parameters."""
        return tuple(self._hyper_values)

    def get_hyperparameter(self, name):
        """Returns hyper-parameter `name` as a `[B]` NumPy array of values.

        Learning-rate schedules are evaluated at the current iteration.
        Returns None for an optional hyper-parameter that is not set.
        """
        self._check_hyper_name(name)
        if name == "learning_rate" and self._learning_rate_schedules():
            return ops.convert_to_numpy(self._get_current_learning_rate())
        if name in self._hyper_variables:
            return ops.convert_to_numpy(self._hyper_variables[name])
        value = self._hyper_values[name]
        if value is None:
            return None
        return np.broadcast_to(np.asarray(value, dtype="float32"),
                               (self.num_models or len(np.atleast_1d(value)),))

    def set_hyperparameter(self, name, value):
        """Sets hyper-parameter `name` to a float or a length-B sequence.

        Takes effect at the next step, without retracing the training step.
        """
        self._check_hyper_name(name)
        value = _standardize(name, value)
        old = self._hyper_values[name]
        if value is None or old is None:
            raise ValueError(
                f"`{name}` can only be changed between values, not switched "
                f"on or off, after the optimizer is created. Received {name}="
                f"{value!r} where it was {old!r}."
            )
        if isinstance(value, Schedule) or (
                isinstance(value, list) and isinstance(value[0], Schedule)):
            raise ValueError(
                f"`{name}` cannot be replaced by a schedule after the "
                "optimizer is created; pass schedules to the constructor."
            )
        if name == "learning_rate" and self._learning_rate_schedules():
            raise TypeError(
                "This optimizer was created with learning-rate schedules, so "
                "its learning rate is not settable. Pass floats to the "
                "constructor to make it settable."
            )
        if name in self._hyper_ranges:
            self._check_range(name, *self._hyper_ranges[name], value=value)
        if isinstance(value, list):
            self._set_num_models(len(value), f"`{name}` has {len(value)} "
                                 "values")
        self._hyper_values[name] = value
        if name in self._hyper_variables:
            variable = self._hyper_variables[name]
            variable.assign(np.broadcast_to(
                np.asarray(value, dtype=variable.dtype), variable.shape))

    def _check_range(self, name, low, high, value=None):
        """Raises a ValueError unless every value of `name` is in range;
        the range is checked again whenever `name` is set."""
        self._hyper_ranges[name] = (low, high)
        if value is None:
            value = self._hyper_values[name]
        values = value if isinstance(value, list) else [value]
        if any(not low <= v <= high for v in values):
            raise ValueError(
                f"`{name}` must be between {low} and {high} for every model. "
                f"Received: {name}={value!r}."
            )

    def _check_hyper_name(self, name):
        if name not in self._hyper_values:
            raise ValueError(
                f"Optimizer '{self.name}' has no hyper-parameter '{name}'. "
                f"Its hyper-parameters are: {', '.join(self._hyper_values)}."
            )

    def _hyper(self, name, variable):
        """Hyper-parameter `name` as `[B, 1, ..., 1]`, in `variable`'s dtype."""
        return self._per_model(self._hyper_variables[name], variable)

    def _per_model(self, values, variable):
        """Broadcasts a `[B]` vector against a `[B, ...]` variable."""
        return broadcast_to_models(ops.cast(values, variable.dtype),
                                   len(variable.shape))

    def _local_step(self, variable):
        """The step number being taken (1 for the first update), in
        `variable`'s dtype and broadcastable against it. Optimizers whose
        math depends on the step (bias corrections, decays) read it here,
        never from `self.iterations`: a model whose step is skipped (a
        non-finite gradient under loss scaling) keeps its own count."""
        return ops.cast(self.iterations + 1, variable.dtype)

    def scale_model_losses(self, losses):
        """The scalar the array differentiates, from its `[B]` losses: their
        sum, scaled as `scale_loss` scales a stock model's loss."""
        return self.scale_loss(ops.sum(losses))

    def _learning_rate_schedules(self):
        value = self._hyper_values["learning_rate"]
        if isinstance(value, Schedule):
            return [value]
        if isinstance(value, list) and isinstance(value[0], Schedule):
            return value
        return []

    @property
    def learning_rate(self):
        """The current `[B]` learning rates."""
        return self._get_current_learning_rate()

    @learning_rate.setter
    def learning_rate(self, value):
        self.set_hyperparameter("learning_rate", value)

    def _get_current_learning_rate(self):
        schedules = self._learning_rate_schedules()
        if schedules:
            rates = ops.stack([ops.cast(s(self._iterations), "float32")
                               for s in schedules])
            if self.num_models is None:
                return rates
            return ops.broadcast_to(rates, (self.num_models,))
        if "learning_rate" in self._hyper_variables:
            return self._hyper_variables["learning_rate"]
        return self.get_hyperparameter("learning_rate")

    # -- building -----------------------------------------------------------

    def build(self, variables):
        self._set_num_models_from(variables)
        super().build(variables)
        for name, value in self._hyper_values.items():
            if value is None or name == "learning_rate" and (
                    self._learning_rate_schedules()):
                continue
            # An initializer, not an assign: Keras may build the optimizer
            # symbolically, where assignments do not run.
            initial = np.broadcast_to(np.asarray(value, dtype="float32"),
                                      (self.num_models,))
            self._hyper_variables[name] = self.add_variable(
                (self.num_models,), name=name,
                initializer=keras.initializers.Constant(initial.copy()),
                aggregation="only_first_replica")

    def _set_num_models_from(self, variables):
        for variable in variables:
            shape = tuple(variable.shape)
            if not shape:
                raise ValueError(
                    f"Fused optimizer '{self.name}' updates [num_models, ...] "
                    f"variables; variable '{variable.path}' is a scalar. Use "
                    "hftatf.layers to build the array's layers."
                )
            self._set_num_models(
                shape[0], f"variable '{variable.path}' has shape {shape} "
                f"(model axis {shape[0]})")

    # -- clipping and weight decay, per model -------------------------------

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
        # tf.clip_by_norm's formula, over each model's slice.
        clipnorm = self._hyper("clipnorm", gradient)
        axes = tuple(range(1, len(gradient.shape)))
        l2sum = ops.sum(ops.square(gradient), axis=axes, keepdims=True)
        positive = l2sum > 0
        l2sum_safe = ops.where(positive, l2sum, ops.ones_like(l2sum))
        l2norm = ops.where(positive, ops.sqrt(l2sum_safe), l2sum)
        clipped = ops.divide(ops.multiply(gradient, clipnorm),
                             ops.maximum(l2norm, clipnorm))
        return ops.where(clipnorm > 0, clipped, gradient)

    def _clip_by_model_global_norm(self, grads):
        # keras.optimizers' clip_by_global_norm, over each model's gradients.
        squares = [ops.sum(ops.square(g), axis=tuple(range(1, len(g.shape))))
                   for g in grads if g is not None]
        norms = ops.sqrt(ops.sum(ops.stack(squares), axis=0))
        clipnorm = ops.cast(self._hyper_variables["global_clipnorm"],
                            norms.dtype)
        scale = clipnorm * ops.minimum(1.0 / norms, 1.0 / clipnorm)
        # Non-finite norms give NaN scales, as in Keras.
        scale = ops.where(clipnorm > 0, scale + (norms - norms), 1.0)
        return [None if g is None else g * self._per_model(scale, g)
                for g in grads]

    def _clip_by_model_value(self, gradient):
        value = self._hyper("clipvalue", gradient)
        clipped = ops.maximum(ops.minimum(gradient, value), -value)
        return ops.where(value > 0, clipped, gradient)

    def _apply_weight_decay(self, variables):
        if self.weight_decay is None:
            return
        for variable in variables:
            if self._use_weight_decay(variable):
                learning_rate = self._per_model(self.learning_rate, variable)
                weight_decay = self._hyper("weight_decay", variable)
                variable.assign_sub(variable * weight_decay * learning_rate)

    # -- serialization ------------------------------------------------------

    def get_config(self):
        config = {
            "name": self.name,
            "use_ema": self.use_ema,
            "ema_momentum": self.ema_momentum,
            "ema_overwrite_frequency": self.ema_overwrite_frequency,
            "loss_scale_factor": self.loss_scale_factor,
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
            "num_models": self.num_models,
        }
        for name in self._hyper_values:
            config[name] = self._hyper_config(name)
        return config

    def _hyper_config(self, name):
        schedules = self._learning_rate_schedules()
        if name == "learning_rate" and schedules:
            serialized = [keras.optimizers.schedules.serialize(s)
                          for s in schedules]
            value = self._hyper_values[name]
            return serialized if isinstance(value, list) else serialized[0]
        if name in self._hyper_variables:
            return [float(v) for v in ops.convert_to_numpy(
                self._hyper_variables[name])]
        return self._hyper_values[name]

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        rate = config.get("learning_rate")
        if isinstance(rate, dict):
            config["learning_rate"] = keras.optimizers.schedules.deserialize(
                rate, custom_objects=custom_objects)
        elif isinstance(rate, list) and rate and isinstance(rate[0], dict):
            config["learning_rate"] = [
                keras.optimizers.schedules.deserialize(
                    r, custom_objects=custom_objects) for r in rate]
        return cls(**config)


def _placeholder_learning_rate():
    raise RuntimeError("A fused optimizer reads its own learning rates.")


def _standardize(name, value):
    """Returns a float, a list of floats (or of schedules), a schedule, or
    None; raises a TypeError/ValueError that says what was expected."""
    if value is None:
        if name == "learning_rate":
            raise ValueError("`learning_rate` cannot be None.")
        return None
    if isinstance(value, Schedule):
        if name != "learning_rate":
            raise TypeError(f"Only `learning_rate` may be a schedule; "
                            f"received {name}={value!r}.")
        return value
    if _is_number(value):
        return float(value)
    if isinstance(value, (np.ndarray, list, tuple)):
        items = list(np.asarray(value, dtype=object).reshape(-1)) if (
            isinstance(value, np.ndarray)) else list(value)
        if not items:
            raise ValueError(f"`{name}` is an empty sequence; give one value "
                             "per model.")
        if all(_is_number(v) for v in items):
            return [float(v) for v in items]
        if name == "learning_rate" and all(isinstance(v, Schedule)
                                           for v in items):
            return items
    expected = ("a float, a sequence of floats (one per model), a "
                "LearningRateSchedule or a sequence of them"
                if name == "learning_rate"
                else "a float or a sequence of floats (one per model)")
    raise TypeError(f"`{name}` must be {expected}. Received: {name}="
                    f"{value!r}.")
