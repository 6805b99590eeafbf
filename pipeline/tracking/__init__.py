"""Experiment trackers: TensorBoard, MLflow and W&B views of the trainer's metrics.

The JSONL streams in `metrics/` stay the record of a run (pipeline.metrics); a tracker mirrors the
same namespaced keys (`reward/mean`, `actor/kl`, `staleness/mean`, ...) at the same `step`, so
curves read the same everywhere. The trainer always holds a `Tracker`: the do-nothing base when
`tracking.backends` is empty, so the loop never asks whether logging is on.

One tracker run per training run, found again by its key (`backends.run_key`: the run directory's
URL and first preparation): the trainer opens it (and reopens it
after a restart: MLflow by the `rlhf.run_key` tag, W&B by an id derived from the run id and that key,
TensorBoard by its folder, purging the steps the resumed trainer redoes), and `finalize` reopens it
to log the held-out evaluations at the steps of the versions it scored (`eval/score` at step K for
policy version K). Tracker libraries are imported only when a backend is chosen; a missing one is
a ConfigError naming the extra to install. A tracker that cannot be opened or fails while logging
(a tracking server that is down or went away) logs a warning and is dropped; training goes on.
MLflow's client gives up on a server that does not answer after one retry (`MLFLOW_CLIENT_ENV`).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os

from ..config import ConfigError, RunConfig
from ..storage import is_local

log = logging.getLogger("rlhf.tracking")
RUN_NAME_ENV = "RLHF_RUN_NAME"
# backend -> (module that must import, pip extra that installs it)
REQUIREMENTS = {"tensorboard": ("tensorboard", "tensorboard"), "mlflow": ("mlflow", "mlflow"),
                "wandb": ("wandb", "wandb")}


class Tracker:
    """A tracker run. This base does nothing: it is what the trainer holds when tracking is off."""

    name = "none"

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Scalars `metrics` (namespaced keys) at trainer step `step`."""

    def close(self, ok: bool = True) -> None:
        """Flush and end the run (`ok=False`: the process is failing)."""


class Trackers(Tracker):
    """Several backends behind one Tracker. A backend that raises is dropped with a warning."""

    name = "trackers"

    def __init__(self, backends: list[Tracker]):
        self.backends = backends

    def log(self, metrics: dict[str, float], step: int) -> None:
        for b in list(self.backends):
            try:
                b.log(metrics, step)
            except Exception as e:  # a tracker outage must not stop a training run
                log.warning("tracker %s failed (%s: %s); it is off for the rest of this process",
                            b.name, type(e).__name__, e)
                self.backends.remove(b)

    def close(self, ok: bool = True) -> None:
        for b in self.backends:
            try:
                b.close(ok)
            except Exception as e:
                log.warning("tracker %s did not close cleanly: %s", b.name, e)
        self.backends = []


def scalars(record: dict) -> dict[str, float]:
    """The numeric entries of a metrics record, without its `step` (the tracker's x axis)."""
    return {k: float(v) for k, v in record.items()
            if k != "step" and isinstance(v, (int, float)) and v == v and abs(v) != float("inf")}


def require(backend: str) -> None:
    """ConfigError unless the library of `backend` is installed."""
    module, extra = REQUIREMENTS[backend]
    if importlib.util.find_spec(module) is None:
        raise ConfigError(f"tracking.backends: {backend} needs the {module!r} package; install it with "
                          f"pip install 'rlhf-pipeline[{extra}]' (or [tracking] for every tracker), or remove "
                          f"{backend} from tracking.backends")


def tracking_dir(run, cfg: RunConfig) -> str:
    """The local folder of tracker files: tracking.dir, else <run_dir>/tracking on local disk, else
    ./tracking/<run_id> (TensorBoard and W&B write local files only)."""
    if cfg.tracking.dir:
        return os.path.abspath(os.path.expanduser(cfg.tracking.dir))
    if is_local(run.fs):
        return run.path("tracking")
    return os.path.abspath(os.path.join("tracking", run.run_id))


def run_name(run, cfg: RunConfig) -> str:
    return cfg.tracking.run_name or os.environ.get(RUN_NAME_ENV) or run.run_id


def config_params(cfg: RunConfig) -> dict[str, str]:
    """The config as flat `section.key` strings (MLflow params)."""
    out: dict[str, str] = {}

    def walk(prefix: str, node) -> None:
        if isinstance(node, dict) and node:
            for k, v in node.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        else:
            out[prefix] = node if isinstance(node, str) else json.dumps(node)

    walk("", cfg.model_dump(mode="json"))
    return out


def open_tracker(run, cfg: RunConfig | None = None, *, resumed_step: int | None = None) -> Tracker:
    """The tracker run of `run` (the do-nothing Tracker when tracking.backends is empty).
    `resumed_step`: the trainer's step at start; TensorBoard drops what earlier sessions logged
    after it. None (evaluation): append only."""
    cfg = cfg or run.config()
    if not cfg.tracking.backends:
        return Tracker()
    for b in cfg.tracking.backends:
        require(b)
    from . import backends

    folder = tracking_dir(run, cfg)
    os.makedirs(folder, exist_ok=True)
    opened: list[Tracker] = []
    try:
        for b in cfg.tracking.backends:
            try:
                opened.append(backends.OPENERS[b](run, cfg, folder, resumed_step))
            except Exception as e:  # a tracking server that is down must not stop the run
                log.warning("tracker %s could not be opened (%s: %s); this process goes on without it",
                            b, type(e).__name__, e)
    except BaseException:
        Trackers(opened).close(ok=False)
        raise
    log.info("tracking %s as %r with %s (files in %s)", run.run_id, run_name(run, cfg),
             ", ".join(cfg.tracking.backends), folder)
    return Trackers(opened)


def log_evaluations(run, results: dict[int, dict], backends: list[str] | None = None) -> bool:
    """Held-out evaluations {policy version: result}, as `eval/<key>` at step = version, to the
    `backends` given (default: the run's). A tracker that cannot be reached costs a warning, not
    the run's finalize step. Returns whether every one of them took them all."""
    cfg = run.config()
    if backends is not None:
        cfg = cfg.model_copy(update={"tracking": cfg.tracking.model_copy(update={"backends": list(backends)})})
    if not cfg.tracking.backends or not results:
        return True
    try:
        tracker = open_tracker(run, cfg)
    except Exception as e:
        log.warning("evaluations %s not sent to the trackers: %s: %s", sorted(results), type(e).__name__, e)
        return False
    try:
        for version, result in sorted(results.items()):
            tracker.log({f"eval/{k}": v for k, v in scalars(result).items()}, step=int(version))
        return len(getattr(tracker, "backends", ())) == len(cfg.tracking.backends)
    finally:
        tracker.close()


def send_evaluations(run, evals: dict[str, dict], versions: list[int]) -> None:
    """Send each tracker the evaluations of `versions` (eval.json's) it has not taken yet, as
    `eval_tracked.json` records per backend: a finalize retried after an attempt that evaluated
    and failed before sending, or whose tracker was down, sends them; none is sent twice."""
    cfg = run.config()
    sent = (run.read_json("eval_tracked.json", {}) or {}).get("sent", {})
    for backend in cfg.tracking.backends:
        todo = {v: evals[str(v)] for v in versions if v not in sent.get(backend, [])}
        if todo and log_evaluations(run, todo, [backend]):
            sent[backend] = sorted(set(sent.get(backend, [])) | set(todo))
            run.write_json("eval_tracked.json", {"sent": sent})
