"""The tracker backends: TensorBoard event files, an MLflow run, a W&B run.

Imported only when a backend is chosen (pipeline.tracking.open_tracker checks the libraries
first). Each logs the scalars it is given at the trainer's step, and attaches the run's frozen
config once, when its run is created.
"""

from __future__ import annotations

import hashlib
import os
import time

from . import Tracker, config_params, run_name

WANDB_ID_MAX = 64  # W&B run ids: at most 64 characters


class TensorBoardTracker(Tracker):
    """Event files in <tracking dir>/tensorboard. A resumed trainer writes a new file whose first
    event purges, for TensorBoard's readers, what the earlier sessions logged after the resumed step."""

    name = "tensorboard"

    def __init__(self, run, cfg, folder: str, resumed_step: int | None):
        from torch.utils.tensorboard import SummaryWriter

        purge = None if resumed_step is None else resumed_step + 1
        self.writer = SummaryWriter(log_dir=os.path.join(folder, "tensorboard"), purge_step=purge, flush_secs=30)
        if resumed_step == 0:
            self.writer.add_text("config", "```\n" + cfg.to_yaml() + "\n```", 0)

    def log(self, metrics: dict[str, float], step: int) -> None:
        for k, v in metrics.items():
            self.writer.add_scalar(k, v, step)

    def close(self, ok: bool = True) -> None:
        self.writer.close()


# A tracking server that is down: MLflow's own defaults (7 retries with backoff, 120 s timeout)
# hold a call, on the training thread, for about 4 minutes. These give up after one retry: within
# seconds when the connection is refused, about 10 s when nothing answers; the tracker is then
# dropped and training goes on. The user's environment wins.
MLFLOW_CLIENT_ENV = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                     "MLFLOW_HTTP_REQUEST_TIMEOUT": "5"}


def _mlflow_uri(cfg, folder: str) -> str:
    uri = cfg.tracking.mlflow_uri or "file://" + os.path.join(folder, "mlruns")
    if uri.startswith("file:") or "://" not in uri:
        # MLflow 3 refuses file stores unless asked; a local folder is what a laptop run wants
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    for k, v in MLFLOW_CLIENT_ENV.items():
        os.environ.setdefault(k, v)
    return uri


def _artifact_root(uri: str) -> str | None:
    """Where a new experiment keeps its artifacts: beside the database of a `sqlite:` URI (MLflow
    would take ./mlruns in the working directory of whichever process creates it); None (the
    store's or the server's default) otherwise."""
    if not uri.startswith("sqlite:///"):
        return None
    db = uri[len("sqlite:///"):].split("?", 1)[0]
    return "file://" + os.path.join(os.path.dirname(os.path.abspath(db)), "mlartifacts")


def run_key(run) -> str:
    """This run directory's own tracker run: its URL and when it was first prepared. The same
    run name under another storage URL, or a run deleted and made again, is another run."""
    created = (run.read_json("prepare.json") or {}).get("created")
    return hashlib.blake2b(f"{run.url}\n{created}".encode(), digest_size=8).hexdigest()


class MlflowTracker(Tracker):
    """An MLflow run in experiment `tracking.project`, found again by its `rlhf.run_key` tag."""

    name = "mlflow"

    def __init__(self, run, cfg, folder: str, resumed_step: int | None):
        from mlflow.tracking import MlflowClient

        uri = _mlflow_uri(cfg, folder)
        self.client = client = MlflowClient(tracking_uri=uri)
        exp = client.get_experiment_by_name(cfg.tracking.project)
        if exp is None:
            try:
                exp_id = client.create_experiment(cfg.tracking.project, artifact_location=_artifact_root(uri))
            except Exception:  # created meanwhile by another run
                exp_id = client.get_experiment_by_name(cfg.tracking.project).experiment_id
        else:
            exp_id = exp.experiment_id
        key = run_key(run)
        found = client.search_runs([exp_id], filter_string=f"tags.`rlhf.run_key` = '{key}'", max_results=1)
        if not found:  # a run begun before tracker runs had keys: its id and URL tags, and no key
            found = [r for r in client.search_runs([exp_id], filter_string=f"tags.`rlhf.run_id` = '{run.run_id}'")
                     if r.data.tags.get("rlhf.run_url") == run.url and "rlhf.run_key" not in r.data.tags][:1]
            if found:
                client.set_tag(found[0].info.run_id, "rlhf.run_key", key)
        if found:
            self.run_id = found[0].info.run_id
            client.update_run(self.run_id, status="RUNNING")
            return
        self.run_id = client.create_run(exp_id, run_name=run_name(run, cfg), tags={
            "rlhf.run_id": run.run_id, "rlhf.run_url": run.url, "rlhf.run_key": key}).info.run_id
        self._attach_config(cfg)

    def _attach_config(self, cfg) -> None:
        from mlflow.entities import Param

        params = [Param(k, v[:6000]) for k, v in config_params(cfg).items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=params[i:i + 100])
        self.client.log_text(self.run_id, cfg.to_yaml(), "config.yaml")

    def log(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in metrics.items()])

    def close(self, ok: bool = True) -> None:
        self.client.set_terminated(self.run_id, "FINISHED" if ok else "FAILED")


def wandb_id(run_id: str) -> str:
    """A W&B run id for a run id: itself when short enough, else a prefix and a hash."""
    if len(run_id) <= WANDB_ID_MAX:
        return run_id
    return run_id[: WANDB_ID_MAX - 17] + "-" + hashlib.blake2b(run_id.encode(), digest_size=8).hexdigest()


class WandbTracker(Tracker):
    """A W&B run (id from the run id and `run_key`, resumed on restart) in <tracking dir>/wandb; offline unless
    WANDB_API_KEY is set (WANDB_MODE, when set, decides). Every key is charted against
    `trainer/step`, so evaluations logged after training land at the steps of their versions."""

    name = "wandb"

    def __init__(self, run, cfg, folder: str, resumed_step: int | None):
        import wandb

        mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
        self.run = wandb.init(project=cfg.tracking.project, name=run_name(run, cfg),
                              id=wandb_id(f"{run.run_id}-{run_key(run)}"),
                              dir=folder, config=cfg.model_dump(mode="json"), resume="allow", mode=mode,
                              settings=wandb.Settings(silent=True, console="off"))
        self.run.define_metric("trainer/step")
        self.run.define_metric("*", step_metric="trainer/step")

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log({**metrics, "trainer/step": step})

    def close(self, ok: bool = True) -> None:
        self.run.finish(exit_code=0 if ok else 1)


OPENERS = {"tensorboard": TensorBoardTracker, "mlflow": MlflowTracker, "wandb": WandbTracker}
