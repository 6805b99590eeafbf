"""The engine's long-running roles (`rlhf sampler`, `rlhf trainer`, `rlhf finalize`) as tasks."""

from __future__ import annotations

import os
import sys
from typing import Any, Sequence

from airflow.sdk.exceptions import AirflowFailException

from plugins.hooks.run_dir import run_attempt
from plugins.operators.process import SupervisedProcessOperator

ROLES = ("sampler", "trainer", "finalize")
# Roles that run while the run is going and stop on the stop marker.
LOOP_ROLES = ("sampler", "trainer")


def engine_command(role: str, run_url: str, extra_args: Sequence[str] = (), nproc: int = 1) -> list[str]:
    """argv that runs one engine role with the worker's own interpreter (same environment)."""
    from pipeline.local_runner import engine_argv

    if role not in ROLES:
        raise ValueError(f"role {role!r}: choose one of {', '.join(ROLES)}")
    return engine_argv(role, run_url, nproc, extra_args)


class RlhfProcessOperator(SupervisedProcessOperator):
    """Supervises `rlhf <role> --run-dir URL`.

    Both sampler and trainer resume from the run directory when restarted (the trainer from its
    last complete checkpoint, the sampler from the latest published policy), so a retry runs the
    same command. Give GPU-heavy roles a `pool` with one slot per device.

    A failed run cleared in the UI resumes: before its process starts, a sampler or trainer task
    removes the stop marker the teardown wrote for an earlier attempt of the DAG run (never a
    user's stop, nor the one after the trainer finished; see `RunDir.request_stop`). A sampler that
    stops because the trainer task ended without finishing fails without retrying, so that
    clearing the run's failed tasks starts it again with the trainer.
    """

    template_fields: Sequence[str] = ("run_url", "extra_args", "env")

    def __init__(self, *, role: str, run_url: str, extra_args: Sequence[str] = (), **kwargs: Any) -> None:
        if role not in ROLES:
            raise ValueError(f"role {role!r}: choose one of {', '.join(ROLES)}")
        super().__init__(command=(), **kwargs)
        self.role = role
        self.run_url = run_url
        self.extra_args = extra_args

    def build_command(self, context) -> list[str]:
        nproc = 1
        if self.role == "trainer":  # one rank per trainer accelerator of this worker (pipeline.devices)
            from pipeline.devices import trainer_ranks
            from pipeline.rundir import RunDir

            cfg = RunDir(self.run_url).config()
            nproc = trainer_ranks(cfg.devices, cfg.trainer.nproc_per_node, os.environ)
        return engine_command(self.role, self.run_url, self.extra_args, nproc)

    def execute(self, context) -> dict:
        if self.role in LOOP_ROLES:
            self._resume_after_clear(context)
        result = super().execute(context)
        if self.role == "sampler":
            self._fail_if_the_trainer_did_not_finish(context)
        return result

    def _resume_after_clear(self, context) -> None:
        from pipeline.rundir import RunDir

        run = RunDir(self.run_url)
        attempt = run_attempt(context)
        stale = run.clear_stale_stop(attempt)
        if stale is not None:
            self.log.warning("attempt %s of this run: removed the stop marker of attempt %s (%s); the %s resumes",
                             attempt, stale.get("attempt"), stale.get("reason"), self.role)
        elif (stop := run.stop_marker(attempt)) is not None:
            self.log.warning("the run is stopped (%s, by %s): the %s will exit at once",
                             stop.get("reason") or "no reason given", stop.get("by") or "unknown", self.role)

    def _fail_if_the_trainer_did_not_finish(self, context) -> None:
        from pipeline.rundir import RunDir

        run = RunDir(self.run_url)
        stop = run.stop_marker(run_attempt(context))
        if stop is not None and stop.get("attempt") is not None and not run.has_marker(run.TRAINER_DONE_MARKER):
            raise AirflowFailException(
                f"the sampler stopped because the {stop.get('reason') or 'run was stopped'}, and the run is not "
                "finished; clear this DAG run's failed tasks (or the whole run) to resume it from the trainer's "
                "last checkpoint")

    def process_environment(self, context) -> dict[str, str]:
        """The accelerators of this role on this worker (`pipeline.devices`): the sampler and the
        trainer of a run never both take `cuda:0`."""
        from pipeline.devices import role_environment
        from pipeline.rundir import RunDir

        env = role_environment(self.role, RunDir(self.run_url).config().devices, os.environ)
        if env:
            self.log.info("%s devices: %s", self.role, env)
        return env

    def on_retry_start(self, context) -> None:
        self.log.info("retry: %s resumes from the run directory %s", self.role, self.run_url)
