"""The REST client of an Airflow 3 api-server (urllib only, no Airflow import).

Authenticates with SimpleAuthManager's `POST /auth/token`; retries idempotent calls that SQLite
answers with "database is locked" (HTTP 500), never a POST.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from typing import Any

TERMINAL = {"success", "failed"}  # states of a finished DAG run


class AirflowError(RuntimeError):
    """A component did not start, or the REST API answered with an error."""


def quote(part: str) -> str:
    """One URL path segment (a DAG id, a run id with its ':' and '+')."""
    return urllib.parse.quote(part, safe="")


@dataclass
class AirflowClient:
    """One user's session with the api-server at `base_url`."""

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
            code, body = self.call("GET", f"/api/v2/dags/{quote(dag_id)}")
            if code == 200:
                return body
            if time.monotonic() > deadline:
                raise AirflowError(f"DAG {dag_id!r} not parsed after {timeout_s:.0f}s (HTTP {code}: {body}); "
                                   "see the import errors in the UI or dag-processor.log")
            time.sleep(2)

    def unpause(self, dag_id: str) -> None:
        self.request("PATCH", f"/api/v2/dags/{quote(dag_id)}", {"is_paused": False})

    def trigger(self, dag_id: str, conf: dict, run_id: str | None = None) -> dict:
        body: dict[str, Any] = {"logical_date": None, "conf": conf}
        if run_id:
            body["dag_run_id"] = run_id
        return self.request("POST", f"/api/v2/dags/{quote(dag_id)}/dagRuns", body)

    def dag_run(self, dag_id: str, run_id: str) -> dict:
        return self.request("GET", f"/api/v2/dags/{quote(dag_id)}/dagRuns/{quote(run_id)}")

    def dag_runs(self, dag_id: str, logical_date: dict[str, str] | None = None) -> list[dict]:
        """Runs of `dag_id` (up to 100); `logical_date={"gte": ISO, "lte": ISO}` narrows them."""
        query = "".join(f"&logical_date_{op}={quote(v)}" for op, v in (logical_date or {}).items())
        return self.request("GET", f"/api/v2/dags/{quote(dag_id)}/dagRuns?limit=100{query}")["dag_runs"]

    def task_instances(self, dag_id: str, run_id: str) -> list[dict]:
        path = f"/api/v2/dags/{quote(dag_id)}/dagRuns/{quote(run_id)}/taskInstances?limit=1000"
        return self.request("GET", path)["task_instances"]

    def xcom(self, dag_id: str, run_id: str, task_id: str, key: str = "return_value") -> Any:
        path = f"/api/v2/dags/{quote(dag_id)}/dagRuns/{quote(run_id)}/taskInstances/{quote(task_id)}/xcomEntries/{quote(key)}"
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
