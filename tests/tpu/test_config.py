"""The launcher's configuration: flags, files, precedence, the array's
hyper-parameters, and invalid runs refused before any work."""

import json
import time

import pytest
from absl.testing import flagsaver

from hftatf.models import recipes
from hftatf.tpu import train
from hftatf.tpu.config import (
    Config,
    ConfigError,
    parse_grid,
    parse_mapping,
    read_file,
)

FLAGS = train.FLAGS


@pytest.fixture(scope="module", autouse=True)
def _launcher_flags():
    """The launcher's flags on absl's global FLAGS for this module's tests,
    removed afterwards (other launchers define flags of the same names)."""
    before = set(FLAGS)
    train.define_flags()
    FLAGS.mark_as_parsed()
    yield
    for name in set(FLAGS) - before:
        delattr(FLAGS, name)


def plan(**values):
    return Config(**values).validate().array_plan()


def test_every_flag_of_the_issue_is_defined_and_documented():
    help_text = FLAGS.get_help()
    for name in ("tpu", "strategy", "zone", "project", "model", "model_args",
                 "learning_rate", "grid", "num_models", "optimizer",
                 "schedule", "batch_size", "epochs", "train_steps",
                 "steps_per_execution", "mixed_precision", "jit_compile",
                 "seed", "dataset", "data_dir", "model_dir", "export_dir",
                 "config_file", "params_override"):
        assert name in FLAGS and f"--{name}:" in help_text, name
    # Each flag of the config, and the config only.
    from hftatf.tpu.config import field_names

    for name in field_names():
        assert name in FLAGS, name


# -- the array --------------------------------------------------------------


def test_no_flags_is_the_main_job():
    config = Config().validate().resolved()
    recipe = recipes.get("mlp")
    assert config.model == "mlp" and config.optimizer == recipe.optimizer
    assert config.epochs == recipe.epochs
    assert config.learning_rate == [0.3, 0.1, 0.03, 0.01]
    assert config.model_dir == "runs/mlp"
    assert config.export_dir == "runs/mlp/export"
    num_models, per_model, shared = config.array_plan()
    assert num_models == 4
    assert per_model == {"learning_rate": [0.3, 0.1, 0.03, 0.01]}
    assert "learning_rate" not in shared


def test_learning_rate_list_gives_one_model_each():
    num_models, per_model, _ = plan(learning_rate=[1e-3, 3e-4, 1e-4])
    assert num_models == 3
    assert per_model == {"learning_rate": [1e-3, 3e-4, 1e-4]}


def test_grid_is_the_product_first_name_slowest():
    num_models, per_model, shared = plan(
        grid="learning_rate=1e-3,1e-4;momentum=0,0.5,0.9")
    assert num_models == 6
    assert per_model == {
        "learning_rate": [1e-3, 1e-3, 1e-3, 1e-4, 1e-4, 1e-4],
        "momentum": [0, 0.5, 0.9, 0, 0.5, 0.9]}
    assert "learning_rate" not in shared


def test_grid_without_learning_rate_shares_the_recipes():
    num_models, per_model, shared = plan(grid="momentum=0,0.9")
    assert num_models == 2 and per_model == {"momentum": [0, 0.9]}
    assert shared["learning_rate"] == recipes.get("mlp").learning_rate


def test_num_models_alone_is_a_seed_array():
    num_models, per_model, shared = plan(num_models=3)
    assert num_models == 3 and per_model == {}
    assert shared["learning_rate"] == recipes.get("mlp").learning_rate
    config = Config(num_models=3).validate().resolved()
    assert config.learning_rate == [recipes.get("mlp").learning_rate]
    assert config.resolved().array_plan()[0] == 3


def test_per_model_optimizer_args_and_shared_ones():
    num_models, per_model, shared = plan(
        optimizer="adamw", learning_rate=[1e-3, 1e-4],
        optimizer_args="weight_decay=[0,0.01],beta_1=0.8")
    assert num_models == 2
    assert per_model == {"learning_rate": [1e-3, 1e-4],
                         "weight_decay": [0, 0.01]}
    assert shared["beta_1"] == 0.8


