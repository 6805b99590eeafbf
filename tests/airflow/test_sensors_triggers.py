"""Sensors defer to triggers that watch the run directory; both agree on markers and on failure."""

import asyncio
import importlib
import threading
import time

import pytest
from airflow.sdk.exceptions import AirflowException, AirflowSensorTimeout, TaskDeferred

import pipeline.orchestration
from pipeline.rundir import RunDir
from plugins.sensors import PhaseCheckpointSensor, ReplayGateSensor
from plugins.triggers import ReplayGateTrigger, RunMarkerTrigger

phase_done_marker, replay_gate_marker = RunDir.phase_done_marker, RunDir.replay_gate_marker


def eligible(monkeypatch, *counts):
    """The engine's count of eligible L2 groups (the replay gate's measure) gives `counts` in turn,
    the last one from then on."""
    seq = iter(counts)
    last = [counts[-1]]

    def count(run):
        last[0] = next(seq, last[0])
        return last[0]

    monkeypatch.setattr(pipeline.orchestration, "eligible_replay_groups", count)


@pytest.fixture
def run(tmp_path):
    from pipeline.config import parse_config
    from pipeline.rundir import RunDir

    run = RunDir(f"file://{tmp_path}/runs/r1")
    run.create(parse_config({"trainer": {"steps": 4, "phases": 2, "replay_epochs": 1, "groups_per_step": 4},
                             "sampler": {"prompts_per_batch": 4}}))
    return run


def first_event(trigger, timeout=10):
    async def go():
        async for event in trigger.run():
            return event.payload

    return asyncio.run(asyncio.wait_for(go(), timeout))


@pytest.mark.parametrize("trigger", [
    RunMarkerTrigger(run_url="file:///r/x", marker="phase_0.done", poke_interval=2.5, fail_on_stop=False),
    RunMarkerTrigger(run_url="file:///r/x", marker="phase_1.done", attempt=2),
    ReplayGateTrigger(run_url="s3://b/runs/x", epoch=3, min_groups=16, poke_interval=1.0),
    ReplayGateTrigger(run_url="s3://b/runs/x", epoch=0, min_groups=4, attempt=1),
])
def test_trigger_serialize_round_trips_through_its_classpath(trigger):
    classpath, kwargs = trigger.serialize()
    module, name = classpath.rsplit(".", 1)
    rebuilt = getattr(importlib.import_module(module), name)(**kwargs)
    assert rebuilt.serialize() == (classpath, kwargs)
    assert classpath.startswith("plugins.triggers.")  # importable by the triggerer, not from dags/


def test_marker_trigger_fires_with_the_marker_payload_once_it_appears(run):
    writer = threading.Timer(0.3, lambda: run.set_marker("phase_0.done", {"step": 2, "checkpoint": "ck"}))
    writer.start()
    t0 = time.monotonic()
    event = first_event(RunMarkerTrigger(run_url=run.url, marker="phase_0.done", poke_interval=0.05))
    assert event["status"] == "success"
    assert event["payload"]["step"] == 2 and event["payload"]["checkpoint"] == "ck"
    assert time.monotonic() - t0 >= 0.25


def test_marker_trigger_fails_when_the_run_is_stopped_without_the_marker(run):
    run.request_stop("trainer task ended without finishing")
    event = first_event(RunMarkerTrigger(run_url=run.url, marker="phase_1.done", poke_interval=0.05))
    assert event["status"] == "error" and "phase_1.done" in event["message"]


def test_a_stop_that_ended_an_earlier_attempt_does_not_fail_the_triggers_of_a_cleared_run(run, monkeypatch):
    run.request_stop("trainer task ended without finishing", by="stop_sampler", attempt=0)
    writer = threading.Timer(0.3, lambda: run.set_marker("phase_1.done", {"step": 4, "checkpoint": "ck4"}))
    writer.start()
    event = first_event(RunMarkerTrigger(run_url=run.url, marker="phase_1.done", poke_interval=0.05, attempt=1))
    assert event["status"] == "success" and event["payload"]["step"] == 4
    eligible(monkeypatch, 1, 1, 6)
    event = first_event(ReplayGateTrigger(run_url=run.url, epoch=0, min_groups=5, poke_interval=0.01, attempt=1))
    assert event["status"] == "success" and event["eligible"] == 6
    # for the attempt it ended, the stop still counts
    event = first_event(RunMarkerTrigger(run_url=run.url, marker="phase_0.done", poke_interval=0.05, attempt=0))
    assert event["status"] == "error"


def test_marker_written_just_before_the_stop_still_counts(run):
    run.set_marker("phase_1.done", {"step": 4, "checkpoint": "ck4"})
    run.request_stop("trainer finished")
    assert first_event(RunMarkerTrigger(run_url=run.url, marker="phase_1.done", poke_interval=0.05))["status"] == "success"


def test_gate_trigger_waits_for_enough_eligible_groups(run, monkeypatch):
    eligible(monkeypatch, 0, 3, 5, 9)
    event = first_event(ReplayGateTrigger(run_url=run.url, epoch=0, min_groups=5, poke_interval=0.01))
    assert event == {"status": "success", "epoch": 0, "eligible": 5, "already_open": False}


def test_gate_trigger_gives_up_when_the_run_stops(run, monkeypatch):
    eligible(monkeypatch, 1)
    run.request_stop("trainer task ended without finishing")
    event = first_event(ReplayGateTrigger(run_url=run.url, epoch=0, min_groups=5, poke_interval=0.01))
    assert event["status"] == "error" and "1 eligible" in event["message"]


