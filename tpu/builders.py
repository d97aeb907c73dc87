"""What the launcher builds from a `Config`: the recipe's stock model, the
per-model learning rates and schedules, and the fused optimizer."""

import keras

import hftatf
from hftatf.tpu.config import ConfigError


def build_model(recipe, config):
    """The recipe's stock model with `config.model_args` over its own."""
    args = dict(recipe.model_args)
    for key, value in config.model_args.items():
        default = args.get(key)
        # YAML and flags give lists where the builders' defaults are tuples.
        args[key] = tuple(value) if isinstance(default, tuple) and (
            isinstance(value, list)) else value
    try:
        return recipe.build(**args)
    except (TypeError, ValueError) as error:
        raise ConfigError(
            f"--model_args {config.model_args}: model {recipe.name!r} "
            f"refused them: {error}") from None


def check_examples_fit(model, element_spec, recipe):
    """Refuses a model whose inputs do not take the data's examples (e.g.
    `--data_args=image_size=16` for a model built for 32 x 32 images)."""
    if not isinstance(element_spec, tuple):
        return
    features = element_spec[0]
    if isinstance(features, dict):
        names = [x.name for x in model.inputs]
        if set(names) != set(features):
            return  # Keras names the difference.
        pairs = [(name, features[name], x)
                 for name, x in zip(names, model.inputs)]
    else:
        specs = keras.tree.flatten(features)
        if len(specs) != len(model.inputs):
            return
        pairs = [(x.name, spec, x) for spec, x in zip(specs, model.inputs)]
    for name, spec, tensor in pairs:
        given, taken = tuple(spec.shape)[1:], tuple(tensor.shape)[1:]
        if len(given) != len(taken) or any(
                a is not None and b is not None and a != b
                for a, b in zip(given, taken)):
            raise ConfigError(
                f"Model {recipe.name!r} takes {name} of shape {taken}, but "
                f"the data's examples have shape {given}: make --model_args "
                "and --data_args agree (e.g. --data_args=image_size=16 with "
                "--model_args=input_shape=[16,16,3]).")


def make_learning_rate(config, rates, steps_per_epoch):
    """Each model's learning rate (a float, B floats, or a per-model
    schedule) under `config.schedule`."""
    schedules = hftatf.optimizers.schedules
    args = config.schedule_args
    total_steps = steps_per_epoch * config.epochs
    if config.schedule == "constant":
        rate = rates
    elif config.schedule == "cosine":
        rate = schedules.CosineDecay(rates, decay_steps=total_steps,
                                     alpha=args.get("alpha", 0.0))
    elif config.schedule == "exponential":
        rate = schedules.ExponentialDecay(
            rates, decay_steps=steps_per_epoch * args.get("decay_epochs", 1),
            decay_rate=args.get("decay_rate", 0.9),
            staircase=args.get("staircase", False))
    else:
        epochs = args.get("decay_epochs", max(1, config.epochs // 3))
        rate = schedules.StepDecay(rates, decay_steps=steps_per_epoch * epochs,
                                   decay_rate=args.get("decay_rate", 0.1))
    warmup = args.get("warmup_epochs", 0)
    if warmup:
        rate = schedules.LinearWarmup(rate, warmup_epochs=warmup,
                                      steps_per_epoch=steps_per_epoch)
    return rate


def make_optimizer(config, per_model, shared, steps_per_epoch):
    """The fused optimizer: the shared arguments, each model's values, and
    the learning-rate schedule; a per-model loss-scale optimizer around it
    under `mixed_float16`."""
    values = {**shared, **per_model}
    values["learning_rate"] = make_learning_rate(
        config, values["learning_rate"], steps_per_epoch)
    optimizer = config.optimizer_class()(**values)
    if config.mixed_precision == "mixed_float16":
        optimizer = hftatf.optimizers.LossScaleOptimizer(optimizer)
    return optimizer
