"""The repository's promises: README commands, CI, installed namespaces."""

import pathlib
import re
import runpy

ROOT = pathlib.Path(__file__).resolve().parents[1]


def readme_commands():
    return re.findall(r"```sh\n(.+?)\n```", (ROOT / "README.md").read_text())


MAIN_JOB = 'python -m pip install -e ".[data]" && hftatf-train'
TESTS = ('python -m pip install -e ".[dev]" && '
         "python -m pytest -n auto --maxprocesses 4 --dist loadgroup")


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


def setup_arguments(monkeypatch):
    """The keyword arguments setup.py passes to `setuptools.setup`."""
    import setuptools

    received = {}
    monkeypatch.setattr(setuptools, "setup", lambda **kw: received.update(kw))
    runpy.run_path(str(ROOT / "setup.py"))
    return received


def test_setup_installs_every_package(monkeypatch):
    listed = set(setup_arguments(monkeypatch)["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts)
             for p in (ROOT / "hftatf").rglob("__init__.py")}
    found |= {"hftatf." + p.parent.name
              for p in (ROOT / "models").glob("__init__.py")}
    found |= {"hftatf." + p.parent.name
              for p in (ROOT / "tpu").glob("__init__.py")}
    assert found <= listed, found - listed


def test_test_modules_have_unique_names():
    # pytest imports test files by module name (tests/ has no packages).
    names = [p.name for p in (ROOT / "tests").rglob("*.py")]
    assert sorted(set(names)) == sorted(names), sorted(
        n for n in set(names) if names.count(n) > 1)


def test_submodules_the_readme_uses_are_attributes_of_hftatf():
    # The README writes hftatf.backup.BackupAndRestore(...),
    # hftatf.distribute.strategy_from_name(...), hftatf.tuning.* after a
    # plain `import hftatf`.
    import hftatf

    for name in ("backup", "callbacks", "distribute", "export", "layers",
                 "optimizers", "passes", "seeds", "models", "tpu"):
        assert getattr(hftatf, name).__name__ == f"hftatf.{name}", name
    for used in re.findall(r"`hftatf\.([a-z_]+)\.",
                           (ROOT / "README.md").read_text()):
        assert hasattr(hftatf, used), used
