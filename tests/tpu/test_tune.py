"""The tuning launcher: a short digits search end to end, and its flags."""

import json
import subprocess
import sys
import warnings

import keras
import keras_tuner
import pytest
from absl import flags

from hftatf import tuning
from hftatf.tpu import tune


def parsed(*args):
    flag_values = flags.FlagValues()
    tune.define_flags(flag_values)
    flag_values(["hftatf-tune", *args])
    return flag_values


def test_search_prints_the_trials_and_exports_the_best(tmp_path, capsys):
    flag_values = parsed(
        "--search_space=learning_rate=choice:0.3,0.01", "--max_trials=2",
        "--optimizer=adam",
        "--epochs=1", "--train_steps=3", "--eval_steps=2", "--num_models=2",
        f"--directory={tmp_path}", "--overwrite")
    tuner = tune.main(["hftatf-tune"], flag_values=flag_values)
    printed = capsys.readouterr().out
    assert "val_accuracy" in printed and "learning_rate" in printed
    assert "0.3" in printed and "0.01" in printed
    done = tuner.oracle.get_best_trials(2)
    assert [t.status for t in done] == ["COMPLETED", "COMPLETED"]
    best = tmp_path / "mlp" / "best" / "rank_0"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = keras.models.load_model(best / "model.keras")
    # Saved with the optimizer state loading builds.
    assert not [w for w in caught if "Skipping variable loading" in str(
        w.message)]
    assert model.output_shape == (None, 10)
    metadata = json.loads((best / "hyperparameters.json").read_text())
    assert metadata["trial"] == done[0].trial_id
    assert metadata["hyperparameters"]["learning_rate"] in (0.3, 0.01)


def test_space_from_yaml_and_flags_reaches_the_model(tmp_path):
    pytest.importorskip("yaml")
    path = tmp_path / "space.yaml"
    path.write_text("hidden_units: {type: choice, values: [[12], [20, 6]]}\n"
                    "learning_rate: {type: fixed, value: 0.5}\n")
    flag_values = parsed(f"--search_space_file={path}",
                         "--search_space=momentum=choice:0.0,0.9;"
                         "learning_rate=fixed:0.2")
    settings = tune._settings(flag_values)
    build = tune.make_hypermodel(settings["recipe"], settings["params"],
                                 settings["model_args"],
                                 settings["optimizer"], seed=0)
    hp = keras_tuner.HyperParameters()
    hp.values.update({"hidden_units": "[20, 6]", "momentum": 0.9})
    model = build(hp)
    units = [layer.units for layer in model.layers
             if isinstance(layer, keras.layers.Dense)]
    assert units == [20, 6, 10]
    assert isinstance(model.optimizer, keras.optimizers.SGD)
    # The flag's entry replaced the file's.
    assert model.optimizer.get_config()["learning_rate"] == (
        pytest.approx(0.2))
    assert model.optimizer.get_config()["momentum"] == pytest.approx(0.9)


def test_tuner_flag_picks_the_fused_tuner(tmp_path):
    flag_values = parsed("--tuner=hyperband", "--epochs=4", "--factor=2",
                         "--num_models=auto", f"--directory={tmp_path}")
    tuner = tune.make_tuner(tune._settings(flag_values), flag_values)
    assert isinstance(tuner, tuning.FusedHyperband)
    assert tuner.num_models == "auto" and tuner.oracle.max_epochs == 4
    flag_values = parsed("--tuner=bayesian", f"--directory={tmp_path}",
                         "--overwrite")
    assert isinstance(tune.make_tuner(tune._settings(flag_values),
                                      flag_values),
                      tuning.FusedBayesianOptimization)


def test_distributed_flags_set_keras_tuners_variables():
    flag_values = parsed("--tuner_id=worker3",
                         "--oracle_address=10.0.0.2:8000")
    assert tune.distributed_environment(flag_values) == {
        "KERASTUNER_TUNER_ID": "worker3",
        "KERASTUNER_ORACLE_IP": "10.0.0.2",
        "KERASTUNER_ORACLE_PORT": "8000"}
    assert tune.distributed_environment(parsed()) == {}


