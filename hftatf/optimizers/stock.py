"""One model of a fused optimizer as a stock Keras optimizer, state included.

`stock_optimizer(optimizer, b)` is the stock optimizer that model `b` of the
array trains with: the stock class of the same name with model `b`'s
hyper-parameters as they are now (a learning rate lowered by a callback
included) and its learning-rate schedule. `copy_state` builds it on a stock
model's variables and gives it model `b`'s state: step count, slots
(momentums, velocities, ...), EMA averages, accumulated gradients and loss
scale. A stock model compiled with it and trained on goes on exactly as
model `b` would have gone on in the array.
"""

import keras
from keras import ops

from hftatf.core import compat
from hftatf.optimizers.schedules import FusedSchedule

# The fused settings that are per-model floats where the stock ones are
# optional: 0 turns them off for a model, None does for a stock optimizer.
_OFF_AT_ZERO = ("clipnorm", "clipvalue", "global_clipnorm")

# What a stock optimizer's step count and learning-rate variable are set
# from: model b's own count and current rate.
_ITERATIONS = object()
_LEARNING_RATE = object()


def stock_optimizer(optimizer, index):
    """A new, unbuilt stock optimizer that trains as model `index` of the
    fused `optimizer` trains.

    Raises:
        TypeError: where the optimizer (or its learning-rate schedule) has
            no stock Keras form: `Lars`, a subclass of a fused optimizer,
            `LinearWarmup`, or a schedule of the user's own that is not a
            stock Keras one.
    """
    inner = getattr(optimizer, "inner_optimizer", None)
    if inner is not None:
        config = optimizer.get_config()
        return keras.optimizers.LossScaleOptimizer(
            stock_optimizer(inner, index),
            initial_scale=config["initial_scale"],
            dynamic_growth_steps=config["dynamic_growth_steps"],
            name=optimizer.name)
    stock_class = _stock_class(optimizer)
    config = optimizer.get_config()
    config.pop("num_models", None)
    for name in optimizer.hyperparameter_names:
        value = config[name]
        if name == "learning_rate" and optimizer._learning_rate_schedules():
            value = _stock_schedule(optimizer._hyper_values[name], index)
        elif isinstance(value, list):
            value = value[index]
        if name in _OFF_AT_ZERO and value == 0:
            value = None
        config[name] = value
    stock = stock_class.from_config(config)
    _, pattern = compat.weight_decay_exclusions(optimizer)
    if pattern is not None:
        compat.set_weight_decay_exclusions(stock, pattern=pattern)
    return stock


def _stock_class(optimizer):
    """The keras.optimizers class of an hftatf optimizer's name; a subclass
    of one (another update, perhaps) has none."""
    name = type(optimizer).__name__
    stock_class = getattr(keras.optimizers, name, None)
    if (not type(optimizer).__module__.startswith("hftatf.")
            or not isinstance(stock_class, type)):
        raise TypeError(
            f"Optimizer '{optimizer.name}' ({name}) has no stock Keras "
            "counterpart (those of hftatf.optimizers are the "
            "keras.optimizers classes of the same names), so its models "
            "cannot be given a stock optimizer.")
    return stock_class


def _stock_schedule(value, index):
    """Model `index`'s schedule of a fused optimizer's learning rate: one
    schedule for all models, or a list of them."""
    schedule = value[index % len(value)] if isinstance(value, list) else value
    if isinstance(schedule, FusedSchedule):
        return schedule.stock_schedule(index)
    stock_class = getattr(keras.optimizers.schedules,
                          type(schedule).__name__, None)
    if stock_class is not type(schedule):
        raise TypeError(
            f"The learning-rate schedule {schedule!r} is not a "
            "keras.optimizers.schedules class, so a stock optimizer with "
            "it would need its code to load.")
    return stock_class.from_config(schedule.get_config())


def copy_state(optimizer, index, stock, variables):
    """Builds `stock` (from `stock_optimizer(optimizer, index)`) on the
    stock variables of `variables`, `(fused variable, stock variable)`
    pairs, and sets its state to model `index`'s.

    Raises:
        ValueError: if some variable of the stock optimizer has no
            counterpart in the fused one (the stock state would be wrong).
    """
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    excluded, _ = compat.weight_decay_exclusions(inner)
    if excluded:
        stock_inner = getattr(stock, "inner_optimizer", stock)
        compat.set_weight_decay_exclusions(stock_inner, keys=[
            compat.variable_key(stock_inner, s) for f, s in variables
            if compat.variable_key(inner, f) in excluded])
    stock.build([s for _, s in variables])
    if optimizer.built:  # Else its state is the initial one, as `stock`'s.
        _copy_variables(optimizer, index, stock, variables)
    return stock


