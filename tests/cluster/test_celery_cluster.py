"""A small cluster on this machine: Airflow with the CeleryExecutor and Postgres, Redis as the
broker, two Celery workers (queue `default`, and the device queue `gpu` that sampler, trainer and
finalize go to: RLHF_DEVICE_QUEUE), each in a working directory of its own, and the run directory
on an S3 endpoint (moto's server on 127.0.0.1). Everything is started by the test and removed
after it, also when it fails.

1. A full `rlhf_train` run succeeds; the sampler and the trainer ran on the device worker, the
   other tasks on the default worker (the hostname each task instance recorded).
2. The same run with the device worker SIGKILLed mid-run, as when its machine dies: its process
   group, and the sampler and trainer processes it supervised (which run in sessions of their
   own, so a lost machine takes them along). The supervisor restarts the worker; Airflow notices
   the lost heartbeats and retries both tasks there; the trainer resumes from its checkpoint on
   S3; every fresh group of the buffer's commit log is trained exactly once (the trainer's
   lineage ledger against the commit log, and the buffer's cursor), none twice, none skipped.

    make test-cluster        # installs Postgres/Redis if missing and the `cluster` extra; ~5 min
"""

import importlib.util
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "buffer"))
sys.path.insert(0, str(Path(__file__).parent))

DEVICE_QUEUE = "gpu"
# How soon Airflow notices a dead worker's tasks (defaults: 300 s); see bench/chaos.py.
DETECTION_ENV = {"AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT": "30",
                 "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT_DETECTION_INTERVAL": "5",
                 "AIRFLOW__SCHEDULER__ORPHANED_TASKS_CHECK_INTERVAL": "15"}
OVERRIDES = {"data.eval_size": 16, "trainer.groups_per_step": 8, "trainer.checkpoint_every": 3,
             "trainer.sync_every": 2, "sampler.poll_s": 0.2}
FULL = {"config_file": "tiny-grpo.yaml", "steps": 8, "phases": 2, "replay_epochs": 0, "run_name": "cluster-full",
        "overrides": OVERRIDES}
KILLED = {**FULL, "steps": 40, "run_name": "cluster-killed"}
RUN_TIMEOUT_S = 360


def say(msg: str) -> None:
    print(f"[cluster {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def chaos_module():
    spec = importlib.util.spec_from_file_location("chaos_analysis", REPO / "bench" / "chaos.py")
    module = sys.modules.get(spec.name)
    if module is None:
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # its dataclasses look their module up there
        spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def cluster():
    from s3_endpoint import moto_s3
    from servers import free_port, postgres, redis
    from spawner import Spawner

    from pipeline.example import ensure_example
    from plugins.local.deployment import LocalAirflow
    from plugins.local.workers import CeleryWorker

    t0 = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="rlhf-cluster-"))
    ensure_example("sort", 0)  # the tiny model, once, before the components compete for the cores
    try:
        with Spawner() as spawner, postgres(spawner, tmp) as db_url, redis(spawner, tmp) as broker_url, \
                moto_s3("rlhf-cluster") as bucket:
            workers = [CeleryWorker("default", ("default",), concurrency=2, cwd=str(tmp / "worker-default")),
                       CeleryWorker("device", (DEVICE_QUEUE,), concurrency=4, cwd=str(tmp / "worker-device"))]
            af = LocalAirflow(home=tmp / "airflow", port=free_port(), runs_root=f"s3://{bucket}/runs",
                              database_url=db_url, broker_url=broker_url, workers=workers,
                              extra_env={"RLHF_DEVICE_QUEUE": DEVICE_QUEUE, **DETECTION_ENV})
            say(f"postgres {db_url}, redis {broker_url}, runs on s3://{bucket}/runs (moto on "
                f"{os.environ['FSSPEC_S3_ENDPOINT_URL']})")
            try:
                client = af.up(wait_s=400)
                say(f"airflow up in {time.monotonic() - t0:.0f}s: {', '.join(af.pids())} (CeleryExecutor)")
                client.wait_for_dag("rlhf_train", timeout_s=300)
                client.unpause("rlhf_train")
                yield {"af": af, "client": client, "tmp": tmp, "t0": t0}
            finally:
                af.down()
    finally:
        say(f"cluster removed; {time.monotonic() - t0:.0f}s in all")
        shutil.rmtree(tmp, ignore_errors=True)


def run_url_of(client, run_id: str) -> str | None:
    code, body = client.call("GET", f"/api/v2/dags/rlhf_train/dagRuns/{run_id}/taskInstances/prepare/xcomEntries/run_url")
    return body["value"] if code == 200 else None


