"""Tuning wall time: a fused random search against a serial stock one.

Both searches tune the same digits MLP (scikit-learn's bundled digits, no
download) over the same space, with the same seed and trial budget:

  * serial: stock `keras_tuner.RandomSearch`, one trial after another;
  * fused: `hftatf.tuning.FusedRandomSearch`, up to `--num-models` trials
    per array (trials of one hidden width share an array).

The space is a learning rate (log-uniform) and a hidden width (a choice of
two, which splits trials into two arrays). Every trial starts from the same
seeded weights and the data are not shuffled, so the two searches train the
same models and must agree on the trials and the best one. Both run in this
process, one after the other, and the script prints their wall times and
the ratio serial / fused (above 1: the arrays pay), with whether they
evaluated the same configurations and picked the same best trial.

    python -m benchmarks.tuning --quick     # under 2 minutes on 2 CPU cores
    python -m benchmarks.tuning --trials 64 --epochs 10 --num-models 16
"""

import argparse
import os
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import keras_tuner  # noqa: E402

from hftatf import tuning  # noqa: E402
from hftatf.models import data  # noqa: E402


def build(hp):
    """The digits MLP of one trial, from the same seeded draw each time."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((8, 8)),
        keras.layers.Flatten(),
        keras.layers.Dense(hp.Choice("units", [64, 128]), activation="relu"),
        keras.layers.Dense(10, activation="softmax"),
    ])
    model.compile(
        optimizer=keras.optimizers.Adam(
            hp.Float("learning_rate", 1e-4, 1e-1, sampling="log")),
        loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


class SerialRandomSearch(keras_tuner.RandomSearch):
    """Stock RandomSearch. Its `run_trial` imports tensorboard to set up
    TensorBoard callbacks, and these searches have none: skipping that step
    lets the stock tuner run without the tensorboard package."""

    def _configure_tensorboard_dir(self, callbacks, trial, execution=0):
        pass


def parse_args(argv):
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=32,
                        help="The trial budget of each search.")
    parser.add_argument("--epochs", type=int, default=10,
                        help="Epochs per trial.")
    parser.add_argument("--num-models", type=int, default=8,
                        help="The fused search's largest array.")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--jit", choices=("auto", "true", "false"),
                        default="auto", help="The arrays' XLA setting "
                        "(auto: on accelerators only).")
    parser.add_argument("--seed", type=int, default=1,
                        help="The oracles' seed.")
    parser.add_argument("--quick", action="store_true",
                        help="8 trials of 3 epochs, arrays of 8.")
    args = parser.parse_args(argv)
    if args.quick:
        args.trials, args.epochs, args.num_models = 8, 3, 8
    for name in ("trials", "epochs", "num_models", "batch_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1.")
    return args


def run(tuner, args, train, validation):
    """Runs `tuner`'s search; returns its wall time in seconds."""
    start = time.perf_counter()
    tuner.search(*train, epochs=args.epochs, batch_size=args.batch_size,
                 validation_data=validation, shuffle=False, verbose=0)
    return time.perf_counter() - start


def trial_values(tuner):
    return [t.hyperparameters.values for t in sorted(
        tuner.oracle.trials.values(), key=lambda t: t.trial_id)]


def main(argv=None):
    args = parse_args(argv)
    train, validation = data.digits()
    jit = {"auto": "auto", "true": True, "false": False}[args.jit]
    with tempfile.TemporaryDirectory() as directory:
        common = dict(objective="val_accuracy", max_trials=args.trials,
                      seed=args.seed, directory=directory)
        serial = SerialRandomSearch(build, project_name="serial", **common)
        fused = tuning.FusedRandomSearch(
            build, project_name="fused", num_models=args.num_models,
            jit_compile=jit, **common)
        serial_time = run(serial, args, train, validation)
        fused_time = run(fused, args, train, validation)
        same_trials = trial_values(serial) == trial_values(fused)
        best_serial = serial.oracle.get_best_trials(1)[0]
        best_fused = fused.oracle.get_best_trials(1)[0]
    print(f"digits MLP, {args.trials} trials x {args.epochs} epochs, batch "
          f"{args.batch_size}, arrays of up to {args.num_models} "
          f"(jit_compile={fused.jit_compile})")
    print(f"{'search':<8} {'wall s':>8} {'best trial':>10} "
          f"{'val_accuracy':>12}")
    for name, seconds, best in (("serial", serial_time, best_serial),
                                ("fused", fused_time, best_fused)):
        print(f"{name:<8} {seconds:>8.1f} {best.trial_id:>10} "
              f"{best.score:>12.4f}")
    print(f"serial / fused wall time: {serial_time / fused_time:.2f}x")
    print(f"same configurations: {same_trials}; same best trial: "
          f"{best_serial.trial_id == best_fused.trial_id}")
    return serial_time / fused_time


if __name__ == "__main__":
    main(sys.argv[1:])