def test_resolved_config_reruns_the_same_array(tmp_path):
    config = Config(grid="learning_rate=0.1,0.01;momentum=0,0.9",
                    model_args="hidden_units=[8]", model_dir=str(tmp_path))
    config = config.validate().resolved()
    path = config.write(tmp_path)
    reread = Config.from_dict(read_file(path))
    # The default export directory stays derived from model_dir.
    assert reread.export_dir is None
    assert reread.resolved() == config
    assert reread.validate().array_plan() == config.array_plan()


# -- parsing and precedence -------------------------------------------------


def test_parse_mapping():
    assert parse_mapping("a=1,b=[2,3],c=x,d=0.1,0.2,e=true,f.g=none",
                         "f") == {"a": 1, "b": [2, 3], "c": "x",
                                  "d": [0.1, 0.2], "e": True, "f.g": None}
    assert parse_mapping("{a: 1, b: [2]}", "f") == {"a": 1, "b": [2]}
    assert parse_mapping("s='x,y'", "f") == {"s": "x,y"}
    assert parse_mapping("splits=[train,'a,b'],n=[[1],[x]],e=[]", "f") == {
        "splits": ["train", "a,b"], "n": [[1], ["x"]], "e": []}
    with pytest.raises(ConfigError, match="name=value"):
        parse_mapping("1,2", "model_args")


def test_parse_grid():
    assert parse_grid("learning_rate=1e-3,1e-4;weight_decay=0") == {
        "learning_rate": [1e-3, 1e-4], "weight_decay": [0]}
    assert parse_grid({"momentum": [0, "0.9"]}) == {"momentum": [0, 0.9]}
    with pytest.raises(ConfigError, match="NAME=V1"):
        parse_grid("learning_rate")
    with pytest.raises(ConfigError, match="number"):
        parse_grid("learning_rate=fast")
    # Nothing dropped without a word: a name given twice, an empty value.
    with pytest.raises(ConfigError, match="names 'learning_rate' twice"):
        parse_grid("learning_rate=0.1;learning_rate=0.2")
    with pytest.raises(ConfigError, match="empty value"):
        parse_grid("learning_rate=0.1,,0.2")


def test_flags_fill_the_config():
    with flagsaver.flagsaver(
            model="mlp", learning_rate=["0.1", "0.01"], batch_size=32,
            model_args="hidden_units=[16,8],dropout=0.1", jit_compile="false",
            optimizer="adam", optimizer_args="beta_1=0.8", train_steps=4,
            steps_per_execution=2, schedule="cosine",
            schedule_args="alpha=0.1,warmup_epochs=1", seed=3):
        config = train.config_from_flags()
    assert config.learning_rate == [0.1, 0.01]
    assert config.batch_size == 32 and config.train_steps == 4
    assert config.model_args == {"hidden_units": [16, 8], "dropout": 0.1}
    assert config.jit_compile is False and config.optimizer == "adam"
    assert config.optimizer_args == {"beta_1": 0.8}
    assert config.schedule_args == {"alpha": 0.1, "warmup_epochs": 1}
    assert config.seed == 3 and config.steps_per_execution == 2


