"""Distributed tuning: a chief and two workers on loopback."""

import itertools
import json
import sys

import pytest

from hftatf.tuning import distributed

SCRIPT = __file__.replace("test_distributed.py", "distributed_search.py")


def test_environment_names_the_role_and_the_chief():
    env = distributed.environment("chief", "127.0.0.1", 8000)
    assert env == {"KERASTUNER_TUNER_ID": "chief",
                   "KERASTUNER_ORACLE_IP": "127.0.0.1",
                   "KERASTUNER_ORACLE_PORT": "8000"}
    assert distributed.role(env) == "chief"
    assert distributed.role({**env, "KERASTUNER_TUNER_ID": "w1"}) == "worker"
    assert distributed.role({}) is None


@pytest.mark.parametrize("kwargs, error, message", [
    ({"num_workers": 0}, ValueError, "num_workers"),
    ({"num_workers": 2, "command": "python x.py"}, TypeError, "list"),
])
def test_launch_rejects_bad_arguments(kwargs, error, message):
    kwargs.setdefault("command", [sys.executable, "-c", "pass"])
    with pytest.raises(error, match=message):
        distributed.launch(**kwargs)


def test_environment_rejects_an_empty_tuner_id():
    with pytest.raises(ValueError, match="tuner id"):
        distributed.environment("", "127.0.0.1", 1)


def test_launch_stops_everything_when_a_worker_fails(tmp_path):
    # The chief would wait forever for the failed worker's trials.
    command = [sys.executable, "-c",
               "import os, time, sys\n"
               "if os.environ['KERASTUNER_TUNER_ID'] == 'chief':\n"
               "    time.sleep(60)\n"
               "sys.exit(3)"]
    with pytest.raises(RuntimeError, match="exited with code 3"):
        distributed.launch(command, num_workers=1, timeout=30)


@pytest.mark.slow
def test_every_trial_of_the_space_runs_once_across_two_workers(tmp_path):
    codes = distributed.launch(
        [sys.executable, SCRIPT, str(tmp_path), "2"], num_workers=2,
        log_dir=str(tmp_path / "logs"), timeout=400)
    assert codes == {"chief": 0, "worker0": 0, "worker1": 0}
    trained = {worker: json.loads(
        (tmp_path / f"{worker}.trials.json").read_text())
        for worker in ("worker0", "worker1")}
    # Both workers trained arrays; no trial ran twice.
    assert all(trained.values()), trained
    ids = trained["worker0"] + trained["worker1"]
    assert len(ids) == len(set(ids))
    configurations = []
    for trial_id in ids:
        record = json.loads((tmp_path / "search" / f"trial_{trial_id}" /
                             "trial.json").read_text())
        assert record["status"] == "COMPLETED"
        assert record["score"] is not None
        values = record["hyperparameters"]["values"]
        configurations.append((values["units"], values["learning_rate"]))
    # The oracle's own records: the trials the workers reported are all it
    # ran, and they cover the space exactly once.
    recorded = sorted(p.parent.name.removeprefix("trial_")
                      for p in (tmp_path / "search").glob("trial_*/"
                                                          "trial.json"))
    assert recorded == sorted(ids)
    assert sorted(configurations) == sorted(itertools.product(
        (8, 16), (0.1, 0.01, 0.001)))
