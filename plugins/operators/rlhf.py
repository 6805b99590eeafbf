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


def engine_command(role: str, run_url: str, extra_args: Sequence[str] = (), nproc: int = 1, **launch) -> list[str]:
    """argv that runs one engine role with the worker's own interpreter (same environment);
    `launch`: a multi-node trainer's torchrun settings (`pipeline.local_runner.engine_argv`)."""
    from pipeline.local_runner import engine_argv

    if role not in ROLES:
        raise ValueError(f"role {role!r}: choose one of {', '.join(ROLES)}")
    return engine_argv(role, run_url, nproc, extra_args, **launch)


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

    Gang scheduling: the trainer task (node 0) holds the device-pool slots of the whole run, and
    the tasks built with `wait_for_trainer` (the sampler replicas, trainer nodes 1..M-1) defer,
    holding no worker or pool slot, until it has started in this attempt of the run
    (`RunDir.trainer_started_marker`). So a pool too small for two runs runs one while the other
    waits, instead of two samplers holding every slot for trainers that never start.
    `replica` makes a sampler replica `sampler-<replica>`; `node` is a trainer task's node rank.

    The trainer task logs a progress line every `trainer.log_every` steps, and when no new step
    appears for `trainer.stall_timeout_s` it sends a `trainer_stalled` alert (`plugins.notifiers`),
    stops the trainer and fails, so that its retries resume the run.
    """

    template_fields: Sequence[str] = ("run_url", "extra_args", "env")

    def __init__(self, *, role: str, run_url: str, extra_args: Sequence[str] = (), replica: int | None = None,
                 node: int = 0, wait_for_trainer: bool = False, **kwargs: Any) -> None:
        if role not in ROLES:
            raise ValueError(f"role {role!r}: choose one of {', '.join(ROLES)}")
        super().__init__(command=(), **kwargs)
        self.role = role
        self.run_url = run_url
        self.extra_args = extra_args
        self.replica, self.node, self.wait_for_trainer = replica, int(node), wait_for_trainer
        self._watch = None  # the trainer's progress and stall watch (see `monitor`)
        self._notifier_spec: str | None = None

    def build_command(self, context) -> list[str]:
        nproc = 1
        if self.role == "trainer":  # one rank per trainer accelerator of this worker (pipeline.devices)
            from pipeline.devices import trainer_ranks
            from pipeline.rundir import RunDir

            run = RunDir(self.run_url)
            cfg = run.config()
            nproc = trainer_ranks(cfg.devices, cfg.trainer.nproc_per_node, os.environ)
            if cfg.trainer.nnodes > 1:
                from pipeline import rendezvous

                started = run.marker(RunDir.trainer_started_marker(run_attempt(context))) or {}
                where = rendezvous.endpoint(run, cfg.trainer, self.node, not_before=float(started.get("time", 0)))
                self.log.info("trainer node %d of %d: rendezvous at %s", self.node, cfg.trainer.nnodes, where)
                return engine_command(self.role, self.run_url, self.extra_args, nproc, nnodes=cfg.trainer.nnodes,
                                      node_rank=self.node, rendezvous=where, rendezvous_id=run.run_id)
        from pipeline.sampler.claims import replica_id

        extra = [*self.extra_args, *(("--sampler-id", replica_id(self.replica)) if self.replica is not None else ())]
        return engine_command(self.role, self.run_url, extra, nproc)

    def execute(self, context) -> dict:
        if self.role in LOOP_ROLES:
            self._resume_after_clear(context)
            self._join_gang(context)
        if self.role == "trainer":  # looked up here, not in the monitor's thread
            from plugins.notifiers import configured_spec

            self._notifier_spec = configured_spec()
        result = super().execute(context)
        if self.role == "sampler":
            self._fail_if_the_trainer_did_not_finish(context)
        return result

    def _join_gang(self, context) -> None:
        """Trainer node 0 marks the run's devices held; a task that waits for it defers until then
        (the trigger gives up when the run is stopped; the role then exits at once)."""
        from pipeline.rundir import RunDir

        run = RunDir(self.run_url)
        name = RunDir.trainer_started_marker(run_attempt(context))
        if self.role == "trainer" and self.node == 0:
            import time

            run.set_marker(name, {"attempt": run_attempt(context), "time": time.time()})
        elif self.wait_for_trainer and not run.has_marker(name) and not run.stop_requested(run_attempt(context)):
            from plugins.triggers.run_dir import RunMarkerTrigger

            self.log.info("waiting, holding no slot, for this run's trainer task to start (%s)", name)
            self.defer(trigger=RunMarkerTrigger(run_url=self.run_url, marker=name, attempt=run_attempt(context)),
                       method_name="execute_when_trainer_started")

    def execute_when_trainer_started(self, context, event=None) -> dict:
        return self.execute(context)

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

        cfg = RunDir(self.run_url).config()
        replica = {"replica": self.replica, "replicas": cfg.sampler.replicas} if self.replica is not None else {}
        env = role_environment(self.role, cfg.devices, os.environ, **replica)
        if env:
            self.log.info("%s devices: %s", self.role, env)
        dag_run = context.get("dag_run")
        dag_id, run_id = getattr(dag_run, "dag_id", None), getattr(dag_run, "run_id", None)
        if dag_id and run_id:  # experiment trackers name their run after the DAG run (pipeline.tracking)
            env = {**env, "RLHF_RUN_NAME": f"{dag_id}/{run_id}"}
        return env

    def monitor(self, context) -> str | None:
        """Trainer only: log the progress line every `trainer.log_every` steps, and stop a trainer
        that recorded no new step for `trainer.stall_timeout_s` (`pipeline.progress.TrainerWatch`)."""
        if self.role != "trainer":
            return None
        if self._watch is None:
            from pipeline.progress import TrainerWatch
            from pipeline.rundir import RunDir

            run = RunDir(self.run_url)
            tc = run.config().trainer
            self._watch = TrainerWatch(run, every=tc.log_every, stall_timeout_s=float(tc.stall_timeout_s))
        line, stalled = self._watch.poll()
        if line:
            self.log.info("progress: %s", line)
        return stalled

    def on_monitor_stop(self, context, reason: str) -> None:
        from plugins.notifiers import notify_stall

        notify_stall(context, reason, self._notifier_spec)

    def on_retry_start(self, context) -> None:
        self.log.info("retry: %s resumes from the run directory %s", self.role, self.run_url)
