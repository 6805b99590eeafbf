"""The trigger form is generated from the run config's schema: same fields, types, enums, bounds."""

import copy
from typing import Annotated

import pytest
from airflow.sdk.exceptions import ParamValidationError
from pydantic import TypeAdapter, ValidationError

from pipeline.config import RunConfig
from plugins.dag_params import CONFIG_FIELDS, ConfigField, build_config, check_conf_keys, config_dict, run_params

RUN_FIELDS = {"config_file", "storage_url", "run_name", "overrides"}  # about the run, not config keys
NOT_CONSTRAINTS = ("title", "description", "default", "type", "enum")


def config_field(key):
    """(pydantic model, field name) of a dotted config key, found through the models themselves."""
    model, *sections = RunConfig, *key.split(".")[:-1]
    for section in sections:
        model = model.model_fields[section].annotation
    return model, key.split(".")[-1]


def config_schema(key):
    model, name = config_field(key)
    return model.model_json_schema()["properties"][name]


def config_accepts(key, value):
    model, name = config_field(key)
    field = model.model_fields[name]
    kind = Annotated[(field.annotation, *field.metadata)] if field.metadata else field.annotation
    try:
        TypeAdapter(kind).validate_python(value, strict=True)
        return True
    except ValidationError:
        return False


def form_accepts(param, value):
    try:
        copy.deepcopy(param).resolve(value)
        return True
    except ParamValidationError:
        return False


def expected_constraints(schema):
    """The config's constraints as the form writes them: integer bounds inclusive (the UI's number
    input reads only minimum/maximum), and a free string non-empty (empty is null, the base value)."""
    out = {k: v for k, v in schema.items() if k not in NOT_CONSTRAINTS}
    if schema["type"] == "integer":
        if "exclusiveMinimum" in out:
            out["minimum"] = out.pop("exclusiveMinimum") + 1
        if "exclusiveMaximum" in out:
            out["maximum"] = out.pop("exclusiveMaximum") - 1
    if schema["type"] == "string" and "enum" not in schema:
        out.setdefault("minLength", 1)
    return out


def probes(schema):
    """Values at and on either side of every bound, every enum member and a non-member."""
    if "enum" in schema:
        return [*schema["enum"], "not-a-choice"]
    if schema["type"] == "string":
        return ["x", "builtin:sort"]
    step = 1 if schema["type"] == "integer" else 1e-6
    bounds = [schema[k] for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum") if k in schema]
    return [b + d for b in bounds for d in (-step, 0, step)] + [schema["default"]]


def test_the_form_offers_exactly_the_exposed_config_fields_and_the_run_fields():
    assert set(run_params()) == set(CONFIG_FIELDS) | RUN_FIELDS
    # the retrain DAG picks each date's prompts and names its run directory after the date
    assert set(run_params(with_dataset=False)) == (set(CONFIG_FIELDS) - {"dataset"}) | (RUN_FIELDS - {"run_name"})


@pytest.mark.parametrize("name", list(CONFIG_FIELDS))
def test_form_field_has_the_config_fields_type_enum_bounds_and_docstring(name):
    key = CONFIG_FIELDS[name].key
    cfg, param = config_schema(key), run_params()[name]
    form = param.schema
    assert form["type"] == ["null", cfg["type"]]  # null = keep the base config's value
    assert param.value is None
    assert form.get("enum") == ([None, *cfg["enum"]] if "enum" in cfg else None)
    assert {k: v for k, v in form.items() if k not in NOT_CONSTRAINTS} == expected_constraints(cfg)
    assert cfg.get("description"), f"{key} needs a docstring in pipeline/config.py: the form shows it"
    assert param.description.startswith(cfg["description"])
    assert form["title"] == CONFIG_FIELDS[name].title


@pytest.mark.parametrize("name", list(CONFIG_FIELDS))
def test_form_field_accepts_exactly_what_the_config_accepts_at_each_bound_and_choice(name):
    key = CONFIG_FIELDS[name].key
    param = run_params()[name]
    for value in probes(config_schema(key)):
        assert form_accepts(param, value) == config_accepts(key, value), (name, value)
    assert form_accepts(param, None)


def test_every_algorithm_the_engine_registers_is_offered_by_the_form():
    from pipeline.trainer.algorithms import ALGORITHMS

    assert set(run_params()["algorithm"].schema["enum"]) == {None, *ALGORITHMS}


@pytest.mark.parametrize("name,bad", [("lr", 0), ("lr", -1e-3), ("steps", 0), ("group_size", 1),
                                      ("max_new_tokens", 0), ("replay_epochs", -1), ("algorithm", "a2c"),
                                      ("sampler_backend", "tgi"), ("model_path", ""), ("steps", "5")])
def test_a_triggered_value_the_config_refuses_is_refused_by_the_form(name, bad):
    with pytest.raises(ParamValidationError):
        run_params()[name].resolve(bad)


@pytest.mark.parametrize("name", list(CONFIG_FIELDS))
def test_each_form_field_sets_its_config_key(name):
    schema, key = config_schema(CONFIG_FIELDS[name].key), CONFIG_FIELDS[name].key
    value = schema["enum"][-1] if "enum" in schema else {"string": "x", "integer": 3, "number": 0.5}[schema["type"]]
    params = {k: p.value for k, p in run_params().items()} | {name: value}
    node = config_dict(params)
    for part in key.split("."):
        node = node[part]
    assert node == value


def test_a_config_field_added_to_the_exposed_list_appears_in_the_form_and_reaches_the_config(monkeypatch):
    monkeypatch.setitem(CONFIG_FIELDS, "temperature", ConfigField("sampler.temperature", "Temperature"))
    param = run_params()["temperature"]
    assert param.schema["type"] == ["null", "number"] and param.schema["exclusiveMinimum"] == 0
    assert param.description.startswith(config_schema("sampler.temperature").get("description", ""))
    check_conf_keys({"temperature": 0.7}, run_params())
    params = {k: p.value for k, p in run_params().items()} | {"temperature": 0.7}
    assert build_config(params, {"temperature": 0.7}, "exp-1").sampler.temperature == 0.7


@pytest.mark.parametrize("key,match", [("trainer.lrr", "no config key 'trainer.lrr'"),
                                       ("trainer", "cannot be a form field")])
def test_an_exposed_key_the_form_cannot_offer_fails_when_the_form_is_built(monkeypatch, key, match):
    monkeypatch.setitem(CONFIG_FIELDS, "bad", ConfigField(key, "Bad"))
    with pytest.raises(ValueError, match=match):
        run_params()
