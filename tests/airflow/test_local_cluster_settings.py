"""`LocalAirflow` as a small cluster (plugins/local/workers.py): Postgres instead of SQLite, the
CeleryExecutor, and Celery workers as supervised components in working directories of their own
(their settings here; tests/cluster runs the real thing)."""

import time

import pytest
from deployments import tear_down

from pipeline.rendezvous import free_port
from plugins.local.deployment import LocalAirflow
from plugins.local.workers import HOSTNAME_CALLABLE, WORKER_NAME_ENV, CeleryWorker, worker_hostname

PG = "postgresql+psycopg2://airflow@127.0.0.1:5999/airflow"


def test_the_default_deployment_stays_sqlite_and_local(tmp_path):
    env = LocalAirflow(home=tmp_path).env()
    assert env["AIRFLOW__CORE__EXECUTOR"] == "LocalExecutor"
    assert env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"].startswith("sqlite:///")
    assert "SQLITE_CONNECT_ARGS" in env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONNECT_ARGS"]
    assert "AIRFLOW__CELERY__BROKER_URL" not in env
    assert list(LocalAirflow(home=tmp_path).components()) == ["api-server", "scheduler", "dag-processor", "triggerer"]


def test_celery_settings_reach_every_component_and_each_worker_has_its_own_folder_and_name(tmp_path):
    workers = [CeleryWorker("default"), CeleryWorker("device", ("gpu",), concurrency=3, cwd=str(tmp_path / "dev"))]
    af = LocalAirflow(home=tmp_path / "home", database_url=PG, broker_url="redis://127.0.0.1:6999/0", workers=workers)
    env = af.env()
    assert env["AIRFLOW__CORE__EXECUTOR"] == "CeleryExecutor"
    assert env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"] == PG
    assert env["AIRFLOW__CELERY__RESULT_BACKEND"] == "db+" + PG  # with its driver
    assert "AIRFLOW__DATABASE__SQL_ALCHEMY_CONNECT_ARGS" not in env  # SQLite's, not Postgres's
    spec = af.components()
    assert set(spec) >= {"worker-default", "worker-device"}
    default, device = spec["worker-default"], spec["worker-device"]
    assert device["cwd"] == str(tmp_path / "dev") and default["cwd"] == str(tmp_path / "home" / "workers" / "default")
    for worker, name, queues in ((default, "default", "default"), (device, "device", "gpu")):
        argv = worker["argv"]
        assert argv[argv.index("--queues") + 1] == queues
        assert argv[argv.index("--celery-hostname") + 1] == f"{name}@%h"
        assert argv[argv.index("--pid") + 1].startswith(worker["cwd"])
        assert "--skip-serve-logs" in argv  # two log servers on one machine would want one port
        assert worker["env"] == {WORKER_NAME_ENV: name, "AIRFLOW__CORE__HOSTNAME_CALLABLE": HOSTNAME_CALLABLE}
    with pytest.raises(ValueError, match="broker_url and workers"):
        LocalAirflow(home=tmp_path, broker_url="redis://x")


def test_a_worker_reports_its_name_in_the_hostname(monkeypatch):
    monkeypatch.delenv(WORKER_NAME_ENV, raising=False)
    plain = worker_hostname()
    monkeypatch.setenv(WORKER_NAME_ENV, "device")
    assert worker_hostname() == f"{plain}-device"


def test_the_supervisor_starts_a_component_in_its_folder_with_its_variables(tmp_path):
    af = LocalAirflow(home=tmp_path / "home", port=free_port())
    folder = tmp_path / "worker-a"
    af.start_supervisor({"worker": {"argv": ["sh", "-c", f'pwd > where; echo "${WORKER_NAME_ENV}" >> where; exec sleep 300'],
                                    "cwd": str(folder), "env": {WORKER_NAME_ENV: "a"}},
                         "plain": ["sleep", "300"]})
    try:
        deadline = time.monotonic() + 15
        while not (folder / "where").exists() or len((folder / "where").read_text().split()) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert (folder / "where").read_text().split() == [str(folder), "a"]
        assert set(af.running()) == {"worker", "plain"} and all(af.running().values())
    finally:
        tear_down(af)