@pytest.mark.parametrize("args, message", [
    (["--num_models=0"], "num_models"),
    (["--num_models=lots"], "num_models"),
    (["--epochs=0"], "epochs"),
    (["--max_trials=0"], "max_trials"),
    (["--model=nope"], "Unknown zoo model"),
    (["--search_space=learning_rate=float:1"], "Bad search space"),
    (["--search_space=momentum=choice:0,fast"], "'momentum'.*types"),
    (["--search_space=learning_rate=float:0:1:log"], "Bad search space"),
    (["--model_args=[1"], "model_args"),
    (["--data_args=size=3"], r"\['size'\] are not arguments of the data"),
    (["--data_args=seed=3"], "cannot set"),
    (["--model=dcgan"], "FusedGAN, a step of its own"),
    (["--objective=val_perplexity"], "pass --direction"),
    (["--tuner_id=w1"], "go together"),
    (["--tuner_id=w1", "--oracle_address=nohost"], "host:port"),
    (["--local_workers=-1"], "local_workers"),
    (["--num_models=2", "--executions_per_trial=3"], "below"),
    (["--local_workers=2", "--tuner_id=w1", "--oracle_address=h:1"],
     "does not go with"),
])
def test_bad_flags_fail_before_any_work(args, message):
    flag_values = parsed(*args)
    with pytest.raises(tune.FlagError, match=message):
        tune._settings(flag_values)
        tune.distributed_environment(flag_values)


@pytest.mark.parametrize("name", ["directory", "export_dir"])
def test_a_directory_flag_naming_a_file_fails_before_any_work(tmp_path,
                                                              name):
    (tmp_path / "afile").write_text("")
    flag_values = parsed(f"--{name}={tmp_path / 'afile'}")
    with pytest.raises(tune.FlagError, match=f"--{name}=.*afile is a file"):
        tune._settings(flag_values)


def test_documented_space_of_ints_and_floats_builds(tmp_path):
    flag_values = parsed(
        "--search_space=learning_rate=float:1e-3:0.3:log;"
        "momentum=choice:0,0.9", f"--directory={tmp_path}")
    settings = tune._settings(flag_values)
    tuner = tune.make_tuner(settings, flag_values)
    hp = keras_tuner.HyperParameters()
    hp.values.update({"momentum": 0.9})
    model = tuner.hypermodel.build(hp)
    assert model.optimizer.get_config()["momentum"] == pytest.approx(0.9)


def test_space_file_of_wrong_types_is_a_flag_error(tmp_path):
    path = tmp_path / "space.json"
    path.write_text(json.dumps({"learning_rate": {
        "type": "float", "min_value": "small", "max_value": 0.1}}))
    with pytest.raises(tune.FlagError, match="Bad search space"):
        tune._settings(parsed(f"--search_space_file={path}"))


def test_objective_the_model_does_not_log_is_a_flag_error(tmp_path):
    flag_values = parsed("--objective=val_acc", f"--directory={tmp_path}")
    with pytest.raises(tune.FlagError, match="val_acc.*val_accuracy"):
        tune.make_tuner(tune._settings(flag_values), flag_values)


def test_unknown_hyperparameter_name_is_a_flag_error():
    flag_values = parsed("--search_space=wingspan=choice:1,2")
    settings = tune._settings(flag_values)
    with pytest.raises(tune.FlagError, match="wingspan"):
        tune.make_hypermodel(settings["recipe"], settings["params"],
                             settings["model_args"], settings["optimizer"])


@pytest.mark.parametrize("args, direction", [
    ([], "max"),  # the recipe's monitor, val_accuracy
    (["--objective=val_loss"], "min"),
    (["--objective=loss"], "min"),
    (["--objective=accuracy"], "max"),
    (["--objective=val_perplexity", "--direction=min"], "min"),
    (["--objective=val_loss", "--direction=max"], "max"),
])
def test_an_objective_goes_the_way_its_name_says(args, direction):
    assert tune._settings(parsed(*args))["objective"].direction == direction