def test_learning_rates_alias_of_earlier_versions():
    with flagsaver.flagsaver(learning_rates=["0.2", "0.02"]):
        assert train.config_from_flags().learning_rate == [0.2, 0.02]


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_precedence_defaults_file_override_flags(tmp_path, suffix):
    if suffix == ".yaml":
        pytest.importorskip("yaml")
    values = {"epochs": 3, "batch_size": 16, "seed": 7,
              "model_args": {"hidden_units": [8]},
              "learning_rate": [0.5, 0.05]}
    path = tmp_path / f"run{suffix}"
    if suffix == ".yaml":
        import yaml

        path.write_text(yaml.safe_dump(values))
    else:
        path.write_text(json.dumps(values))
    override = "epochs=4,seed=8,model_args.dropout=0.1"
    with flagsaver.flagsaver(config_file=str(path)):
        config = train.config_from_flags()
    assert (config.epochs, config.batch_size, config.seed) == (3, 16, 7)
    assert config.steps_per_execution == Config().steps_per_execution
    with flagsaver.flagsaver(config_file=str(path), params_override=override):
        config = train.config_from_flags()
    assert (config.epochs, config.batch_size, config.seed) == (4, 16, 8)
    assert config.model_args == {"hidden_units": [8], "dropout": 0.1}
    with flagsaver.flagsaver(config_file=str(path), params_override=override,
                             epochs=5, learning_rate=["0.3"]):
        config = train.config_from_flags()
    assert (config.epochs, config.batch_size, config.seed) == (5, 16, 8)
    assert config.learning_rate == [0.3]
    # A flag left at its default does not override the file.
    with flagsaver.flagsaver(config_file=str(path)):
        assert train.config_from_flags().batch_size == 16


# -- invalid runs fail before any work --------------------------------------


INVALID = [
    (dict(model="no_such_model"), "Unknown zoo model 'no_such_model'"),
    (dict(grid="learning_rate=0.1,0.01", learning_rate=["0.1", "0.2"]),
     "--grid and per-model lists"),
    (dict(grid="momentum=0,0.9", optimizer_args="weight_decay=[0,1]"),
     "--grid and per-model lists"),
    (dict(grid="learning_rate=0.1,0.01", learning_rate=["0.5"]),
     "both in --grid and as a single value"),
    (dict(learning_rate=["0.1", "0.2", "0.3"],
          optimizer_args="weight_decay=[0,0.1]"),
     "learning_rate has 3, weight_decay has 2 values"),
    (dict(learning_rate=["0.1", "0.2"], num_models=3),
     "--num_models=3 does not match"),
    (dict(grid="learning_rate=0.1,0.01", num_models=3),
     "--num_models=3 does not match"),
    (dict(learning_rate=["0.1", "x"]), "comma list of numbers"),
    (dict(learning_rate=["0.1", "-1"]), "positive"),
    (dict(optimizer="adamx"), "Unknown fused optimizer 'adamx'"),
    (dict(optimizer_args="betta=0.9"), "not an argument of"),
    (dict(optimizer_args="nesterov=[true,false]"),
     "cannot take one value per model"),
    (dict(optimizer_args="momentum=[0.5,2]"), "refuses"),
    (dict(batch_size=0), "--batch_size must be a positive integer"),
    (dict(epochs=0), "--epochs must be a positive integer"),
    (dict(train_steps=3, steps_per_execution=2), "multiple of"),
    (dict(schedule="cosine", schedule_args="decay_rate=0.5"),
     "not arguments of the 'cosine' schedule"),
    (dict(params_override="epoch=3"), "Unknown configuration name 'epoch'"),
    (dict(model_args="hidden=[4]"), "not arguments of model 'mlp'"),
    (dict(data_args="image_sizes=4"), "not arguments of the data"),
    (dict(dataset="cifar10"), "no --data_dir"),
    (dict(dataset="/no/such/dir/*.tfrecord"), "no file matches"),
    (dict(tpu="local", strategy="cpu"), "does not use one"),
    (dict(export_dir="gs://bucket/export"), "must be a local directory"),
    (dict(seed=-1), "--seed must be an integer from 0 to 2"),
    (dict(seed=2**32), "--seed must be an integer from 0 to 2"),
    (dict(verbose=7), "--verbose must be 0 .silent., 1"),
    (dict(optimizer="adamw", optimizer_args="weight_decay=[0,abc]"),
     "Per-model values of 'weight_decay' must be numbers"),
    (dict(schedule="step", schedule_args="decay_epochs=0"),
     "decay_epochs must be > 0"),
    (dict(schedule="exponential", schedule_args="decay_epochs=0"),
     "decay_epochs must be > 0"),
    (dict(schedule="exponential", schedule_args="staircase=maybe"),
     "staircase must be true or false"),
    (dict(validation_dataset="validation.tfrecord"),
     "--validation_dataset=validation.tfrecord goes with TFRecord files"),
    (dict(data_dir="/data/tensorflow_datasets"),
     "--data_dir=/data/tensorflow_datasets is where tensorflow-datasets"),
]


