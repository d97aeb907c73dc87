"""Search spaces from launcher flags and YAML files."""

import json

import keras_tuner
import pytest

from hftatf.tuning import space


def declared(params):
    hp = keras_tuner.HyperParameters()
    values = {p.name: p.declare(hp) for p in params}
    return hp, values


def test_every_kind_reads_from_text():
    params = space.parse(
        "learning_rate=float:1e-4:1e-1:log; dropout=float:0:0.5:linear:0.1;"
        "depth=int:1:4:1; width=int:8:64:2:log; hidden_units=choice:[64],"
        "[128,64]; activation=choice:relu,tanh; use_bias=boolean;"
        "momentum=fixed:0.9")
    hp, values = declared(params)
    by_name = {p.name: p for p in hp.space}
    rate = by_name["learning_rate"]
    assert (rate.min_value, rate.max_value, rate.sampling) == (1e-4, 1e-1,
                                                                "log")
    assert by_name["dropout"].step == 0.1
    assert (by_name["width"].step, by_name["width"].sampling) == (2, "log")
    assert isinstance(by_name["depth"], keras_tuner.engine.hyperparameters.Int)
    # Lists are choices of their JSON text, decoded for the model.
    assert by_name["hidden_units"].values == ["[64]", "[128, 64]"]
    assert values["hidden_units"] == [64]
    assert by_name["activation"].values == ["relu", "tanh"]
    assert values["use_bias"] is False and values["momentum"] == 0.9


def test_ints_among_floats_are_a_choice_of_floats():
    (text,) = space.parse("momentum=choice:0,0.9")
    (mapping,) = space.from_mapping(
        {"momentum": {"type": "choice", "values": [0, 0.9], "default": 0}})
    assert text.values == mapping.values == (0.0, 0.9)
    assert all(type(v) is float for v in text.values)
    _, values = declared([mapping])
    assert values["momentum"] == 0.0 and type(values["momentum"]) is float


def test_trial_values_decode_back_to_lists():
    (param,) = space.parse("hidden_units=choice:[32],[64,32]")
    assert param.decode("[64, 32]") == [64, 32]
    assert param.decode("[32]") == [32]


def test_a_choice_of_booleans_gives_booleans():
    (param,) = space.parse("use_bias=choice:true,false")
    _, values = declared([param])
    assert values["use_bias"] is True
    assert param.decode(0) is False and param.decode(1) is True
    (fixed,) = space.parse("shuffle=fixed:false")
    assert declared([fixed])[1]["shuffle"] is False


def test_yaml_file_gives_the_same_space(tmp_path):
    pytest.importorskip("yaml")
    path = tmp_path / "space.yaml"
    path.write_text(
        "learning_rate: {type: float, min_value: 1.0e-4, max_value: 0.1,\n"
        "                sampling: log}\n"
        "hidden_units: {type: choice, values: [[64], [128, 64]],\n"
        "               default: [128, 64]}\n")
    params = space.read_file(path)
    assert params == space.parse(
        "learning_rate=float:1e-4:0.1:log;hidden_units=choice:[64],"
        "[128,64]")[:1] + [space.Param("hidden_units", "choice",
                                       values=([64], [128, 64]),
                                       default=[128, 64])]
    _, values = declared(params)
    assert values["hidden_units"] == [128, 64]


def test_json_file_reads_without_yaml(tmp_path):
    path = tmp_path / "space.json"
    path.write_text(json.dumps({"units": {"type": "int", "min_value": 8,
                                          "max_value": 32, "step": 8}}))
    (param,) = space.read_file(path)
    assert (param.kind, param.min_value, param.step) == ("int", 8, 8)


@pytest.mark.parametrize("text, message", [
    ("learning_rate", "name=kind:arguments"),
    ("x=float:1", "MIN:MAX"),
    ("x=float:1:0", "min_value <= max_value"),
    ("x=float:0:1:cubic", "sampling"),
    ("x=int:a:3", "Cannot read"),
    ("x=choice:", "without values"),
    ("x=gaussian:0:1", "unknown type"),
    ("x=boolean:true", "no arguments"),
    ("x=fixed:1;x=fixed:2", "more than once"),
    ("x=float:0.1:0.2:linear:0", "step > 0"),
    ("x=int:1:4:-1", "step > 0"),
    ("x=fixed:", "without a value"),
    ("x=choice:[64],32", r"different types \(int, list\)"),
    ("x=choice:relu,0.5", r"different types \(float, str\)"),
])
def test_bad_text_is_a_clear_error(text, message):
    with pytest.raises(ValueError, match=message):
        space.parse(text)


@pytest.mark.parametrize("mapping, message", [
    ([1, 2], "mapping"),
    ({"x": 3}, "'type'"),
    ({"x": {"type": "float", "min_value": 0, "max_value": 1, "lo": 2}},
     "unknown keys"),
    ({"x": {"type": "choice", "values": [True, 1]}}, "'x'.*different types"),
    ({"x": {"type": "fixed"}}, "without a value"),
])
def test_bad_mapping_is_a_clear_error(mapping, message):
    with pytest.raises(ValueError, match=message):
        space.from_mapping(mapping)


def test_empty_text_is_an_empty_space():
    assert space.parse("") == [] and space.parse(None) == []
