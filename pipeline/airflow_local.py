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

    def dag_runs(self, dag_id: str) -> list[dict]:
        return self.request("GET", f"/api/v2/dags/{_q(dag_id)}/dagRuns?limit=100")["dag_runs"]

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
    def pids_file(self) -> Path:
        return self.home / "pids.json"

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
    def pids(self) -> dict[str, int]:
        try:
            return {k: int(v) for k, v in json.loads(self.pids_file.read_text()).items()}
        except FileNotFoundError:
            return {}

    def running(self) -> dict[str, bool]:
        return {name: group_alive(pid) for name, pid in self.pids().items()}

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
        if any(self.running().values()):
            raise AirflowError(f"Airflow of {self.home} is already running ({self.pids()}); run `rlhf airflow down`")
        self.migrate()
        try:
            for name in COMPONENTS:
                self._start(name)
            client = self.client()
            self.wait_healthy(client, wait_s)
            return client
        except BaseException:
            self.down()
            raise

    def _start(self, name: str) -> int:
        """Start one component in its own process group; its pid is recorded in pids.json."""
        with open(self.log_file(name), "ab") as log:
            proc = subprocess.Popen([*self._airflow(), *COMPONENTS[name]], env=self.env(), stdout=log,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                                    cwd=str(self.home))
        self.pids_file.write_text(json.dumps({**self.pids(), name: proc.pid}))
        return proc.pid

    def _stop(self, name: str, grace_s: float = 30.0) -> None:
        pid = self.pids().get(name)
        if pid is None:
            return
        try:
            os.killpg(pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + grace_s
        while group_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.5)
        if group_alive(pid):
            os.killpg(pid, signal.SIGKILL)

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
        """SIGTERM every component's process group, SIGKILL what is left after `grace_s`."""
        pids = self.pids()
        for pid in pids.values():
            try:
                os.killpg(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(self.running().values()):
            time.sleep(0.5)
        for name, alive in self.running().items():
            if alive:
                try:
                    os.killpg(pids[name], signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self.pids_file.unlink(missing_ok=True)
        return list(pids)

    def client(self) -> AirflowClient:
        user, password = self.credentials()
        return AirflowClient(self.base_url, user, password)

    def backfill(self, dag_id: str, from_date: str, to_date: str, conf: dict | None = None,
                 max_active_runs: int = 1) -> str:
        args = ["backfill", "create", "--dag-id", dag_id, "--from-date", from_date, "--to-date", to_date,
                "--max-active-runs", str(max_active_runs)]
        if conf:
            args += ["--dag-run-conf", json.dumps(conf)]
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
    af = _deployment(args)
    running = af.running()
    print(json.dumps({"home": str(af.home), "url": af.base_url, "processes": running,
                      "health": af.client().health() if running else None}, indent=1))
    return 0 if running and all(running.values()) else 1


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
    p = subparsers.add_parser("airflow", help="embedded Airflow: up, down, status, demo")
    sub = p.add_subparsers(dest="airflow_cmd", required=True)
    for name, fn, help_ in (("up", cmd_up, "start api-server, scheduler, dag-processor, triggerer"),
                            ("down", cmd_down, "stop the components (SIGTERM to their process groups)"),
                            ("status", cmd_status, "show the components and their health"),
                            ("demo", cmd_demo, "up, trigger rlhf_train with the demo config, follow it, down")):
        s = sub.add_parser(name, help=help_)
        s.add_argument("--home", default=str(REPO / ".airflow"), help="AIRFLOW_HOME (default .airflow/)")
        s.add_argument("--port", type=int, default=8080)
        s.add_argument("--runs-root", default=str(REPO / "runs"), help="where run directories are created")
        if name == "demo":
            s.add_argument("--config-file", default=None, help="a YAML name in configs/ (default tiny-grpo.yaml)")
            s.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                           help="config override, e.g. --set trainer.steps=40")
            s.add_argument("--timeout", type=float, default=3600.0, help="seconds to wait for the run")
        s.set_defaults(fn=fn)