@pytest.mark.parametrize("values, message", INVALID)
def test_invalid_flags_fail_before_any_work(tmp_path, values, message):
    model_dir = tmp_path / "run"
    values = {"verbose": 0, **values}
    with flagsaver.flagsaver(model_dir=str(model_dir), **values):
        with pytest.raises(ConfigError, match=message):
            train.main([])
    assert not model_dir.exists()


def test_staircase_is_a_boolean_or_true_or_false(tmp_path):
    path = tmp_path / "run.yaml"
    # A YAML string, which bool() would make True.
    path.write_text("schedule: exponential\n"
                    "schedule_args: {staircase: 'False'}\n")
    with flagsaver.flagsaver(config_file=str(path)):
        config = train.config_from_flags()
    assert config.schedule_args == {"staircase": False}
    config = Config(schedule="exponential", schedule_args={"staircase": 1})
    with pytest.raises(ConfigError, match="staircase must be true or false"):
        config.validate()


def test_invalid_config_file_values(tmp_path):
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"batch_size": 32, "modle": "mlp"}))
    with flagsaver.flagsaver(config_file=str(path)):
        with pytest.raises(ConfigError, match="'modle' in --config_file"):
            train.config_from_flags()
    with flagsaver.flagsaver(config_file=str(tmp_path / "missing.yaml")):
        with pytest.raises(ConfigError, match="does not exist"):
            train.config_from_flags()


@pytest.mark.backends("tensorflow", reason="a TPUStrategy and its TPU "
                      "look-up are TensorFlow's; on JAX --strategy=tpu is "
                      "the keras.distribution of the devices JAX sees")
def test_tpu_strategy_without_a_tpu_fails_fast(tmp_path, monkeypatch):
    monkeypatch.delenv("TPU_NAME", raising=False)
    model_dir = tmp_path / "run"
    start = time.monotonic()
    for tpu, message in [(None, "needs a TPU"), ("local", "has none"),
                         ("no-such-tpu", "'no-such-tpu' could not be "
                          "resolved")]:
        with flagsaver.flagsaver(strategy="tpu", tpu=tpu,
                                 model_dir=str(model_dir)):
            with pytest.raises(ConfigError, match=message):
                train.main([])
    assert time.monotonic() - start < 30
    assert not model_dir.exists()


def test_global_batch_must_split_between_replicas(tmp_path, monkeypatch):
    from hftatf.tpu import data

    assert data.per_replica_batch_size(64, 4) == 16
    with pytest.raises(ConfigError, match="--batch_size=10 .* 4 replicas.*"
                       "e.g. 8 or 12"):
        data.per_replica_batch_size(10, 4)
    # The launcher checks it as soon as the strategy is there.
    strategies = []

    class FourReplicas:
        num_replicas_in_sync = 4

    def make_strategy(config, num_models=1, tf_data=True):
        strategies.append(config.strategy)
        return FourReplicas()

    monkeypatch.setattr(train, "make_strategy", make_strategy)
    model_dir = tmp_path / "run"
    with flagsaver.flagsaver(strategy="mirrored", batch_size=66,
                             model_dir=str(model_dir)):
        with pytest.raises(ConfigError, match="split evenly between the 4"):
            train.main([])
    assert strategies == ["mirrored"] and not model_dir.exists()
