"""A launcher run resumed from its backup: the epoch it resumes at, and
the check that it resumes with the settings it trained with."""

from absl import logging

from hftatf import backup
from hftatf.tpu.config import Config, ConfigError, read_file


def backed_up_epoch(backup_dir, num_models):
    """The epoch a run of `num_models` resumes at from the backup in
    `backup_dir` (0 where there is none).

    Raises:
        ConfigError: for an unreadable backup, or one of another number of
            models: before anything of the killed run (config, history) is
            overwritten.
    """
    try:
        metadata = backup.read_metadata(backup_dir)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    try:
        backup.check_num_models(metadata, backup_dir, num_models)
    except ValueError as error:
        raise ConfigError(
            f"{error} (Rerun with the killed run's settings, in its "
            "config.yaml, or pass another --model_dir to start afresh.)"
        ) from None
    return 0 if metadata is None else metadata["epoch"]


# What each model of a run trains with and on: a run resumed from its
# backup keeps its optimizer's per-model values and its models, so these
# cannot change there (its results would name values it did not train with).
_RUN_SETTINGS = ("model", "model_args", "num_models", "learning_rate",
                 "grid", "optimizer", "optimizer_args", "schedule",
                 "schedule_args", "batch_size", "mixed_precision", "seed")


def _setting_change(key, before, now):
    """How setting `key` changed, in words short enough for one line at
    B = 100 (a list by its first difference)."""
    short = f"{key} {before!r}, now {now!r}"
    if len(short) <= 100 or not (
            isinstance(before, list) and isinstance(now, list)):
        return short
    if len(before) != len(now):
        return f"{key} {len(before)} values, now {len(now)}"
    first = next(i for i, (a, b) in enumerate(zip(before, now)) if a != b)
    return (f"{key} {before[first]!r} for model {first}, now "
            f"{now[first]!r} (of {len(now)} values)")


def check_resumed_config(config, model_dir, initial_epoch):
    """Refuses a run that resumes with other training settings than its
    own (`_RUN_SETTINGS`); warns where others changed."""
    if not initial_epoch:
        return
    for name in ("config.yaml", "config.json"):
        path = model_dir / name
        if not path.exists():
            continue
        try:
            previous = Config.from_dict(read_file(path), str(path))
            previous = previous.resolved().to_dict()
        except ValueError:
            return
        current = config.to_dict()
        changed = sorted(key for key, value in current.items()
                         if previous.get(key) != value)
        fixed = [key for key in changed if key in _RUN_SETTINGS]
        if fixed:
            raise ConfigError(
                f"--model_dir={model_dir} holds a run backed up at epoch "
                f"{initial_epoch} that trained with other settings: "
                + "; ".join(_setting_change(key, previous.get(key),
                                            current[key]) for key in fixed)
                + ". Resumed, it would go on with its own and report "
                "these. Resume it with its settings (--config_file="
                f"{path}), or pass another --model_dir to start afresh.")
        if changed:
            logging.warning(
                "Resuming the run in %s with changed settings %s.",
                model_dir, changed)
        return