def task_hosts(client, run_id: str) -> dict[str, list[tuple[int, str, str]]]:
    """task id -> [(try, state, hostname)] of every try (the current one from the task instance,
    earlier ones from its tries)."""
    out: dict[str, list[tuple[int, str, str]]] = {}
    for ti in client.task_instances("rlhf_train", run_id):
        if ti.get("map_index", -1) not in (-1, 0):
            continue
        path = f"/api/v2/dags/rlhf_train/dagRuns/{run_id}/taskInstances/{ti['task_id']}/tries"
        if ti.get("map_index", -1) >= 0:
            path = f"/api/v2/dags/rlhf_train/dagRuns/{run_id}/taskInstances/{ti['task_id']}/{ti['map_index']}/tries"
        code, body = client.call("GET", path)
        tries = body.get("task_instances", []) if code == 200 and isinstance(body, dict) else [ti]
        out[ti["task_id"]] = sorted((int(t.get("try_number") or 0), t.get("state"), t.get("hostname") or "")
                                    for t in tries)
    return out


def exactly_once(run_url: str) -> dict:
    """Which committed fresh groups the final weights were trained on, from data: the buffer's
    commit log (every L1 `add`, in the order the trainer reads them) against the trainer's lineage
    ledger (the groups of every update, written before each checkpoint and rolled back to it on
    resume, so the updates a killed trainer lost are not counted). Also bench/chaos.py's matching
    of the trainer's metrics records to the same commit log, reported beside it."""
    from collections import Counter

    from pipeline.buffer import ReplayBuffer
    from pipeline.lineage import read_ledger
    from pipeline.rundir import RunDir

    chaos, run = chaos_module(), RunDir(run_url)
    buf = ReplayBuffer(run.buffer_url, run.config().buffer)
    order = [g["id"] for g in chaos.committed_fresh_groups(buf, chaos.log_actions(buf))]
    ledger = read_ledger(run).to_pydict()
    fresh = [(step, gid) for step, gid, kind in zip(ledger["step"], ledger["group_id"], ledger["kind"]) if kind == "fresh"]
    counts = Counter(gid for _, gid in fresh)
    frontier = max((i + 1 for i, gid in enumerate(order) if counts.get(gid)), default=0)
    consumed = int((buf.refresh().consumed.get("trainer") or {}).get("groups", -1))
    return {"groups_committed": len(order), "groups_trained": len(counts),
            "groups_lost": sum(1 for gid in order[:frontier] if not counts.get(gid)),
            "groups_trained_twice": sum(1 for n in counts.values() if n >= 2),
            "groups_never_committed": len(set(counts) - set(order)),
            "fresh_steps": sorted({step for step, _ in fresh}), "buffer_consumed": consumed,
            "metrics": {k: v for k, v in chaos.exactly_once(run).items()
                        if k in ("groups_lost", "groups_trained_twice", "unmatched_steps", "steps_recorded_ok")}}


def assert_exactly_once(found: dict, steps: int, groups_per_step: int) -> None:
    assert found["groups_lost"] == 0 and found["groups_trained_twice"] == 0, found
    assert found["groups_never_committed"] == 0 and found["fresh_steps"] == list(range(1, steps + 1)), found
    assert found["groups_trained"] == steps * groups_per_step == found["buffer_consumed"], found
    assert found["groups_trained"] <= found["groups_committed"], found


