"""Celery workers of a `LocalAirflow` (CeleryExecutor instead of LocalExecutor).

A worker is one more supervised component: `airflow celery worker` serving some queues, in a
working directory of its own (its pid file and whatever the tasks write into the current folder
stay apart from the other workers'), restarted by the supervisor when it dies. Several workers on
one machine would all report the machine's hostname; each one here reports `<host>-<name>`
(`AIRFLOW__CORE__HOSTNAME_CALLABLE`, the name a task instance records), so the UI and the REST
API tell which worker ran a task, as they would on a cluster of machines.

Nothing here imports Airflow or Celery: the components are `airflow` CLI processes.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path

WORKER_NAME_ENV = "RLHF_WORKER_NAME"
HOSTNAME_CALLABLE = "plugins.local.workers.worker_hostname"


def worker_hostname() -> str:
    """The hostname a task instance records: the machine's, plus the worker's name when this
    process belongs to a named worker of a `LocalAirflow` (several workers on one machine)."""
    host = socket.getfqdn()
    name = os.environ.get(WORKER_NAME_ENV)
    return f"{host}-{name}" if name else host


@dataclass(frozen=True)
class CeleryWorker:
    """`airflow celery worker --queues <queues>` named `name`, in `cwd` (default: HOME/workers/<name>)."""

    name: str
    queues: tuple[str, ...] = ("default",)
    concurrency: int = 4
    cwd: str | None = None

    def component(self, airflow: list[str], home: Path) -> dict:
        """The supervisor's spec of this worker (see plugins.local.supervisor)."""
        cwd = Path(self.cwd) if self.cwd else home / "workers" / self.name
        argv = [*airflow, "celery", "worker", "--queues", ",".join(self.queues),
                "--concurrency", str(self.concurrency), "--celery-hostname", f"{self.name}@%h",
                "--pid", str(cwd / "worker.pid"),
                # task logs are files in the shared log folder; no log server per worker (they
                # would all want port 8793)
                "--skip-serve-logs", "--without-mingle", "--without-gossip"]
        return {"argv": argv, "cwd": str(cwd),
                "env": {WORKER_NAME_ENV: self.name, "AIRFLOW__CORE__HOSTNAME_CALLABLE": HOSTNAME_CALLABLE}}


def celery_environment(broker_url: str, database_url: str) -> dict[str, str]:
    """Settings of every component of a CeleryExecutor deployment: the broker, and task results in
    the metadata database (`db+` + its SQLAlchemy URL, as the official compose file does)."""
    return {
        "AIRFLOW__CORE__EXECUTOR": "CeleryExecutor",
        "AIRFLOW__CELERY__BROKER_URL": broker_url,
        # with its driver: SQLAlchemy's default for a bare postgresql:// may be a driver not installed
        "AIRFLOW__CELERY__RESULT_BACKEND": f"db+{database_url}",
        "AIRFLOW__CELERY__WORKER_CONCURRENCY": "4",
    }
