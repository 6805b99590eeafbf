"""'Clear' on a failed run resumes it: the teardown's stop marker names the attempt it ended.

The tasks run here as a cleared DAG run would run them (their context carries the run's clear
count), without the Airflow deployment: the operators start the real engine processes.
"""

import sys
import threading
from pathlib import Path

import pytest
from airflow.sdk.exceptions import AirflowException, AirflowFailException

from pipeline.buffer import ReplayBuffer
from pipeline.config import parse_config
from pipeline.models import load_tokenizer
from pipeline.policy import PolicyStore
from pipeline.orchestration import prepare
from pipeline.rundir import RunDir
from pipeline.trainer.checkpoint import list_checkpoints
from pipeline.trainer.loop import FAULT_ENV
from plugins.operators import RlhfProcessOperator
from plugins.taskgroups import _stop_sampler

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "trainer"))
from trainer_rollouts import synthetic_shard  # noqa: E402

GROUPS, GROUP_SIZE = 4, 4
CONFIG = {
    "seed": 0,
    "model": {"path": "builtin:digit"},
    "data": {"train": "builtin:digit", "eval": "builtin:digit", "eval_size": 8},
    "reward": {"fn": "digit"},
    "sampler": {"group_size": GROUP_SIZE, "prompts_per_batch": GROUPS, "poll_s": 0.05, "max_staleness": 99},
    "trainer": {"steps": 4, "groups_per_step": GROUPS, "checkpoint_every": 2, "sync_every": 100,
                "lr": 3e-3, "micro_batch_tokens": 64, "wait_timeout_s": 60},
}


class FakeTI:
    def __init__(self, try_number):
        self.try_number = try_number


class FakeDagRun:
    def __init__(self, clear_number):
        self.clear_number = clear_number


def context(clear_number: int, try_number: int = 1) -> dict:
    return {"ti": FakeTI(try_number), "dag_run": FakeDagRun(clear_number)}


class QuickRole(RlhfProcessOperator):
    """The operator's own logic around a process that exits at once (as the engine does when stopped)."""

    def build_command(self, context):
        return [sys.executable, "-c", "print('stopped')"]


@pytest.fixture
def run(tmp_path):
    run = RunDir(f"file://{tmp_path}/runs/r1")
    run.create(parse_config({"trainer": {"steps": 4}}))
    return run


def failed_attempt(run, attempt=0):
    """The trainer task of `attempt` ended without finishing; its teardown stops the run and fails
    (so that clearing the run's failed tasks runs it again)."""
    with pytest.raises(AirflowFailException, match="clear this DAG run's failed tasks"):
        _stop_sampler(run.url, dag_run=FakeDagRun(attempt))


def final_stop(run, stop: str) -> None:
    """A stop that holds for every attempt: a user's ("user"), or the teardown's after the trainer
    finished ("trainer finished")."""
    if stop == "user":
        run.request_stop("stopped by hand", by="alice")
    else:
        run.set_marker("trainer_done", {"step": 4})
        _stop_sampler(run.url, dag_run=FakeDagRun(0))


def test_a_stop_that_ended_an_earlier_attempt_is_stale_for_a_later_one(run):
    failed_attempt(run, 0)
    stop = run.marker("stop")
    assert (stop["by"], stop["attempt"], stop["reason"]) == ("stop_sampler", 0, "trainer task ended without finishing")
    assert run.stop_requested() and run.stop_requested(0)  # the engine and attempt 0 stop
    assert not run.stop_requested(1)
    failed_attempt(run, 1)  # attempt 1 failed too: its teardown replaces the stale stop
    assert run.marker("stop")["attempt"] == 1 and run.stop_requested(1)


@pytest.mark.parametrize("stop", ["user", "trainer finished"])
def test_a_users_stop_and_the_stop_after_a_finished_trainer_hold_for_every_attempt(run, stop):
    final_stop(run, stop)
    for role in ("sampler", "trainer"):
        QuickRole(task_id=role, role=role, run_url=run.url).execute(context(3, try_number=2))
    assert run.stop_requested(3) and run.marker("stop")["attempt"] is None


