"""The config loader against generated input (property-based): random keys and nesting, wrong
types, truncated and reordered YAML, non-mapping roots, huge numbers, NaN/inf, unicode, odd
`key=value` overrides. Whatever the input, the loader returns a config that survives its own frozen
snapshot (to_yaml, then load_config) or raises a one-line ConfigError naming a field or the file;
never another exception.
"""

from __future__ import annotations

import copy
import datetime
import math
import typing
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from pipeline.config import ConfigError, RunConfig, apply_overrides, load_config, parse_config

PROPERTY = settings(max_examples=200, deadline=None, derandomize=True, database=None)
SHIPPED = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))


def _fields(model: type[BaseModel], prefix: str = "") -> list[tuple[str, object]]:
    """(dotted key, annotation) of every leaf field of the config, sections walked into."""
    out = []
    for name, f in model.model_fields.items():
        ann = f.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out += _fields(ann, f"{prefix}{name}.")
        else:
            out.append((f"{prefix}{name}", ann))
    return out


LEAVES = _fields(RunConfig)
SECTIONS = [n for n, f in RunConfig.model_fields.items() if isinstance(f.annotation, type)
            and issubclass(f.annotation, BaseModel)]
NAMES = {part for key, _ in LEAVES for part in key.split(".")} | {"config", "override"}

# past 4300 digits an int has no repr, so these are built, not listed (hypothesis reprs strategies)
huge = st.sampled_from([2**63, -(2**63) - 1, 10**30]) | st.sampled_from([1, -1]).map(lambda sign: sign * 10**5000)
scalars = (st.none() | st.booleans() | st.integers() | huge | st.floats() | st.text(max_size=12)
           | st.sampled_from(["", "1e3", ".nan", "-.inf", "yes", "~", "☃", "\x00", "2024-01-01"]))
json_values = st.recursive(scalars, lambda kids: st.lists(kids, max_size=3)
                           | st.dictionaries(st.text(max_size=6), kids, max_size=3), max_leaves=6)


def _plausible(ann) -> st.SearchStrategy:
    """Values of a field's own type (so that many generated configs are accepted), or any value."""
    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if origin is typing.Literal:
        own = st.sampled_from(args)
    elif ann is bool:
        own = st.booleans()
    elif ann is int:
        own = st.integers(-3, 64) | huge
    elif ann is float:
        own = st.floats(-2, 1e4) | st.sampled_from([math.nan, math.inf, -math.inf])
    elif ann is str:
        own = st.text(max_size=12)
    elif args and type(None) in args:  # X | None
        own = st.none() | st.one_of([_plausible(a) for a in args if a is not type(None)])
    else:
        own = json_values
    return st.one_of(own, own, json_values)


@st.composite
def configs(draw) -> dict:
    """A nested mapping: some of the config's keys with values of their type or not, plus random
    keys at any level."""
    data: dict = {}
    for key, ann in draw(st.lists(st.sampled_from(LEAVES), max_size=6, unique_by=lambda f: f[0])):
        node = data
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = draw(_plausible(ann))
    for _ in range(draw(st.integers(0, 2))):
        where = draw(st.sampled_from([None, *SECTIONS]))
        node = data if where is None else data.setdefault(where, {})
        if isinstance(node, dict):
            node[draw(st.text(max_size=8) | st.integers() | st.none())] = draw(json_values)
    if draw(st.booleans()):  # a section that is not a mapping
        data[draw(st.sampled_from(SECTIONS))] = draw(scalars | st.lists(scalars, max_size=2))
    return data


def check(load) -> RunConfig | None:
    """`load()` gives a usable config or a one-line ConfigError; anything else fails the test."""
    try:
        cfg = load()
    except ConfigError as e:
        msg = str(e)
        assert msg and "\n" not in msg and len(msg) < 1000, f"not a one-line message: {msg!r}"
        return None
    assert isinstance(cfg, RunConfig)
    _assert_usable(cfg)
    return cfg


def _assert_usable(cfg: RunConfig) -> None:
    """Every number is finite and 64-bit, and the frozen snapshot loads back as the same config."""
    def walk(v):
        if isinstance(v, dict):
            for x in v.values():
                walk(x)
        elif isinstance(v, list):
            for x in v:
                walk(x)
        elif isinstance(v, float):
            assert math.isfinite(v), cfg
        elif isinstance(v, int):
            assert -(2**63) <= v < 2**63, cfg

    walk(cfg.model_dump())
    path = Path(_SNAPSHOT)
    path.write_text(cfg.to_yaml())
    assert load_config(path) == cfg


_SNAPSHOT = ""


@pytest.fixture(scope="module", autouse=True)
def snapshot_file(tmp_path_factory):
    global _SNAPSHOT
    _SNAPSHOT = str(tmp_path_factory.mktemp("cfg") / "config.yaml")
    yield


