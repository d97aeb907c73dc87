"""Training recipes: what the launchers need to train a zoo model by name.

A recipe bundles a model builder, a data recipe that needs no download, the
loss and metrics, and default hyper-parameters. `hftatf-train --model NAME`
looks recipes up here; each zoo module registers its own.
"""

import dataclasses
import importlib
import pathlib
import pkgutil
from collections.abc import Callable
from typing import Any

_RECIPES = {}

# The modules of the package that hold no model (data and recipe helpers).
_NOT_MODELS = ("recipes", "data", "batches", "clouds", "records", "text",
               "gan_jax", "gan_tensorflow",
               "masked_lm")


@dataclasses.dataclass(frozen=True)
class Recipe:
    """How to train one zoo model.

    Attributes:
        name: the name the launcher's `--model` flag takes.
        build: `build(**model_args)` -> a plain (unfused) `keras.Model`.
        data: `data(batch_size, seed=0, **data_args)` -> `(train, val)`, two
            sets of `(x, y)` batches (y may be None for unsupervised
            models), built without any download: `tf.data.Dataset`s on the
            TensorFlow backend, `keras.utils.PyDataset`s elsewhere
            (`hftatf.models.batches`).
        loss: the Keras loss (name or object) to compile with.
        metrics: the Keras metrics to compile with.
        optimizer: the default `hftatf.optimizers` name.
        learning_rate: the default learning rate.
        epochs: the default number of epochs.
        model_args: the default `build` arguments (small enough for a CPU).
        data_args: the default `data` arguments.
        model_class: the `FusedModel` subclass the array is built as (e.g.
            a GAN's), or None for `hftatf.FusedModel`.
        monitor: the log entry that tells how good a model is.
        monitor_mode: "max" or "min" for `monitor`.
    """

    name: str
    build: Callable[..., Any]
    data: Callable[..., Any]
    loss: Any = None
    metrics: tuple = ()
    optimizer: str = "adam"
    learning_rate: float = 1e-3
    epochs: int = 5
    model_args: dict = dataclasses.field(default_factory=dict)
    data_args: dict = dataclasses.field(default_factory=dict)
    model_class: Any = None
    monitor: str = "val_loss"
    monitor_mode: str = "min"


def register(recipe):
    """Adds `recipe` to the table the launchers read; returns it."""
    if recipe.name in _RECIPES:
        raise ValueError(f"A recipe named {recipe.name!r} already exists.")
    _RECIPES[recipe.name] = recipe
    return recipe


def get(name):
    """Returns the recipe called `name`; a ValueError lists the others."""
    _load_zoo()
    try:
        return _RECIPES[name]
    except KeyError:
        raise ValueError(
            f"Unknown zoo model {name!r}. Available: "
            f"{', '.join(sorted(_RECIPES))}.") from None


def names():
    """The names of every registered recipe, sorted."""
    _load_zoo()
    return sorted(_RECIPES)


def _load_zoo():
    # Importing a zoo module registers its recipes (and its Keras objects).
    for module in pkgutil.iter_modules([str(pathlib.Path(__file__).parent)]):
        if module.name not in _NOT_MODELS:
            importlib.import_module(f"{__package__}.{module.name}")
