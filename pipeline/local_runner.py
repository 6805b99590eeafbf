"""The local runner: prepare, sampler(s) and trainer as OS processes, finalize.

It takes the steps the Airflow DAG takes, through the same functions (`pipeline.orchestration`):
`prepare` (the prepare task), two subprocesses `rlhf sampler` / `rlhf trainer` (the two
long-running tasks), `advance` on every tick (the reshard tasks and the replay-gate sensors),
`stop_after_trainer` (the teardown) and `finalize` (the finalize task).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time

from . import orchestration
from .config import RunConfig
from .devices import role_environment, trainer_ranks
from .processes import RunFailed, group_alive, stop_group
from .rundir import RunDir, new_run_id, run_url_for
from .sampler.claims import replica_ids
from .signals import StopSignal, default_stop_signals
from .storage import is_storage_error

log = logging.getLogger("rlhf.runner")


def _child(cmd: str, run: RunDir, cfg: RunConfig, threads: int, nproc: int = 1, replica: int = 0,
           extra_args=(), **launch) -> subprocess.Popen:
    """`python -m pipeline <cmd>` (under torchrun when nproc > 1) on the accelerators of its role."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
               TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    env.update(role_environment(cmd, cfg.devices, os.environ, replica=replica, replicas=cfg.sampler.replicas))
    # A session of its own: a terminal's Ctrl-C or hangup reaches the runner only, which stops the
    # children through the stop marker (and SIGTERM to their group if they overstay).
    return subprocess.Popen(engine_argv(cmd, run.url, nproc, extra_args, **launch), env=env,
                            start_new_session=True, preexec_fn=default_stop_signals)


class Replicas:
    """Several processes of one role as one process for the runner: running while any runs.
    Sampler replicas (`all_needed=False`): one that fails while others run is logged and left out
    (the others claim its share of the draws), and the group fails only if none ended cleanly.
    Trainer nodes (`all_needed=True`): one failing is the trainer failing, and the others are
    stopped."""

    def __init__(self, procs: dict[str, subprocess.Popen], all_needed: bool = False):
        self.procs, self.lost, self.all_needed = procs, set(), all_needed

    @property
    def pid(self) -> int:
        return next(iter(self.procs.values())).pid

    def poll(self) -> int | None:
        codes = {k: p.poll() for k, p in self.procs.items()}
        failed = [rc for rc in codes.values() if rc not in (None, 0)]
        if self.all_needed and failed:
            for p in self.procs.values():
                if p.poll() is None:
                    stop_group(p.pid, grace_s=10.0)
            return failed[0]
        self._report(codes)
        if any(rc is None for rc in codes.values()):
            return None
        return self._outcome(list(codes.values()))

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        codes = {k: p.wait(timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
                 for k, p in self.procs.items()}
        self._report(codes)
        return self._outcome(list(codes.values()))

    def _report(self, codes: dict[str, int | None]) -> None:
        """Log each replica that failed, once: the group's outcome can hide it (the others finished)."""
        for k, rc in codes.items():
            if rc not in (None, 0) and k not in self.lost and len(self.procs) > 1:
                self.lost.add(k)
                log.warning("%s exited with %s; %d of %d still running", k, rc,
                            sum(c is None for c in codes.values()), len(codes))

    def _outcome(self, codes: list[int]) -> int:
        """The group's exit code once every process has ended."""
        if not self.all_needed and 0 in codes:
            return 0  # the replicas that remained finished the run
        return next((rc for rc in codes if rc != 0), 0)


def engine_argv(role: str, run_url: str, nproc: int = 1, extra_args=(), *, nnodes: int = 1, node_rank: int = 0,
                rendezvous: str | None = None, rendezvous_id: str = "rlhf") -> list[str]:
    """argv of one engine role with this interpreter. Several trainer ranks run under torchrun: on
    one node standalone, across `nnodes` nodes through the c10d rendezvous at `rendezvous`."""
    if nnodes > 1:
        launcher = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--node-rank={node_rank}",
                    f"--nproc-per-node={nproc}", "--rdzv-backend=c10d", f"--rdzv-endpoint={rendezvous}",
                    f"--rdzv-id={rendezvous_id}"]
    elif nproc > 1:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    else:
        launcher = [sys.executable]
    return [*launcher, "-m", "pipeline", role, "--run-dir", run_url, *map(str, extra_args)]


