"""Alerts through Airflow's notifiers, run by real Airflow (`dag.test()`: the task runner, the
scheduler's run-state logic and the DAG's failure callback), recorded by the file notifier.

- a DAG run whose task fails, and fails again on its retry, sends exactly one `run_failed` alert;
- a successful run sends none;
- a trainer task whose trainer records no step (no sampler feeds it) sends exactly one
  `trainer_stalled` alert, stops the trainer's processes and fails the task.

`dag.test()` runs only DAGs of a DAG bundle: each test writes its DAG file into a DAGS_FOLDER of its own.
"""

from __future__ import annotations

import importlib.util
import json
import os
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def metadata_db():
    import subprocess
    import sys

    airflow = Path(sys.executable).with_name("airflow")
    subprocess.run([str(airflow), "db", "migrate"], check=True, capture_output=True, env=dict(os.environ), timeout=300)


@pytest.fixture
def alerts(tmp_path, monkeypatch, metadata_db):
    path = tmp_path / "alerts.jsonl"
    monkeypatch.setenv("RLHF_NOTIFIER", f"file:{path}")

    def read() -> list[dict]:
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    return read


@pytest.fixture(scope="module")
def dags_folder(tmp_path_factory):
    """A DAG bundle of its own for the module's DAG files."""
    folder = tmp_path_factory.mktemp("dags")
    bundles = [{"name": "alerts-tests", "classpath": "airflow.dag_processing.bundles.local.LocalDagBundle",
                "kwargs": {"path": str(folder), "refresh_interval": 0}}]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AIRFLOW__CORE__DAGS_FOLDER", str(folder))
        mp.setenv("AIRFLOW__DAG_PROCESSOR__DAG_BUNDLE_CONFIG_LIST", json.dumps(bundles))
        yield folder


@pytest.fixture
def dag_file(dags_folder):
    folder = dags_folder

    def load(name: str, source: str):
        path = folder / f"{name}.py"
        path.write_text(textwrap.dedent(source))
        spec = importlib.util.spec_from_file_location(f"alerts_dag_{name}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module.dag

    return load


HEADER = """
from datetime import datetime, timedelta
from airflow.sdk import DAG, task
from plugins.notifiers import RunFailureAlert
"""


def test_a_run_whose_task_fails_after_its_retry_sends_one_alert(alerts, dag_file, tmp_path):
    tries = tmp_path / "tries"
    dag = dag_file("alerts_failing", HEADER + f"""
with DAG("alerts_failing", schedule=None, start_date=datetime(2025, 1, 1), catchup=False,
         on_failure_callback=RunFailureAlert()) as dag:

    @task(retries=1, retry_delay=timedelta(seconds=0))
    def boom():
        with open({str(tries)!r}, "a") as f:
            f.write("x")
        raise RuntimeError("reward file raised")

    boom()
""")
    dr = dag.test()
    assert dr.state == "failed"
    assert tries.read_text() == "xx"  # the task ran twice: its retry did not notify
    sent = alerts()
    assert [a["event"] for a in sent] == ["run_failed"], sent
    assert sent[0]["dag_id"] == "alerts_failing" and sent[0]["run_id"] == dr.run_id
    assert "boom" in sent[0]["reason"]
    assert "/rlhf/dags/alerts_failing/runs/manual__" in sent[0]["dashboard"]


def test_a_successful_run_sends_nothing(alerts, dag_file):
    dag = dag_file("alerts_fine", HEADER + """
with DAG("alerts_fine", schedule=None, start_date=datetime(2025, 1, 1), catchup=False,
         on_failure_callback=RunFailureAlert()) as dag:

    @task(retries=0)
    def fine():
        return 1

    fine()
""")
    assert dag.test().state == "success"
    assert alerts() == []


def _trainer_pids(run_url: str) -> list[int]:
    pids = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv = cmdline.read_bytes().decode().split("\0")
        except OSError:
            continue
        if "trainer" in argv and run_url in argv:
            pids.append(int(cmdline.parent.name))
    return pids


def test_a_stalled_trainer_sends_one_alert_and_its_task_fails(alerts, dag_file, tmp_path, monkeypatch):
    from pipeline import orchestration
    from pipeline.config import load_config

    monkeypatch.setenv("RLHF_RUNS_ROOT", str(tmp_path / "runs"))
    cfg = load_config("configs/tiny-test.yaml", ["trainer.stall_timeout_s=6", "trainer.wait_timeout_s=300"])
    run = orchestration.prepare(cfg, f"file://{tmp_path}/runs/stall")
    dag = dag_file("alerts_stall", f"""
from datetime import datetime
from airflow.sdk import DAG
from plugins.operators.rlhf import RlhfProcessOperator

with DAG("alerts_stall", schedule=None, start_date=datetime(2025, 1, 1), catchup=False) as dag:
    trainer = RlhfProcessOperator(task_id="trainer", role="trainer", run_url={run.url!r}, retries=0,
                                  kill_grace_s=5)
    trainer.monitor_interval_s = 1.0
""")
    dr = dag.test()  # no sampler: the trainer waits for rollouts that never come
    assert dr.state == "failed"
    assert dr.get_task_instance("trainer").state == "failed"
    sent = alerts()
    assert [a["event"] for a in sent] == ["trainer_stalled"], sent
    assert sent[0]["task_id"] == "trainer" and sent[0]["run_id"] == dr.run_id
    assert "no new trainer step" in sent[0]["reason"] and "stall_timeout_s=6" in sent[0]["reason"]
    assert _trainer_pids(run.url) == []  # the stalled trainer's process group was stopped
