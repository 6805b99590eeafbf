"""Experiment trackers: one tiny `rlhf run` with TensorBoard, MLflow and W&B on, read back with each
tracker's own reader, against the run's JSONL metrics and eval.json (the record)."""

from __future__ import annotations

import glob
import json
import logging
import os
import sys
import time

import pytest
from spawner import Spawner
from wandb_records import history, run_record

from pipeline.config import ConfigError, parse_config
from pipeline.rundir import RunDir
from pipeline.tracking import Tracker, Trackers, open_tracker, require

pytestmark = pytest.mark.integration
STEPS = 4
RUN_NAME = "rlhf_train/manual__2026-01-01T00:00:00+00:00"  # what the Airflow operators pass


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("tracking")
    run_dir = root / "runs" / "tracked"
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(OMP_NUM_THREADS="1", WANDB_MODE="offline", RLHF_RUN_NAME=RUN_NAME, WANDB_CONFIG_DIR=str(root / "wb-config"),
               WANDB_CACHE_DIR=str(root / "wb-cache"), WANDB_DATA_DIR=str(root / "wb-data"))
    cmd = [sys.executable, "-m", "pipeline", "run", "configs/tiny-test.yaml", "--run-dir", f"file://{run_dir}",
           "--no-progress", "--set", f"trainer.steps={STEPS}", "--set", "model.path=builtin:sort",
           "--set", "data.train=builtin:sort", "--set", "data.eval=builtin:sort", "--set", "reward.fn=sort",
           "--set", "tracking.backends=[tensorboard,mlflow,wandb]"]
    with Spawner() as spawn:
        p = spawn.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    run = RunDir(str(run_dir))
    fresh = [r for r in run.read_metrics("trainer") if "step" in r]
    evals = json.loads((run_dir / "eval.json").read_text())
    return run, fresh, evals


