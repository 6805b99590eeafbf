"""Triggers that wait on a run directory in the triggerer, so waiting sensors hold no worker slot.

Both poll shared storage; every fsspec call runs in a thread (`asyncio.to_thread`) because the
triggerer's event loop serves every deferred task of the deployment. Both give up with an error
event when the run is stopped (the teardown writes the stop marker once the trainer task has
finished for good), so a sensor never waits out its timeout for a trainer that is gone. A stop
that ended an earlier attempt of the run (before it was cleared in the UI) does not count for the
sensor of a later attempt: `attempt` is the DAG run's clear count the sensor ran with.
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

from airflow.triggers.base import BaseTrigger, TriggerEvent

from plugins.hooks.run_dir import RunDirHook


class RunMarkerTrigger(BaseTrigger):
    """Fires when `markers/<marker>.json` exists in the run directory; its payload is the event's."""

    def __init__(self, *, run_url: str, marker: str, poke_interval: float = 5.0, fail_on_stop: bool = True,
                 attempt: int | None = None):
        super().__init__()
        self.run_url = run_url
        self.marker = marker
        self.poke_interval = float(poke_interval)
        self.fail_on_stop = fail_on_stop
        self.attempt = attempt

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            f"{type(self).__module__}.{type(self).__qualname__}",
            {"run_url": self.run_url, "marker": self.marker, "poke_interval": self.poke_interval,
             "fail_on_stop": self.fail_on_stop, "attempt": self.attempt},
        )

    async def run(self) -> AsyncIterator[TriggerEvent]:
        hook = RunDirHook(self.run_url)
        while True:
            payload = await asyncio.to_thread(hook.marker, self.marker)
            if payload is not None:
                yield TriggerEvent({"status": "success", "marker": self.marker, "payload": payload})
                return
            if self.fail_on_stop and await asyncio.to_thread(hook.stop_requested, self.attempt):
                # The marker may have been written just before the stop: look once more.
                payload = await asyncio.to_thread(hook.marker, self.marker)
                if payload is not None:
                    yield TriggerEvent({"status": "success", "marker": self.marker, "payload": payload})
                else:
                    yield TriggerEvent({"status": "error", "marker": self.marker,
                                        "message": f"run {self.run_url} was stopped before marker "
                                                   f"{self.marker!r} appeared (did the trainer fail?)"})
                return
            await asyncio.sleep(self.poke_interval)


class ReplayGateTrigger(BaseTrigger):
    """Fires when replay gate `epoch` is ready by the engine's condition
    (`pipeline.orchestration.replay_gate_ready`, with the threshold `min_groups` the sensor took
    from the run's config), or when the gate is already open (e.g. on a retried sensor). It only
    reads: the sensor opens the gate when it resumes."""

    def __init__(self, *, run_url: str, epoch: int, min_groups: int, poke_interval: float = 5.0,
                 attempt: int | None = None):
        super().__init__()
        self.run_url = run_url
        self.epoch = int(epoch)
        self.min_groups = int(min_groups)
        self.poke_interval = float(poke_interval)
        self.attempt = attempt

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            f"{type(self).__module__}.{type(self).__qualname__}",
            {"run_url": self.run_url, "epoch": self.epoch, "min_groups": self.min_groups,
             "poke_interval": self.poke_interval, "attempt": self.attempt},
        )

    async def run(self) -> AsyncIterator[TriggerEvent]:
        hook = RunDirHook(self.run_url)
        while True:
            gate = await asyncio.to_thread(hook.replay_gate, self.epoch, self.min_groups)
            eligible = gate["eligible"]
            if gate["ready"]:
                yield TriggerEvent({"status": "success", "epoch": self.epoch, "eligible": eligible,
                                    "already_open": gate["open"]})
                return
            if await asyncio.to_thread(hook.replay_epoch_skipped, self.epoch):
                yield TriggerEvent({"status": "skipped", "epoch": self.epoch, "eligible": eligible,
                                    "message": f"the trainer finished without replay epoch {self.epoch}: "
                                               f"{eligible} eligible groups (< {self.min_groups})"})
                return
            if await asyncio.to_thread(hook.stop_requested, self.attempt):
                yield TriggerEvent({"status": "error", "epoch": self.epoch,
                                    "message": f"run {self.run_url} was stopped with {eligible} eligible "
                                               f"replay groups (< {self.min_groups}) for epoch {self.epoch}"})
                return
            await asyncio.sleep(self.poke_interval)
