"""The base class of fused optimizers: per-model hyper-parameters as data.

Every variable a fused optimizer updates is `[B, ...]` (the model axis
first, DESIGN.md §1). `FusedOptimizer` is `keras.optimizers.Optimizer`
with one part per concern, each in a module of its own:
`hyperparameters` (the `[B]` hyper-parameter vectors and their
broadcasting), `clipping` (per-model norms, clipping and weight decay),
`steps` (the per-model step, step counts and partial steps) and
`averaging` (gradient accumulation and moving averages). Subclasses, like
stock Keras optimizers, override `build`, `update_step` and `get_config`.
"""

import keras
from keras import ops

from hftatf.core.validation import ModelCount, check_num_models, shared
from hftatf.optimizers.averaging import PerModelAveraging
from hftatf.optimizers.clipping import PerModelClipping
from hftatf.optimizers.hyperparameters import (
    PerModelHyperparameters,
    standardize,
)
from hftatf.optimizers.steps import PerModelSteps


class FusedOptimizer(PerModelHyperparameters, PerModelClipping,
                     PerModelSteps, PerModelAveraging, ModelCount,
                     keras.optimizers.Optimizer):
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

    Values that cannot be right are refused, when given and when set: a
    learning rate (or a schedule's rate) that is not a finite number >= 0,
    betas outside [0, 1), a negative epsilon, clipping or weight decay, a
    momentum outside [0, 1], any hyper-parameter that is NaN or infinite
    (`hyperparameters.RANGES`, and a class's own `hyperparameter_ranges`).

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

    Slots (the contract `stock_optimizer` and `copy_state` rely on, and so
    `FusedModel.unfuse`, per-model export and checkpoints): an optimizer
    whose class has a stock Keras counterpart keeps each kind of slot as
    the stock optimizer does, under the stock attribute's name
    (`_momentums`, `_velocities`, `momentums`, ...): a list with one
    `[B, ...]` slot (or None) per variable, in the order of the variables
    it was built on, model `b`'s slot being `slot[b]`, of the stock slot's
    shape (`self.add_optimizer_variables(variables, ...)` makes such a
    list). Its other state variables carry the stock attribute's name
    (Nadam's `_u_product`) or the stock variable's name. Giving a stock
    optimizer the state of an optimizer that keeps a slot elsewhere raises
    a ValueError naming the slot.

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

    # `{name: hftatf.core.validation.Range}`: the ranges of this class's
    # hyper-parameters where they differ from (or add to) those every fused
    # optimizer checks (`hyperparameters.RANGES`).
    hyperparameter_ranges = {}

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
        values = {name: standardize(name, value)
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
        self._check_hyperparameters()

    # -- the model axis -----------------------------------------------------

    @ModelCount.num_models.setter
    def num_models(self, num_models):
        self._set_num_models(check_num_models(num_models),
                             f"num_models={num_models}")

    def scale_model_losses(self, losses):
        """The scalar the array differentiates, from its `[B]` losses: their
        sum, scaled as `scale_loss` scales a stock model's loss."""
        return self.scale_loss(ops.sum(losses))

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