def _names_something(msg: str, path: str | None = None) -> bool:
    return (path is not None and path in msg) or any(n in msg for n in NAMES)


# properties -----------------------------------------------------------------------------------
@PROPERTY
@given(data=configs())
@example(data={"buffer": {"l2_min_reward_mean": math.nan}})
@example(data={"trainer": {"lr": 10**5000}})
@example(data={"trainer": {"steps": 10**30}})
@example(data={"sampler": {"vllm": {"revision": datetime.date(2024, 1, 1)}}})
@example(data={"sampler": {"vllm": {"x": b"\xff"}}})
@example(data={"seed": -1})
def test_any_mapping_gives_a_usable_config_or_a_config_error(data):
    before = copy.deepcopy(data)
    check(lambda: parse_config(data))
    assert data == before, "parse_config changed the caller's dict"


@PROPERTY
@given(key=st.sampled_from(LEAVES), bad=st.lists(st.integers(), min_size=1, max_size=2))
def test_a_wrong_value_is_named_by_its_dotted_key(key, bad):
    *parents, leaf = key[0].split(".")
    data = node = {}
    for p in parents:
        node = node.setdefault(p, {})
    node[leaf] = bad
    with pytest.raises(ConfigError) as e:
        parse_config(data)
    assert key[0] in str(e.value)


@PROPERTY
@given(section=st.sampled_from(SECTIONS), key=st.text(max_size=10), value=json_values)
def test_an_unknown_key_is_named_with_its_section(section, key, value):
    if key in type(getattr(RunConfig(), section)).model_fields:
        return
    with pytest.raises(ConfigError) as e:
        parse_config({section: {key: value}})
    shown = "".join(c if c.isprintable() else repr(c)[1:-1] for c in key)  # as the message shows it
    assert f"unknown config key '{section}.{shown}'" in str(e.value)


@PROPERTY
@given(root=json_values.filter(lambda v: not isinstance(v, dict) and v is not None))
def test_a_root_that_is_not_a_mapping_is_a_config_error(root):
    with pytest.raises(ConfigError, match="mapping"):
        parse_config(root)


yaml_text = st.text(alphabet=st.characters(codec="utf-8") | st.sampled_from(list("[]{}:,-#&*!|>'\"%@ \n\t")),
                    max_size=20)
overrides = st.one_of(
    st.tuples(st.sampled_from([k for k, _ in LEAVES]) | st.text(max_size=12), yaml_text).map("=".join),
    st.text(max_size=12),  # without '='
    json_values,  # not a string
)


@PROPERTY
@given(base=configs(), items=st.lists(overrides, max_size=3))
@example(base={}, items=["trainer.steps=["])
@example(base={}, items=["seed=" + "9" * 5000])
@example(base={}, items=["sampler.vllm={a: 1, a: 2}"])
@example(base={"trainer": 3}, items=["trainer.steps=4"])
@example(base={}, items=[3])
def test_overrides_give_a_usable_config_or_a_config_error(base, items):
    before = copy.deepcopy(base)
    check(lambda: parse_config(base, items))
    assert base == before, "overrides changed the caller's dict"


@PROPERTY
@given(which=st.sampled_from(SHIPPED), cut=st.floats(0, 1), edit=st.sampled_from(["truncate", "replace", "swap"]),
       text=yaml_text, other=st.floats(0, 1))
def test_truncated_reordered_or_corrupted_file_gives_a_config_or_names_the_file_or_a_key(
        which, cut, edit, text, other):
    raw = which.read_text()
    lines = raw.splitlines(keepends=True)
    if edit == "truncate":  # at a random character
        raw = raw[: int(len(raw) * cut)]
    elif edit == "replace":
        at = int(len(raw) * cut)
        raw = raw[:at] + text + raw[at + len(text):]
    else:  # two lines swapped
        i, j = int(len(lines) * cut) % len(lines), int(len(lines) * other) % len(lines)
        lines[i], lines[j] = lines[j], lines[i]
        raw = "".join(lines)
    path = Path(_SNAPSHOT).with_name("damaged.yaml")
    path.write_text(raw, encoding="utf-8")
    try:
        check(lambda: load_config(path))
    except ConfigError as e:
        assert _names_something(str(e), str(path)), str(e)


@PROPERTY
@given(raw=st.binary(max_size=64))
@example(raw=b"\xff\xfe: 1")
@example(raw=b"[" * 5000)
@example(raw=b"seed: 2024-13-45")
def test_any_bytes_as_a_config_file(raw):
    path = Path(_SNAPSHOT).with_name("bytes.yaml")
    path.write_bytes(raw)
    try:
        check(lambda: load_config(path))
    except ConfigError as e:
        assert _names_something(str(e), str(path)), str(e)