def test_tensorboard_event_files_hold_the_curves_and_the_config(tracked_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run, fresh, evals = tracked_run
    ea = EventAccumulator(run.path("tracking", "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    ea.Reload()
    for key in ("reward/mean", "actor/loss", "staleness/mean"):
        got = [(e.step, e.value) for e in ea.Scalars(key)]
        assert got == [(r["step"], pytest.approx(r[key], rel=1e-5, abs=1e-6)) for r in fresh], key
    assert [(e.step, e.value) for e in ea.Scalars("eval/score")] == [
        (0, pytest.approx(evals["0"]["score"])), (STEPS, pytest.approx(evals[str(STEPS)]["score"]))]
    config = ea.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "run_id: tracked" in config and "steps: 4" in config


def test_mlflow_file_store_holds_one_run_with_config_curves_and_evaluations(tracked_run, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")

    run, fresh, evals = tracked_run
    client = MlflowClient(tracking_uri="file://" + run.path("tracking", "mlruns"))
    exp = client.get_experiment_by_name("rlhf")
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1  # the trainer and finalize's evaluation share one tracker run
    r = runs[0]
    assert r.info.run_name == RUN_NAME and r.data.tags["rlhf.run_id"] == "tracked"
    assert r.info.status == "FINISHED"
    assert r.data.params["trainer.steps"] == "4" and r.data.params["reward.fn"] == "sort"
    for key in ("reward/mean", "actor/grad_norm"):
        got = sorted((m.step, m.value) for m in client.get_metric_history(r.info.run_id, key))
        assert got == [(x["step"], pytest.approx(x[key], rel=1e-6)) for x in fresh], key
    got = sorted((m.step, m.value) for m in client.get_metric_history(r.info.run_id, "eval/score"))
    assert got == [(0, pytest.approx(evals["0"]["score"])), (STEPS, pytest.approx(evals[str(STEPS)]["score"]))]
    local = client.download_artifacts(r.info.run_id, "config.yaml")
    assert parse_config(__import__("yaml").safe_load(open(local))).trainer.steps == STEPS


def test_wandb_offline_runs_hold_config_curves_and_evaluations(tracked_run):
    run, fresh, evals = tracked_run
    files = sorted(glob.glob(run.path("tracking", "wandb", "offline-run-*", "run-*.wandb")))
    assert len(files) == 2  # the trainer's and finalize's sessions of one W&B run (same id)
    trainer_file, eval_file = files
    for f in files:
        run_id, name, project, config = run_record(f)
        assert (run_id.split("-")[0], name, project) == ("tracked", RUN_NAME, "rlhf")
    assert run_record(trainer_file)[3]["trainer"]["steps"] == STEPS
    rows = [h for h in history(trainer_file) if "reward/mean" in h]
    assert [(h["trainer/step"], h["reward/mean"]) for h in rows] == \
        [(r["step"], pytest.approx(r["reward/mean"], rel=1e-6)) for r in fresh]
    got = [(h["trainer/step"], h["eval/score"]) for h in history(eval_file) if "eval/score" in h]
    assert got == [(0, pytest.approx(evals["0"]["score"])), (STEPS, pytest.approx(evals[str(STEPS)]["score"]))]


def test_without_backends_the_tracker_does_nothing(tmp_path):
    run = RunDir(str(tmp_path / "quiet"))
    tracker = open_tracker(run, parse_config({}), resumed_step=0)
    assert type(tracker) is Tracker
    tracker.log({"reward/mean": 1.0}, 1)
    tracker.close()
    assert not (tmp_path / "quiet").exists()


def test_a_missing_tracker_library_names_the_extra(monkeypatch, tmp_path):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    with pytest.raises(ConfigError, match=r"rlhf-pipeline\[mlflow\]"):
        require("mlflow")
    cfg = parse_config({"tracking": {"backends": ["mlflow"]}})
    with pytest.raises(ConfigError, match=r"rlhf-pipeline\[mlflow\]"):
        open_tracker(RunDir(str(tmp_path / "r")), cfg, resumed_step=0)
    with pytest.raises(ConfigError, match="twice"):
        parse_config({"tracking": {"backends": ["wandb", "wandb"]}})


def test_a_failing_tracker_is_dropped_and_the_others_go_on(caplog):
    class Broken(Tracker):
        name = "broken"

        def log(self, metrics, step):
            raise ConnectionError("tracking server gone")

    class Keep(Tracker):
        name = "keep"

        def __init__(self):
            self.seen = []

        def log(self, metrics, step):
            self.seen.append(step)

    keep = Keep()
    trackers = Trackers([Broken(), keep])
    with caplog.at_level(logging.WARNING, logger="rlhf.tracking"):
        trackers.log({"a": 1.0}, 1)
        trackers.log({"a": 2.0}, 2)
    assert keep.seen == [1, 2] and [b.name for b in trackers.backends] == ["keep"]
    assert "tracking server gone" in caplog.text


def test_a_resumed_trainer_replaces_the_tensorboard_steps_it_redoes(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = RunDir(str(tmp_path / "resumed"))
    cfg = parse_config({"run_id": "resumed", "tracking": {"backends": ["tensorboard"]}})
    first = open_tracker(run, cfg, resumed_step=0)
    for step in range(1, 5):
        first.log({"reward/mean": float(step)}, step)
    first.close(ok=False)  # killed after step 4; its newest checkpoint is step 2
    second = open_tracker(run, cfg, resumed_step=2)
    for step in (3, 4, 5):
        second.log({"reward/mean": 10.0 * step}, step)
    second.close()
    ea = EventAccumulator(run.path("tracking", "tensorboard"))
    ea.Reload()
    assert [(e.step, e.value) for e in ea.Scalars("reward/mean")] == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0),
                                                                     (5, 50.0)]


def test_a_tracking_server_that_is_down_costs_seconds_and_a_warning_not_the_run(tmp_path, monkeypatch, caplog):
    from pipeline.tracking.backends import MLFLOW_CLIENT_ENV

    for k in MLFLOW_CLIENT_ENV:
        monkeypatch.delenv(k, raising=False)
    cfg = parse_config({"tracking": {"backends": ["tensorboard", "mlflow"], "mlflow_uri": "http://127.0.0.1:9"}})
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="rlhf.tracking"):
        tracker = open_tracker(RunDir(str(tmp_path / "r")), cfg, resumed_step=0)
    assert time.monotonic() - t0 < 60  # MLflow's defaults retried for about 4 minutes
    assert [b.name for b in tracker.backends] == ["tensorboard"] and "mlflow could not be opened" in caplog.text
    tracker.log({"reward/mean": 1.0}, 1)
    tracker.close()


def test_runs_that_share_a_run_id_get_their_own_mlflow_runs_and_artifacts_stay_beside_the_database(
        tmp_path, monkeypatch):
    """The same run id under two storage URLs (or a run deleted and made again) was logged into
    one MLflow run; with a sqlite URI, config.yaml went to ./mlruns of the working directory."""
    from mlflow.tracking import MlflowClient

    from pipeline.tracking import open_tracker

    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path}/db/mlflow.db"
    (tmp_path / "db").mkdir()
    ids = []
    for root in ("team-a", "team-b", "team-a"):  # the third: team-a's run, reopened
        run = RunDir(f"file://{tmp_path}/{root}/runs/exp1")
        run.write_json("prepare.json", {"created": {"team-a": 1.0, "team-b": 2.0}[root]})
        cfg = parse_config({"run_id": "exp1", "tracking": {"backends": ["mlflow"], "mlflow_uri": uri,
                                                          "dir": f"{tmp_path}/{root}/tracking"}})
        tracker = open_tracker(run, cfg, resumed_step=0)
        ids.append(tracker.backends[0].run_id)
        tracker.close()
    assert ids[0] != ids[1] and ids[2] == ids[0]
    artifacts = MlflowClient(uri).get_run(ids[0]).info.artifact_uri
    assert artifacts.startswith(f"file://{tmp_path}/db/mlartifacts/")
    assert not (tmp_path / "mlruns").exists()


def test_an_mlflow_run_begun_before_run_keys_is_found_again_by_its_id_and_url(tmp_path):
    from mlflow.tracking import MlflowClient

    from pipeline.tracking import open_tracker

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    run = RunDir(f"file://{tmp_path}/runs/exp1")
    run.write_json("prepare.json", {"created": 1.0})
    client = MlflowClient(uri)
    exp = client.create_experiment("rlhf", artifact_location=f"file://{tmp_path}/artifacts")
    old = client.create_run(exp, tags={"rlhf.run_id": "exp1", "rlhf.run_url": run.url}).info.run_id
    cfg = parse_config({"run_id": "exp1", "tracking": {"backends": ["mlflow"], "mlflow_uri": uri,
                                                      "dir": f"{tmp_path}/tracking"}})
    tracker = open_tracker(run, cfg, resumed_step=3)
    assert tracker.backends[0].run_id == old
    tracker.close()
    assert "rlhf.run_key" in client.get_run(old).data.tags
