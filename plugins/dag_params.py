"""The trigger form of the RLHF DAGs and its translation into a validated run config.

Validation happens twice, on purpose. The JSON schema of each `Param` runs when a run is triggered
(a bad value is an HTTP 400 and no run is created). Airflow accepts unknown conf keys silently, and
a schema cannot express every rule of the engine, so `prepare` then rejects unknown keys and runs
the result through the engine's one config loader (`pipeline.config.parse_config`), whose errors
name the field and the fix.

The config fields of the form are generated from RunConfig's JSON schema (types, bounds, enums,
the field docstrings as descriptions): `CONFIG_FIELDS` only names them. Form fields left empty
(null) keep the value of the base config file, or the engine default.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from pathlib import Path
from typing import Any, NamedTuple

from airflow.sdk import Param

from plugins.local.folders import configs_folder

RUN_NAME_PATTERN = r"^([A-Za-z0-9][A-Za-z0-9._-]{0,127})?$"
CONFIG_FILE_PATTERN = r"^([A-Za-z0-9][A-Za-z0-9_.-]*\.ya?ml)?$"
# Run directories go under $RLHF_RUNS_ROOT, or under one of the comma-separated URLs of
# $RLHF_ALLOWED_STORAGE_ROOTS (set by the deployment's admin); the form's storage_url picks one.
RUNS_ROOT_ENV = "RLHF_RUNS_ROOT"
ALLOWED_ROOTS_ENV = "RLHF_ALLOWED_STORAGE_ROOTS"
# At trigger time (HTTP 400): no '..' segment (also as %2e), no backslash, no control character.
# Where a root may be is checked in `runs_root`, when prepare runs.
STORAGE_URL_PATTERN = r"^(?!(.*/)?(\.|%2[eE]){2}(/|$))[^\x00-\x1f\\]*$"
CONFIGS_DIR_ENV = "RLHF_CONFIGS_DIR"

class ConfigField(NamedTuple):
    key: str    # dotted RunConfig key
    title: str  # the form's label


# The config fields the form offers. Everything else the form says about a field (type, bounds,
# enum, description) is read from RunConfig's JSON schema by `config_param`, so one line here
# exposes a field and the form cannot drift from the config. Other keys go through `overrides`.
CONFIG_FIELDS: dict[str, ConfigField] = {
    "model_path": ConfigField("model.path", "Model"),
    "dataset": ConfigField("data.train", "Training prompts"),
    "eval_dataset": ConfigField("data.eval", "Held-out prompts"),
    "reward": ConfigField("reward.fn", "Reward"),
    "algorithm": ConfigField("trainer.algorithm", "Algorithm"),
    "steps": ConfigField("trainer.steps", "Optimizer steps"),
    "phases": ConfigField("trainer.phases", "Phases"),
    "replay_epochs": ConfigField("trainer.replay_epochs", "Replay epochs"),
    "lr": ConfigField("trainer.lr", "Learning rate"),
    "groups_per_step": ConfigField("trainer.groups_per_step", "Groups per step"),
    "sampler_backend": ConfigField("sampler.backend", "Sampler backend"),
    "group_size": ConfigField("sampler.group_size", "Group size"),
    "max_new_tokens": ConfigField("sampler.max_new_tokens", "Max new tokens"),
    "sampler_replicas": ConfigField("sampler.replicas", "Samplers"),
    "trainer_nodes": ConfigField("trainer.nnodes", "Trainer nodes"),
    "seed": ConfigField("seed", "Seed"),
}
# JSON-schema keys of a config field that carry no constraint; any other key the form cannot
# translate (a nested model, a union) fails `config_param` when the DAG file is parsed.
_ANNOTATION_KEYS = ("title", "description", "default")


def config_field_schema(key: str, schema: dict | None = None) -> dict:
    """The JSON schema of the dotted config key `key`, from `RunConfig.model_json_schema()`."""
    from pipeline.config import RunConfig

    root = schema or RunConfig.model_json_schema()

    def deref(node: dict) -> dict:
        ref = node.get("$ref")
        if ref is None:
            return node
        target = root
        for part in ref.removeprefix("#/").split("/"):
            target = target[part]
        return {**target, **{k: v for k, v in node.items() if k != "$ref"}}

    node = root
    for i, part in enumerate(key.split(".")):
        props = deref(node).get("properties", {})
        if part not in props:
            raise ValueError(f"{key}: no config key {'.'.join(key.split('.')[:i + 1])!r}; "
                           f"choose one of {', '.join(props)}")
        node = props[part]
    return deref(node)


def config_param(key: str, title: str, schema: dict | None = None) -> Param:
    """A form field for config key `key`: null (= keep the base config's value) or a value the
    config accepts. Two form-only rules: integer bounds are written inclusive (the UI's number
    input reads only minimum/maximum; for integers `> 0` is `>= 1`), and a string may not be empty
    (empty means null)."""
    field = dict(config_field_schema(key, schema))
    options = [s for s in field.pop("anyOf", []) if s != {"type": "null"}]
    if len(options) == 1:  # `X | None` in the config: the form is nullable anyway
        field.update(options[0])
    elif options:
        raise ValueError(f"{key}: a union type cannot be a form field; set it through overrides")
    spec = {k: v for k, v in field.items() if k not in _ANNOTATION_KEYS}
    if "type" not in spec or "$ref" in spec or "properties" in spec:
        raise ValueError(f"{key}: {spec} cannot be a form field; set it through overrides")
    kind = spec["type"]
    if kind == "integer":
        if "exclusiveMinimum" in spec:
            spec["minimum"] = math.floor(spec.pop("exclusiveMinimum")) + 1
        if "exclusiveMaximum" in spec:
            spec["maximum"] = math.ceil(spec.pop("exclusiveMaximum")) - 1
    if kind == "string" and "enum" not in spec and "const" not in spec:
        spec.setdefault("minLength", 1)
    spec["type"] = ["null", *(kind if isinstance(kind, list) else [kind])]
    if "const" in spec:
        spec["enum"] = [spec.pop("const")]
    if "enum" in spec:
        spec["enum"] = [None, *spec["enum"]]
    about = field.get("description", "").strip()
    empty = "Empty = the base config's value" + (
        f" (engine default: {json.dumps(field['default'])})." if "default" in field else ".")
    return Param(None, **spec, title=title, description=f"{about} {empty}".strip())


def run_params(*, with_dataset: bool = True) -> dict[str, Param]:
    """The trigger form. `with_dataset=False` for DAGs that choose their prompts and name their run
    directories themselves (the retrain DAG: one per date), so the form offers neither."""
    from pipeline.config import RunConfig

    schema = RunConfig.model_json_schema()
    fields = {name: config_param(f.key, f.title, schema) for name, f in CONFIG_FIELDS.items()
              if with_dataset or name != "dataset"}
    return {
        "config_file": Param("", type="string", pattern=CONFIG_FILE_PATTERN, title="Base config",
                             description="A YAML file of the project's configs/ folder (e.g. tiny-grpo.yaml); "
                                         "empty = engine defaults"),
        **fields,
        "storage_url": Param("", type="string", maxLength=1000, pattern=STORAGE_URL_PATTERN, title="Runs root",
                             description="fsspec URL under which run directories are created "
                                         f"(empty = ${RUNS_ROOT_ENV} of the deployment); it must lie under "
                                         f"${RUNS_ROOT_ENV} or a root of ${ALLOWED_ROOTS_ENV}"),
        **({"run_name": Param("", type="string", pattern=RUN_NAME_PATTERN, title="Run name",
                              description="Run directory name; empty = derived from the DAG run")}
           if with_dataset else {}),
        "overrides": Param({}, type="object", title="Config overrides",
                           description='Further config keys, dotted: {"trainer.kl_coef": 0.01, "sampler.temperature": 0.8}'),
    }


def configs_dir() -> Path:
    """$RLHF_CONFIGS_DIR, else the configs/ folder installed with the project."""
    return Path(os.environ.get(CONFIGS_DIR_ENV) or configs_folder())


def runs_root(storage_url: str) -> str:
    """The validated root URL for run directories: empty = the deployment's runs root; anything
    else must lie under one of `allowed_roots()`. This is the authoritative check (a trigger can
    bypass the form's pattern only to fail here); both DAGs' prepare tasks call it first."""
    roots = allowed_roots()
    if not storage_url:
        return roots[0]
    root = storage_root(storage_url, "storage_url")
    from pipeline.rundir import url_is_under

    if not any(url_is_under(root, allowed) for allowed in roots):
        raise ValueError(f"storage_url: {root!r} is outside the storage roots this deployment allows "
                         f"({', '.join(roots)}); leave it empty for ${RUNS_ROOT_ENV} or choose a folder under "
                         f"one of them (an admin adds roots to ${ALLOWED_ROOTS_ENV}, comma-separated)")
    return root


def allowed_roots() -> list[str]:
    """$RLHF_RUNS_ROOT (default: `runs` in the working folder), then the roots of
    $RLHF_ALLOWED_STORAGE_ROOTS."""
    roots = [storage_root(os.environ.get(RUNS_ROOT_ENV) or os.path.abspath("runs"), RUNS_ROOT_ENV)]
    extra = os.environ.get(ALLOWED_ROOTS_ENV) or ""
    return roots + [storage_root(r.strip(), ALLOWED_ROOTS_ENV) for r in extra.split(",") if r.strip()]


def storage_root(url: str, field: str) -> str:
    """`url` without a trailing '/', if it is an absolute path or a URL of a supported store and
    has no '..' segment; `field` names where the value came from in the error."""
    from pipeline.config import ConfigError
    from pipeline.locations import validate_run_location
    from pipeline.rundir import validate_run_url

    root = url.rstrip("/") or "/"
    try:
        validate_run_location(root)
    except ConfigError as e:
        raise ValueError(f"{field}: {e}") from None
    if "://" in root:
        protocol = root.split("://", 1)[0]
        if protocol in ("file", "local") and not root.split("://", 1)[1].startswith("/"):
            raise ValueError(f"{field}: {root!r} must be an absolute path")
    elif not root.startswith("/"):
        raise ValueError(f"{field}: {root!r} must be an absolute path or an fsspec URL")
    return validate_run_url(root, field)


def run_name_from(dag_id: str, airflow_run_id: str) -> str:
    """A path-safe run directory name for a DAG run (Airflow run ids hold ':' and '+'; no '..').
    One cut to 128 characters ends with a hash of the whole id, so two long run ids that share a
    prefix get two directories."""
    full = f"{dag_id}-{airflow_run_id}"
    name = re.sub(r"\.{2,}", ".", re.sub(r"[^A-Za-z0-9._-]+", "-", full)).lstrip("-._").rstrip("-.")
    if len(name) > 128:
        name = name[:119].rstrip("-.") + "-" + hashlib.sha256(full.encode()).hexdigest()[:8]
    return name


def check_conf_keys(conf: dict, params: dict) -> None:
    unknown = sorted(set(conf or {}) - set(params))
    if unknown:
        raise ValueError(f"unknown parameter(s) {', '.join(unknown)}; valid parameters: {', '.join(sorted(params))}")


def config_dict(params: dict) -> dict:
    """Base config file + form fields + overrides, as a nested dict (not validated yet)."""
    from pipeline.config import read_config_file
    from pipeline.config_yaml import apply_overrides

    data: dict = {}
    name = params.get("config_file") or ""
    if name:
        if not re.match(CONFIG_FILE_PATTERN, name):
            raise ValueError(f"config_file: {name!r} is not a file name of the configs/ folder")
        path = configs_dir() / name
        if not path.is_file():
            choices = ", ".join(sorted(p.name for p in configs_dir().glob("*.y*ml")))
            raise ValueError(f"config_file: {name!r} not found in {configs_dir()}; choose one of: {choices}")
        data = read_config_file(path)
    sets = [f"{field.key}={_yaml_scalar(params[name])}" for name, field in CONFIG_FIELDS.items()
            if params.get(name) is not None]
    overrides = params.get("overrides") or {}
    if not isinstance(overrides, dict):
        raise ValueError("overrides: expected an object of dotted config keys, e.g. {\"trainer.lr\": 0.001}")
    sets += [f"{k}={_yaml_scalar(v)}" for k, v in _dotted(overrides)]
    return apply_overrides(data, sets)


def _dotted(overrides: dict, prefix: str = ""):
    """(dotted key, value) of an overrides object; a nested object ({"trainer": {"kl_coef": 0.01}})
    sets its keys one by one, merged into the section as a dotted key would be, not replacing it."""
    for k, v in overrides.items():
        if isinstance(v, dict) and v:
            yield from _dotted(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def _yaml_scalar(value: Any) -> str:
    # JSON is valid YAML: strings stay strings ("007" is not read back as 7), lists stay lists.
    return json.dumps(value)


def build_config(params: dict, conf: dict | None, run_name: str):
    """Validated RunConfig for this DAG run; raises pipeline.config.ConfigError or ValueError."""
    from pipeline.config import parse_config
    from pipeline.locations import validate_run_id

    check_conf_keys(conf or {}, params)
    data = config_dict(params)
    data["run_id"] = validate_run_id(run_name)
    return parse_config(data)
