"""Fused optimizers: stock Keras optimizers with per-model hyper-parameters.

Every float hyper-parameter is a float (shared) or a length-B sequence (one
value per model of the array).
"""

import inspect

import keras

from hftatf.core import compat, hooks
from hftatf.optimizers import schedules
from hftatf.optimizers.adadelta import Adadelta
from hftatf.optimizers.adafactor import Adafactor
from hftatf.optimizers.adagrad import Adagrad
from hftatf.optimizers.adam import Adam
from hftatf.optimizers.adamax import Adamax
from hftatf.optimizers.adamw import AdamW
from hftatf.optimizers.base import FusedOptimizer
from hftatf.optimizers.ftrl import Ftrl
from hftatf.optimizers.lamb import Lamb
from hftatf.optimizers.lars import Lars
from hftatf.optimizers.lion import Lion
from hftatf.optimizers.loss_scale import LossScaleOptimizer
from hftatf.optimizers.muon import Muon
from hftatf.optimizers.nadam import Nadam
from hftatf.optimizers.rmsprop import RMSprop
from hftatf.optimizers.schedule_free_adamw import ScheduleFreeAdamW
from hftatf.optimizers.sgd import SGD
from hftatf.optimizers.stock import stock_optimizer

__all__ = [
    "Adadelta",
    "Adafactor",
    "Adagrad",
    "Adam",
    "Adamax",
    "AdamW",
    "Ftrl",
    "FusedOptimizer",
    "get",
    "Lamb",
    "Lars",
    "Lion",
    "LossScaleOptimizer",
    "Muon",
    "Nadam",
    "RMSprop",
    "ScheduleFreeAdamW",
    "schedules",
    "select",
    "SGD",
    "stock_optimizer",
]


def _fused_classes():
    """{lower-case name: class} of every fused optimizer of the package."""
    return {name.lower(): obj for name, obj in globals().items()
            if isinstance(obj, type) and issubclass(obj, FusedOptimizer)
            and obj is not FusedOptimizer}


def _needs_arguments(cls):
    """Whether `cls()` fails for want of an argument (a wrapper's inner
    optimizer, say)."""
    return any(p.default is p.empty and p.kind in (p.POSITIONAL_ONLY,
                                                   p.POSITIONAL_OR_KEYWORD)
               for p in list(inspect.signature(cls).parameters.values()))


def _loss_scale_class():
    """The fused loss-scale optimizer, where the package has one."""
    return globals().get("LossScaleOptimizer")


@hooks.provides("optimizers.get")
def get(identifier):
    """Returns a fused optimizer for `identifier`.

    Args:
        identifier: one of
            - a fused optimizer, returned as it is;
            - the name of one, case-insensitive (`"adam"`, `"Lamb"`,
              `"lars"`, ...): an instance with default arguments;
            - a config dict: a serialized hftatf optimizer, or a stock
              Keras optimizer config (converted as an instance is);
            - an unbuilt stock `keras.optimizers` instance of a class that
              hftatf fuses, converted with the same hyper-parameters for
              every model: learning-rate schedules are kept (shared by the
              models), clipping becomes per-model clipping and weight-decay
              exclusions by name are kept, which is what B separate copies
              of the stock optimizer would do. A stock
              `LossScaleOptimizer` becomes `hftatf.optimizers.
              LossScaleOptimizer` around the converted inner optimizer.

    Raises:
        TypeError: for a stock optimizer whose conversion would compute
            something other than B copies of it: a class hftatf does not
            fuse (or a subclass of a stock class, whose update hftatf cannot
            know), a callable learning rate, weight-decay exclusions of
            stock variables; and for identifiers of any other type.
        ValueError: for an unknown name, or a stock optimizer that is
            already built or has taken steps.
    """
    loss_scale = _loss_scale_class()
    if isinstance(identifier, FusedOptimizer) or (
            loss_scale is not None and isinstance(identifier, loss_scale)):
        return identifier
    by_name = _fused_classes()
    if isinstance(identifier, str):
        by_name = {name: cls for name, cls in by_name.items()
                   if not _needs_arguments(cls)}
        try:
            return by_name[identifier.lower()]()
        except KeyError:
            raise ValueError(
                f"Unknown fused optimizer '{identifier}'. Available by "
                f"name: {', '.join(sorted(by_name))}.") from None
    if isinstance(identifier, dict):
        return _from_dict(identifier, by_name)
    if isinstance(identifier, keras.optimizers.Optimizer):
        return _from_stock(identifier, by_name)
    raise TypeError(
        "`optimizer` must be an hftatf optimizer (e.g. "
        "hftatf.optimizers.Adam(learning_rate=[...])), its name, its config "
        "or a stock Keras optimizer to convert. Received: "
        f"{identifier!r}.")


