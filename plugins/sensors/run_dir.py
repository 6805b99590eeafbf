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

from plugins.hooks.run_dir import RunDirHook, phase_done_marker, replay_gate_marker, run_attempt
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
        payload = RunDirHook(self.run_url).marker(phase_done_marker(int(self.phase)))
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
        self.defer(
            trigger=RunMarkerTrigger(run_url=self.run_url, marker=phase_done_marker(int(self.phase)),
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
    """Opens replay epoch `epoch` once L2 holds at least `min_groups` eligible groups.

    Opening means writing `markers/replay_gate_<epoch>.open`, which the trainer waits for. The
    threshold defaults to one optimizer step's worth of groups (`trainer.groups_per_step`).
    """

    template_fields = ("run_url", "epoch", "min_groups")

    def __init__(self, *, run_url: str, epoch: int | str, min_groups: int | str | None = None,
                 deferrable: bool = True, **kwargs: Any) -> None:
        kwargs.setdefault("retries", 1)
        super().__init__(**kwargs)
        self.run_url = run_url
        self.epoch = epoch
        self.min_groups = min_groups
        self.deferrable = deferrable

    def _threshold(self, hook: RunDirHook) -> int:
        if self.min_groups not in (None, ""):
            return int(self.min_groups)
        return int(hook.run.config().trainer.groups_per_step)

    def _open(self, hook: RunDirHook, eligible: int | None) -> dict:
        gate = replay_gate_marker(int(self.epoch))
        if hook.marker(gate) is None:
            hook.set_marker(gate, {"eligible": eligible, "epoch": int(self.epoch)})
            self.log.info("replay epoch %s opened with %s eligible groups", self.epoch, eligible)
        return {"epoch": int(self.epoch), "eligible": eligible}

    def poke(self, context) -> PokeReturnValue:
        hook = RunDirHook(self.run_url)
        existing = hook.marker(replay_gate_marker(int(self.epoch)))
        if existing is not None:
            return PokeReturnValue(is_done=True, xcom_value={"epoch": int(self.epoch),
                                                             "eligible": existing.get("eligible")})
        eligible = hook.eligible_replay_groups()
        if eligible < self._threshold(hook):
            if hook.replay_epoch_skipped(int(self.epoch)):
                raise AirflowSkipException(f"the trainer finished without replay epoch {self.epoch} "
                                           f"({eligible} eligible groups)")
            return PokeReturnValue(is_done=False)
        return PokeReturnValue(is_done=True, xcom_value=self._open(hook, eligible))

    def execute(self, context) -> Any:
        if not self.deferrable:
            return super().execute(context)
        ready = self.poke(context)
        if ready:
            return ready.xcom_value
        hook = RunDirHook(self.run_url)
        self.defer(
            trigger=ReplayGateTrigger(run_url=self.run_url, epoch=int(self.epoch),
                                      min_groups=self._threshold(hook), poke_interval=self.poke_interval,
                                      attempt=run_attempt(context)),
            method_name="execute_complete",
            timeout=timedelta(seconds=self.timeout),
        )

    def execute_complete(self, context, event: dict[str, Any] | None = None) -> dict:
        if event and event.get("status") == "skipped":
            raise AirflowSkipException(event["message"])
        event = _raise_on_error(event)
        return self._open(RunDirHook(self.run_url), event.get("eligible"))
