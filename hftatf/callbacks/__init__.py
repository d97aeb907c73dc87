"""Per-model callbacks for `FusedModel` arrays.

A fused array logs every loss and metric twice: `name`, the mean over the
models that have not diverged (what stock Keras callbacks read: `fit`
refuses those that would act on it through a `monitor`, unless told to act
on the mean, see `hftatf.core.logs.check_stock_callbacks`), and `name_0`
... `name_{B-1}`, one value per model. The callbacks here read the
per-model values and act on each model on its own:

- `EarlyStopping` stops (freezes) each model when its own monitored value
  stops improving, restoring that model's best weights if asked;
- `ReduceLROnPlateau` lowers each model's own learning rate;
- `LearningRateScheduler` sets each model's learning rate every epoch from
  its own current rate;
- `CSVLogger` writes one row per epoch and model (a tidy table);
- `TensorBoard` writes one run per model, named after what varies between
  the models (`lr=0.03`), so TensorBoard overlays them;
- `ModelCheckpoint` saves each model's best weights as a plain Keras model.

Each callback takes the arguments of its stock Keras namesake; `monitor` is
the name of the quantity without the model suffix (`"val_loss"`, read as
`val_loss_b` for model `b`).
"""

from hftatf.callbacks.base import PerModelMonitorCallback, monitor_direction
from hftatf.callbacks.csv_logger import CSVLogger
from hftatf.callbacks.early_stopping import EarlyStopping
from hftatf.callbacks.learning_rate import (
    LearningRateScheduler,
    ReduceLROnPlateau,
)
from hftatf.callbacks.model_checkpoint import ModelCheckpoint
from hftatf.callbacks.tensorboard import TensorBoard
from hftatf.core.logs import split_logs

__all__ = [
    "CSVLogger",
    "EarlyStopping",
    "LearningRateScheduler",
    "ModelCheckpoint",
    "PerModelMonitorCallback",
    "ReduceLROnPlateau",
    "TensorBoard",
    "monitor_direction",
    "split_logs",
]
