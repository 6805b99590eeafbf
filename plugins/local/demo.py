"""`rlhf airflow demo`: start a `LocalAirflow`, trigger `rlhf_train`, follow the run, stop."""

from __future__ import annotations

import json
import sys
import time

from plugins.local.client import AirflowClient, AirflowError, quote
from plugins.local.deployment import LocalAirflow

DEMO_CONF = {"config_file": "tiny-grpo.yaml"}


def _progress_line(client: AirflowClient, dag_id: str, run_id: str, run_state: str, t0: float) -> str:
    """`[  61s] running · step 194/400 · reward 0.66 · ... · phase 1/1` (`pipeline.progress`), with
    the tasks that run (before the first trainer step) or failed."""
    tis = client.task_instances(dag_id, run_id)
    running = sorted({ti["task_id"] for ti in tis if ti["state"] == "running"})
    failed = sorted({ti["task_id"] for ti in tis if ti["state"] in ("failed", "up_for_retry")})
    line = ""
    try:
        run_url = client.xcom(dag_id, run_id, "prepare", "run_url")
        from pipeline.progress import progress_line
        from pipeline.rundir import RunDir

        line = progress_line(RunDir(run_url))
    except (AirflowError, OSError, ValueError):
        line = ""
    parts = [f"[{time.monotonic() - t0:6.0f}s] {run_state}"] + ([line] if line else [])
    if running and (not line or line.startswith("waiting")):
        parts.append("running: " + ", ".join(running))
    if failed:
        parts.append("failed or retrying: " + ", ".join(failed))
    return " · ".join(parts)


def demo(af: LocalAirflow, conf: dict, dag_id: str = "rlhf_train", timeout_s: float = 3600) -> int:
    user, password = af.credentials()
    print(f"starting Airflow in {af.home} ...", flush=True)
    client = af.up()
    try:
        print(f"Airflow UI: {af.base_url}  (user {user}, password {password})", flush=True)
        client.wait_for_dag(dag_id)
        client.unpause(dag_id)
        run = client.trigger(dag_id, conf)
        run_id = run["dag_run_id"]
        print(f"triggered {dag_id} run {run_id} with {json.dumps(conf)}", flush=True)
        t0 = time.monotonic()
        tty = sys.stdout.isatty()

        def show(r: dict) -> None:
            line = _progress_line(client, dag_id, run_id, r["state"], t0)
            print(("\r" + line.ljust(110)) if tty else line, end="" if tty else "\n", flush=True)

        final = client.wait_for_run(dag_id, run_id, timeout_s, on_poll=show, poll_s=5.0)
        print()
        dashboard = f"{af.base_url}/rlhf/dags/{quote(dag_id)}/runs/{quote(run_id)}"
        if final["state"] != "success":
            failed = [t["task_id"] for t in client.task_instances(dag_id, run_id) if t["state"] == "failed"]
            print(f"run {run_id} {final['state']}; failed tasks: {', '.join(failed) or '-'}; "
                  f"logs under {af.home / 'logs'}; dashboard {dashboard}")
            return 1
        result = client.xcom(dag_id, run_id, "finalize")
        print(json.dumps(result.get("summary", result), indent=1))
        print(f"run {run_id} succeeded; policy {result.get('policy_url')}")
        print(f"dashboard: {dashboard}")
        return 0
    finally:
        af.down()
        print("Airflow stopped", flush=True)