def _from_dict(config, by_name):
    if "hftatf" in str(config.get("registered_name")) or str(
            config.get("module", "")).startswith("hftatf"):
        return get(keras.saving.deserialize_keras_object(config))
    class_name = str(config.get("class_name", ""))
    cls = by_name.get(class_name.lower())
    if cls is not None and not hasattr(keras.optimizers, cls.__name__):
        # A fused optimizer with no stock twin (Lars): its own config.
        return cls.from_config(config.get("config") or {})
    # A stock config: read by the stock class itself, then converted.
    # (keras.optimizers.deserialize returns some configs as strings.)
    stock_classes = {
        name.lower(): obj for name, obj in vars(keras.optimizers).items()
        if isinstance(obj, type)
        and issubclass(obj, keras.optimizers.Optimizer)}
    stock_cls = stock_classes.get(class_name.lower())
    if stock_cls is None:
        raise ValueError(
            f"Cannot read optimizer config {config!r}: '{class_name}' is "
            "neither an hftatf optimizer nor a keras.optimizers class. Pass "
            "the config of an hftatf optimizer or of a stock Keras "
            "optimizer.")
    return get(stock_cls.from_config(dict(config.get("config") or {})))


def _from_stock(stock, by_name):
    name = type(stock).__name__
    if getattr(keras.optimizers, name, None) is not type(stock):
        raise TypeError(
            f"Cannot convert optimizer '{stock.name}' of class {name}: it is "
            "not a stock keras.optimizers class (a subclass, or another "
            "library's optimizer), so hftatf cannot know what its update "
            "computes. Write its fused form (a subclass of "
            "hftatf.optimizers.FusedOptimizer), or use one of "
            f"hftatf.optimizers: {', '.join(sorted(by_name))}.")
    if stock.built:
        raise ValueError(
            f"The stock optimizer '{stock.name}' is already built "
            "on other variables; pass a new one, or an hftatf optimizer.")
    if isinstance(stock, keras.optimizers.LossScaleOptimizer):
        return _from_stock_loss_scale(stock)
    fused_cls = by_name.get(name.lower())
    if fused_cls is None or getattr(keras.optimizers,
                                    fused_cls.__name__) is not type(stock):
        raise TypeError(
            f"hftatf has no fused form of {name}; use one of "
            f"hftatf.optimizers: {', '.join(sorted(by_name))}.")
    _check_stock_state(stock)
    config = stock.get_config()
    rate = compat.learning_rate_setting(stock)
    if isinstance(rate, keras.optimizers.schedules.LearningRateSchedule):
        config["learning_rate"] = rate
    try:
        fused = fused_cls.from_config(dict(config))
    except (TypeError, ValueError) as error:
        raise TypeError(
            f"Cannot convert {name} optimizer '{stock.name}' to "
            f"hftatf.optimizers.{fused_cls.__name__}: {error}") from error
    _check_same_config(stock, fused)
    _, pattern = compat.weight_decay_exclusions(stock)
    if pattern is not None:
        compat.set_weight_decay_exclusions(fused, keys=(), pattern=pattern)
    return fused


