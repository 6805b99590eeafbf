"""Sensors that gate the per-phase and per-replay-epoch tasks of an RLHF run.

Both look once in `execute` (a retried sensor whose condition already holds finishes at once), then
defer to a trigger, so hundreds of waiting sensors cost the triggerer a few coroutines and no worker
slots. With `deferrable=False` they fall back to BaseSensorOperator's poke/reschedule loop over the
same `poke` (no triggerer needed). Keep `retries >= 1`: Airflow 3.3.2 occasionally fails a sensor
with "finished with state success, but the task instance's state attribute is queued".
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from airflow.sdk import BaseSensorOperator, PokeReturnValue
from airflow.sdk.exceptions import AirflowException, AirflowSkipException

from plugins.hooks.run_dir import RunDirHook, run_attempt
from plugins.triggers.run_dir import ReplayGateTrigger, RunMarkerTrigger


def _raise_on_error(event: dict[str, Any] | None) -> dict[str, Any]:
    if not event or event.get("status") != "success":
        raise AirflowException((event or {}).get("message", f"trigger returned {event!r}"))
    return event


class PhaseCheckpointSensor(BaseSensorOperator):
    """Waits until the trainer has written the checkpoint closing phase `phase`.

    Returns (XCom) `{"phase", "step", "checkpoint"}` for the reshard task.
    """

    template_fields = ("run_url", "phase")

    def __init__(self, *, run_url: str, phase: int | str, deferrable: bool = True, **kwargs: Any) -> None:
        kwargs.setdefault("retries", 1)
        super().__init__(**kwargs)
        self.run_url = run_url
        self.phase = phase
        self.deferrable = deferrable

    def _result(self, payload: dict) -> dict:
        return {"phase": int(self.phase), "step": payload.get("step"), "checkpoint": payload.get("checkpoint"),
                "run_url": self.run_url}

    def poke(self, context) -> PokeReturnValue:
        payload = RunDirHook(self.run_url).phase_done(int(self.phase))
        if payload is None:
            return PokeReturnValue(is_done=False)
        return PokeReturnValue(is_done=True, xcom_value=self._result(payload))

    def execute(self, context) -> Any:
        if not self.deferrable:
            return super().execute(context)
        ready = self.poke(context)
        if ready:
            return ready.xcom_value
        self.log.info("phase %s of %s not finished yet; deferring", self.phase, self.run_url)
        marker = RunDirHook(self.run_url).run.phase_done_marker(int(self.phase))
        self.defer(
            trigger=RunMarkerTrigger(run_url=self.run_url, marker=marker,
                                     poke_interval=self.poke_interval, attempt=run_attempt(context)),
            method_name="execute_complete",
            timeout=timedelta(seconds=self.timeout),
        )

    def execute_complete(self, context, event: dict[str, Any] | None = None) -> dict:
        event = _raise_on_error(event)
        result = self._result(event["payload"])
        self.log.info("phase %s done at step %s: %s", self.phase, result["step"], result["checkpoint"])
        return result


class ReplayGateSensor(BaseSensorOperator):
    """Opens replay epoch `epoch` once the engine's replay-gate condition holds
    (`pipeline.orchestration.replay_gate_ready`: L2 holds at least one optimizer step's worth,
    `trainer.groups_per_step`, of eligible groups; the trainer defers an epoch on the same test).

    Opening means writing the marker `RunDir.replay_gate_marker(epoch)`, which the trainer waits for.
    Returns (XCom) `{"epoch", "eligible"}`.
    """

    template_fields = ("run_url", "epoch")

    def __init__(self, *, run_url: str, epoch: int | str, deferrable: bool = True, **kwargs: Any) -> None:
        kwargs.setdefault("retries", 1)
        super().__init__(**kwargs)
        self.run_url = run_url
        self.epoch = epoch
        self.deferrable = deferrable

    def poke(self, context) -> PokeReturnValue:
        hook = RunDirHook(self.run_url)
        gate = hook.poll_replay_gate(int(self.epoch))
        if gate["open"]:
            if gate["opened_now"]:
                self.log.info("replay epoch %s opened with %s eligible groups", self.epoch, gate["eligible"])
            return PokeReturnValue(is_done=True, xcom_value={"epoch": gate["epoch"], "eligible": gate["eligible"]})
        if hook.replay_epoch_skipped(int(self.epoch)):
            raise AirflowSkipException(f"the trainer finished without replay epoch {self.epoch} "
                                       f"({gate['eligible']} eligible groups)")
        return PokeReturnValue(is_done=False)

    def execute(self, context) -> Any:
        if not self.deferrable:
            return super().execute(context)
        ready = self.poke(context)
        if ready:
            return ready.xcom_value
        hook = RunDirHook(self.run_url)
        self.defer(
            trigger=ReplayGateTrigger(run_url=self.run_url, epoch=int(self.epoch),
                                      min_groups=hook.replay_gate_min_groups(), poke_interval=self.poke_interval,
                                      attempt=run_attempt(context)),
            method_name="execute_complete",
            timeout=timedelta(seconds=self.timeout),
        )

    def execute_complete(self, context, event: dict[str, Any] | None = None) -> dict:
        if event and event.get("status") == "skipped":
            raise AirflowSkipException(event["message"])
        event = _raise_on_error(event)
        opened = RunDirHook(self.run_url).open_replay_gate(int(self.epoch), event.get("eligible"))
        self.log.info("replay epoch %s open with %s eligible groups", self.epoch, opened["eligible"])
        return opened
