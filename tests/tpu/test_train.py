"""The main job: the digits launcher, run short."""

import json

import keras
import numpy as np
import pytest
from absl.testing import flagsaver

from hftatf.models import data
from hftatf.tpu import train

if "learning_rates" not in train.FLAGS:
    train.define_flags()


def test_launcher_trains_and_exports_four_models(tmp_path, capsys):
    train.FLAGS.mark_as_parsed()
    with flagsaver.flagsaver(epochs=1, train_steps=3, verbose=0,
                             export_dir=str(tmp_path / "export")):
        train.main([])
    printed = capsys.readouterr().out
    assert "learning_rate" in printed and "val_accuracy" in printed
    for rate in ("0.3", "0.1", "0.03", "0.01"):
        assert rate in printed
    (_, _), (x_val, _) = data.digits()
    for b in range(4):
        path = tmp_path / "export" / f"model_{b}"
        model = keras.models.load_model(path / "model.keras")
        assert model.predict(x_val[:4], verbose=0).shape == (4, 10)
        metadata = json.loads((path / "metadata.json").read_text())
        assert np.isclose(metadata["hyperparameters"]["learning_rate"],
                          [0.3, 0.1, 0.03, 0.01][b])
        assert "val_accuracy" in metadata["metrics"]


def test_best_learning_rate_learns_digits(tmp_path):
    config = train.Config(epochs=8, verbose=0, export_dir="")
    _, _, results = train.train(config)
    assert max(r["val_accuracy"] for r in results) > 0.9


@pytest.mark.parametrize("flag, value, message", [
    ("learning_rates", ["0.1", "x"], "comma list"),
    ("learning_rates", ["0.1", "-1"], "positive"),
    ("epochs", 0, "epochs"),
    ("batch_size", 0, "batch_size"),
])
def test_invalid_flags_fail_before_any_work(flag, value, message):
    train.FLAGS.mark_as_parsed()
    with flagsaver.flagsaver(**{flag: value}):
        with pytest.raises(ValueError, match=message):
            train.Config.from_flags()
