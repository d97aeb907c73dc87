"""Search spaces written as text (launcher flags) or as a YAML mapping.

One hyper-parameter per entry, `name=kind:arguments`, entries separated by
`;`:

    learning_rate=float:1e-4:1e-1:log;momentum=choice:0,0.9;
    hidden_units=choice:[64],[128,64];dropout=float:0:0.5:linear:0.1;
    depth=int:1:4;use_bias=boolean;activation=fixed:relu

- `float:MIN:MAX[:SAMPLING[:STEP]]`, SAMPLING `linear` (default), `log` or
  `reverse_log`;
- `int:MIN:MAX[:STEP[:SAMPLING]]`;
- `choice:V1,V2,...`, values read as JSON where they parse (numbers,
  `true`/`false`, lists such as `[128,64]`), as strings otherwise; all of
  one kind (numbers, strings, booleans or lists), ints among floats read
  as floats (`choice:0,0.9` is 0.0 or 0.9);
- `boolean`; `fixed:VALUE`.

A STEP must be positive.

The same space as YAML (or JSON), one mapping per hyper-parameter with the
arguments of its `keras_tuner.HyperParameters` method:

    learning_rate: {type: float, min_value: 1.0e-4, max_value: 0.1,
                    sampling: log}
    hidden_units: {type: choice, values: [[64], [128, 64]]}

keras-tuner's `Choice` takes numbers, strings and booleans only; a choice
among lists is declared with the lists' JSON text as its values, and
`Param.decode` turns a trial's value back into the list.
"""

import dataclasses
import json
import pathlib

__all__ = ["Param", "parse", "from_mapping", "read_file"]

_KINDS = ("float", "int", "choice", "boolean", "fixed")
_SAMPLINGS = ("linear", "log", "reverse_log")


@dataclasses.dataclass(frozen=True)
class Param:
    """One hyper-parameter of a search space.

    Attributes:
        name: its name.
        kind: "float", "int", "choice", "boolean" or "fixed".
        min_value, max_value, step, sampling: for "float" and "int".
        values: for "choice".
        value: for "fixed".
        default: the default value, or None for keras-tuner's.
    """

    name: str
    kind: str
    min_value: float = None
    max_value: float = None
    step: float = None
    sampling: str = "linear"
    values: tuple = ()
    value: object = None
    default: object = None

    def __post_init__(self):
        if not self.name or any(c in self.name for c in "=;: "):
            raise ValueError(
                "A hyper-parameter name must be non-empty, without '=', ';', "
                f"':' or spaces. Received: {self.name!r}.")
        if self.kind not in _KINDS:
            raise ValueError(
                f"Hyper-parameter '{self.name}' has an unknown type "
                f"{self.kind!r}; expected one of {', '.join(_KINDS)}.")
        if self.kind in ("float", "int"):
            if self.min_value is None or self.max_value is None or not (
                    self.min_value <= self.max_value):
                raise ValueError(
                    f"Hyper-parameter '{self.name}' ({self.kind}) needs "
                    f"min_value <= max_value. Received: min_value="
                    f"{self.min_value!r}, max_value={self.max_value!r}.")
            if self.sampling not in _SAMPLINGS:
                raise ValueError(
                    f"Hyper-parameter '{self.name}' has sampling "
                    f"{self.sampling!r}; expected one of "
                    f"{', '.join(_SAMPLINGS)}.")
            if self.step is not None and not self.step > 0:
                raise ValueError(
                    f"Hyper-parameter '{self.name}' ({self.kind}) needs a "
                    f"step > 0, or none. Received: step={self.step!r}.")
        if self.kind == "choice":
            self._standardize_values()
        if self.kind == "fixed" and self.value in (None, ""):
            raise ValueError(
                f"Hyper-parameter '{self.name}' is fixed without a value; "
                "give one, e.g. fixed:relu or {type: fixed, value: relu}.")

    def _standardize_values(self):
        """Makes a choice's values one type, as keras-tuner's `Choice`
        takes them: ints among floats become floats (`choice:0,0.9`)."""
        if not self.values:
            raise ValueError(
                f"Hyper-parameter '{self.name}' is a choice without values; "
                "give at least one, e.g. choice:0.1,0.01.")
        types = {"list" if isinstance(v, (list, tuple)) else type(v).__name__
                 for v in self.values}
        if types == {"int", "float"}:
            object.__setattr__(self, "values",
                               tuple(float(v) for v in self.values))
            if isinstance(self.default, int) and not isinstance(
                    self.default, bool):
                object.__setattr__(self, "default", float(self.default))
        elif len(types) > 1:
            raise ValueError(
                f"Hyper-parameter '{self.name}' is a choice among values of "
                f"different types ({', '.join(sorted(types))}): "
                f"{list(self.values)}. A choice takes values of one type: "
                "all numbers, all strings, all booleans or all lists.")

    def declare(self, hp):
        """Declares this hyper-parameter on `hp` (a
        `keras_tuner.HyperParameters`) and returns its decoded value."""
        if self.kind == "float":
            value = hp.Float(self.name, float(self.min_value),
                             float(self.max_value), step=self.step,
                             sampling=self.sampling, default=self.default)
        elif self.kind == "int":
            value = hp.Int(self.name, int(self.min_value),
                           int(self.max_value), step=self.step or 1,
                           sampling=self.sampling, default=self.default)
        elif self.kind == "choice":
            default = None if self.default is None else _label(self.default)
            value = hp.Choice(self.name, [_label(v) for v in self.values],
                              default=default)
        elif self.kind == "boolean":
            value = hp.Boolean(self.name, default=bool(self.default))
        else:
            value = hp.Fixed(self.name, _label(self.value))
        return self.decode(value)

    def decode(self, value):
        """A trial's value of this hyper-parameter as the model or optimizer
        takes it: lists of a choice come back from their JSON text, and
        booleans, which keras-tuner's `Choice` returns as 0 or 1, as
        booleans."""
        for original in (*self.values, self.value):
            if isinstance(original, (list, tuple)) and value == _label(
                    original):
                return list(original)
            if isinstance(original, bool) and not isinstance(
                    value, (str, list, tuple)) and value == original:
                return original
        return value