def _copy_variables(optimizer, index, stock, variables):
    """Sets each variable `stock` itself holds (not an inner optimizer's)
    to model `index`'s value of its counterpart in `optimizer`.

    Slots are found by the slot contract of `FusedOptimizer`: in lists by
    variable index (`_momentums[i]` is the momentum of variable `i`), under
    the stock attribute's name; their names may repeat (Adafactor names
    both factors after the variable). The other variables are found under
    the same attribute (`_u_product`, `dynamic_scale`) or name.
    """
    inner = getattr(optimizer, "inner_optimizer", None)
    if inner is not None:
        _copy_variables(inner, index, stock.inner_optimizer, variables)
    done = set()
    fused_lists = compat.slot_lists(optimizer)
    for attribute, slots in compat.slot_lists(stock).items():
        for fused, variable in variables:
            slot = slots[compat.variable_index(stock, variable)]
            if slot is not None:
                source = _fused_slot(optimizer, stock, attribute,
                                     fused_lists, fused, slot)
                slot.assign(_model_value(optimizer, source, index, slot))
                done.add(id(slot))
    fused_by_name = {v.name: v for v in optimizer.variables}
    for variable in stock.variables:
        if id(variable) in done:
            continue
        source = _counterpart(optimizer, stock, variable, fused_by_name)
        if source is None:
            raise ValueError(
                f"Cannot give the stock optimizer '{stock.name}' the state "
                f"of model {index} of '{optimizer.name}': its variable "
                f"'{variable.name}' has no counterpart in the fused "
                "optimizer.")
        variable.assign(_model_value(optimizer, source, index, variable))


def _fused_slot(optimizer, stock, attribute, fused_lists, fused, slot):
    """The fused optimizer's slot that holds, for every model, what the
    stock `slot` (of `attribute`, for the fused variable `fused`) holds;
    a ValueError naming the slot where the fused optimizer breaks the slot
    contract of `FusedOptimizer`."""
    slots = fused_lists.get(attribute)
    if slots is None:
        value = getattr(optimizer, attribute, None)
        others = ", ".join(f"`{name}`" for name in fused_lists) or "none"
        found = (f"has no attribute `{attribute}`" if value is None
                 else f"holds {type(value).__name__} {value!r:.60} in "
                 f"`{attribute}`")
        raise _contract_error(optimizer, stock, attribute, (
            f"{found} (its lists of one slot per variable: {others})"))
    source = slots[compat.variable_index(optimizer, fused)]
    want = (optimizer.num_models, *slot.shape)
    if source is None or tuple(source.shape) not in (want,
                                                      tuple(slot.shape)):
        found = ("None" if source is None
                 else f"a slot of shape {tuple(source.shape)}")
        raise _contract_error(optimizer, stock, attribute, (
            f"holds {found} for variable '{fused.path}' in "
            f"`{attribute}`, where the stock slot has shape "
            f"{tuple(slot.shape)}: expected shape {want}"))
    return source


def _contract_error(optimizer, stock, attribute, found):
    name = type(optimizer).__name__
    return ValueError(
        f"Cannot give the stock optimizer '{stock.name}' the state of "
        f"'{optimizer.name}': stock {type(stock).__name__} keeps slots in "
        f"`{attribute}`, and {name} {found}. Expected: `{attribute}`, a "
        "list of one [num_models, ...] slot (or None) per variable, in the "
        f"order of the variables it was built on. Fix: in {name}.build, "
        f"store these slots as `self.{attribute} = "
        "self.add_optimizer_variables(variables, ...)` (the slot contract "
        "of hftatf.optimizers.FusedOptimizer).")


def _counterpart(optimizer, stock, variable, fused_by_name):
    """The fused optimizer's variable (or what to read for it) that holds
    what the stock non-slot `variable` holds."""
    if variable is compat.step_counter(stock):
        return _ITERATIONS
    if variable is compat.learning_rate_setting(stock):
        return _LEARNING_RATE
    for attribute, value in compat.variable_attributes(stock).items():
        if value is variable and isinstance(
                getattr(optimizer, attribute, None), keras.Variable):
            return getattr(optimizer, attribute)
    return fused_by_name.get(variable.name)


def _model_value(optimizer, source, index, variable):
    if source is _ITERATIONS:
        # The raw count of steps applied to the model: what a stock
        # optimizer's `iterations` counts (micro-steps included).
        counts = getattr(optimizer, "_model_iterations", None)
        if counts is None:
            return optimizer.iterations
        return ops.convert_to_numpy(counts)[index]
    if source is _LEARNING_RATE:
        return optimizer.get_hyperparameter("learning_rate")[index]
    value = ops.convert_to_numpy(source)
    if value.shape == tuple(variable.shape):
        return value  # Shared by every model.
    return value[index]