def engine_processes(worker: str) -> list[int]:
    """Process groups of the engine processes (`python -m pipeline ...`) a worker started: the
    operator passes RLHF_* variables on, so they carry the worker's name."""
    from plugins.local.workers import WORKER_NAME_ENV

    groups = set()
    for d in Path("/proc").glob("[0-9]*"):
        try:
            argv = (d / "cmdline").read_bytes().split(b"\0")
            env = (d / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"pipeline" in argv and f"{WORKER_NAME_ENV}={worker}".encode() in env:
            groups.add(os.getpgid(int(d.name)))
    return sorted(groups)


def print_tasks(hosts: dict) -> None:
    for task_id in ("prepare", "sampler", "trainer", "phase.reshard", "finalize", "stop_sampler"):
        for try_number, state, host in hosts.get(task_id, []):
            say(f"  {task_id:<14} try {try_number}: {state:<8} on {host}")


def test_a_full_run_succeeds_with_device_tasks_on_the_device_worker(cluster):
    client = cluster["client"]
    run_id = client.trigger("rlhf_train", FULL)["dag_run_id"]
    t0 = time.monotonic()
    final = client.wait_for_run("rlhf_train", run_id, timeout_s=RUN_TIMEOUT_S)
    hosts = task_hosts(client, run_id)
    say(f"run 1 ({FULL['steps']} steps): {final['state']} in {time.monotonic() - t0:.0f}s")
    print_tasks(hosts)
    assert final["state"] == "success", hosts
    for task_id in ("sampler", "trainer", "finalize"):
        assert hosts[task_id][-1][2].endswith("-device"), (task_id, hosts[task_id])
    for task_id in ("prepare", "stop_sampler"):
        assert hosts[task_id][-1][2].endswith("-default"), (task_id, hosts[task_id])
    run_url = run_url_of(client, run_id)
    assert run_url.startswith("s3://")
    found = exactly_once(run_url)
    say(f"run 1 exactly once: {found['groups_trained']} groups trained of {found['groups_committed']} committed, "
        f"{found['groups_lost']} lost, {found['groups_trained_twice']} trained twice (lineage ledger vs commit log); "
        f"metrics records: {found['metrics']}")
    assert_exactly_once(found, FULL["steps"], OVERRIDES["trainer.groups_per_step"])


def kill_device_worker(af, run_url: str) -> dict:
    """SIGKILL the device worker's process group and the engine groups it started, at once."""
    from pipeline.rundir import RunDir

    engines = engine_processes("device")
    worker = af.pids()["worker-device"]
    os.killpg(worker, signal.SIGKILL)
    for pgid in engines:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    # the newest checkpoint is at least the first phase's (metrics on S3 reach storage in batches)
    run = RunDir(run_url)
    return {"worker_pgid": worker, "engine_pgids": engines,
            "checkpointed_step": int((run.marker("phase_0.done") or {}).get("step", 0)),
            "trainer_step_logged": max((r["step"] for r in run.read_metrics("trainer") if "step" in r), default=0)}


def test_a_killed_device_worker_is_retried_and_resumes_training_each_group_once(cluster):
    from pipeline.rundir import RunDir

    af, client = cluster["af"], cluster["client"]
    run_id = client.trigger("rlhf_train", KILLED)["dag_run_id"]
    t0, deadline = time.monotonic(), time.monotonic() + RUN_TIMEOUT_S
    run_url, killed = None, None
    while killed is None and time.monotonic() < deadline:
        assert client.dag_run("rlhf_train", run_id)["state"] not in ("success", "failed"), "ended before the kill"
        run_url = run_url or run_url_of(client, run_id)
        if run_url:
            run = RunDir(run_url)
            assert not run.has_marker("trainer_done"), "the trainer finished before it could be killed; raise steps"
            # after the first phase's checkpoint, while both device tasks run on the worker
            if run.has_marker("phase_0.done") and len(engine_processes("device")) >= 2:
                killed = kill_device_worker(af, run_url)
        time.sleep(0.5)
    assert killed is not None, "the device worker never ran both engine processes"
    say(f"run 2: SIGKILLed worker-device (process group {killed['worker_pgid']}) and the engine groups it "
        f"supervised {killed['engine_pgids']}, {time.monotonic() - t0:.0f}s in; the trainer had checkpointed step "
        f"{killed['checkpointed_step']} (logged up to step {killed['trainer_step_logged']})")
    final = client.wait_for_run("rlhf_train", run_id, timeout_s=max(deadline - time.monotonic(), 1))
    hosts = task_hosts(client, run_id)
    restarts = af.status()["components"]["worker-device"]["restarts"]
    say(f"run 2 ({KILLED['steps']} steps): {final['state']} in {time.monotonic() - t0:.0f}s; "
        f"worker-device restarted {restarts}x by the supervisor")
    print_tasks(hosts)
    assert final["state"] == "success", hosts
    assert restarts >= 1
    trainer_tries = hosts["trainer"]
    assert len(trainer_tries) >= 2 and trainer_tries[-1][1] == "success", trainer_tries
    assert all(host.endswith("-device") for _, _, host in trainer_tries), trainer_tries
    records = RunDir(run_url).read_metrics("trainer")
    resumed = [r["resumed_step"] for r in records if r.get("event") == "start" and r.get("resumed_step")]
    say(f"run 2 trainer retried: try {trainer_tries[-1][0]} resumed from the checkpoint of step "
        f"{resumed[-1] if resumed else None} on S3")
    # from the checkpoint it had when killed (or a later one), neither from scratch nor from the end
    assert resumed and killed["checkpointed_step"] <= resumed[-1] < KILLED["steps"], (resumed, killed)
    found = exactly_once(run_url)
    say(f"run 2 exactly once: {found['groups_trained']} groups trained of {found['groups_committed']} committed, "
        f"{found['groups_lost']} lost, {found['groups_trained_twice']} trained twice (lineage ledger vs commit log; "
        f"buffer cursor {found['buffer_consumed']}); metrics records: {found['metrics']}")
    say(json.dumps({k: v for k, v in found.items() if k != "fresh_steps"}))
    assert_exactly_once(found, KILLED["steps"], OVERRIDES["trainer.groups_per_step"])
