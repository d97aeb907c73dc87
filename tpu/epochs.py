"""How the launcher cuts its input into epochs, on either input pipeline
(`data`, `tf.data`; `data_numpy`, NumPy batches): the global batch split
between the replicas, epochs of whole steps, the checks that refuse a data
set too small for them, and the `Inputs` a run trains on."""

import dataclasses

from absl import logging

from hftatf.tpu.config import ConfigError


def per_replica_batch_size(global_batch_size, num_replicas):
    """The global batch split evenly between `num_replicas`.

    Raises:
        ConfigError: where it does not split evenly.
    """
    if global_batch_size % num_replicas:
        low = global_batch_size // num_replicas * num_replicas
        raise ConfigError(
            f"--batch_size={global_batch_size} (the global batch) must "
            f"split evenly between the {num_replicas} replicas. Pass a "
            f"multiple of {num_replicas}, e.g. {max(low, num_replicas)} or "
            f"{low + num_replicas}.")
    return global_batch_size // num_replicas


def whole_steps(smallest, local, batch, steps_per_execution, what,
                described):
    """The whole steps (of `steps_per_execution` x `local` replica batches)
    in the `smallest` shard (of batches of `batch`) of the `what`
    ("training" or "validation") set, `described`.

    Raises:
        ConfigError: for a training set of not one step (a validation set
            of none is left out, with a warning).
    """
    whole = smallest // local
    whole -= whole % steps_per_execution
    if whole == 0:
        message = (
            f"The {what} set ({described}) has {smallest} whole batches "
            f"of {batch} examples per input pipeline (a pass drops its "
            f"last, partial batch): not one step of {steps_per_execution} "
            f"x {local} replica batches.")
        if what == "training":
            raise ConfigError(
                f"{message} Lower --batch_size or --steps_per_execution.")
        logging.warning("%s No validation: lower --batch_size to "
                        "validate.", message)
    return whole


def check_one_step(smallest, local, batch, described):
    """Raises unless the `smallest` training shard holds one step of
    `local` replica batches (the stream repeats it)."""
    if smallest < local:
        raise ConfigError(
            f"The training set ({described}) has {smallest} whole batches "
            f"of {batch} examples per input pipeline (a pass drops its "
            f"last, partial batch): not one step of {local} replica "
            "batches. Lower --batch_size.")


def check_validation_steps(smallest, eval_steps, local, batch, described):
    """Raises unless the `smallest` validation shard holds `eval_steps`
    steps: Keras would stop validating where it runs out, silently."""
    if smallest < eval_steps * local:
        raise ConfigError(
            f"--eval_steps={eval_steps}, but the validation set "
            f"({described}) has {smallest // local} steps of {local} x "
            f"{batch} examples per input pipeline. Lower --eval_steps, or "
            "leave it out to validate on one pass.")


def log_resumption(initial_epoch, skip):
    """Says where a resumed run's input stream starts (`skip` batches on,
    for `initial_epoch`)."""
    if skip:
        logging.info("Resuming at epoch %d: the input stream skips %d "
                     "batches per input pipeline.", initial_epoch, skip)


@dataclasses.dataclass
class Inputs:
    """A run's distributed inputs.

    Attributes:
        train: the training `DistributedDataset` (an endless stream), or
            (`data_numpy`) an endless `keras.utils.PyDataset`.
        validation: the validation `DistributedDataset` (or
            `PyDataset`), or None; every `validation_steps` steps read
            the same examples.
        steps_per_epoch: training steps per epoch.
        validation_steps: validation steps per epoch (0 without one).
        per_replica_batch_size: examples per replica per step.
        num_input_pipelines: the input pipelines (hosts).
        element_spec: the `tf.TypeSpec`s of one replica's training batch
            (`data_numpy`: `keras.KerasTensor`s of one batch fed).
    """

    train: object
    validation: object
    steps_per_epoch: int
    validation_steps: int
    per_replica_batch_size: int
    num_input_pipelines: int
    element_spec: object = None