def _check_stock_state(stock):
    """Refuses stock state that a config does not carry."""
    rate = compat.learning_rate_setting(stock)
    if callable(rate) and not isinstance(
            rate, (keras.Variable,
                   keras.optimizers.schedules.LearningRateSchedule)):
        raise TypeError(
            f"Cannot convert optimizer '{stock.name}': its learning rate is "
            f"a callable ({rate!r}), which fused optimizers do not take. "
            "Pass a float, a LearningRateSchedule, or one per model.")
    if compat.weight_decay_exclusions(stock)[0]:
        raise TypeError(
            f"Cannot convert optimizer '{stock.name}': it excludes variables "
            "from weight decay by `var_list`, and those are stock variables, "
            "not the array's. Call `exclude_from_weight_decay(var_list=...)` "
            "on the fused optimizer with the array's variables instead.")
    steps = int(keras.ops.convert_to_numpy(compat.step_counter(stock)))
    if steps != 0:
        raise ValueError(
            f"Cannot convert optimizer '{stock.name}': it has taken "
            f"{steps} steps, which its config does "
            "not carry. Pass a new one.")


def _check_same_config(stock, fused):
    """Raises unless every value of the stock config is in the fused one:
    a fused class that dropped or changed an argument would otherwise train
    something else than B copies of the stock optimizer."""
    stock_config = stock.get_config()
    fused_config = fused.get_config()
    for key, value in stock_config.items():
        if key not in fused_config or not _same_value(value,
                                                      fused_config[key]):
            raise TypeError(
                f"Converting {type(stock).__name__} optimizer '{stock.name}' "
                f"to hftatf.optimizers.{type(fused).__name__} would change "
                f"`{key}`: {value!r} became "
                f"{fused_config.get(key, '(missing)')!r}.")


def _same_value(a, b):
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(
            _same_value(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(map(_same_value, a, b))
    # Fused optimizers keep float hyper-parameters as the same Python
    # floats, so equality is exact; NaN is a value like any other here.
    return a == b or (a != a and b != b)


def _from_stock_loss_scale(stock):
    loss_scale = _loss_scale_class()
    if loss_scale is None:
        raise TypeError(
            f"Cannot convert LossScaleOptimizer '{stock.name}': this version "
            "of hftatf has no fused LossScaleOptimizer, and the stock one "
            "checks gradients for non-finite values across all models, so "
            "one model's overflow would skip every model's step. Use "
            "`loss_scale_factor` on the fused optimizer, or no loss "
            "scaling.")
    inner = get(stock.inner_optimizer)
    fused = loss_scale(inner, initial_scale=stock.initial_scale,
                       dynamic_growth_steps=stock.dynamic_growth_steps,
                       name=stock.name)
    fused_config = fused.get_config()
    for key in ("initial_scale", "dynamic_growth_steps"):
        if not _same_value(getattr(stock, key), fused_config.get(key)):
            raise TypeError(
                f"Converting LossScaleOptimizer '{stock.name}' would change "
                f"`{key}`: {getattr(stock, key)!r} became "
                f"{fused_config.get(key, '(missing)')!r}.")
    return fused


def select(optimizer, indices):
    """A new, unbuilt optimizer for the models `indices` of `optimizer`'s
    array: same class and settings, with the kept models' per-model
    hyper-parameters and schedules, in the order of `indices`.

    The state (slots, step counts) is not copied: `FusedModel.select` copies
    it once the new optimizer is built.
    """
    indices = list(indices)
    inner = getattr(optimizer, "inner_optimizer", None)
    config = optimizer.get_config()
    if inner is not None:
        config["inner_optimizer"] = select(inner, indices)
        return type(optimizer)(**config)
    schedules_ = optimizer._learning_rate_schedules()
    for name in optimizer.hyperparameter_names:
        value = config.get(name)
        if name == "learning_rate" and schedules_:
            config[name] = _select_schedules(
                optimizer._hyper_values[name], indices)
        elif isinstance(value, list):
            config[name] = [value[j] for j in indices]
    config["num_models"] = len(indices)
    return type(optimizer).from_config(config)


def _select_schedules(value, indices):
    if isinstance(value, list):
        return [value[j] for j in indices]
    if isinstance(value, schedules.FusedSchedule):
        return value.select(indices)
    return value  # A stock schedule, shared by every model.
