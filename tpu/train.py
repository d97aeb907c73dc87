"""Trains an array of classifiers with per-model learning rates, and exports
each model.

With no flags, it trains 4 MLPs on scikit-learn's bundled digits (no
download, CPU is enough) with learning rates 0.3, 0.1, 0.03 and 0.01, prints
a table of each model's result, and exports the 4 models:

    hftatf-train
    python -m hftatf.tpu.train --learning_rates=0.1,0.01 --epochs=5
"""

import dataclasses
import json
import pathlib

import keras
from absl import app, flags, logging

import hftatf
from hftatf.models import data, mlp

FLAGS = flags.FLAGS


def define_flags():
    """Defines the launcher's flags; every one is optional."""
    flags.DEFINE_list("learning_rates", ["0.3", "0.1", "0.03", "0.01"],
                      "Learning rate of each model; the array has one model "
                      "per value.")
    flags.DEFINE_enum("optimizer", "sgd", ["sgd", "adam"],
                      "Fused optimizer.")
    flags.DEFINE_float("momentum", 0.9, "SGD momentum, shared by the models.")
    flags.DEFINE_integer("epochs", 30, "Training epochs.")
    flags.DEFINE_integer("train_steps", None,
                         "If set, train only this many steps per epoch.")
    flags.DEFINE_integer("batch_size", 64, "Batch size (shared by models).")
    flags.DEFINE_list("hidden_units", ["128", "64"],
                      "Width of each hidden layer of the MLP.")
    flags.DEFINE_integer("seed", 0, "Random seed.")
    flags.DEFINE_string("export_dir", "runs/digits/export",
                        "Where each model is exported ('' to skip).")
    flags.DEFINE_integer("verbose", 1, "Keras verbosity (1: progress bar).")


@dataclasses.dataclass
class Config:
    """A launcher run, validated before any work starts."""

    learning_rates: list = dataclasses.field(
        default_factory=lambda: [0.3, 0.1, 0.03, 0.01])
    optimizer: str = "sgd"
    momentum: float = 0.9
    epochs: int = 30
    train_steps: int | None = None
    batch_size: int = 64
    hidden_units: list = dataclasses.field(default_factory=lambda: [128, 64])
    seed: int = 0
    export_dir: str = "runs/digits/export"
    verbose: int = 1

    def validate(self):
        if not self.learning_rates:
            raise ValueError("--learning_rates needs at least one value.")
        if any(rate <= 0 for rate in self.learning_rates):
            raise ValueError("Every learning rate must be positive. "
                             f"Received: {self.learning_rates}.")
        for name in ("epochs", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be at least 1. Received: "
                                 f"{getattr(self, name)}.")
        if self.train_steps is not None and self.train_steps < 1:
            raise ValueError("--train_steps must be at least 1. Received: "
                             f"{self.train_steps}.")
        return self

    @classmethod
    def from_flags(cls):
        def numbers(values, kind, flag):
            try:
                return [kind(v) for v in values]
            except ValueError:
                raise ValueError(f"--{flag} must be a comma list of numbers. "
                                 f"Received: {','.join(values)}.") from None

        return cls(
            learning_rates=numbers(FLAGS.learning_rates, float,
                                   "learning_rates"),
            optimizer=FLAGS.optimizer,
            momentum=FLAGS.momentum,
            epochs=FLAGS.epochs,
            train_steps=FLAGS.train_steps,
            batch_size=FLAGS.batch_size,
            hidden_units=numbers(FLAGS.hidden_units, int, "hidden_units"),
            seed=FLAGS.seed,
            export_dir=FLAGS.export_dir,
            verbose=FLAGS.verbose,
        ).validate()


def train(config):
    """Runs `config`; returns `(array, history, results)`, where `results`
    holds one dict per model."""
    config.validate()
    keras.utils.set_random_seed(config.seed)
    (x_train, y_train), (x_val, y_val) = data.digits(seed=config.seed)
    model = mlp.build(x_train.shape[1:], hidden_units=config.hidden_units)
    array = hftatf.fuse(model, num_models=len(config.learning_rates))
    if config.optimizer == "sgd":
        optimizer = hftatf.optimizers.SGD(config.learning_rates,
                                          momentum=config.momentum)
    else:
        optimizer = hftatf.optimizers.Adam(config.learning_rates)
    array.compile(optimizer, loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    history = array.fit(
        x_train, y_train, batch_size=config.batch_size, epochs=config.epochs,
        steps_per_epoch=config.train_steps, validation_data=(x_val, y_val),
        verbose=config.verbose)
    results = [
        {"model": b, "learning_rate": rate,
         **hftatf.export.model_metrics(history, b)}
        for b, rate in enumerate(config.learning_rates)]
    if config.export_dir:
        export_dir = pathlib.Path(config.export_dir)
        hftatf.export.export_models(array, export_dir, history=history)
        (export_dir / "config.json").write_text(
            json.dumps(dataclasses.asdict(config), indent=2))
    return array, history, results


def format_results(results):
    """A table with one row per model."""
    columns = ["model", "learning_rate", "loss", "accuracy", "val_loss",
               "val_accuracy"]
    rows = [[f"{r[c]:.4g}" if isinstance(r.get(c), float) else str(
        r.get(c, "")) for c in columns] for r in results]
    widths = [max(len(c), *(len(row[i]) for row in rows))
              for i, c in enumerate(columns)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths))
              for row in rows]
    return "\n".join(lines)


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    config = Config.from_flags()
    _, _, results = train(config)
    print(format_results(results))
    best = max(results, key=lambda r: r.get("val_accuracy", 0.0))
    print(f"Best: model {best['model']} (learning rate "
          f"{best['learning_rate']:g}).")
    if config.export_dir:
        print(f"Exported {len(results)} models to {config.export_dir}/")


def run():
    """Console-script entry point (`hftatf-train`)."""
    define_flags()
    app.run(main)


if __name__ == "__main__":
    run()
