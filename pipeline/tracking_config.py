"""The `tracking:` section of a run config: which experiment trackers mirror the metrics streams.

Its own module because `pipeline/config.py` is near its size limit; `RunConfig.tracking` refers to
it. The JSONL streams in `metrics/` are always written and stay the record; trackers are extra
views of the same keys (see pipeline.tracking).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

BACKENDS = ("tensorboard", "mlflow", "wandb")


class TrackingConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True,
                              allow_inf_nan=False)

    backends: list[Literal["tensorboard", "mlflow", "wandb"]] = Field(default_factory=list)
    """Experiment trackers fed with the trainer's metrics and the held-out evaluations: any of tensorboard, mlflow, wandb (each an extra to install: pip install 'rlhf-pipeline[tracking]'). Empty: the JSONL metrics only."""
    dir: str | None = None
    """Local folder for tracker files (TensorBoard event files, the default MLflow store, W&B offline runs); empty: <run_dir>/tracking when the run directory is on local disk, else ./tracking/<run_id>."""
    mlflow_uri: str | None = None
    """MLflow tracking URI (http://host:5000, sqlite:///mlflow.db, ...); empty: a file store in <tracking dir>/mlruns."""
    project: str = Field("rlhf", min_length=1, max_length=128)
    """W&B project and MLflow experiment the run is logged under."""
    run_name: str | None = Field(None, min_length=1, max_length=256)
    """Display name of the tracker run; empty: $RLHF_RUN_NAME (set by the Airflow operators to the DAG run) or the run id."""

    @field_validator("backends")
    @classmethod
    def _unique(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v):
            raise ValueError(f"{v} names a backend twice; list each of {', '.join(BACKENDS)} at most once")
        return v
