"""The lines the launcher prints before the first epoch: what the run
trains (the model, B, what varies per model), on what data, where (the
devices, the Keras backend, XLA on or off) and how long (epochs, steps)."""

import keras

from hftatf import report
from hftatf.tpu.data import is_tpu_strategy


def header_lines(plan, array):
    """What the run of `plan` (`train._Plan`) trains with the compiled
    `array`, where and how, in three lines."""
    config, strategy = plan.config, plan.strategy
    steps = f"{plan.inputs.steps_per_epoch} steps per epoch"
    if plan.inputs.validation_steps:
        steps += f" (+{plan.inputs.validation_steps} validation)"
    varying = "; ".join(f"{name} {_listed(values)}"
                        for name, values in plan.per_model.items())
    compiled = is_tpu_strategy(strategy) or array.compiles_with_xla
    return [
        f"hftatf-train: {plan.num_models} {config.model} models; data: "
        f"{plan.source.description}; {config.epochs} "
        f"epoch{'' if config.epochs == 1 else 's'} of {steps}, "
        f"batch {config.batch_size}",
        "  per model: " + (varying or "the initialisation only (same "
                           "hyper-parameters)"),
        f"  device: {_placement(strategy)}; "
        f"backend {keras.config.backend()}; XLA "
        f"{'on' if compiled else 'off'}"]


def _listed(values, most=8):
    """Hyper-parameter values as given; the first and last where many."""
    shown = [report.format_hyperparameter(value) for value in values]
    if len(shown) > most:
        shown = [*shown[:3], "…", *shown[-2:]]
        return f"{', '.join(shown)} ({len(values)} values)"
    return ", ".join(shown)


def _placement(strategy):
    """`1 CPU (OneDeviceStrategy)`, `4 GPUs (ModelAxisParallel)`: the
    devices the run uses and what lays it out (on JAX, the
    `keras.distribution` set, or none)."""
    if keras.config.backend() != "tensorflow":
        distribution = keras.distribution.distribution()
        devices = (distribution.device_mesh.devices.flatten().tolist()
                   if distribution is not None
                   else keras.distribution.list_devices()[:1])
        kinds = [str(d).split(":")[0].upper() for d in devices]
        how = type(distribution).__name__ if distribution else "one device"
        return f"{_counted(kinds)} ({how})"
    import tensorflow as tf

    kinds = [tf.DeviceSpec.from_string(device).device_type or "CPU"
             for device in strategy.extended.worker_devices]
    return f"{_counted(kinds)} ({type(strategy).__name__})"


def _counted(kinds):
    """`1 CPU`, `2 GPUs`: the device kinds listed, counted."""
    counts = {}
    for kind in kinds:
        counts[kind] = counts.get(kind, 0) + 1
    return ", ".join(f"{count} {kind}{'s' if count > 1 else ''}"
                     for kind, count in counts.items())
