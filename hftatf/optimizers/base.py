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

Every model also keeps its own step count (`model_iterations`), and a step
can be applied to some models only (`apply(..., model_mask=...)`): the
models left out keep every variable, slot, moving average, accumulator and
step count exactly as they were. `LossScaleOptimizer` uses this to skip, per
model, the steps whose gradients overflowed, as the stock loss-scale
optimizer skips the steps of a single model.
"""

import contextlib
import numbers
import threading

import keras
import numpy as np
import tensorflow as tf
from keras import ops
from tensorflow.python.ops import control_flow_util

from hftatf import sparse
from hftatf.layers.base import broadcast_to_models
from hftatf.validation import check_num_models, shared

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
        use_ema, ema_overwrite_frequency, loss_scale_factor,
        gradient_accumulation_steps, name: as in `keras.optimizers.Optimizer`,
            applied to each model on its own step count (see below).
        ema_momentum: a float in [0, 1] or a length-B sequence of them: model
            `b`'s weights are averaged with `ema_momentum[b]`. Used only with
            `use_ema=True`; defaults to 0.99, as in Keras.
        num_models: the number of models `B`. Optional: it is taken from the
            length of any per-model sequence, from `FusedModel.compile`, or
            from the variables the optimizer is built on.

    Step counts: `iterations` counts the steps applied to any model;
    `model_iterations` (`[B]`) counts each model's own steps, and is what
    each model's learning-rate schedule, bias corrections
    (`_local_step`), moving average and gradient accumulation read, exactly
    as a stock optimizer reads its `iterations`. The two agree unless steps
    were applied to some models only.

    Sparse gradients (an embedding table's, `hftatf.sparse`) are applied
    as stock optimizers apply them: clipping takes norms and values over
    the occurrences of the rows looked up. An optimizer whose stock
    counterpart applies an element-wise operation to the occurrences
    (Adam's square of the gradient) sets `applies_sparse_gradients` and
    keeps them sparse through that operation (`_summed`, `_at_rows`); for
    the others each gradient is made dense (occurrences of a row summed)
    before `update_step`, which equals the stock sparse update.

    Partial steps: `apply(grads, model_mask=mask)` (and `apply_gradients`)
    with a `[B]` boolean `mask` updates only the models where `mask` is
    True. Subclasses get this for free as long as they update every
    variable through `self.assign`, `self.assign_add` and `self.assign_sub`,
    as stock optimizers do.
    """

    # Whether `update_step` takes sparse gradients (see above); those of
    # the other optimizers are made dense before it.
    applies_sparse_gradients = False

    # Whether `apply` itself skips, per model, the steps whose gradients are
    # not finite (as loss scaling does); FusedModel reads it.
    skips_nonfinite_steps = False

    # The hyper-parameters whose complement, `1 - value`, the stock
    # optimizer computes from the Python float (in double precision) and
    # rounds once (Adam's `1 - self.beta_2`): read with `_complement`.
    # From a float32 value it would be off by up to 2e-4 of itself for
    # values near 1 (`1 - float32(0.9999)`), and each step with it.
    complemented_hyperparameters = ()

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
        for name in ("loss_scale_factor", "gradient_accumulation_steps",
                     "ema_overwrite_frequency", "use_ema"):
            shared(name, kwargs.get(name))
        values = {"learning_rate": learning_rate}
        values.update(hyperparameters or {})
        values.update(weight_decay=weight_decay, clipnorm=clipnorm,
                      clipvalue=clipvalue, global_clipnorm=global_clipnorm,
                      ema_momentum=kwargs.pop("ema_momentum", 0.99))
        values = {name: _standardize(name, value)
                  for name, value in values.items()}
        lengths = {name: len(value) for name, value in values.items()
                   if isinstance(value, list)}
        # The stock optimizer sees placeholders for the learning rate and the
        # EMA momentum: the real ones are per model, read from `[B]`
        # variables.
        super().__init__(
            learning_rate=_placeholder_learning_rate,
            weight_decay=weight_decay,
            clipnorm=clipnorm,
            clipvalue=clipvalue,
            global_clipnorm=global_clipnorm,
            ema_momentum=0.99,
            **kwargs,
        )
        self._hyper_values = values
        self._hyper_variables = {}
        self._complement_variables = {}
        self._hyper_ranges = {}
        self._model_iterations = None
        self._num_models = None
        if num_models is not None:
            self.num_models = num_models
        for name, length in lengths.items():
            self._set_num_models(length, f"`{name}` has {length} values")
        if getattr(learning_rate, "num_models", None) is not None:
            # An hftatf schedule with per-model parameters.
            self._set_num_models(
                learning_rate.num_models,
                f"its learning-rate schedule '{learning_rate.name}' is "
                f"configured for {learning_rate.num_models} models")
        if self.use_ema:
            self._check_range("ema_momentum", 0.0, 1.0)

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

        Learning-rate schedules are evaluated at each model's own step
        count.
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
            for store, _, values in self._stored_values(name, value):
                store[name].assign(values)
        if name in self.__dict__:  # an attribute the stock base keeps
            super().__setattr__(name, value)

    def __getattr__(self, name):
        # Each hyper-parameter reads as an attribute, as in the stock
        # optimizer (`optimizer.beta_1`): a float, or one float per model.
        values = self.__dict__.get("_hyper_values")
        if values is not None and name in values:
            return self._hyper_config(name)
        raise AttributeError(
            f"'{type(self).__name__}' object has no attribute '{name}'")

    def __setattr__(self, name, value):
        # ... and is set as one (`optimizer.beta_1 = [0.8, 0.9]`), through
        # `set_hyperparameter`: checked, and read by the next step.
        values = self.__dict__.get("_hyper_values")
        if (values is not None and name in values
                and not isinstance(getattr(type(self), name, None),
                                   property)):
            self.set_hyperparameter(name, value)
            return
        super().__setattr__(name, value)

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

    def _complement(self, name, variable):
        """`1 - hyper-parameter name` as `[B, 1, ..., 1]`, in `variable`'s
        dtype, computed from the Python floats as the stock optimizer
        computes it (`complemented_hyperparameters`)."""
        return self._per_model(self._complement_variables[name], variable)

    def _per_model(self, values, variable):
        """Broadcasts a `[B]` vector against a `[B, ...]` variable; once per
        rank and dtype in a step (`_broadcasts`)."""
        rank, dtype = len(variable.shape), variable.dtype
        cache = _BROADCASTS.__dict__.get(id(self))
        key = (id(values), rank, dtype)
        if cache is not None and key in cache and cache[key][0] is values:
            return cache[key][1]
        result = broadcast_to_models(ops.cast(values, dtype), rank)
        if cache is not None:
            # The source is kept with its broadcast: its id stays its own.
            cache[key] = (values, result)
        return result

    @contextlib.contextmanager
    def _broadcasts(self):
        """Within, each `[B]` hyper-parameter (and step count) is cast and
        reshaped once per variable rank and dtype, not once per variable:
        on a CPU without XLA, a step of many small variables spends much
        of its time on those ops. Not under tf.distribute, where each
        variable's update runs on its own device."""
        # A fresh cache in each branch of a cond: a tensor made in one
        # branch cannot be read outside it.
        with _set_for(_BROADCASTS, self,
                      None if tf.distribute.has_strategy() else {}):
            yield

    def _local_step(self, variable):
        """Each model's number for the step being taken (1 for its first
        update), as `[B, 1, ..., 1]` in `variable`'s dtype. Optimizers whose
        math depends on the step (bias corrections, decays) read it here,
        never from `self.iterations`: a model whose step is skipped (a
        non-finite gradient under loss scaling) keeps its own count."""
        cache = _BROADCASTS.__dict__.get(id(self))
        if cache is None:
            return self._per_model(self.model_iterations + 1, variable)
        if "step" not in cache:
            cache["step"] = self.model_iterations + 1
        return self._per_model(cache["step"], variable)

    @property
    def ema_momentum(self):
        """The EMA momentum: a float, or one float per model."""
        return self._hyper_config("ema_momentum")

    @ema_momentum.setter
    def ema_momentum(self, value):
        # The stock constructor sets a placeholder before the per-model
        # values exist; they are set from the constructor's argument.
        if getattr(self, "_hyper_values", None) is not None:
            self.set_hyperparameter("ema_momentum", value)

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
            return self._scheduled_learning_rates(schedules)
        if "learning_rate" in self._hyper_variables:
            return self._hyper_variables["learning_rate"]
        return self.get_hyperparameter("learning_rate")

    def _scheduled_learning_rates(self, schedules):
        """Model `b`'s rate is its schedule at its own raw step count, as a
        stock optimizer evaluates its schedule at its `_iterations`. A
        schedule may also return one rate per model (`[B]`)."""
        if self._model_iterations is None:
            # Not built: every model is at step `_iterations`.
            rates = [_as_vector(s(self._iterations)) for s in schedules]
            if len(rates) == 1:
                rates = rates[0]
            else:
                rates = ops.concatenate(rates)
            if self.num_models is None:
                return rates
            return ops.broadcast_to(rates, (self.num_models,))
        steps = _read(self._model_iterations)
        rates = []
        for model in range(self.num_models):
            rate = schedules[model % len(schedules)](steps[model])
            rate = ops.cast(rate, "float32")
            rates.append(rate[model] if len(rate.shape) else rate)
        return ops.stack(rates)

    # -- building -----------------------------------------------------------

    def build(self, variables):
        self._set_num_models_from(variables)
        super().build(variables)
        for name, value in self._hyper_values.items():
            if value is None or name == "learning_rate" and (
                    self._learning_rate_schedules()) or (
                    name == "ema_momentum" and not self.use_ema):
                continue
            # An initializer, not an assign: Keras may build the optimizer
            # symbolically, where assignments do not run.
            for store, key, values in self._stored_values(name, value):
                store[name] = self.add_variable(
                    (self.num_models,), name=key,
                    initializer=keras.initializers.Constant(values),
                    aggregation="only_first_replica")
        # Each model's own `_iterations`: the raw count of the steps applied
        # to it (micro-steps under gradient accumulation), checkpointed.
        self._model_iterations = self.add_variable(
            (self.num_models,), name="model_iterations", dtype="int",
            initializer="zeros", aggregation="only_first_replica")

    def _stored_values(self, name, value):
        """`(store, key, values)` for each `[B]` variable that holds
        hyper-parameter `name` (a float or a list): the value itself, in
        `_hyper_variables`, and for a complemented one `1 - value`,
        computed in double precision, in `_complement_variables`; `key` is
        the variable's name."""
        value = np.asarray(value, dtype="float64")
        found = [(self._hyper_variables, name, value)]
        if name in self.complemented_hyperparameters:
            found.append((self._complement_variables, f"one_minus_{name}",
                          1.0 - value))
        # In double precision: a float64 variable (`floatx="float64"`)
        # holds the value itself, as a stock optimizer's does.
        return [(store, key, np.broadcast_to(
            values, (self.num_models,)).copy())
            for store, key, values in found]

    def load_own_variables(self, store):
        # A file saved before the complements of hyper-parameters were
        # variables (`complemented_hyperparameters`) holds the others, in
        # the same order: they load, and the complements are set from the
        # hyper-parameters loaded. The stock base skips, with a warning,
        # a file whose count differs.
        complements = self._complements()
        variables = self.variables
        if complements and len(store.keys()) == (
                len(variables) - len(complements)):
            ids = {id(variable) for _, _, variable in complements}
            kept = [v for v in variables if id(v) not in ids]
            for index, variable in enumerate(kept):
                variable.assign(store[str(index)])
            for optimizer, name, variable in complements:
                variable.assign(optimizer._complement_of_loaded(name))
            return
        super().load_own_variables(store)

    def _complements(self):
        """`(optimizer, name, variable)` for each complement variable of
        this optimizer and of any it wraps (`inner_optimizer`)."""
        found = []
        for optimizer in (self, getattr(self, "inner_optimizer", None)):
            if isinstance(optimizer, FusedOptimizer):
                found.extend((optimizer, name, variable) for name, variable
                             in optimizer._complement_variables.items())
        return found

    def _complement_of_loaded(self, name):
        """`1 - name` for the value its variable holds: from the config's
        Python floats where the variable holds them, else from the
        variable's values."""
        loaded = ops.convert_to_numpy(self._hyper_variables[name])
        held = {key: values for _, key, values
                in self._stored_values(name, self._hyper_values[name])}
        if not np.array_equal(loaded, held[name].astype(loaded.dtype)):
            held = {key: values for _, key, values
                    in self._stored_values(name, loaded)}
        return held[f"one_minus_{name}"]

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
        # tf.clip_by_norm's formula, over each model's slice (a sparse
        # gradient's: over its occurrences, as tf.clip_by_norm over an
        # IndexedSlices' values).
        clipnorm = self._hyper("clipnorm", gradient)
        if sparse.is_sparse(gradient):
            values = gradient.values
            l2sum = self._at_rows(broadcast_to_models(
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

    def _apply_weight_decay(self, variables):
        if self.weight_decay is None:
            return
        for variable in variables:
            # As the stock optimizer on TensorFlow: an exclusion pattern is
            # matched against the TensorFlow variable's name, its path
            # ("logits/kernel:0"), so a pattern may name a layer.
            if self._use_weight_decay(_unwrap(variable)):
                learning_rate = self._per_model(self.learning_rate, variable)
                weight_decay = self._hyper("weight_decay", variable)
                self.assign_sub(variable,
                                variable * weight_decay * learning_rate)

    # -- steps per model ----------------------------------------------------

    @property
    def model_iterations(self):
        """Each model's step count, `[B]`: what `iterations` is for a stock
        optimizer (divided by `gradient_accumulation_steps` when gradients
        are accumulated). Before the optimizer is built, `iterations`."""
        if self._model_iterations is None:
            return self.iterations
        counts = _read(self._model_iterations)
        if self.gradient_accumulation_steps:
            counts = ops.floor_divide(counts,
                                      self.gradient_accumulation_steps)
        return counts

    def apply_gradients(self, grads_and_vars, model_mask=None):
        """As `keras.optimizers.Optimizer.apply_gradients`; `model_mask` as
        in `apply`."""
        grads, trainable_variables = zip(*grads_and_vars)
        self.apply(grads, trainable_variables, model_mask=model_mask)
        return self._iterations

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
        if mask is None or tf.distribute.has_strategy() or _compiled_by_xla():
            # (A replica-context cond may not hold the merge_call that
            # updates make under tf.distribute. XLA fuses the selects of
            # the masked update into it: no cost per step, and one update
            # to trace and compile, not two.)
            self._apply(grads, trainable_variables, mask)
        else:
            # Most steps update every model: those take the unmasked
            # update, without a select per variable and slot. Tracing both
            # costs time once (mobilenet_v3_small, B = 3, CPU: first step
            # 24.5 s, 18.9 s with the masked update alone); the selects
            # would cost it every step (101 -> 109 ms).
            ops.cond(ops.all(mask),
                     lambda: self._apply(grads, trainable_variables, None),
                     lambda: self._apply(grads, trainable_variables, mask))

    def _apply(self, grads, trainable_variables, mask):
        """`apply` to the built optimizer's `trainable_variables`, with the
        standardized `mask`."""
        with keras.name_scope(self.name, caller=self), self._masked(mask), \
                self._broadcasts():
            grads, trainable_variables = self._filter_empty_gradients(
                grads, trainable_variables)
            grads, trainable_variables = (
                self._overwrite_variables_directly_with_gradients(
                    grads, trainable_variables))
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
            self._iterations.assign_add(1)
        else:
            self._model_iterations.assign_add(
                ops.cast(mask, self._model_iterations.dtype))
            self._iterations.assign_add(
                ops.cast(ops.any(mask), self._iterations.dtype))

    def _variables_to_update(self, grads, trainable_variables):
        """Builds the optimizer if needed and returns the variables that
        `grads` belong to, with the checks of the stock `apply`."""
        if trainable_variables is None:
            if not self.built:
                raise ValueError(
                    "When passing `grads` without `variables`, the optimizer "
                    "must already be built on a list of variables. Call "
                    "`optimizer.build(trainable_variables)` first.")
            if len(grads) != len(self._trainable_variables_indices):
                raise ValueError(
                    f"Received {len(grads)} gradients, but the optimizer "
                    f"was built on {len(self._trainable_variables)} "
                    "variables. Pass one gradient per variable, in the "
                    "order of the variables it was built with.")
            return self._trainable_variables
        trainable_variables = list(trainable_variables)
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(trainable_variables)
            self.built = True
        self._check_variables_are_known(trainable_variables)
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

    def _backend_apply_gradients(self, grads, trainable_variables):
        # The stock sequence (accumulate or update, then the moving
        # average), with each model's own step count deciding what is due.
        if self.gradient_accumulation_steps:
            self._accumulate_or_update(grads, trainable_variables)
        else:
            self._update(grads, trainable_variables)
        if self.use_ema:
            self._update_model_variables_moving_average(
                self._trainable_variables)
            if self.ema_overwrite_frequency:
                due = ops.equal(ops.mod(self.model_iterations + 1,
                                        self.ema_overwrite_frequency), 0)
                overwrite = self._overwrite_model_variables_with_average_value
                self._for_models(
                    due, lambda: overwrite(self._trainable_variables))

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
        with _set_for(_MERGED, self, self._merged_by_clipping(grads)):
            self._backend_update_step(grads, trainable_variables,
                                      self.learning_rate)

    def _merged_by_clipping(self, grads):
        """The `[B]` models whose sparse gradients `global_clipnorm` made
        dense (None if none): replicas' sums of them must be merged too."""
        if self.global_clipnorm is None or not tf.distribute.has_strategy(
                ) or not any(sparse.is_sparse(g) for g in grads):
            return None
        return self._hyper_variables["global_clipnorm"] > 0

    def _all_reduce_sum_gradients(self, grads_and_vars):
        # Stock replicas sum the dense gradients that global clipping made:
        # a row looked up on two replicas is one row of the sum.
        grads_and_vars = super()._all_reduce_sum_gradients(grads_and_vars)
        merged = _MERGED.__dict__.get(id(self))
        if merged is None:
            return grads_and_vars
        return [(sparse.merged(g, merged, self.num_models)
                 if sparse.is_sparse(g) else g, v) for g, v in grads_and_vars]

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
            self._accumulated_gradients[self._get_variable_index(v)]
            for v in trainable_variables]
        self._for_models(due, lambda: self._update(
            [(g + a) / steps for g, a in zip(grads, accumulators)],
            trainable_variables))
        for gradient, accumulator in zip(grads, accumulators):
            reset = broadcast_to_models(due, len(accumulator.shape))
            self.assign(accumulator, ops.where(
                reset, ops.zeros(accumulator.shape, accumulator.dtype),
                accumulator + gradient))

    def _for_models(self, due, update):
        """Runs `update` for the models where the `[B]` boolean `due` holds
        (and that the step applies to); the others are left untouched."""
        with self._masked(due), self._broadcasts():
            if tf.distribute.has_strategy():
                # A replica-context cond may not hold a merge_call, which
                # updates under tf.distribute make: run, selecting per model.
                update()
            else:
                # Skips the work altogether on steps where no model is due.
                ops.cond(ops.any(self._model_mask), update, lambda: None)

    # -- moving averages of the weights, per model ---------------------------

    def _update_model_variables_moving_average(self, trainable_variables):
        """The stock EMA update, with model `b`'s momentum and step count:
        the average is the weights themselves on the model's first step."""
        if not self.use_ema:
            return
        not_first_step = ops.not_equal(self.model_iterations, 0)
        for variable, average in zip(trainable_variables,
                                     self._model_variables_moving_average):
            if average is None:
                continue
            momentum = ops.multiply(
                self._per_model(not_first_step, variable),
                self._hyper("ema_momentum", variable))
            self.assign(average,
                        ops.multiply(momentum, average)
                        + ops.multiply(ops.subtract(1, momentum), variable))

    def _overwrite_model_variables_with_average_value(
            self, trainable_variables):
        """Copies the moving averages into the weights (of the models a
        partial step applies to)."""
        averages = self._model_variables_moving_average
        if len(trainable_variables) != len(averages):
            raise ValueError(
                f"The optimizer holds moving averages of {len(averages)} "
                f"variables but was given {len(trainable_variables)}. Pass "
                "the variables the optimizer was built with.")
        for variable, average in zip(trainable_variables, averages):
            if average is not None:
                self.assign(variable, _read(average))

    # -- partial steps: updates restricted to some models --------------------

    @property
    def _model_mask(self):
        """The `[B]` mask of the models being updated, or None (all)."""
        return _MASKS.__dict__.get(id(self))

    @contextlib.contextmanager
    def _masked(self, mask, replace=False):
        """Restricts updates to the models where `mask` holds (and where the
        enclosing mask holds, unless `replace`). Masks are kept per thread:
        tf.distribute runs each replica in a thread of its own."""
        previous = self._model_mask
        if mask is not None and previous is not None and not replace:
            mask = ops.logical_and(previous, mask)
        with _set_for(_MASKS, self, mask):
            yield

    def assign(self, variable, value):
        mask = self._model_mask
        if sparse.is_sparse(value) and (
                mask is not None
                or sparse.rows_per_model(value, variable.shape) > 1):
            # The rows given replace the variable's; the others stay.
            old = _read(variable)
            value = ops.reshape(tf.tensor_scatter_nd_update(
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
            return super().assign_add(variable, _rows_of(value, variable))
        return super().assign(variable, self._select(
            mask, variable, _read(variable) + _dense(value, variable)))

    def assign_sub(self, variable, value):
        mask = self._model_mask
        if mask is None:
            return super().assign_sub(variable, _rows_of(value, variable))
        return super().assign(variable, self._select(
            mask, variable, _read(variable) - _dense(value, variable)))

    def _select(self, mask, variable, value):
        """`value` for the models in `mask`, `variable`'s own value for the
        others."""
        if len(variable.shape) == 0:
            raise ValueError(
                f"Optimizer '{self.name}' updated the scalar variable "
                f"'{variable.name}' during a step applied to some models "
                "only; only [num_models, ...] variables can be updated per "
                "model. Give the variable a leading model axis.")
        mask = broadcast_to_models(mask, len(variable.shape))
        return ops.where(mask, ops.cast(value, variable.dtype),
                         _read(variable))

    def _backend_update_step(self, grads, trainable_variables, learning_rate):
        mask = self._model_mask
        if mask is None:
            return super()._backend_update_step(grads, trainable_variables,
                                                learning_rate)
        # As the TensorFlow optimizer does: gradients summed over replicas,
        # then each variable updated in a cross-replica merge_call. The mask
        # travels through the merge_call as an argument, so that each copy
        # of a variable is updated with its own replica's mask.
        trainable_variables = [_unwrap(v) for v in trainable_variables]
        grads_and_vars = self._all_reduce_sum_gradients(
            list(zip(grads, trainable_variables)))
        tf.__internal__.distribute.interim.maybe_merge_call(
            self._masked_update_step, self._distribution_strategy,
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
        value = self._hyper_values[name]
        if name in self._hyper_variables:
            current = ops.convert_to_numpy(self._hyper_variables[name])
            # The floats given, while the variable holds them (a config
            # keeps the complements exact), else what it holds (restored).
            if value is not None and np.array_equal(
                    np.broadcast_to(np.float32(value), current.shape),
                    current):
                return value
            return [float(v) for v in current]
        return value

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


# Per thread, by optimizer: the masks of the partial steps being applied,
# and the caches of `_per_model`.
_MASKS = threading.local()
_BROADCASTS = threading.local()
# ... and the models whose sparse gradients global clipping merged.
_MERGED = threading.local()


@contextlib.contextmanager
def _set_for(store, optimizer, value):
    """Within, this thread's entry of `optimizer` in `store` (a
    `threading.local`) is `value`, unless `value` is None; the previous
    entry (or none) is restored after."""
    entries = store.__dict__
    previous = entries.get(id(optimizer))
    if value is not None:
        entries[id(optimizer)] = value
    try:
        yield
    finally:
        if previous is None:
            entries.pop(id(optimizer), None)
        else:
            entries[id(optimizer)] = previous


def _unwrap(variable):
    return variable.value if isinstance(variable, keras.Variable) else variable


def _read(variable):
    """The value of a Keras or TensorFlow variable, as a tensor."""
    return tf.convert_to_tensor(_unwrap(variable))


def _dense(value, variable):
    return ops.cast(sparse.dense(value, variable.shape), variable.dtype)


def _rows_of(value, variable):
    """`value` as TensorFlow's variables add it: a sparse value of rows of
    the model axis as it is (scattered), one of finer rows made dense."""
    if sparse.is_sparse(value) and sparse.rows_per_model(
            value, variable.shape) > 1:
        return sparse.dense(value, variable.shape)
    return value


def _as_vector(rate):
    return ops.reshape(ops.cast(rate, "float32"), (-1,))


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


def _compiled_by_xla():
    """Whether the function being traced is compiled by XLA."""
    return control_flow_util.GraphOrParentsInXlaContext(
        tf.compat.v1.get_default_graph())
