"""`LocalAirflow`: an Airflow 3 deployment on one machine, for development, demos and tests.

The four components (api-server, scheduler, dag-processor, triggerer) run as `airflow` CLI
processes under one supervisor (`plugins.local.supervisor`), each in its own process group, bound
to 127.0.0.1, with SQLite + LocalExecutor in one AIRFLOW_HOME, the project's dags/ and plugins/
folders (`plugins.local.folders`, so an installed package works too) and a short DAG refresh
interval. Everything goes through the CLI and the REST API (`plugins.local.client`): nothing here
imports Airflow.

The same class runs a small cluster on one machine: `database_url` (e.g. Postgres) replaces
SQLite, and `broker_url` with `workers` (`plugins.local.workers.CeleryWorker`) switches to the
CeleryExecutor, with each worker one more supervised component (tests/cluster does this).

`airflow dags test` is no substitute: it runs tasks one at a time in one process, which deadlocks
the sampler and the trainer (each waits for the other).
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

from pipeline.devices import DEVICE_POOL
from pipeline.processes import group_alive, stop_group, stop_groups
from plugins.local.client import TERMINAL, AirflowClient, AirflowError, quote
from plugins.local.folders import configs_folder, dags_folder, plugins_folder
from plugins.local.workers import CeleryWorker, celery_environment

COMPONENTS = {
    "api-server": ["api-server"],
    "scheduler": ["scheduler", "--skip-serve-logs"],
    "dag-processor": ["dag-processor"],
    "triggerer": ["triggerer", "--skip-serve-logs"],
}
DEFAULT_HOME = ".airflow"  # under the current directory, as `rlhf run` puts runs/ there
DEFAULT_RUNS_ROOT = "runs"
# SQLite connect arguments for every component (imported by Airflow by name, see env()): wait up to
# a minute for a write lock instead of failing with "database is locked" when four components and
# the task processes write at once.
SQLITE_CONNECT_ARGS = {"timeout": 60}
REPROCESS_BEHAVIOURS = ("completed", "failed", "none")  # Airflow's backfill reprocess behaviours


class LocalAirflow:
    """An Airflow deployment under `home`, serving on 127.0.0.1:`port`."""

    def __init__(self, home: str | Path | None = None, port: int = 8080, runs_root: str | None = None,
                 pool_slots: int = 4, extra_env: dict[str, str] | None = None, database_url: str | None = None,
                 broker_url: str | None = None, workers: tuple[CeleryWorker, ...] | list[CeleryWorker] = ()):
        self.home = Path(home or DEFAULT_HOME).resolve()
        self.port = int(port)
        self.runs_root = runs_root or str(Path(DEFAULT_RUNS_ROOT).resolve())
        self.pool_slots = pool_slots
        self.extra_env = dict(extra_env or {})
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.database_url = database_url or f"sqlite:///{self.home / 'airflow.db'}"
        self.broker_url = broker_url
        self.workers = tuple(workers)
        if bool(broker_url) != bool(self.workers):
            raise ValueError("broker_url and workers go together: the CeleryExecutor needs both")

    @property
    def sqlite(self) -> bool:
        return self.database_url.startswith("sqlite")

    # files -------------------------------------------------------------------------------------
    @property
    def passwords_file(self) -> Path:
        return self.home / "passwords.json"

    def log_file(self, component: str) -> Path:
        return self.home / "logs" / f"{component}.log"

    def _secret(self, name: str, nbytes: int) -> str:
        self.home.mkdir(parents=True, exist_ok=True)
        path = self.home / name
        if not path.exists():
            path.write_text(secrets.token_hex(nbytes))
            path.chmod(0o600)
        return path.read_text().strip()

    def credentials(self) -> tuple[str, str]:
        self.home.mkdir(parents=True, exist_ok=True)
        if not self.passwords_file.exists():
            self.passwords_file.write_text(json.dumps({"admin": secrets.token_urlsafe(12)}))
            self.passwords_file.chmod(0o600)
        return "admin", json.loads(self.passwords_file.read_text())["admin"]

    def env(self) -> dict[str, str]:
        self.home.mkdir(parents=True, exist_ok=True)
        (self.home / "logs").mkdir(exist_ok=True)
        # the folder that holds the project's packages: the checkout, or site-packages
        pythonpath = os.pathsep.join(p for p in (str(plugins_folder().parent), os.environ.get("PYTHONPATH", "")) if p)
        env = {
            **os.environ,
            "AIRFLOW_HOME": str(self.home),
            "AIRFLOW__CORE__DAGS_FOLDER": str(dags_folder()),
            "AIRFLOW__CORE__PLUGINS_FOLDER": str(plugins_folder()),
            "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__PARALLELISM": "16",
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": self.database_url,
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": "admin:admin",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(self.passwords_file),
            "AIRFLOW__API__HOST": "127.0.0.1",
            "AIRFLOW__API__PORT": str(self.port),
            "AIRFLOW__API__BASE_URL": self.base_url,
            "AIRFLOW__API__WORKERS": "1",
            "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"{self.base_url}/execution/",
            # 64 random bytes: shorter HMAC keys make PyJWT warn on every token.
            "AIRFLOW__API_AUTH__JWT_SECRET": self._secret("jwt_secret", 64),
            "AIRFLOW__API__SECRET_KEY": self._secret("api_secret", 32),
            "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",
            "AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL": "10",
            "AIRFLOW__DAG_PROCESSOR__PARSING_PROCESSES": "1",
            "AIRFLOW__LOGGING__BASE_LOG_FOLDER": str(self.home / "logs"),
            "AIRFLOW__SCHEDULER__SCHEDULER_IDLE_SLEEP_TIME": "1",
            "PYTHONPATH": pythonpath,
            "RLHF_RUNS_ROOT": self.runs_root,
            "RLHF_CONFIGS_DIR": str(configs_folder()),
            # Components and tasks share few cores: keep every process to explicit thread counts.
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
            "MKL_NUM_THREADS": os.environ.get("MKL_NUM_THREADS", "1"),
            "TOKENIZERS_PARALLELISM": "false",
        }
        if self.sqlite:
            env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONNECT_ARGS"] = "plugins.local.deployment.SQLITE_CONNECT_ARGS"
            env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONNECT_ARGS_ASYNC"] = "plugins.local.deployment.SQLITE_CONNECT_ARGS"
        if self.broker_url:
            env.update(celery_environment(self.broker_url, self.database_url))
        return {**env, **self.extra_env}

    def components(self) -> dict[str, list[str] | dict]:
        """What the supervisor runs: the four Airflow components, then the Celery workers."""
        spec: dict[str, list[str] | dict] = {name: [*self._airflow(), *args] for name, args in COMPONENTS.items()}
        for worker in self.workers:
            spec[f"worker-{worker.name}"] = worker.component(self._airflow(), self.home)
        return spec

    def _airflow(self) -> list[str]:
        exe = Path(sys.executable).with_name("airflow")
        return [str(exe)] if exe.exists() else [sys.executable, "-m", "airflow"]

    def _cli(self, *args: str, timeout: float = 300, attempts: int = 6) -> str:
        for attempt in range(attempts):
            out = subprocess.run([*self._airflow(), *args], env=self.env(), capture_output=True, text=True,
                                 timeout=timeout)
            # A failed transaction is rolled back: rerunning after a lock timeout is safe.
            if out.returncode == 0 or "database is locked" not in out.stderr:
                break
            time.sleep(2 * (attempt + 1))
        if out.returncode != 0:
            raise AirflowError(f"airflow {' '.join(args)} failed ({out.returncode}): {out.stderr[-2000:]}")
        return out.stdout

    # lifecycle ---------------------------------------------------------------------------------
    # One supervisor process owns the components: it starts each in its own process group, restarts
    # one that exits (a scheduler that dies on an upstream bug comes back) and records what it did
    # in supervisor.json, which `status` reads. `down` asks it to stop them all.
    @property
    def state_file(self) -> Path:
        return self.home / "supervisor.json"

    def state(self) -> dict:
        try:
            return json.loads(self.state_file.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return {}

    def pids(self) -> dict[str, int]:
        """Process-group ids of the components the supervisor last started."""
        return {name: int(c["pid"]) for name, c in self.state().get("components", {}).items() if c.get("pid")}

    def supervisor_alive(self) -> bool:
        pid = self.state().get("pid")
        return bool(pid) and group_alive(int(pid))

    def running(self) -> dict[str, bool]:
        comps = self.state().get("components", {})
        return {name: bool(c.get("pid")) and group_alive(int(c["pid"])) for name, c in comps.items()}

    def status(self) -> dict:
        """What `rlhf airflow status` prints: the supervisor, each component, the REST health."""
        state, running = self.state(), self.running()
        comps = {name: {**c, "alive": running.get(name, False)} for name, c in state.get("components", {}).items()}
        sup = self.supervisor_alive()
        healthy = sup and bool(comps) and all(c["alive"] for c in comps.values())
        return {"home": str(self.home), "url": self.base_url, "healthy": healthy,
                "supervisor": {"pid": state.get("pid"), "alive": sup}, "components": comps,
                "health": self.client().health() if sup else None}

    def migrate(self) -> None:
        """Create or upgrade the metadata DB and the device pool (idempotent)."""
        self._cli("db", "migrate")
        if self.sqlite:
            # WAL journal: readers no longer block the writer (the scheduler, the api-server and
            # every task process share this file). The mode is stored in the file: once is enough.
            import sqlite3

            with sqlite3.connect(self.home / "airflow.db") as db:
                db.execute("PRAGMA journal_mode=WAL")
        self._cli("pools", "set", DEVICE_POOL, str(self.pool_slots),
                  "one slot per accelerator; a run's trainer holds the run's (RLHF_RUN_DEVICE_SLOTS)")

    def up(self, wait_s: float = 180.0) -> AirflowClient:
        if self.supervisor_alive() or any(self.running().values()):
            raise AirflowError(f"Airflow of {self.home} is already running ({self.pids()}); run `rlhf airflow down`")
        self.migrate()
        try:
            self.start_supervisor()
            client = self.client()
            self.wait_healthy(client, wait_s)
            return client
        except BaseException:
            self.down()
            raise

    def start_supervisor(self, components: dict[str, list[str]] | None = None, wait_s: float = 30.0) -> int:
        """Start the supervisor, detached in its own session; return once every component runs.
        `components` (name -> argv, or a spec dict) defaults to `self.components()`."""
        spec = components or self.components()
        self.home.mkdir(parents=True, exist_ok=True)
        (self.home / "logs").mkdir(exist_ok=True)
        (self.home / "supervisor-spec.json").write_text(json.dumps(spec))
        self.state_file.unlink(missing_ok=True)
        for hold in self.home.glob("hold-*"):
            hold.unlink()
        with open(self.log_file("supervisor"), "ab") as log:
            proc = subprocess.Popen([sys.executable, "-m", "plugins.local.supervisor", str(self.home)],
                                    env=self.env(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True, cwd=str(self.home))
        deadline = time.monotonic() + wait_s
        while set(self.pids()) != set(spec) or not all(self.running().values()):
            if proc.poll() is not None:
                raise AirflowError(f"the supervisor exited ({proc.returncode}); see {self.log_file('supervisor')}")
            if time.monotonic() > deadline:
                raise AirflowError(f"components not started after {wait_s:.0f}s: {self.running()}")
            time.sleep(0.2)
        return proc.pid

    def _hold(self, name: str) -> Path:
        return self.home / f"hold-{name}"

    def _stop(self, name: str, timeout_s: float = 60.0) -> None:
        """Stop one component and keep it stopped (the supervisor holds it) until `_start(name)`."""
        self._hold(name).touch()
        deadline = time.monotonic() + timeout_s
        while self.state().get("components", {}).get(name, {}).get("status") != "held":
            if not self.supervisor_alive() or time.monotonic() > deadline:
                raise AirflowError(f"{name} was not stopped; see {self.log_file('supervisor')}")
            time.sleep(0.2)

    def _start(self, name: str, timeout_s: float = 60.0) -> None:
        """Let the supervisor start a held component again; return once it runs."""
        self._hold(name).unlink(missing_ok=True)
        deadline = time.monotonic() + timeout_s
        while self.state().get("components", {}).get(name, {}).get("status") != "running":
            if not self.supervisor_alive() or time.monotonic() > deadline:
                raise AirflowError(f"{name} did not start again; see {self.log_file('supervisor')}")
            time.sleep(0.2)

    def wait_healthy(self, client: AirflowClient, wait_s: float) -> dict:
        deadline = time.monotonic() + wait_s
        health: dict | None = None
        while time.monotonic() < deadline:
            dead = [n for n, alive in self.running().items() if not alive]
            if dead:
                raise AirflowError(f"{', '.join(dead)} exited; see {self.log_file(dead[0])}")
            health = client.health()
            if health and all((health.get(c) or {}).get("status") == "healthy"
                              for c in ("metadatabase", "scheduler", "triggerer", "dag_processor")):
                return health
            time.sleep(2)
        raise AirflowError(f"Airflow not healthy after {wait_s:.0f}s: {health}; logs in {self.home / 'logs'}")

    def down(self, grace_s: float = 30.0) -> list[str]:
        """Ask the supervisor to stop every component (SIGTERM to each process group, SIGKILL what
        is left after `grace_s`); do it here for whatever is still alive if the supervisor is gone."""
        state = self.state()
        names = list(state.get("components", {}))
        sup = int(state.get("pid") or 0)
        if sup and group_alive(sup):
            stop_group(sup, grace_s=grace_s + 10)  # it stops the components itself
        stop_groups([pid for pid in self.pids().values() if group_alive(pid)], grace_s=5)
        self.state_file.unlink(missing_ok=True)
        return names

    def client(self) -> AirflowClient:
        user, password = self.credentials()
        return AirflowClient(self.base_url, user, password)

    def backfill(self, dag_id: str, from_date: str, to_date: str, conf: dict | None = None,
                 max_active_runs: int = 1, reprocess: str = "completed", wait_in_flight_s: float = 3600.0,
                 log=print) -> list[dict]:
        """Queue a run of `dag_id` for every date its schedule has in [from_date, to_date] and
        return those runs; raise AirflowError naming any date that got none.

        `reprocess` is Airflow's reprocess behaviour. The default, "completed", does what a user
        who names dates asks for: a date that already ran (the scheduler's own run of the latest
        interval, an earlier backfill, failed or successful) is cleared and run again with `conf`.
        Airflow skips a date whose run is still in flight; this waits for such runs to finish
        first (up to `wait_in_flight_s`), so every date named gets its run."""
        if reprocess not in REPROCESS_BEHAVIOURS:
            raise ValueError(f"reprocess: {reprocess!r}; use one of {', '.join(REPROCESS_BEHAVIOURS)}")
        client = self.client()
        span = {"gte": f"{from_date}T00:00:00Z", "lte": f"{to_date}T00:00:00Z"}
        deadline = time.monotonic() + wait_in_flight_s
        while busy := [r for r in client.dag_runs(dag_id, logical_date=span) if r["state"] not in TERMINAL]:
            if time.monotonic() > deadline:
                raise AirflowError(f"runs still in flight after {wait_in_flight_s:.0f}s: "
                                   f"{[(r['dag_run_id'], r['state']) for r in busy]}")
            log(f"waiting for {len(busy)} run(s) in the range to finish: "
                + ", ".join(f"{r['dag_run_id']} ({r['state']})" for r in busy))
            time.sleep(5)
        planned = client.request("POST", "/api/v2/backfills/dry_run", {
            "dag_id": dag_id, "from_date": span["gte"], "to_date": span["lte"], "reprocess_behavior": reprocess,
            "max_active_runs": max_active_runs})["backfills"]
        wanted = sorted(b["logical_date"] for b in planned if b.get("logical_date"))
        args = ["backfill", "create", "--dag-id", dag_id, "--from-date", from_date, "--to-date", to_date,
                "--max-active-runs", str(max_active_runs), "--reprocess-behavior", reprocess]
        if conf:
            args += ["--dag-run-conf", json.dumps(conf)]
        self._backfill_cli(args, dag_id, client)
        runs = {_day_time(r["logical_date"]): r for r in client.dag_runs(dag_id, logical_date=span)
                if r["run_type"] == "backfill"}
        missing = [d for d in wanted if _day_time(d) not in runs]
        if missing:
            raise AirflowError(f"backfill of {dag_id} made no run for {missing}; runs seen: "
                               f"{[(r['dag_run_id'], r['state']) for r in client.dag_runs(dag_id, logical_date=span)]}")
        return [runs[_day_time(d)] for d in wanted]

    def _backfill_cli(self, args: list[str], dag_id: str, client, attempts: int = 6) -> str:
        """`airflow backfill create`, retried while SQLite answers "database is locked".

        SQLite only: creating the runs reads, then writes in one transaction, which fails while
        another component commits (the scheduler every second on a busy machine). Airflow commits
        the backfill's own row first, so every failed attempt may leave an active backfill with none
        or some of its runs: cancel it before the next attempt (its queued runs fail, and the retry
        reprocesses them), or that attempt is refused as "another backfill is running". The retries
        run with the scheduler held; once it starts again, it runs the backfill. (Postgres
        deployments never retry.)"""
        before = {b["id"] for b in self._active_backfills(client, dag_id)}
        held = False
        try:
            for attempt in range(max(1, attempts)):
                try:
                    return self._cli(*args, attempts=1)
                except AirflowError as e:
                    if "database is locked" not in str(e) or attempt + 1 >= attempts:
                        raise
                for b in self._active_backfills(client, dag_id):
                    if b["id"] not in before:
                        client.request("PUT", f"/api/v2/backfills/{b['id']}/cancel")
                if not held and self.running().get("scheduler"):
                    self._stop("scheduler")
                    held = True
                time.sleep(attempt)
        finally:
            if held:
                self._start("scheduler")

    @staticmethod
    def _active_backfills(client, dag_id: str) -> list[dict]:
        found = client.request("GET", f"/api/v2/backfills?dag_id={quote(dag_id)}&limit=100")["backfills"]
        return [b for b in found if b.get("completed_at") is None]


def _day_time(iso: str) -> str:
    """A logical date as `YYYY-MM-DDTHH:MM:SS` (UTC), whatever suffix the API wrote."""
    from datetime import datetime, timezone

    when = datetime.fromisoformat(iso.replace("Z", "+00:00"))
    return when.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S")
