"""Reading config files and text: YAML that refuses duplicate keys, dotted `key=value` overrides, and bad
values shown on one short line. `pipeline.config` validates what these return."""

from __future__ import annotations

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


class _YamlLoader(yaml.SafeLoader):
    """safe_load, except that a key given twice in one mapping is an error, not the last one wins."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key, _ in node.value:
            if isinstance(key, yaml.ScalarNode):
                if (key.tag, key.value) in seen:
                    raise yaml.constructor.ConstructorError(None, None, f"key {key.value!r} given twice",
                                                            key.start_mark)
                seen.add((key.tag, key.value))
        return super().construct_mapping(node, deep)


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
    """Apply `a.b.c=value` overrides (values parsed as YAML scalars) to a nested dict."""
    if not isinstance(overrides, (list, tuple, type(None))):
        raise ConfigError(f"overrides: {show_value(overrides)} is not a list; pass a list of key=value strings")
    for item in overrides or []:
        if not isinstance(item, str) or "=" not in item:
            raise ConfigError(f"override {show_value(item)}: expected key=value, e.g. trainer.steps=20")
        key, raw = item.split("=", 1)
        parts = key.strip().split(".")
        node = data
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: '{p}' is not a section")
        try:
            node[parts[-1]] = _coerce_override(raw)
        except ValueError as e:
            raise ConfigError(f"override {show_value(item)}: the value is not valid YAML ({e}); quote it") from None
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