def _label(value):
    """What keras-tuner stores for `value`: lists as their JSON text."""
    if isinstance(value, (list, tuple)):
        return json.dumps(list(value))
    return value


def _scalar(text):
    """A flag's value: JSON where it parses (numbers, booleans, lists),
    else the string itself."""
    text = text.strip()
    try:
        return json.loads(text)
    except ValueError:
        return text


def _split_values(text):
    """Splits `a,b,[c,d]` at the commas outside brackets."""
    parts, depth, current = [], 0, ""
    for char in text:
        depth += (char == "[") - (char == "]")
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    parts.append(current)
    return [p for p in (p.strip() for p in parts) if p]


def parse(text):
    """The `Param`s of a search space written as flags do (see the module
    docstring); an empty text gives an empty space."""
    params = []
    for entry in (e.strip() for e in (text or "").split(";")):
        if not entry:
            continue
        name, equals, spec = entry.partition("=")
        if not equals:
            raise ValueError(
                f"Cannot read search-space entry {entry!r}: expected "
                "name=kind:arguments, e.g. learning_rate=float:1e-4:1e-1:log.")
        kind, _, arguments = spec.strip().partition(":")
        params.append(_from_spec(name.strip(), kind.strip(), arguments))
    _check_unique(params)
    return params


def _from_spec(name, kind, arguments):
    fields = [a.strip() for a in arguments.split(":")] if arguments else []
    try:
        if kind in ("float", "int"):
            if not 2 <= len(fields) <= 4:
                raise ValueError("expected MIN:MAX with an optional "
                                 "sampling and step")
            number = float if kind == "float" else int
            if kind == "float":
                sampling = fields[2] if len(fields) > 2 else "linear"
                step = number(fields[3]) if len(fields) > 3 else None
            else:
                step = number(fields[2]) if len(fields) > 2 else None
                sampling = fields[3] if len(fields) > 3 else "linear"
            return Param(name, kind, min_value=number(fields[0]),
                         max_value=number(fields[1]), step=step,
                         sampling=sampling)
        if kind == "choice":
            return Param(name, kind, values=tuple(
                _scalar(v) for v in _split_values(arguments)))
        if kind == "boolean":
            if fields:
                raise ValueError("a boolean takes no arguments")
            return Param(name, kind)
        if kind == "fixed":
            return Param(name, kind, value=_scalar(arguments))
    except ValueError as error:
        if str(error).startswith(("Hyper-parameter", "A hyper-parameter")):
            raise
        raise ValueError(
            f"Cannot read hyper-parameter '{name}={kind}:{arguments}': "
            f"{error}.") from None
    return Param(name, kind)  # Raises: an unknown kind.


def from_mapping(mapping):
    """The `Param`s of a space given as a mapping `{name: {type: ...,
    ...}}` (a loaded YAML or JSON file)."""
    if not isinstance(mapping, dict):
        raise ValueError(
            "A search space must be a mapping from hyper-parameter names to "
            f"their specs. Received: {mapping!r}.")
    params = []
    for name, spec in mapping.items():
        if not isinstance(spec, dict) or "type" not in spec:
            raise ValueError(
                f"Hyper-parameter '{name}' needs a mapping with a 'type' "
                f"({', '.join(_KINDS)}). Received: {spec!r}.")
        spec = dict(spec)
        kind = spec.pop("type")
        if "values" in spec:
            spec["values"] = tuple(spec["values"])
        known = {f.name for f in dataclasses.fields(Param)} - {"name",
                                                               "kind"}
        unknown = sorted(set(spec) - known)
        if unknown:
            raise ValueError(
                f"Hyper-parameter '{name}' has unknown keys {unknown}; "
                f"expected some of {sorted(known)}.")
        params.append(Param(str(name), kind, **spec))
    _check_unique(params)
    return params


def read_file(path):
    """The `Param`s of the space in a YAML (needs PyYAML) or JSON file."""
    path = pathlib.Path(path)
    text = path.read_text()
    if path.suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError as error:
            raise ImportError(
                f"Reading {path} needs PyYAML: pip install 'hftatf[tune]' "
                "(or give the space as a .json file).") from error
        mapping = yaml.safe_load(text)
    else:
        mapping = json.loads(text)
    return from_mapping(mapping or {})


def _check_unique(params):
    names = [p.name for p in params]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(
            f"The search space names {repeated} more than once.")