# regressions: one plain test per bug the properties found --------------------------------------
def test_top_level_that_is_not_a_mapping_is_a_config_error():
    with pytest.raises(ConfigError, match="top level is a list"):
        parse_config([1, 2])  # was a TypeError from dict()


def test_override_value_that_is_not_yaml_names_the_override():
    with pytest.raises(ConfigError, match=r"override 'trainer.steps=\[': the value is not valid YAML"):
        parse_config({}, ["trainer.steps=["])  # was a yaml ParserError


def test_overrides_that_are_not_strings_in_a_list_are_config_errors():
    with pytest.raises(ConfigError, match="override 3: expected key=value"):
        parse_config({}, [3])  # was a TypeError
    with pytest.raises(ConfigError, match="not a list"):
        parse_config({}, "trainer.steps=3")


def test_file_that_is_not_utf8_or_is_a_folder_names_the_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(b"seed: \xff")
    with pytest.raises(ConfigError, match="bad.yaml.*UTF-8"):
        load_config(bad)  # was a UnicodeDecodeError
    with pytest.raises(ConfigError, match=str(tmp_path)):
        load_config(tmp_path)  # was an IsADirectoryError


def test_a_key_with_a_line_break_is_named_on_one_line():
    with pytest.raises(ConfigError, match=r"unknown config key 'a\\nb'") as e:
        parse_config({"a\nb": 1})
    assert "\n" not in str(e.value)


def test_yaml_error_is_one_line_and_names_the_file(tmp_path):
    bad = tmp_path / "cut.yaml"
    bad.write_text("trainer: {steps: 3\n")
    with pytest.raises(ConfigError) as e:
        load_config(bad)
    assert "cut.yaml" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("text, why", [("[" * 5000, "nested too deeply"), ("seed: !!timestamp 2024-13-45", "month"),
                                       ("seed: " + "9" * 5000, "digits")])
def test_yaml_the_parser_cannot_build_is_a_config_error(tmp_path, text, why):
    bad = tmp_path / "c.yaml"
    bad.write_text(text)
    with pytest.raises(ConfigError, match=why):
        load_config(bad)  # were RecursionError / ValueError


def test_a_key_given_twice_is_an_error_not_the_last_one_wins(tmp_path):
    twice = tmp_path / "twice.yaml"
    twice.write_text("trainer:\n  steps: 4\ntrainer:\n  steps: 5\n")
    with pytest.raises(ConfigError, match="'trainer' given twice"):
        load_config(twice)
    merged = tmp_path / "merged.yaml"  # a YAML merge key overridden after it is not a duplicate
    merged.write_text("trainer:\n  <<: {steps: 4, lr: 0.5}\n  steps: 6\n")
    cfg = load_config(merged)
    assert cfg.trainer.steps == 6 and cfg.trainer.lr == 0.5


@pytest.mark.parametrize("key, value", [("buffer.l2_min_reward_mean", ".nan"), ("trainer.wait_timeout_s", ".inf"),
                                        ("sampler.temperature", ".inf")])
def test_nan_and_inf_are_rejected_naming_the_field(key, value):
    with pytest.raises(ConfigError, match=f"{key}: Input should be a finite number"):
        parse_config({}, [f"{key}={value}"])


def test_integers_beyond_64_bits_are_rejected_and_the_message_still_prints():
    with pytest.raises(ConfigError, match="trainer.steps: an integer beyond 64 bits"):
        parse_config({"trainer": {"steps": 10**30}})  # was accepted; to_yaml then failed past 4300 digits
    with pytest.raises(ConfigError, match="trainer.lr: .*an integer of 16610 bits"):
        parse_config({"trainer": {"lr": 10**5000}})  # was a ValueError from repr() in the message


def test_negative_seed_is_rejected():
    with pytest.raises(ConfigError, match="seed: Input should be greater than or equal to 0"):
        parse_config({"seed": -1})


def test_vllm_engine_arguments_must_be_json_values():
    with pytest.raises(ConfigError, match="sampler.vllm.x: input was not a valid JSON value"):
        parse_config({"sampler": {"vllm": {"x": b"\xff"}}})  # was accepted; to_yaml then failed
    cfg = parse_config({"sampler": {"vllm": {"tensor_parallel_size": 2, "kv": {"dtype": "auto"}}}})
    _assert_usable(cfg)


def test_parse_config_leaves_the_callers_dict_as_it_was():
    data = {"trainer": {"steps": 4}}
    assert parse_config(data, ["trainer.steps=8"]).trainer.steps == 8
    assert data == {"trainer": {"steps": 4}}  # the override used to be written into it
