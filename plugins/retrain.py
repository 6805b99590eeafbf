"""Inputs of a scheduled retraining run: the dated prompt partition and the starting policy."""

from __future__ import annotations

import os
import re
from datetime import datetime

PROMPTS_ROOT_ENV = "RLHF_PROMPTS_ROOT"
DATE_RE = re.compile(r"^\d{4}-\d{2}-\d{2}$")
QUEUED_WAIT_S = 300.0


def partition_date(logical_date: datetime | None, dag_run) -> str:
    """YYYY-MM-DD of the run: its logical date, or its run_after for runs triggered without one."""
    when = logical_date or getattr(dag_run, "logical_date", None) or dag_run.run_after
    return when.strftime("%Y-%m-%d")


def registry_url(root: str, dag_id: str) -> str:
    return f"{root}/registry/{dag_id}.json"


def partition_url(prompts_root: str, date: str) -> str:
    """The dataset of `date`: the folder `<prompts_root>/ds=<date>` of Parquet files, which prepare
    stages into the run (`pipeline.data`: a folder of Parquet files is a dataset)."""
    from pipeline.data import data_files
    from pipeline.storage import url_to_fs

    if not DATE_RE.match(date):
        raise ValueError(f"partition date {date!r} is not YYYY-MM-DD")
    fs, root = url_to_fs(prompts_root)
    if not data_files(fs, f"{root}/ds={date}"):
        raise FileNotFoundError(f"no prompts for {date}: {prompts_root}/ds={date}/*.parquet is empty or missing")
    return f"{prompts_root}/ds={date}"


def wait_for_earlier_run(ti, poll_s: float = 5.0, timeout_s: float = 12 * 3600) -> None:
    """Wait while the run of the previous logical date is still going: this date starts from the
    policy that one registers. The DAG's max_active_runs=1 orders scheduled runs, but a backfill
    that reprocesses a date which already ran starts that run beside the backfill's own ones."""
    import time

    previous = ti.get_previous_dagrun()
    if previous is None:
        return
    start = time.monotonic()
    state = ti.get_dagrun_state(previous.dag_id, previous.run_id)
    # a queued one may be waiting for a slot this run holds: wait for it only a while
    while state == "running" or (state == "queued" and time.monotonic() - start < QUEUED_WAIT_S):
        if time.monotonic() - start > timeout_s:
            raise TimeoutError(f"the earlier run {previous.run_id} is still {state} after {timeout_s:.0f} s")
        print(f"waiting for the earlier run {previous.run_id} ({state}): this date starts from its policy")
        time.sleep(poll_s)
        state = ti.get_dagrun_state(previous.dag_id, previous.run_id)


def prepare_retrain(dag_id: str, params: dict, conf: dict | None, date: str, runs_root: str,
                    dag_run_id: str | None = None) -> dict:
    from plugins.dag_params import check_conf_keys, storage_root
    from plugins.registry import PolicyRegistry
    from plugins.taskgroups import prepare_run

    check_conf_keys(conf or {}, params)
    prompts_root = (params.get("prompts_root") or os.environ.get(PROMPTS_ROOT_ENV) or "").rstrip("/")
    if not prompts_root:
        raise ValueError(f"prompts_root: empty; pass the root of the ds=YYYY-MM-DD partitions or set ${PROMPTS_ROOT_ENV}")
    prompts_root = storage_root(prompts_root, "prompts_root")  # absolute, a supported store, no '..'
    run_name = f"{dag_id}-{date}"
    inputs = partition_url(prompts_root, date)
    previous = PolicyRegistry(registry_url(runs_root, dag_id)).previous(date)
    extra = {"data.train": inputs}
    if previous is not None:
        extra["model.path"] = previous["policy_url"]
    start = previous["policy_url"] if previous else "the form's model"
    print(f"{date}: prompts from {inputs}; starting from {start}")
    out = prepare_run(dag_id, params, None, run_name, extra, rerun_suffix=True, dag_run_id=dag_run_id)
    return {**out, "date": date, "start_policy": previous["policy_url"] if previous else None}


def register_policy(dag_id: str, prepared: dict, finalized: dict) -> dict:
    from plugins.dag_params import runs_root
    from plugins.registry import PolicyRegistry

    root = prepared["run_url"].rsplit("/", 1)[0]
    entry = {"run_url": finalized["run_url"], "policy_url": finalized["policy_url"],
             "version": finalized["version"], "eval_after": finalized.get("eval_after"),
             "started_from": prepared.get("start_policy")}
    PolicyRegistry(registry_url(runs_root(root), dag_id)).record(prepared["date"], entry)
    return entry