def run_local(cfg: RunConfig, run_url: str | None = None, progress: bool = True,
              runs_root: str = orchestration.DEFAULT_RUNS_ROOT) -> dict:
    """prepare -> sampler + trainer subprocesses -> finalize.

    Ctrl-C, SIGTERM and SIGHUP stop runner, sampler and trainer cleanly: the runner writes the
    stop marker, the sampler commits its queued shards, the trainer stops at its next wait
    (`pipeline.signals`).
    Started with SIGINT ignored (`rlhf run ... &` in a script) or SIGHUP ignored (nohup), the
    runner keeps ignoring it, as whoever started it that way intends; SIGTERM still stops it. The
    sampler and trainer get the default dispositions back instead of inheriting the ignore.
    """
    from .progress import follow

    t_start = time.time()
    run = RunDir(run_url or run_url_for(runs_root, cfg.run_id or new_run_id()))
    # A new run: the engines start now and load their libraries while the run is prepared (they
    # wait for its last write); a run that exists (a resume) is prepared first.
    procs: dict[str, subprocess.Popen] = {}
    prepared = False
    try:
        early = not run.exists()
        if early:
            procs = _engines(run, cfg, ("--after-prepare",))
        run = orchestration.prepare(cfg, run.url)
        prepared = True
        log.info("run directory: %s", run.url)
        if not early:
            _resume_after_a_runner_stop(run)
            procs = _engines(run, cfg)
        frozen, settled = run.config(), set()  # read once: the run's config does not change while it runs
        follow(run, procs, show_bar=progress, on_tick=lambda: orchestration.advance(run, frozen, settled), cfg=frozen)
        rc = procs["trainer"].wait()
        if rc == 0 and not run.has_marker(RunDir.TRAINER_DONE_MARKER):
            stop = run.marker(RunDir.STOP_MARKER) or {}
            raise RunFailed(f"the trainer stopped before its last step ({stop.get('reason') or 'stop marker'}); "
                               "the run is not finished: run the same command again to resume it")
        if rc == 0:
            # the last phase's checkpoint becomes the final policy version
            orchestration.advance(run, frozen, settled)
        orchestration.stop_after_trainer(run, by="runner", unfinished=f"trainer exited with {rc}")
        src = procs["sampler"].wait(timeout=120)
        for p in _processes(procs):  # what a child left running in its group (an engine's workers)
            _terminate(p, grace_s=0.0)
        if rc != 0 or src != 0:
            raise RunFailed(f"trainer exited with {rc}, sampler with {src}; see the output above and {run.url}/metrics; "
                            "the same command resumes the run from its last checkpoint once the cause is fixed")
    except BaseException as e:
        _stop_engines(run if prepared else None, procs, e)
        if is_storage_error(e):
            raise _storage_failed(run, e, "the engines are stopped. " + (
                "The same command resumes the run from its last checkpoint" if prepared else
                "Nothing ran; the same command tries again")) from e
        raise
    return _finalize(run, t_start)


def _finalize(run: RunDir, t_start: float) -> dict:
    """finalize, then summary.json with the command's time (`total_s`)."""
    try:
        summary = orchestration.finalize(run)
        summary["total_s"] = round(time.time() - t_start, 2)
        run.write_json("summary.json", summary)
    except Exception as e:
        if is_storage_error(e):
            raise _storage_failed(run, e, "training is done; the same command finalizes the run") from e
        raise
    return summary


def _storage_failed(run: RunDir, e: BaseException, then: str) -> RunFailed:
    """The one line `rlhf run` ends with when storage failed (its traceback at debug level, -v)."""
    log.debug("storage failure", exc_info=e)
    return RunFailed(f"{run.url}: storage failed ({type(e).__name__}: {e}); {then}")