def test_a_new_dag_run_on_the_same_run_directory_resumes_it_where_another_one_failed(run):
    """A DAG run's attempts count from 0: a second DAG run with the same run name (to resume, or to
    rerun at another scale) would take the first one's stop for its own attempt 0."""
    assert run.take_over("manual__A") == []  # a fresh directory
    run.set_marker(RunDir.trainer_started_marker(0), {"attempt": 0})
    failed_attempt(run, 0)
    assert run.take_over("manual__A") == []  # the same DAG run's prepare again: its markers stay
    assert run.stop_requested(0) and run.has_marker("trainer_started_0")
    assert sorted(run.take_over("manual__B")) == ["stop", "trainer_started_0"]
    assert not run.stop_requested(0) and not run.has_marker("trainer_started_0")


@pytest.mark.parametrize("stop", ["user", "trainer finished"])
def test_a_final_stop_holds_for_a_new_dag_run_too(run, stop):
    final_stop(run, stop)
    run.take_over("manual__B")
    assert run.stop_requested(0)


def test_a_cleared_task_removes_the_stale_stop_before_its_process_starts(run):
    failed_attempt(run, 0)
    QuickRole(task_id="trainer", role="trainer", run_url=run.url).execute(context(1, try_number=2))
    assert not run.has_marker("stop")
    # the teardown of the cleared run stops it again at the end
    run.set_marker("trainer_done", {"step": 4})
    _stop_sampler(run.url, dag_run=FakeDagRun(1))
    assert run.marker("stop")["reason"] == "trainer finished" and run.stop_requested(2)


def test_a_sampler_stopped_because_the_trainer_failed_fails_without_retrying(run):
    failed_attempt(run, 0)
    sampler = QuickRole(task_id="sampler", role="sampler", run_url=run.url)
    with pytest.raises(AirflowFailException, match="trainer task ended without finishing"):
        sampler.execute(context(0))
    run.set_marker("trainer_done", {"step": 4})  # a normal end: the sampler succeeds
    run.request_stop("trainer finished", by="stop_sampler")
    assert sampler.execute(context(0))["returncode"] == 0


def make_run(path) -> str:
    """A prepared run whose L1 holds the groups of steps 1-3 only: step 4 needs a sampler."""
    run = prepare(parse_config(CONFIG), run_url=f"file://{path}")
    tok = load_tokenizer(PolicyStore(run).local_dir(0))
    prompts = [tok(f"digits {i}: ", add_special_tokens=False)["input_ids"] for i in range(8)]
    with ReplayBuffer(run.buffer_url, run.config().buffer).writer("test") as w:
        for shard in range(3):
            w.write(synthetic_shard(tok, prompts, shard, GROUPS, GROUP_SIZE, seed=0))
    return run.url


@pytest.mark.integration
def test_clearing_a_failed_run_resumes_it_from_the_last_checkpoint(tmp_path):
    url = make_run(tmp_path / "runs" / "cleared")
    run = RunDir(url)
    # attempt 0: the trainer dies after step 3 (last checkpoint: step 2), for good; the teardown runs
    trainer = RlhfProcessOperator(task_id="trainer", role="trainer", run_url=url, env={FAULT_ENV: "3"},
                                  kill_grace_s=5)
    with pytest.raises(AirflowException, match="exited with code"):
        trainer.execute(context(0))
    assert [c.step for c in list_checkpoints(run)] == [2]
    failed_attempt(run, 0)

    # attempt 1: the run is cleared; its sampler and trainer start again
    sampler = RlhfProcessOperator(task_id="sampler", role="sampler", run_url=url, kill_grace_s=5)
    trainer = RlhfProcessOperator(task_id="trainer", role="trainer", run_url=url, kill_grace_s=5)
    outcome = {}

    def run_sampler():
        try:
            outcome["sampler"] = sampler.execute(context(1, try_number=2))
        except Exception as e:  # noqa: BLE001 - the test reports it
            outcome["sampler"] = e

    thread = threading.Thread(target=run_sampler)
    thread.start()
    try:
        trainer.execute(context(1, try_number=2))
        thread.join(timeout=120)
    finally:
        sampler.on_kill()
        thread.join(timeout=30)
    assert isinstance(outcome.get("sampler"), dict), outcome  # stopped by trainer_done: success

    assert run.marker("trainer_done")["step"] == 4
    records = run.read_metrics("trainer")
    assert [r["resumed_step"] for r in records if r.get("event") == "start"] == [0, 2]
    assert [r["step"] for r in records if "step" in r] == [1, 2, 3, 4]
    assert ReplayBuffer(run.buffer_url).committed_groups() > 3 * GROUPS  # step 4 trained on new rollouts
    _stop_sampler(url, dag_run=FakeDagRun(1))
    assert run.marker("stop")["reason"] == "trainer finished"
