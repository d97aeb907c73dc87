"""The launcher's configuration as text: config files (YAML or JSON) and
the values of flags (`--learning_rate=1e-3,3e-4`, `--grid=...`,
`--model_args=depth=18`), parsed into Python values, and `ConfigError`,
what every invalid value raises.
"""

import ast
import json
import math
import numbers
import pathlib
import re

# Fields whose values are mappings; overrides merge into them key by key.
MAPPINGS = ("model_args", "data_args", "optimizer_args", "schedule_args",
            "grid")


class ConfigError(ValueError):
    """An invalid launcher configuration, found before any work starts."""


def read_file(path):
    """The mapping in a YAML (`.yaml`/`.yml`, needs PyYAML) or JSON file."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise ConfigError(
            f"--config_file {str(path)!r} does not exist or is not a file.")
    text = path.read_text()
    if path.suffix == ".json":
        try:
            values = json.loads(text)
        except ValueError as error:
            raise ConfigError(
                f"--config_file {str(path)!r} is not valid JSON: {error}"
            ) from None
    else:
        try:
            import yaml
        except ImportError:
            raise ConfigError(
                f"Reading the YAML file {str(path)!r} needs PyYAML: pip "
                "install pyyaml (or give the config as a .json file)."
            ) from None
        try:
            values = yaml.safe_load(text)
        except yaml.YAMLError as error:
            raise ConfigError(
                f"--config_file {str(path)!r} is not valid YAML: {error}"
            ) from None
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise ConfigError(
            f"--config_file {str(path)!r} must hold a mapping of "
            f"configuration names to values. Received: {values!r}.")
    return values


# -- parsing ----------------------------------------------------------------


def parse_value(text):
    """A flag's value text as a Python value: a number, a bool, None, a list
    or a dict (JSON or Python literal syntax), a list of such values or
    bare words (`[train,validation]`), else the text itself."""
    if not isinstance(text, str):
        return text
    text = text.strip()
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("none", "null", "~"):
        return None
    for parse in (json.loads, ast.literal_eval):
        try:
            return parse(text)
        except (ValueError, SyntaxError, TypeError, MemoryError,
                RecursionError):
            pass
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    if text.startswith("[") and text.endswith("]"):
        return [parse_value(item) for item in _split(text[1:-1], ",")]
    return text


def parse_mapping(text, flag, separator=","):
    """`"a=1,b=[2,3],c.d=x"` (or a YAML/JSON mapping) -> a dict.

    A bare value continues the previous key's value as a list:
    `"learning_rate=0.1,0.01,epochs=3"` gives `learning_rate: [0.1, 0.01]`.
    """
    if text is None:
        return {}
    if isinstance(text, dict):
        return dict(text)
    text = str(text).strip()
    if not text:
        return {}
    if text.startswith("{"):
        value = _parse_structured(text)
        if not isinstance(value, dict):
            raise ConfigError(
                f"--{flag} is not a valid mapping. Received: {text!r}.")
        return value
    values = {}
    key = None
    continued = set()
    for token in _split(text, separator):
        name, equals, value = token.partition("=")
        if equals and re.fullmatch(r"[A-Za-z_][\w.]*", name.strip()):
            key = name.strip()
            values[key] = parse_value(value)
            continued.discard(key)
        elif key is None:
            raise ConfigError(
                f"--{flag} must be a list of name=value pairs (or a YAML "
                f"mapping). Received: {text!r}.")
        else:
            if key not in continued:
                values[key] = [values[key]]
                continued.add(key)
            values[key].append(parse_value(token))
    return values


def parse_grid(text):
    """`"learning_rate=1e-3,1e-4;weight_decay=0,1e-4"` (or a mapping) ->
    `{"learning_rate": [1e-3, 1e-4], "weight_decay": [0, 1e-4]}`."""
    if text is None:
        return {}
    if isinstance(text, dict):
        items = dict(text)
    else:
        text = str(text).strip()
        if not text:
            return {}
        if text.startswith("{"):
            items = _parse_structured(text)
            if not isinstance(items, dict):
                raise ConfigError(f"--grid is not a mapping: {text!r}.")
        else:
            items = {}
            for part in _split(text, ";"):
                name, equals, values = part.partition("=")
                if not equals or not name.strip():
                    raise ConfigError(
                        "--grid must be NAME=V1,V2,...;NAME=V1,... (e.g. "
                        "\"learning_rate=1e-3,1e-4;weight_decay=0,1e-4\"). "
                        f"Received: {text!r}.")
                name = name.strip()
                if name in items:
                    raise ConfigError(
                        f"--grid names {name!r} twice; give all its values "
                        f"in one entry ({name}=V1,V2,...). Received: "
                        f"{text!r}.")
                if any(not value.strip() for value in values.split(",")):
                    raise ConfigError(
                        f"--grid {name!r} has an empty value in "
                        f"{values.strip()!r}. Received: {text!r}.")
                items[name] = [parse_value(v) for v in _split(values, ",")]
    grid = {}
    for name, values in items.items():
        values = list(values) if isinstance(values, (list, tuple)) else [
            values]
        if not values:
            raise ConfigError(f"--grid {name!r} has no values.")
        grid[str(name)] = [_number(v, f"--grid {name}") for v in values]
    return grid


def _parse_structured(text):
    try:
        import yaml
    except ImportError:
        return parse_value(text)
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise ConfigError(f"Cannot read {text!r}: {error}") from None


def _split(text, separator):
    """Splits on `separator` outside brackets and quotes."""
    parts, depth, quote, current = [], 0, None, []
    for char in text:
        if quote:
            if char == quote:
                quote = None
        elif char in "'\"":
            quote = char
        elif char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
        elif char == separator and depth == 0:
            parts.append("".join(current).strip())
            current = []
            continue
        current.append(char)
    parts.append("".join(current).strip())
    return [part for part in parts if part]


# -- normalisation ----------------------------------------------------------


def normalize(name, value, source):
    """`value` for field `name` in its canonical type (flags give strings,
    YAML numbers or strings)."""
    if name == "learning_rate":
        if value is None:
            return None
        if isinstance(value, str):
            value = _split(value, ",") if "," in value else [value]
        if not isinstance(value, (list, tuple)):
            value = [value]
        if not value:
            raise ConfigError(
                f"learning_rate in {source} needs at least one value.")
        return [_number(v, "--learning_rate") for v in value]
    if name == "grid":
        return parse_grid(value)
    if name in MAPPINGS:
        mapping = parse_mapping(value, name)
        mapping = {str(k): plain(v) for k, v in mapping.items()}
        if name == "schedule_args" and "staircase" in mapping:
            # A YAML string "false" is no True (`validate` refuses what is
            # neither a bool nor true/false).
            mapping["staircase"] = _boolean(mapping["staircase"])
        return mapping
    if name == "jit_compile":
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        if value not in ("auto", True, False):
            raise ConfigError(
                f"jit_compile must be auto, true or false. Received: "
                f"{value!r} in {source}.")
        return value
    if name == "deterministic":
        return _boolean(value)
    if name in ("batch_size", "epochs", "train_steps", "eval_steps",
                "steps_per_execution", "num_models", "seed", "verbose",
                "table_every"):
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                raise ConfigError(
                    f"--{name} must be an integer. Received: {value!r} in "
                    f"{source}.") from None
        if isinstance(value, float) and value.is_integer():
            return int(value)
        return value
    if name in ("tpu", "zone", "project", "dataset", "validation_dataset",
                "data_dir", "optimizer") and value == "":
        return None
    return value


def _boolean(value):
    """`value`, with the strings true and false (any case) as bools."""
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    return value


def plain(value):
    """Tuples as lists, recursively (YAML and JSON write lists)."""
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def _number(value, what):
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise ConfigError(
                f"{what} must be a number or a comma list of numbers. "
                f"Received: {value!r}.") from None
    if not is_number(value) or not math.isfinite(value):
        raise ConfigError(
            f"{what} must be a number or a comma list of numbers. "
            f"Received: {value!r}.")
    return value


def is_number(value):
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def not_int(value):
    return not isinstance(value, numbers.Integral) or isinstance(value, bool)


def check_positive(name, value):
    if not_int(value) or value < 1:
        raise ConfigError(
            f"--{name} must be a positive integer. Received: {value!r}.")


def round_value(value):
    """`value` to 6 significant digits (0.1 * 0.3 is 0.03, not
    0.030000000000000002)."""
    return float(f"{value:.6g}")


def describe(name, values):
    flag = "--learning_rate" if name == "learning_rate" else (
        f"--optimizer_args {name}")
    return f"{flag}={','.join(_number_text(v) for v in values)}"


def _number_text(value):
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return f"{value:g}"
    return str(value)
