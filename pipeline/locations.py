"""Names and locations a user gives, checked before they are used: names that end up in paths
(run ids, sampler and writer ids) and the locations of inputs (model folders, datasets)."""

from __future__ import annotations

import re
from contextlib import contextmanager

from .config_yaml import ConfigError

NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")  # fullmatch: `$` would let a trailing newline through


def validate_name(value: str, field: str, max_len: int = 128) -> str:
    """Names that end up in paths (run ids, sampler and writer ids): [A-Za-z0-9._-], starting
    with a letter or digit, no '..', at most `max_len` characters."""
    if not isinstance(value, str) or not NAME_RE.fullmatch(value) or len(value) > max_len or ".." in value:
        raise ConfigError(
            f"{field}: invalid value {value!r}; use 1-{max_len} characters from [A-Za-z0-9._-], "
            "starting with a letter or digit, without '..'"
        )
    return value


def validate_run_id(run_id: str) -> str:
    return validate_name(run_id, "run_id")


# Where runs and their inputs may live: local paths and these fsspec protocols. Not http(s)://,
# hf://, ftp://, github:// and the like: nothing is downloaded at run time, and a value typed into
# the trigger form cannot make a worker request some other host. (memory://, the in-process store,
# for inputs only.)
STORAGE_PROTOCOLS = ("file", "local", "s3", "s3a", "gs", "gcs", "abfs", "az", "hdfs")
INPUT_PROTOCOLS = STORAGE_PROTOCOLS + ("memory",)


def validate_input_url(value: str, builtin: bool = True) -> str:
    """A model folder or dataset location: `builtin:<task>` (when `builtin`), a path, or a URL of
    one of INPUT_PROTOCOLS (not fsspec's chained `a::b` URLs)."""
    if builtin and value.startswith("builtin:"):
        return value
    return _in_store(value, INPUT_PROTOCOLS)


def validate_run_location(value: str) -> str:
    """A run directory or runs root: a path or a URL of one of STORAGE_PROTOCOLS (every process of
    the run reaches it; memory:// lives in one process only)."""
    return _in_store(value, STORAGE_PROTOCOLS)


def _in_store(value: str, protocols: tuple[str, ...]) -> str:
    protocol = value.split("://", 1)[0] if "://" in value else None
    if "::" in value or (protocol is not None and protocol not in protocols):
        raise ConfigError(f"{value!r} is not a path or a URL of a supported store; use a path or a URL of one of "
                          f"{', '.join(protocols)}")
    return value


@contextmanager
def reaching(field: str, url: str):
    """Errors of reaching the store of an input (a filesystem package not installed, missing
    credentials, an unreachable endpoint) as a ConfigError naming the config field and the URL."""
    try:
        yield
    except ConfigError:
        raise
    except ImportError as e:
        raise ConfigError(f"{field}: reading {url!r} needs a package that is not installed ({e})") from None
    except Exception as e:  # noqa: BLE001 - the store's own error, quoted
        raise ConfigError(f"{field}: cannot read {url!r}: {type(e).__name__}: {e}") from None
