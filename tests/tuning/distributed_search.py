"""One process of a distributed fused random search on digits.

Run by tests/tuning/test_distributed.py as the chief and as each worker
(keras-tuner reads the role from KERASTUNER_TUNER_ID). Arguments: the
project directory and the number of workers. Each worker waits for the
others before searching, so that all of them take part, and writes the ids
of the trials it trained to `<directory>/<tuner id>.trials.json`.
"""

import json
import os
import pathlib
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402

from hftatf import tuning  # noqa: E402
from hftatf.models import data  # noqa: E402

UNITS = (8, 16)
LEARNING_RATES = (0.1, 0.01, 0.001)


def build(hp):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((8, 8)),
        keras.layers.Flatten(),
        keras.layers.Dense(hp.Choice("units", UNITS), activation="relu"),
        keras.layers.Dense(10, activation="softmax"),
    ])
    model.compile(
        optimizer=keras.optimizers.SGD(
            hp.Choice("learning_rate", LEARNING_RATES)),
        loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


class RecordingSearch(tuning.FusedRandomSearch):
    """Remembers the trials this process trained."""

    trained = []

    def on_trial_end(self, trial):
        self.trained.append(trial.trial_id)
        super().on_trial_end(trial)


def main(directory, num_workers):
    directory = pathlib.Path(directory)
    tuner_id = os.environ["KERASTUNER_TUNER_ID"]
    tuner = RecordingSearch(
        build, objective="val_accuracy", max_trials=20, seed=1,
        num_models=2, directory=str(directory), project_name="search")
    if tuner_id != "chief":
        (directory / f"{tuner_id}.ready").touch()
        deadline = time.monotonic() + 120
        while len(list(directory.glob("*.ready"))) < num_workers:
            if time.monotonic() > deadline:
                raise TimeoutError("The other workers did not start.")
            time.sleep(0.1)
    (x, y), (x_val, y_val) = data.digits()
    tuner.search(x[:256], y[:256], epochs=1, batch_size=64,
                 validation_data=(x_val[:128], y_val[:128]), verbose=0)
    if tuner_id != "chief":
        (directory / f"{tuner_id}.trials.json").write_text(
            json.dumps(RecordingSearch.trained))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
