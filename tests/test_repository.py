"""The repository's promises: README commands, CI, installed namespaces."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def readme_commands():
    return re.findall(r"```sh\n(.+?)\n```", (ROOT / "README.md").read_text())


MAIN_JOB = 'python -m pip install -e ".[data]" && hftatf-train'
TESTS = 'python -m pip install -e ".[dev]" && python -m pytest'


def test_readme_has_the_two_setup_commands():
    assert readme_commands() == [MAIN_JOB, TESTS]


def test_ci_runs_the_readme_test_command_exactly():
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert readme_commands()[1] in lines


def test_zoo_and_launchers_install_under_the_hftatf_namespace():
    import hftatf.models.mlp
    import hftatf.tpu.train

    assert pathlib.Path(hftatf.models.mlp.__file__).parent.name == "models"
    assert pathlib.Path(hftatf.tpu.train.__file__).parent.name == "tpu"
