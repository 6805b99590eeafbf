"""The trigger form of the RLHF DAGs and its translation into a validated run config.

Validation happens twice, on purpose. The JSON schema of each `Param` runs when a run is triggered
(a bad value is an HTTP 400 and no run is created). Airflow accepts unknown conf keys silently, and
a schema cannot express every rule of the engine, so `prepare` then rejects unknown keys and runs
the result through the engine's one config loader (`pipeline.config.parse_config`), whose errors
name the field and the fix.

Form fields left empty (null) keep the value of the base config file, or the engine default.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from airflow.sdk import Param

RUN_NAME_PATTERN = r"^([A-Za-z0-9][A-Za-z0-9._-]{0,127})?$"
CONFIG_FILE_PATTERN = r"^([A-Za-z0-9][A-Za-z0-9_.-]*\.ya?ml)?$"
RUNS_ROOT_ENV = "RLHF_RUNS_ROOT"
CONFIGS_DIR_ENV = "RLHF_CONFIGS_DIR"
STORAGE_PROTOCOLS = ("file", "local", "s3", "s3a", "gs", "gcs", "abfs", "az", "hdfs")

# form field -> dotted config key
FIELD_TO_CONFIG = {
    "model_path": "model.path",
    "dataset": "data.train",
    "eval_dataset": "data.eval",
    "reward": "reward.fn",
    "algorithm": "trainer.algorithm",
    "steps": "trainer.steps",
    "phases": "trainer.phases",
    "replay_epochs": "trainer.replay_epochs",
    "sampler_backend": "sampler.backend",
    "seed": "seed",
}


def _nullable(kind: str, **schema: Any) -> dict:
    return {"type": ["null", kind], **schema}


def run_params(*, with_dataset: bool = True) -> dict[str, Param]:
    """The trigger form. `with_dataset=False` for DAGs that choose their prompts themselves."""
    params = {
        "config_file": Param("", type="string", pattern=CONFIG_FILE_PATTERN, title="Base config",
                             description="A YAML file of the project's configs/ folder (e.g. tiny-grpo.yaml); "
                                         "empty = engine defaults"),
        "model_path": Param(None, **_nullable("string", minLength=1), title="Model",
                            description="Hugging Face model folder or fsspec URL, or builtin:<task>"),
        "dataset": Param(None, **_nullable("string", minLength=1), title="Training prompts",
                         description="Parquet file/URL in verl's columns, or builtin:<task>"),
        "eval_dataset": Param(None, **_nullable("string", minLength=1), title="Held-out prompts"),
        "reward": Param(None, **_nullable("string", minLength=1), title="Reward",
                        description="Registered reward name or path/to/file.py:function (verl signature)"),
        "algorithm": Param(None, type=["null", "string"], enum=[None, "grpo"], title="Algorithm"),
        "steps": Param(None, **_nullable("integer", minimum=1, maximum=1_000_000), title="Optimizer steps"),
        "phases": Param(None, **_nullable("integer", minimum=1, maximum=1000), title="Phases",
                        description="Checkpoint + reshard boundaries over the run"),
        "replay_epochs": Param(None, **_nullable("integer", minimum=0, maximum=100), title="Replay epochs",
                               description="Epochs replayed from L2, each opened by a replay-gate sensor"),
        "sampler_backend": Param(None, type=["null", "string"], enum=[None, "hf", "vllm"], title="Sampler backend"),
        "seed": Param(None, **_nullable("integer", minimum=0), title="Seed"),
        "storage_url": Param("", type="string", maxLength=1000, title="Runs root",
                             description="fsspec URL under which run directories are created "
                                         f"(empty = ${RUNS_ROOT_ENV} of the deployment)"),
        "run_name": Param("", type="string", pattern=RUN_NAME_PATTERN, title="Run name",
                          description="Run directory name; empty = derived from the DAG run"),
        "overrides": Param({}, type="object", title="Config overrides",
                           description='Further config keys, dotted: {"trainer.lr": 0.001, "sampler.group_size": 8}'),
    }
    if not with_dataset:
        del params["dataset"]
    return params


def configs_dir() -> Path:
    return Path(os.environ.get(CONFIGS_DIR_ENV) or Path(__file__).resolve().parents[1] / "configs")


def runs_root(storage_url: str) -> str:
    """The validated root URL for run directories."""
    root = (storage_url or os.environ.get(RUNS_ROOT_ENV) or os.path.abspath("runs")).rstrip("/")
    if "://" in root:
        protocol = root.split("://", 1)[0]
        if protocol not in STORAGE_PROTOCOLS:
            raise ValueError(f"storage_url: protocol {protocol!r} is not supported; use one of "
                             f"{', '.join(STORAGE_PROTOCOLS)}")
        if protocol in ("file", "local") and not root.split("://", 1)[1].startswith("/"):
            raise ValueError(f"storage_url: {root!r} must be an absolute path")
    elif not root.startswith("/"):
        raise ValueError(f"storage_url: {root!r} must be an absolute path or an fsspec URL")
    return root


def run_name_from(dag_id: str, airflow_run_id: str) -> str:
    """A path-safe run directory name for a DAG run (Airflow run ids hold ':' and '+')."""
    return (re.sub(r"[^A-Za-z0-9._-]+", "-", f"{dag_id}-{airflow_run_id}").strip("-.")[:128]).replace("..", ".")


def check_conf_keys(conf: dict, params: dict) -> None:
    unknown = sorted(set(conf or {}) - set(params))
    if unknown:
        raise ValueError(f"unknown parameter(s) {', '.join(unknown)}; valid parameters: {', '.join(sorted(params))}")


def config_dict(params: dict) -> dict:
    """Base config file + form fields + overrides, as a nested dict (not validated yet)."""
    import yaml

    from pipeline.config import apply_overrides

    data: dict = {}
    name = params.get("config_file") or ""
    if name:
        if not re.match(CONFIG_FILE_PATTERN, name):
            raise ValueError(f"config_file: {name!r} is not a file name of the configs/ folder")
        path = configs_dir() / name
        if not path.is_file():
            choices = ", ".join(sorted(p.name for p in configs_dir().glob("*.y*ml")))
            raise ValueError(f"config_file: {name!r} not found in {configs_dir()}; choose one of: {choices}")
        data = yaml.safe_load(path.read_text()) or {}
    sets = [f"{key}={_yaml_scalar(params[f])}" for f, key in FIELD_TO_CONFIG.items() if params.get(f) is not None]
    overrides = params.get("overrides") or {}
    if not isinstance(overrides, dict):
        raise ValueError("overrides: expected an object of dotted config keys, e.g. {\"trainer.lr\": 0.001}")
    sets += [f"{k}={_yaml_scalar(v)}" for k, v in overrides.items()]
    return apply_overrides(data, sets)


def _yaml_scalar(value: Any) -> str:
    import json

    # JSON is valid YAML: strings stay strings ("007" is not read back as 7), lists stay lists.
    return json.dumps(value)


def build_config(params: dict, conf: dict | None, run_name: str):
    """Validated RunConfig for this DAG run; raises pipeline.config.ConfigError or ValueError."""
    from pipeline.config import parse_config, validate_run_id

    check_conf_keys(conf or {}, params)
    data = config_dict(params)
    data["run_id"] = validate_run_id(run_name)
    return parse_config(data)