def _stop_engines(run: RunDir | None, procs: dict, e: BaseException) -> None:
    """Ctrl-C or a failure `e`: ask the engines to stop at their next poll, then make sure. Before
    the run is prepared (`run` None) they only wait for it: stopped at once, nothing written."""
    marked = False
    try:
        marked = run is not None and _request_stop(run, e)
    finally:  # a second Ctrl-C while the marker is written still stops them, at once
        deadline = time.monotonic() + (15 if marked else 0)  # without the marker, signals at once
        for p in _processes(procs):
            _terminate(p, grace_s=max(0.0, deadline - time.monotonic()))


def _request_stop(run: RunDir, e: BaseException) -> bool:
    """Write the runner's stop marker for `e` (a user's stop stays); False if the storage failed
    (the failure being stopped for, often): the engines are then left to the signals that follow."""
    try:
        if not run.has_marker(RunDir.STOP_MARKER):
            run.request_stop(f"interrupted by {e.signum.name}" if isinstance(e, StopSignal) else
                             "interrupted" if isinstance(e, KeyboardInterrupt) else f"runner failed: {e}", by="runner")
        return True
    except Exception as err:
        log.warning("could not write the stop marker to %s (%s); stopping the engines by signal", run.url, err)
        return False


def _engines(run: RunDir, cfg: RunConfig, extra_args=()) -> dict:
    """The sampler replicas and the trainer, started with `extra_args` each. If one cannot be
    started, those already started are stopped (nothing else knows of them yet)."""
    started: list[subprocess.Popen] = []

    def child(*args, **kwargs) -> subprocess.Popen:
        started.append(_child(*args, **kwargs))
        return started[-1]

    try:
        samplers = Replicas({sid: child("sampler", run, cfg, cfg.sampler.threads, replica=i,
                                        extra_args=(*extra_args, "--sampler-id", sid))
                             for i, sid in enumerate(replica_ids(cfg.sampler.replicas))})
        return {"sampler": samplers, "trainer": _trainer(run, cfg, extra_args, child)}
    except BaseException:
        for p in started:
            _terminate(p, grace_s=0.0)
        raise


def _trainer(run: RunDir, cfg: RunConfig, extra_args, child):
    """The trainer: one launcher, or with `trainer.nnodes: M` M launchers on this machine standing
    in for M nodes, meeting at a loopback rendezvous (what M Airflow tasks do across machines)."""
    nproc = trainer_ranks(cfg.devices, cfg.trainer.nproc_per_node)
    tc = cfg.trainer
    if tc.nnodes == 1:
        return child("trainer", run, cfg, tc.threads, nproc, extra_args=extra_args)
    from .rendezvous import free_port

    where = tc.rendezvous or f"127.0.0.1:{free_port()}"
    return Replicas({f"trainer-node-{i}": child("trainer", run, cfg, tc.threads, nproc, extra_args=extra_args,
                                                  nnodes=tc.nnodes, node_rank=i, rendezvous=where,
                                                  rendezvous_id=run.run_id)
                     for i in range(tc.nnodes)}, all_needed=True)


def _resume_after_a_runner_stop(run: RunDir) -> None:
    """Rerunning `rlhf run` on an unfinished run resumes it: the stop marker an earlier runner
    wrote when it was interrupted or failed is removed (a user's stop stays, and so does the one
    after a finished trainer)."""
    stop = run.marker(RunDir.STOP_MARKER)
    if stop and stop.get("by") == "runner" and not run.has_marker(RunDir.TRAINER_DONE_MARKER):
        run.delete_marker(RunDir.STOP_MARKER)
        log.info("resuming %s: removed the stop of the previous attempt (%s)", run.url, stop.get("reason"))


def _processes(procs: dict) -> list[subprocess.Popen]:
    return [q for p in procs.values() for q in (p.procs.values() if isinstance(p, Replicas) else [p])]


def _terminate(p: subprocess.Popen, grace_s: float = 10.0) -> None:
    """Wait up to `grace_s` for a clean exit (stop marker), then stop the group (SIGTERM, then
    SIGKILL after 10 s): also when the child itself has exited, what it left in its group (torchrun's
    workers after the launcher died, an engine's subprocesses)."""
    try:
        p.wait(timeout=grace_s)
        if not group_alive(p.pid):
            return
    except subprocess.TimeoutExpired:
        pass
    stop_group(p.pid, grace_s=10.0)
    try:
        p.wait(timeout=10.0)
    except subprocess.TimeoutExpired:
        pass
