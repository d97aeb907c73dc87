"""What the training benchmark trains: a zoo recipe made into stock models,
an hftatf array, and one fixed set of batches both are fed.

`Workload(name)` wraps `hftatf.models.recipes.get(name)`, so every recipe of
the zoo is a workload, with its own builder arguments, data, loss, metrics
and optimizer. Stock models are compiled with stock Keras (the optimizer the
recipe names, at its learning rate); the array is `hftatf.fuse(model, B)`
compiled with the fused form of that same optimizer, so both sides run the
same update rule.

Recipes with a training step of their own (a `model_class` such as
`FusedGAN`) need a stock twin for the serial and concurrent modes; the
twins live in `STOCK_TRAINERS`, keyed by the array class's name.
"""

import dataclasses
import inspect

import keras
import numpy as np

import hftatf
from benchmarks.flags import parse_overrides, parse_value  # noqa: F401
from hftatf.models import dcgan, recipes
from hftatf.models.batches import uses_tf_data

# Array class name -> stock twin trained by `fit` as the array trains each
# of its models.
STOCK_TRAINERS = {"FusedGAN": dcgan.GAN}


def stock_optimizer(name, learning_rate):
    """A fresh stock Keras optimizer `name` at `learning_rate`."""
    cls = type(keras.optimizers.get(name))
    return cls(learning_rate=learning_rate)


@dataclasses.dataclass
class Workload:
    """A zoo recipe as a benchmark workload.

    Attributes:
        name: the recipe name (`hftatf.models.recipes.names()`).
        batch_size: samples per step of every model.
        model_args: builder arguments over the recipe's.
        data_args: data-recipe arguments over the recipe's.
    """

    name: str
    batch_size: int = 64
    model_args: dict = dataclasses.field(default_factory=dict)
    data_args: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        self.recipe = recipes.get(self.name)

    @property
    def array_class(self):
        return self.recipe.model_class or hftatf.FusedModel

    @property
    def has_stock_trainer(self):
        """Whether stock Keras can train this model (serial, concurrent)."""
        return (self.recipe.model_class is None
                or self.array_class.__name__ in STOCK_TRAINERS)

    def build(self):
        """The recipe's plain Keras model (uncompiled)."""
        return self.recipe.build(**{**self.recipe.model_args,
                                    **self.model_args})

    def stock_model(self, jit_compile, steps_per_execution=1):
        """A fresh stock model compiled as stock Keras trains it."""
        optimizer = stock_optimizer(self.recipe.optimizer,
                                    self.recipe.learning_rate)
        if self.recipe.model_class is not None:
            trainer = STOCK_TRAINERS.get(self.array_class.__name__)
            if trainer is None:
                raise ValueError(
                    f"Model {self.name!r} trains with "
                    f"{self.array_class.__name__}, which has no stock twin "
                    "in benchmarks.workloads.STOCK_TRAINERS; benchmark it "
                    "with --modes fused, or add one.")
            model = trainer(self.build())
            model.compile(optimizer=optimizer, jit_compile=jit_compile,
                          steps_per_execution=steps_per_execution)
            return model
        model = self.build()
        model.compile(optimizer, loss=self.recipe.loss,
                      metrics=list(self.recipe.metrics) or None,
                      jit_compile=jit_compile,
                      steps_per_execution=steps_per_execution)
        return model

    def fused_model(self, num_models, jit_compile="auto",
                    steps_per_execution=1, models_per_pass="auto"):
        """A fresh array of `num_models`, compiled with the fused form of
        the recipe's optimizer."""
        array = hftatf.fuse(self.build(), num_models,
                            model_class=self.array_class)
        optimizer = hftatf.optimizers.get(stock_optimizer(
            self.recipe.optimizer, self.recipe.learning_rate))
        kwargs = {}
        if self.recipe.loss is not None:
            kwargs["loss"] = self.recipe.loss
        if self.recipe.metrics:
            kwargs["metrics"] = list(self.recipe.metrics)
        if "models_per_pass" in inspect.signature(array.compile).parameters:
            if models_per_pass != "auto":
                kwargs["models_per_pass"] = models_per_pass
        elif models_per_pass not in ("auto", None, num_models):
            raise ValueError(
                f"{type(array).__name__} trains with a step of its own, "
                "which computes all models in one pass; leave "
                f"models_per_pass at 'auto' or 'all' for {self.name!r}. "
                f"Received: models_per_pass={models_per_pass!r}.")
        array.compile(optimizer=optimizer, jit_compile=jit_compile,
                      steps_per_execution=steps_per_execution, **kwargs)
        return array

    def batches(self, count, seed=0):
        """`count` (at least 1) full batches of the recipe's training data,
        stacked: every leaf gets a leading axis of `count`. The data are
        cycled through as often as `count` needs."""
        if count < 1:
            raise ValueError(
                f"A workload needs at least one batch of data. Received: "
                f"count={count}; pass a positive count (--data_batches).")
        train, _ = self.recipe.data(
            self.batch_size, seed=seed,
            **{**self.recipe.data_args, **self.data_args})
        kept = []
        while len(kept) < count:
            before = len(kept)
            for batch in _numpy_batches(train):
                if len(keras.tree.flatten(batch)[0]) == self.batch_size:
                    kept.append(batch)
                if len(kept) == count:
                    break
            if len(kept) == before:
                raise ValueError(
                    f"The data of {self.name!r} hold no full batch of "
                    f"batch_size={self.batch_size}; pass a smaller batch "
                    "size (--batch_size) or more data (--data_args).")
        return keras.tree.map_structure(lambda *b: np.stack(b), *kept)

    def dataset(self, count, seed=0):
        """The same `count` batches again and again, from memory: no input
        pipeline cost in the timings, and every mode sees the same data."""
        stacked = self.batches(count, seed)
        if uses_tf_data():
            import tensorflow as tf

            return tf.data.Dataset.from_tensor_slices(stacked).repeat(
            ).prefetch(tf.data.AUTOTUNE)
        return CycledBatches(stacked)


class CycledBatches(keras.utils.PyDataset):
    """Stacked batches (a leading axis of batches on every leaf) served
    again and again, without end: `fit` takes `steps_per_epoch` of them."""

    def __init__(self, stacked):
        super().__init__()
        self.stacked = stacked
        self.count = len(keras.tree.flatten(stacked)[0])

    @property
    def num_batches(self):
        return None

    def __getitem__(self, index):
        return keras.tree.map_structure(
            lambda leaf: leaf[index % self.count], self.stacked)


def _numpy_batches(data):
    """One pass over a recipe's batches (`tf.data` or a PyDataset), each
    batch as NumPy arrays."""
    if hasattr(data, "as_numpy_iterator"):
        yield from data.as_numpy_iterator()
        return
    for batch in data:
        yield keras.tree.map_structure(np.asarray, batch)
    data.on_epoch_end()
