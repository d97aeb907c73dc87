"""The lines the launcher prints before the first epoch: what the run
trains (the model, B, what varies per model), on what data, where (the
devices, the Keras backend, XLA on or off) and how long (epochs, steps)."""

import keras
import tensorflow as tf

from hftatf import report


def header_lines(plan, array):
    """What the run of `plan` (`train._Plan`) trains with the compiled
    `array`, where and how, in three lines."""
    config, strategy = plan.config, plan.strategy
    steps = f"{plan.inputs.steps_per_epoch} steps per epoch"
    if plan.inputs.validation_steps:
        steps += f" (+{plan.inputs.validation_steps} validation)"
    varying = "; ".join(f"{name} {_listed(values)}"
                        for name, values in plan.per_model.items())
    compiled = isinstance(strategy, tf.distribute.TPUStrategy) or (
        array.compiles_with_xla)
    return [
        f"hftatf-train: {plan.num_models} {config.model} models; data: "
        f"{plan.source.description}; {config.epochs} epochs of {steps}, "
        f"batch {config.batch_size}",
        "  per model: " + (varying or "the initialisation only (same "
                           "hyper-parameters)"),
        f"  device: {_devices(strategy)} ({type(strategy).__name__}); "
        f"backend {keras.config.backend()}; XLA "
        f"{'on' if compiled else 'off'}"]


def _listed(values, most=8):
    """Hyper-parameter values as given; the first and last where many."""
    shown = [report.format_hyperparameter(value) for value in values]
    if len(shown) > most:
        shown = [*shown[:3], "…", *shown[-2:]]
        return f"{', '.join(shown)} ({len(values)} values)"
    return ", ".join(shown)


def _devices(strategy):
    """`1 CPU`, `2 GPUs`, `8 TPUs`: the devices the replicas run on."""
    kinds = {}
    for device in strategy.extended.worker_devices:
        kind = tf.DeviceSpec.from_string(device).device_type or "CPU"
        kinds[kind] = kinds.get(kind, 0) + 1
    return ", ".join(f"{count} {kind}{'s' if count > 1 else ''}"
                     for kind, count in kinds.items())