def test_gate_trigger_reports_an_epoch_the_trainer_skipped(run, monkeypatch):
    eligible(monkeypatch, 1)
    run.set_marker(run.TRAINER_DONE_MARKER, {"step": 4, "replay_epochs_skipped": [0]})
    run.request_stop("trainer finished")
    event = first_event(ReplayGateTrigger(run_url=run.url, epoch=0, min_groups=5, poke_interval=0.01))
    assert event["status"] == "skipped" and "without replay epoch 0" in event["message"]


# sensors ------------------------------------------------------------------------------------------
def test_checkpoint_sensor_defers_with_the_phase_marker_trigger(run):
    sensor = PhaseCheckpointSensor(task_id="wait", run_url=run.url, phase=1, poke_interval=3, timeout=600)
    with pytest.raises(TaskDeferred) as deferred:
        sensor.execute({})
    trigger = deferred.value.trigger
    assert isinstance(trigger, RunMarkerTrigger)
    assert (trigger.run_url, trigger.marker, trigger.poke_interval) == (run.url, "phase_1.done", 3.0)
    assert deferred.value.method_name == "execute_complete"
    assert deferred.value.timeout.total_seconds() == 600


def test_sensors_hand_their_runs_attempt_to_the_trigger(run, monkeypatch):
    class DagRun:
        clear_number = 2

    eligible(monkeypatch, 0)
    for sensor in (PhaseCheckpointSensor(task_id="wait", run_url=run.url, phase=1),
                   ReplayGateSensor(task_id="gate", run_url=run.url, epoch=0)):
        with pytest.raises(TaskDeferred) as deferred:
            sensor.execute({"dag_run": DagRun()})
        assert deferred.value.trigger.attempt == 2


def test_checkpoint_sensor_returns_at_once_when_the_phase_is_done(run):
    run.set_marker(phase_done_marker(0), {"step": 2, "checkpoint": run.child_url("checkpoints", "step_2")})
    out = PhaseCheckpointSensor(task_id="wait", run_url=run.url, phase=0).execute({})
    assert out == {"phase": 0, "step": 2, "checkpoint": run.child_url("checkpoints", "step_2"), "run_url": run.url}


def test_checkpoint_sensor_turns_a_trigger_error_into_a_task_failure(run):
    sensor = PhaseCheckpointSensor(task_id="wait", run_url=run.url, phase=0)
    with pytest.raises(AirflowException, match="stopped"):
        sensor.execute_complete({}, {"status": "error", "message": "run was stopped"})
    ok = sensor.execute_complete({}, {"status": "success", "payload": {"step": 2, "checkpoint": "c"}})
    assert ok["step"] == 2


def test_checkpoint_sensor_in_poke_mode_times_out_with_timeout_zero(run):
    sensor = PhaseCheckpointSensor(task_id="wait", run_url=run.url, phase=0, deferrable=False, timeout=0,
                                   poke_interval=0.01)
    with pytest.raises(AirflowSensorTimeout):
        sensor.execute({})


def test_sensors_retry_by_default():
    assert PhaseCheckpointSensor(task_id="a", run_url="file:///r/x", phase=0).retries >= 1
    assert ReplayGateSensor(task_id="b", run_url="file:///r/x", epoch=0).retries >= 1


def test_gate_sensor_skips_an_epoch_the_trainer_skipped(run, monkeypatch):
    from airflow.sdk.exceptions import AirflowSkipException

    eligible(monkeypatch, 1)
    sensor = ReplayGateSensor(task_id="gate", run_url=run.url, epoch=0)
    with pytest.raises(AirflowSkipException):
        sensor.execute_complete({}, {"status": "skipped", "message": "the trainer finished without replay epoch 0"})
    run.set_marker(run.TRAINER_DONE_MARKER, {"step": 4, "replay_epochs_skipped": [0]})
    with pytest.raises(AirflowSkipException, match="without replay epoch 0"):
        sensor.execute({})
    assert run.marker(replay_gate_marker(0)) is None


def test_gate_sensor_opens_the_gate_when_enough_groups_are_eligible(run, monkeypatch):
    eligible(monkeypatch, 7)
    out = ReplayGateSensor(task_id="gate", run_url=run.url, epoch=0).execute({})
    assert out == {"epoch": 0, "eligible": 7}
    assert run.marker(replay_gate_marker(0))["eligible"] == 7


def test_gate_sensor_defers_with_the_configs_threshold(run, monkeypatch):
    eligible(monkeypatch, 1)
    with pytest.raises(TaskDeferred) as deferred:
        ReplayGateSensor(task_id="gate", run_url=run.url, epoch=0).execute({})
    trigger = deferred.value.trigger
    assert isinstance(trigger, ReplayGateTrigger)
    assert (trigger.epoch, trigger.min_groups) == (0, 4)  # trainer.groups_per_step
    assert not run.has_marker(replay_gate_marker(0))


def test_gate_sensor_opens_the_gate_when_its_trigger_fires(run):
    sensor = ReplayGateSensor(task_id="gate", run_url=run.url, epoch=0)
    assert sensor.execute_complete({}, {"status": "success", "eligible": 3}) == {"epoch": 0, "eligible": 3}
    assert run.has_marker(replay_gate_marker(0))


def test_gate_sensor_in_poke_mode_times_out_with_timeout_zero(run, monkeypatch):
    eligible(monkeypatch, 0)
    sensor = ReplayGateSensor(task_id="gate", run_url=run.url, epoch=0, deferrable=False, timeout=0)
    with pytest.raises(AirflowSensorTimeout):
        sensor.execute({})
    assert not run.has_marker(replay_gate_marker(0))