@pytest.mark.parametrize("args", [["--train_steps=0"], ["--eval_steps=0"],
                                  ["--train_steps=-1"]])
def test_step_counts_must_be_positive(args):
    with pytest.raises(flags.IllegalFlagValueError):
        parsed(*args)


@pytest.mark.parametrize("args, message", [
    (["--eval_steps=1000"], "--eval_steps=1000, but the validation set"),
    (["--batch_size=100000"], "not one step"),
])
def test_data_that_cannot_hold_the_steps_fail_before_training(
        tmp_path, args, message):
    flag_values = parsed(*args, "--max_trials=1", "--num_models=1",
                         f"--directory={tmp_path}")
    with pytest.raises(tune.FlagError, match=message):
        tune.search(tune._settings(flag_values), flag_values)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("args, message", [
    (["--model_args=nope=1"], "could not be built.*nope"),
    (["--search_space=hidden_units=int:0:3"], "could not be built"),
])
def test_a_model_its_builder_refuses_is_a_flag_error(tmp_path, args,
                                                     message):
    flag_values = parsed(*args, f"--directory={tmp_path}")
    with pytest.raises(tune.FlagError, match=message):
        tune.make_tuner(tune._settings(flag_values), flag_values)


def test_a_builder_of_keyword_arguments_takes_unprefixed_names(tmp_path):
    flag_values = parsed("--model=resnet18",
                         "--model_args=input_shape=[8,8,3]",
                         "--search_space=width=choice:0.0625,0.125;"
                         "momentum=fixed:0.5")
    settings = tune._settings(flag_values)
    build = tune.make_hypermodel(settings["recipe"], settings["params"],
                                 settings["model_args"],
                                 settings["optimizer"])
    hp = keras_tuner.HyperParameters()
    hp.values.update({"width": 0.125})
    wide = build(hp).count_params()
    hp.values.update({"width": 0.0625})
    narrow = build(hp)
    assert narrow.count_params() < wide
    assert narrow.optimizer.get_config()["momentum"] == pytest.approx(0.5)


def test_only_completed_trials_are_exported(tmp_path):
    class Trial:
        def __init__(self, trial_id, status):
            self.trial_id, self.status = trial_id, status
            self.score, self.hyperparameters = 0.5, keras_tuner.\
                HyperParameters()

    class Tuner:
        """keras-tuner pads the best trials with unfinished ones."""

        class oracle:  # noqa: N801
            @staticmethod
            def get_best_trials(num_trials):
                return [Trial("1", "COMPLETED"),
                        Trial("2", "FAILED")][:num_trials]

        @staticmethod
        def get_best_models(num_models):
            assert num_models == 1
            return [keras.Sequential([keras.Input((2,)),
                                      keras.layers.Dense(1)])]

    written = tune.export_best(Tuner, tmp_path, num_best=2)
    assert [path.name for path in written] == ["rank_0"]
    assert json.loads((tmp_path / "rank_0" / "hyperparameters.json")
                      .read_text())["trial"] == "1"


@pytest.mark.slow
def test_local_cluster_runs_a_chief_and_workers(tmp_path):
    output = subprocess.run(
        [sys.executable, "-m", "hftatf.tpu.tune", "--local_workers=2",
         "--search_space=learning_rate=choice:0.3,0.1,0.03", "--epochs=1",
         "--train_steps=2", "--eval_steps=1", "--num_models=2",
         f"--directory={tmp_path}", "--overwrite"],
        capture_output=True, text=True, timeout=400, check=True).stdout
    # The chief printed the three trials and exported the best one.
    assert output.count("COMPLETED") == 3
    assert (tmp_path / "mlp" / "best" / "rank_0" / "model.keras").exists()
