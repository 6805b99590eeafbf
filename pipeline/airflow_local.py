"""Embedded Airflow for one machine: `rlhf airflow up | down | status | demo`.

Starts the four Airflow 3 components (api-server, scheduler, dag-processor, triggerer) as `airflow`
CLI subprocesses, each in its own process group, bound to 127.0.0.1, with SQLite + LocalExecutor in
a project-local AIRFLOW_HOME (`.airflow/`), the repository's dags/ and plugins/ folders, and a
short DAG refresh interval. It talks to Airflow only through the CLI and the REST API: the engine
never imports Airflow, and this module does not either.

`airflow dags test` is no substitute: it runs tasks one at a time in one process, which deadlocks
the sampler and the trainer (each waits for the other).
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
COMPONENTS = {
    "api-server": ["api-server"],
    "scheduler": ["scheduler", "--skip-serve-logs"],
    "dag-processor": ["dag-processor"],
    "triggerer": ["triggerer", "--skip-serve-logs"],
}
DEVICE_POOL = "rlhf_devices"  # see plugins/taskgroups.py
DEMO_CONF = {"config_file": "tiny-grpo.yaml"}
# SQLite connect arguments for every component (imported by Airflow by name, see env()): wait up to
# a minute for a write lock instead of failing with "database is locked" when four components and
# the task processes write at once.
SQLITE_CONNECT_ARGS = {"timeout": 60}
TERMINAL = {"success", "failed"}
REPROCESS_BEHAVIOURS = ("completed", "failed", "none")  # Airflow's backfill reprocess behaviours


class AirflowError(RuntimeError):
    """A component did not start, or the REST API answered with an error."""


# ------------------------------------------------------------------------------------------------
# REST client (urllib only)
# ------------------------------------------------------------------------------------------------
@dataclass
class AirflowClient:
    base_url: str
    username: str
    password: str
    timeout_s: float = 120.0  # the embedded api-server waits up to 60 s on SQLite's write lock
    _token: str | None = field(default=None, repr=False)

    def _raw(self, method: str, path: str, body: Any = None, token: str | None = None) -> tuple[int, Any]:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.base_url.rstrip("/") + path, data=data, method=method)
        req.add_header("Content-Type", "application/json")
        if token:
            req.add_header("Authorization", f"Bearer {token}")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                raw = resp.read()
                code = resp.status
        except urllib.error.HTTPError as e:
            raw, code = e.read(), e.code
        try:
            return code, json.loads(raw) if raw else None
        except json.JSONDecodeError:
            return code, raw.decode(errors="replace")

    def token(self) -> str:
        if self._token is None:
            code, body = self._raw("POST", "/auth/token", {"username": self.username, "password": self.password})
            if code not in (200, 201):
                raise AirflowError(f"POST /auth/token: HTTP {code}: {body}")
            self._token = body["access_token"]
        return self._token

    def request(self, method: str, path: str, body: Any = None, ok: tuple[int, ...] = (200, 201, 204)) -> Any:
        code, out = self._raw(method, path, body, self.token())
        # SQLite under several writers occasionally answers "database is locked" (HTTP 500):
        # retry the idempotent methods a few times; a POST is never repeated.
        for delay in (1, 2, 4):
            if code < 500 or method not in ("GET", "PATCH", "PUT", "DELETE"):
                break
            time.sleep(delay)
            code, out = self._raw(method, path, body, self.token())
        if code not in ok:
            raise AirflowError(f"{method} {path}: HTTP {code}: {out}")
        return out

    def call(self, method: str, path: str, body: Any = None, authenticated: bool = True) -> tuple[int, Any]:
        """(status, body) without raising: for callers that check error answers themselves."""
        return self._raw(method, path, body, self.token() if authenticated else None)

    def health(self) -> dict | None:
        try:
            code, body = self._raw("GET", "/api/v2/monitor/health")
        except OSError:
            return None
        return body if code == 200 and isinstance(body, dict) else None

    # DAGs and runs -----------------------------------------------------------------------------
    def wait_for_dag(self, dag_id: str, timeout_s: float = 120.0) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            code, body = self.call("GET", f"/api/v2/dags/{_q(dag_id)}")
            if code == 200:
                return body
            if time.monotonic() > deadline:
                raise AirflowError(f"DAG {dag_id!r} not parsed after {timeout_s:.0f}s (HTTP {code}: {body}); "
                                   "see the import errors in the UI or dag-processor.log")
            time.sleep(2)

    def unpause(self, dag_id: str) -> None:
        self.request("PATCH", f"/api/v2/dags/{_q(dag_id)}", {"is_paused": False})

    def trigger(self, dag_id: str, conf: dict, run_id: str | None = None) -> dict:
        body: dict[str, Any] = {"logical_date": None, "conf": conf}
        if run_id:
            body["dag_run_id"] = run_id
        return self.request("POST", f"/api/v2/dags/{_q(dag_id)}/dagRuns", body)

    def dag_run(self, dag_id: str, run_id: str) -> dict:
        return self.request("GET", f"/api/v2/dags/{_q(dag_id)}/dagRuns/{_q(run_id)}")

    def dag_runs(self, dag_id: str, logical_date: dict[str, str] | None = None) -> list[dict]:
        """Runs of `dag_id` (up to 100); `logical_date={"gte": ISO, "lte": ISO}` narrows them."""
        query = "".join(f"&logical_date_{op}={_q(v)}" for op, v in (logical_date or {}).items())
        return self.request("GET", f"/api/v2/dags/{_q(dag_id)}/dagRuns?limit=100{query}")["dag_runs"]

    def task_instances(self, dag_id: str, run_id: str) -> list[dict]:
        path = f"/api/v2/dags/{_q(dag_id)}/dagRuns/{_q(run_id)}/taskInstances?limit=1000"
        return self.request("GET", path)["task_instances"]

    def xcom(self, dag_id: str, run_id: str, task_id: str, key: str = "return_value") -> Any:
        path = f"/api/v2/dags/{_q(dag_id)}/dagRuns/{_q(run_id)}/taskInstances/{_q(task_id)}/xcomEntries/{_q(key)}"
        return self.request("GET", path)["value"]

    def wait_for_run(self, dag_id: str, run_id: str, timeout_s: float, on_poll=None, poll_s: float = 3.0) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            run = self.dag_run(dag_id, run_id)
            if on_poll is not None:
                on_poll(run)
            if run["state"] in TERMINAL:
                return run
            if time.monotonic() > deadline:
                raise AirflowError(f"run {run_id} of {dag_id} still {run['state']} after {timeout_s:.0f}s")
            time.sleep(poll_s)


def group_alive(pgid: int) -> bool:
    """True while the process group has a member that is not a zombie."""
    try:
        os.waitpid(pgid, os.WNOHANG)  # reap the leader if it is our own exited child
    except ChildProcessError:
        pass
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    proc = Path("/proc")
    if not proc.is_dir():
        return True
    for stat in proc.glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def stop_group(pgid: int, grace_s: float = 30.0) -> None:
    """SIGTERM a process group, then SIGKILL whatever is left of it after `grace_s`."""
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace_s
    while group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.2)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _q(part: str) -> str:
    return urllib.parse.quote(part, safe="")


# ------------------------------------------------------------------------------------------------
# The local deployment
# ------------------------------------------------------------------------------------------------
class LocalAirflow:
    """An Airflow deployment under `home`, serving on 127.0.0.1:`port`."""

    def __init__(self, home: str | Path | None = None, port: int = 8080, runs_root: str | None = None,
                 pool_slots: int = 4, extra_env: dict[str, str] | None = None):
        self.home = Path(home or REPO / ".airflow").resolve()
        self.port = int(port)
        self.runs_root = runs_root or str(REPO / "runs")
        self.pool_slots = pool_slots
        self.extra_env = dict(extra_env or {})
        self.base_url = f"http://127.0.0.1:{self.port}"

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
        pythonpath = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
        env = {
            **os.environ,
            "AIRFLOW_HOME": str(self.home),
            "AIRFLOW__CORE__DAGS_FOLDER": str(REPO / "dags"),
            "AIRFLOW__CORE__PLUGINS_FOLDER": str(REPO / "plugins"),
            "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__PARALLELISM": "16",
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{self.home / 'airflow.db'}",
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONNECT_ARGS": "pipeline.airflow_local.SQLITE_CONNECT_ARGS",
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONNECT_ARGS_ASYNC": "pipeline.airflow_local.SQLITE_CONNECT_ARGS",
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
            "RLHF_CONFIGS_DIR": str(REPO / "configs"),
            # Components and tasks share few cores: keep every process to explicit thread counts.
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
            "MKL_NUM_THREADS": os.environ.get("MKL_NUM_THREADS", "1"),
            "TOKENIZERS_PARALLELISM": "false",
            **self.extra_env,
        }
        return env

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
        # WAL journal: readers no longer block the writer (the scheduler, the api-server and every
        # task process share this file). The mode is stored in the file, so once is enough.
        import sqlite3

        with sqlite3.connect(self.home / "airflow.db") as db:
            db.execute("PRAGMA journal_mode=WAL")
        self._cli("pools", "set", DEVICE_POOL, str(self.pool_slots),
                  "one slot per accelerator; sampler, trainer and finalize each hold one")

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
        `components` (name -> argv) defaults to the four Airflow components."""
        spec = components or {name: [*self._airflow(), *args] for name, args in COMPONENTS.items()}
        self.home.mkdir(parents=True, exist_ok=True)
        (self.home / "logs").mkdir(exist_ok=True)
        (self.home / "supervisor-spec.json").write_text(json.dumps(spec))
        self.state_file.unlink(missing_ok=True)
        for hold in self.home.glob("hold-*"):
            hold.unlink()
        with open(self.log_file("supervisor"), "ab") as log:
            proc = subprocess.Popen([sys.executable, "-m", "pipeline.airflow_local", "supervise", str(self.home)],
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
            os.killpg(sup, signal.SIGTERM)
            deadline = time.monotonic() + grace_s + 10
            while group_alive(sup) and time.monotonic() < deadline:
                time.sleep(0.3)
        for pid in [*self.pids().values(), sup]:
            if pid and group_alive(pid):
                stop_group(pid, grace_s=5)
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
        self._backfill_cli(args)
        runs = {_day_time(r["logical_date"]): r for r in client.dag_runs(dag_id, logical_date=span)
                if r["run_type"] == "backfill"}
        missing = [d for d in wanted if _day_time(d) not in runs]
        if missing:
            raise AirflowError(f"backfill of {dag_id} made no run for {missing}; runs seen: "
                               f"{[(r['dag_run_id'], r['state']) for r in client.dag_runs(dag_id, logical_date=span)]}")
        return [runs[_day_time(d)] for d in wanted]

    def _backfill_cli(self, args: list[str]) -> str:
        try:
            return self._cli(*args, attempts=2)
        except AirflowError as e:
            if "database is locked" not in str(e) or not self.running().get("scheduler"):
                raise
        # SQLite only: creating the runs reads, then writes in one transaction, which fails while the
        # scheduler commits every second on a busy machine. Write them with the scheduler stopped;
        # the restarted scheduler then runs them. (Postgres deployments never get here.)
        self._stop("scheduler")
        try:
            return self._cli(*args)
        finally:
            self._start("scheduler")


def _day_time(iso: str) -> str:
    """A logical date as `YYYY-MM-DDTHH:MM:SS` (UTC), whatever suffix the API wrote."""
    from datetime import datetime, timezone

    when = datetime.fromisoformat(iso.replace("Z", "+00:00"))
    return when.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S")


# ------------------------------------------------------------------------------------------------
# The supervisor process: `python -m pipeline.airflow_local supervise HOME`
# ------------------------------------------------------------------------------------------------
RESTART_BACKOFF_S = (1, 2, 5, 10, 30)  # by restarts of that component in the last 10 minutes


class _Supervisor:
    """Starts the components of `home/supervisor-spec.json`, each in its own process group, and
    restarts one whose leader exits, after what it left in its group (executor workers, task
    supervisors) is killed; Airflow then fails and retries the tasks those ran. A file
    `hold-<name>` keeps a component stopped. SIGTERM, SIGINT or SIGHUP stop everything."""

    def __init__(self, home: Path):
        self.home = home
        self.spec: dict[str, list[str]] = json.loads((home / "supervisor-spec.json").read_text())
        self.procs: dict[str, subprocess.Popen | None] = dict.fromkeys(self.spec)
        self.comps = {name: {"pid": None, "status": "starting", "restarts": 0, "last_exit": None,
                             "last_exit_at": None} for name in self.spec}
        self.next_start = dict.fromkeys(self.spec, 0.0)
        self.exits: dict[str, list[float]] = {name: [] for name in self.spec}
        self.stopping = False

    def log(self, msg: str) -> None:
        print(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {msg}", flush=True)

    def save(self) -> None:
        tmp = self.home / ".supervisor.json.tmp"
        tmp.write_text(json.dumps({"pid": os.getpid(), "components": self.comps}, indent=1))
        os.replace(tmp, self.home / "supervisor.json")

    def spawn(self, name: str) -> None:
        with open(self.home / "logs" / f"{name}.log", "ab") as out:
            proc = subprocess.Popen(self.spec[name], stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True, cwd=str(self.home))
        self.procs[name] = proc
        self.comps[name].update(pid=proc.pid, status="running", started_at=time.time())
        self.log(f"started {name} (pid {proc.pid})")

    def exited(self, name: str, proc: subprocess.Popen, held: bool) -> None:
        stop_group(proc.pid, grace_s=5)
        self.procs[name] = None
        comp = self.comps[name]
        comp.update(last_exit=proc.returncode, last_exit_at=time.time(), status="held" if held else "restarting")
        if held:
            return
        now = time.monotonic()
        self.exits[name] = [t for t in self.exits[name] if now - t < 600] + [now]
        delay = RESTART_BACKOFF_S[min(len(self.exits[name]), len(RESTART_BACKOFF_S)) - 1]
        self.next_start[name] = now + delay
        comp["restarts"] += 1
        self.log(f"{name} exited with code {proc.returncode}; restart {comp['restarts']} in {delay}s")

    def step(self) -> None:
        for name in self.spec:
            held = (self.home / f"hold-{name}").exists()
            proc = self.procs[name]
            if proc is not None and proc.poll() is not None:
                self.exited(name, proc, held)
            elif proc is not None and held:
                self.log(f"stopping {name} (held)")
                stop_group(proc.pid)
                proc.wait()
                self.exited(name, proc, held=True)
            elif proc is None and not held and time.monotonic() >= self.next_start[name]:
                self.spawn(name)
            else:
                continue
            self.save()

    def run(self, poll_s: float = 0.5) -> int:
        def on_signal(signum, frame):
            self.stopping = True

        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, on_signal)
        self.save()
        while not self.stopping:
            self.step()
            time.sleep(poll_s)
        self.log("stopping every component")
        live = [p for p in self.procs.values() if p is not None and p.poll() is None]
        for proc in live:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for proc in live:
            stop_group(proc.pid, grace_s=30)
        for comp in self.comps.values():
            comp["status"] = "stopped"
        self.save()
        return 0


# ------------------------------------------------------------------------------------------------
# demo: trigger rlhf_train and follow it
# ------------------------------------------------------------------------------------------------
def _progress_line(client: AirflowClient, dag_id: str, run_id: str, run_state: str, t0: float) -> str:
    tis = client.task_instances(dag_id, run_id)
    counts: dict[str, int] = {}
    for ti in tis:
        counts[ti["state"] or "none"] = counts.get(ti["state"] or "none", 0) + 1
    step = ""
    try:
        run_url = client.xcom(dag_id, run_id, "prepare", "run_url")
        from .runs import RunDir

        records = RunDir(run_url).read_metrics("trainer")
        if records:
            last = records[-1]
            reward = last.get("reward/mean")
            step = f" | trainer step {last.get('step')}" + (f", reward {reward:.3f}" if isinstance(reward, float) else "")
    except (AirflowError, OSError, ValueError):
        pass
    states = ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
    return f"[{time.monotonic() - t0:6.0f}s] run {run_state}: {states}{step}"


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
        dashboard = f"{af.base_url}/rlhf/dags/{_q(dag_id)}/runs/{_q(run_id)}"
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


# ------------------------------------------------------------------------------------------------
# CLI: rlhf airflow up|down|status|demo
# ------------------------------------------------------------------------------------------------
def _deployment(args) -> LocalAirflow:
    return LocalAirflow(home=args.home, port=args.port, runs_root=args.runs_root)


def cmd_up(args) -> int:
    af = _deployment(args)
    user, password = af.credentials()
    af.up()
    print(f"Airflow UI: {af.base_url}  (user {user}, password {password})")
    print(f"DAGs: {REPO / 'dags'}; logs: {af.home / 'logs'}; stop with `rlhf airflow down`")
    return 0


def cmd_down(args) -> int:
    stopped = _deployment(args).down()
    print(f"stopped: {', '.join(stopped) or 'nothing was running'}")
    return 0


def cmd_status(args) -> int:
    """Each component: alive or dead, pid, restarts and last exit code; exit 1 if one is down."""
    af = _deployment(args)
    report = af.status()
    print(json.dumps(report, indent=1))
    return 0 if report["healthy"] else 1


def cmd_backfill(args) -> int:
    af = _deployment(args)
    if not af.supervisor_alive():
        print(f"error: Airflow of {af.home} is not running; start it with `rlhf airflow up`", file=sys.stderr)
        return 2
    try:
        conf = json.loads(args.conf) if args.conf else None
    except json.JSONDecodeError as e:
        print(f"error: --conf is not JSON: {e}", file=sys.stderr)
        return 2
    try:
        runs = af.backfill(args.dag_id, args.from_date, args.to_date, conf=conf,
                           max_active_runs=args.max_active_runs, reprocess=args.reprocess)
    except AirflowError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for run in runs:
        print(f"{run['logical_date'][:10]}: {run['dag_run_id']} ({run['state']})")
    return 0


def cmd_demo(args) -> int:
    from .config import apply_overrides

    conf = dict(DEMO_CONF)
    if args.config_file:
        conf["config_file"] = args.config_file
    overrides = apply_overrides({}, args.set)
    flat: dict[str, Any] = {}

    def walk(prefix: str, node: Any) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(f"{prefix}.{k}" if prefix else k, v)
        else:
            flat[prefix] = node

    walk("", overrides)
    if flat:
        conf["overrides"] = flat
    return demo(_deployment(args), conf, timeout_s=args.timeout)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("airflow", help="embedded Airflow: up, down, status, demo, backfill")
    sub = p.add_subparsers(dest="airflow_cmd", required=True)
    for name, fn, help_ in (("up", cmd_up, "start api-server, scheduler, dag-processor, triggerer"),
                            ("down", cmd_down, "stop the components (SIGTERM to their process groups)"),
                            ("status", cmd_status, "show the components and their health"),
                            ("demo", cmd_demo, "up, trigger rlhf_train with the demo config, follow it, down"),
                            ("backfill", cmd_backfill, "queue a run for every date of a range (reruns dates that ran)")):
        s = sub.add_parser(name, help=help_)
        s.add_argument("--home", default=str(REPO / ".airflow"), help="AIRFLOW_HOME (default .airflow/)")
        s.add_argument("--port", type=int, default=8080)
        s.add_argument("--runs-root", default=str(REPO / "runs"), help="where run directories are created")
        if name == "backfill":
            s.add_argument("dag_id")
            s.add_argument("--from-date", required=True, help="YYYY-MM-DD, first logical date")
            s.add_argument("--to-date", required=True, help="YYYY-MM-DD, last logical date (inclusive)")
            s.add_argument("--conf", default=None, help="JSON run conf, as the trigger form's fields")
            s.add_argument("--max-active-runs", type=int, default=1)
            s.add_argument("--reprocess", choices=REPROCESS_BEHAVIOURS, default="completed",
                           help="dates that already ran: rerun them (completed, the default), only failed "
                                "ones (failed), or skip them (none)")
        if name == "demo":
            s.add_argument("--config-file", default=None, help="a YAML name in configs/ (default tiny-grpo.yaml)")
            s.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                           help="config override, e.g. --set trainer.steps=40")
            s.add_argument("--timeout", type=float, default=3600.0, help="seconds to wait for the run")
        s.set_defaults(fn=fn)


if __name__ == "__main__" and sys.argv[1:2] == ["supervise"]:
    sys.exit(_Supervisor(Path(sys.argv[2])).run())
