"""The modules of hftatf's model zoo that a saved model needs imported.

A zoo model's Keras objects (PointNet's `OrthogonalityRegularizer`) are
registered when their module is imported; loading a file imports the zoo
modules its config names, and no other module.
"""

import importlib
import json
import re
import zipfile

# The package of hftatf's model zoo, whose Keras objects (PointNet's
# `OrthogonalityRegularizer`) its modules register when imported.
ZOO_PACKAGE = "hftatf.models"
_ZOO_MODULE = re.compile(re.escape(ZOO_PACKAGE) + r"(\.[A-Za-z_]\w*)+")


def zoo_modules(config):
    """The modules of hftatf's model zoo that the serialized model `config`
    names (as the `module` of a registered object): loading the model needs
    them imported. Only modules under `hftatf.models` are listed, so that
    loading a file never imports any other module it names."""
    found = set()
    pending = [config]
    while pending:
        value = pending.pop()
        if isinstance(value, dict):
            module = value.get("module")
            if isinstance(module, str) and _ZOO_MODULE.fullmatch(module):
                found.add(module)
            pending.extend(value.values())
        elif isinstance(value, list):
            pending.extend(value)
    return sorted(found)


def import_zoo_modules(config):
    """Imports the zoo modules `config` names, which registers their Keras
    objects, so that a zoo model loads without its user importing the
    zoo."""
    for module in zoo_modules(config):
        importlib.import_module(module)


def keras_file_config(path):
    """The model config stored in the `.keras` file `path` ({} for a
    legacy `.h5` file or one that is not a zip archive)."""
    try:
        with zipfile.ZipFile(path) as archive:
            return json.loads(archive.read("config.json"))
    except (zipfile.BadZipFile, KeyError, json.JSONDecodeError):
        return {}
