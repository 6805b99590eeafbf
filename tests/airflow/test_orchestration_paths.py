"""The local runner and the DAG tasks take the same steps: the functions of `pipeline.orchestration`.

Each step is replaced by a recorder; the local runner (with stand-ins for its two processes) and
the task bodies of the DAG (prepare, reshard, replay-gate sensor and trigger, teardown, finalize)
run against one run directory, and both must have called every step.
"""

from __future__ import annotations

import asyncio

import pytest

from pipeline import orchestration
from pipeline.config import parse_config
from pipeline.rundir import RunDir

STEPS = {"prepare", "publish_phase", "check_replay_gate", "stop_after_trainer", "finalize"}
CONFIG = {"trainer": {"steps": 4, "phases": 2, "replay_epochs": 1, "groups_per_step": 4}, "sampler": {"prompts_per_batch": 4}}


@pytest.fixture
def run(tmp_path, monkeypatch):
    monkeypatch.setenv("RLHF_RUNS_ROOT", str(tmp_path / "runs"))
    run = RunDir(f"file://{tmp_path}/runs/r1")
    run.create(parse_config(CONFIG))
    for k, step in ((0, 2), (1, 4)):
        run.set_marker(RunDir.phase_done_marker(k),
                       {"step": step, "checkpoint": run.child_url("checkpoints", f"step_{step}")})
    return run


@pytest.fixture
def calls(run, monkeypatch) -> list[str]:
    """Every orchestration step, replaced by one that records its name and answers plausibly."""
    seen: list[str] = []
    answers = {
        "prepare": lambda cfg, run_url=None, *a, **k: run,
        "publish_phase": lambda r, phase, step, checkpoint: {"phase": int(phase), "version": int(step),
                                                             "published_now": True, "files": 1, "bytes": 1},
        "check_replay_gate": lambda r, epoch, min_groups=None: {"epoch": int(epoch), "open": False, "ready": True,
                                                                "eligible": 4, "min_groups": 4},
        "stop_after_trainer": lambda r, **k: {"reason": "trainer finished", "attempt": None},
        "finalize": lambda r, *a, **k: {"run_id": r.run_id},
    }
    for name, answer in answers.items():
        def step(*a, _name=name, _answer=answer, **k):
            seen.append(_name)
            return _answer(*a, **k)

        monkeypatch.setattr(orchestration, name, step)
    return seen


class Process:
    """A stand-in for the runner's sampler or trainer process: running for `polls` looks, then exit 0."""

    def __init__(self, polls: int = 0):
        self.polls, self.pid = polls, -1

    def poll(self):
        self.polls -= 1
        return None if self.polls >= 0 else 0

    def wait(self, timeout=None):
        return 0


def test_the_local_runner_takes_every_orchestration_step(run, calls, monkeypatch):
    import pipeline.local_runner as runner

    procs = {"sampler": Process(polls=10), "trainer": Process(polls=1)}
    monkeypatch.setattr(runner, "_child", lambda role, *a, **k: procs[role])
    run.set_marker(RunDir.TRAINER_DONE_MARKER, {"step": 4})  # what the (stand-in) trainer writes at its end
    summary = runner.run_local(parse_config(CONFIG), run.url, progress=False)
    assert set(calls) == STEPS
    assert calls[0] == "prepare" and calls[-2:] == ["stop_after_trainer", "finalize"]
    assert summary["run_id"] == run.run_id and "total_s" in summary


def test_the_dag_tasks_take_every_orchestration_step(run, calls):
    from plugins.dag_params import run_params
    from plugins.operators import FinalizeRunOperator, engine_command
    from plugins.sensors import ReplayGateSensor
    from plugins.taskgroups import _stop_sampler, prepare_run, reshard
    from plugins.triggers import ReplayGateTrigger

    params = {k: p.value for k, p in run_params().items()}
    prepared = prepare_run("rlhf_train", params, {}, run.run_id)
    assert calls == ["prepare"] and prepared["run_url"] == run.url
    out = reshard.function({"run_url": run.url, "phase": 0, "step": 2, "checkpoint": "ck"})
    assert out["version"] == 2 and calls[-1] == "publish_phase"
    assert ReplayGateSensor(task_id="gate", run_url=run.url, epoch=0).execute({}) == {"epoch": 0, "eligible": 4}
    assert calls[-1] == "check_replay_gate" and run.has_marker(RunDir.replay_gate_marker(0))

    async def first_event(trigger):
        async for event in trigger.run():
            return event.payload

    calls.clear()
    event = asyncio.run(asyncio.wait_for(first_event(
        ReplayGateTrigger(run_url=run.url, epoch=0, min_groups=4, poke_interval=0.01)), 10))
    assert event["status"] == "success" and calls == ["check_replay_gate"]
    assert _stop_sampler(run.url) == run.url and calls[-1] == "stop_after_trainer"
    # the finalize task runs `rlhf finalize`, whose body is the step
    command = FinalizeRunOperator(task_id="finalize", run_url=run.url).build_command({})
    assert command == engine_command("finalize", run.url)
    from pipeline.cli import build_parser

    args = build_parser().parse_args(command[3:])
    assert args.fn(args) == 0 and calls[-1] == "finalize"
    assert set(calls) | {"prepare", "publish_phase"} == STEPS


def test_the_trainer_defers_a_replay_epoch_on_the_gate_condition_itself():
    from pipeline.trainer import loop

    assert loop.replay_gate_ready is orchestration.replay_gate_ready
    assert loop.replay_gate_min_groups is orchestration.replay_gate_min_groups


def test_finalize_returns_the_compaction_the_engine_step_recorded(run, monkeypatch):
    """The operator emits the Asset event from what `rlhf finalize` wrote; it compacts nothing itself."""
    from pipeline.policy import PolicyStore

    from plugins.operators import FinalizeRunOperator
    from plugins.operators.process import SupervisedProcessOperator

    monkeypatch.setattr(SupervisedProcessOperator, "execute", lambda self, context: {"returncode": 0})
    monkeypatch.setattr(PolicyStore, "latest", lambda self: 4)
    run.write_json("summary.json", {"eval_after": 0.5, "compaction": {"l1_shards_in": 3}})

    out = FinalizeRunOperator(task_id="finalize", run_url=run.url).execute({"outlet_events": {}})
    assert out["compaction"] == {"l1_shards_in": 3} and out["version"] == 4 and out["eval_after"] == 0.5
    assert out["policy_url"] == run.child_url("policy", "v000004")
