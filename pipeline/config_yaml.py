"""Reading config files and text: YAML that refuses duplicate keys, dotted `key=value` overrides, and bad
values shown on one short line. `pipeline.config` validates what these return."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """A bad config value; the message is one line naming the field and the fix."""


def one_line(text: str) -> str:
    """`text` with line breaks and other unprintable characters (of a key, say) escaped."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def show_value(value: Any) -> str:
    """repr of a bad value, cut to one short line (an int past 4300 digits has no repr at all)."""
    try:
        text = repr(value)
    except ValueError:
        return f"an integer of {value.bit_length()} bits" if isinstance(value, int) else \
            f"a {type(value).__name__} holding an integer past 4300 digits"
    return text if len(text) <= 200 else text[:200] + "..."


_CORE = "tag:yaml.org,2002:"
_OLD_SCALARS = {_CORE + t for t in ("bool", "int", "float", "null", "timestamp")}


def _core_int(loader, node) -> int:
    text = loader.construct_scalar(node)
    sign, digits = (-1, text[1:]) if text[0] == "-" else (1, text.lstrip("+"))
    base = {"0o": 8, "0x": 16}.get(digits[:2], 10)
    return sign * int(digits[2:] if base != 10 else digits, base)


def _core_float(loader, node) -> float:
    text = loader.construct_scalar(node).lower()
    return float(text.replace(".inf", "inf").replace(".nan", "nan"))


class _YamlLoader(yaml.SafeLoader):
    """safe_load, except that a key given twice in one mapping is an error, not the last one wins,
    and that plain scalars resolve as in YAML 1.2's core schema (what JSON and most tools read):
    `5e-4` is a float, `010` is 10, `1:30` and `2026-11-08` stay strings, only true/false are
    booleans. PyYAML's YAML 1.1 made them a string, 8, 90, a date, and yes/no/on/off booleans."""

    yaml_implicit_resolvers = {
        first: [(tag, rx) for tag, rx in resolvers if tag not in _OLD_SCALARS]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key, _ in node.value:
            if isinstance(key, yaml.ScalarNode):
                if (key.tag, key.value) in seen:
                    raise yaml.constructor.ConstructorError(None, None, f"key {key.value!r} given twice",
                                                            key.start_mark)
                seen.add((key.tag, key.value))
        return super().construct_mapping(node, deep)


_YamlLoader.add_implicit_resolver(_CORE + "bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
_YamlLoader.add_implicit_resolver(_CORE + "null", re.compile(r"^(?:~|null|Null|NULL|)$"), ["~", "n", "N", ""])
_YamlLoader.add_implicit_resolver(_CORE + "int", re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$"),
                                  list("-+0123456789"))
_YamlLoader.add_implicit_resolver(
    _CORE + "float", re.compile(r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?"
                                r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"), list("-+.0123456789"))
_YamlLoader.add_constructor(_CORE + "int", _core_int)
_YamlLoader.add_constructor(_CORE + "float", _core_float)


class _Dumper(yaml.SafeDumper):
    """safe_dump that quotes a string that YAML 1.1 or 1.2 would read as something else (`1e3`,
    `0o17`, `yes`), so that a run's config.yaml reads back the same with either."""

    yaml_implicit_resolvers = {k: list(v) for k, v in yaml.SafeDumper.yaml_implicit_resolvers.items()}


for _first, _resolvers in _YamlLoader.yaml_implicit_resolvers.items():
    for _tag, _rx in _resolvers:
        if _tag in _OLD_SCALARS:
            _Dumper.yaml_implicit_resolvers.setdefault(_first, []).append((_tag, _rx))


def dump_yaml(data: Any) -> str:
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False)


def load_yaml_text(text: str) -> Any:
    """YAML text as Python values; ValueError with a one-line reason when it is not valid YAML."""
    try:
        return yaml.load(text, Loader=_YamlLoader)
    except (yaml.YAMLError, ValueError) as e:  # ValueError: a bad date, an int past 4300 digits
        raise ValueError(" ".join(str(e).split())) from None
    except RecursionError:
        raise ValueError("nested too deeply") from None


def _coerce_override(raw: str) -> Any:
    return load_yaml_text(raw) if raw != "" else ""


def apply_overrides(data: dict, overrides: list[str] | None) -> dict:
    """Apply `a.b.c=value` overrides (values parsed as YAML) to a nested dict. A mapping given for
    a section merges into it, key by key as dotted keys would (`trainer={steps: 5}` sets steps and
    keeps the rest of the section; `trainer={}` changes nothing); any other value replaces what
    was there, a free-form mapping such as `sampler.vllm={}` too."""
    if not isinstance(overrides, (list, tuple, type(None))):
        raise ConfigError(f"overrides: {show_value(overrides)} is not a list; pass a list of key=value strings")
    for item in overrides or []:
        if not isinstance(item, str) or "=" not in item:
            raise ConfigError(f"override {show_value(item)}: expected key=value, e.g. trainer.steps=20")
        key, raw = item.split("=", 1)
        parts = key.strip().split(".")
        if not all(parts):
            raise ConfigError(f"override {show_value(item)}: {'no key before =' if not key.strip() else 'an empty key part'}; "
                              "expected key=value, e.g. trainer.steps=20")
        node = data
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: '{p}' is not a section")
        try:
            value = _coerce_override(raw)
        except ValueError as e:
            raise ConfigError(f"override {show_value(item)}: the value is not valid YAML ({e}); quote it") from None
        if len(parts) == 1 and isinstance(value, dict) and isinstance(node.get(parts[0]), dict):
            node[parts[0]].update(value)
        else:
            node[parts[-1]] = value
    return data


def read_config_file(path: str | Path) -> dict:
    """A config file's mapping of sections, not yet validated (the form merges its fields into it)."""
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"config file {str(path)!r} not found; pass a YAML file such as configs/tiny-grpo.yaml")
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {str(path)!r} cannot be read as UTF-8 text ({e}); "
                          "pass a YAML file such as configs/tiny-grpo.yaml") from None
    try:
        data = load_yaml_text(text) or {}
    except ValueError as e:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r}: top level must be a mapping of sections")
    return data
