"""The run directory: the only place sampler, trainer, reshard tasks and Airflow meet.

Layout under the run URL (any fsspec URL, e.g. file:///data/runs/<run_id> or s3://b/runs/<run_id>):

    config.yaml              frozen config snapshot (create-only)
    data/train.parquet       staged prompts (verl columns)
    data/eval.parquet        staged held-out prompts
    buffer/                  replay buffer (tiers + commit log), see pipeline.buffer
    checkpoints/step_<N>/    trainer checkpoints (trainer layout)
    policy/v<K>/             policy versions in sampler layout, each committed by its manifest
    markers/<name>.json      phase done, replay gate open, stop, trainer/sampler state
    metrics/<proc>.jsonl     one metrics stream per process
    summary.json             written when the run finishes

Every object another process reads is published atomically (see pipeline.storage).
"""

from __future__ import annotations

import json
import time
from datetime import datetime, timezone
from typing import Any, Iterator

from .config import ConfigError, RunConfig, parse_config, validate_run_id
from .storage import join, list_names, put_atomic, put_if_absent, read_bytes, to_url, url_to_fs

MARKER_NAME_CHARS = set("abcdefghijklmnopqrstuvwxyz0123456789_.-")


def new_run_id(prefix: str = "run") -> str:
    return f"{prefix}-{datetime.now(timezone.utc).strftime('%Y%m%d-%H%M%S')}-{int(time.time() * 1e6) % 1000:03d}"


def run_url_for(runs_root: str, run_id: str) -> str:
    return join(runs_root, validate_run_id(run_id))


class RunDir:
    """A handle on one run directory. Cheap to construct; holds no open files."""

    def __init__(self, url: str):
        if not url:
            raise ConfigError("--run-dir: empty URL; pass a path or fsspec URL such as file:///tmp/runs/r1")
        self.fs, self.root = url_to_fs(url)
        self.url = to_url(self.fs, self.root)
        validate_run_id(self.root.rstrip("/").rsplit("/", 1)[-1])

    # paths ------------------------------------------------------------------------------------
    def path(self, *parts: str) -> str:
        return join(self.root, *parts)

    def child_url(self, *parts: str) -> str:
        return to_url(self.fs, self.path(*parts))

    @property
    def run_id(self) -> str:
        return self.root.rstrip("/").rsplit("/", 1)[-1]

    @property
    def buffer_url(self) -> str:
        return self.child_url("buffer")

    # config -----------------------------------------------------------------------------------
    def exists(self) -> bool:
        return self.fs.exists(self.path("config.yaml"))

    def create(self, config: RunConfig) -> bool:
        """Freeze `config` into the run directory. Returns False if the run already existed with the
        same config (a retried prepare); raises if it existed with a different one."""
        config = config.model_copy(update={"run_id": self.run_id})
        text = config.to_yaml().encode()
        if put_if_absent(self.fs, self.path("config.yaml"), text):
            return True
        existing = self.config()
        if existing.model_dump() != config.model_dump():
            raise ConfigError(
                f"run directory {self.url} already holds a different config; "
                "choose another run_id or delete the old run"
            )
        return False

    def config(self) -> RunConfig:
        import yaml

        try:
            raw = read_bytes(self.fs, self.path("config.yaml"))
        except FileNotFoundError:
            raise ConfigError(f"{self.url} is not a run directory (no config.yaml); run `rlhf prepare` first") from None
        return parse_config(yaml.safe_load(raw))

    # json objects -----------------------------------------------------------------------------
    def write_json(self, rel: str, obj: Any) -> None:
        put_atomic(self.fs, self.path(rel), json.dumps(obj, indent=1, sort_keys=True).encode())

    def read_json(self, rel: str, default: Any = None) -> Any:
        try:
            return json.loads(read_bytes(self.fs, self.path(rel)))
        except FileNotFoundError:
            return default

    # markers ----------------------------------------------------------------------------------
    @staticmethod
    def _marker(name: str) -> str:
        if not name or not set(name) <= MARKER_NAME_CHARS:
            raise ValueError(f"marker name {name!r}: use lowercase letters, digits, '_', '.', '-'")
        return f"markers/{name}.json"

    def set_marker(self, name: str, payload: dict | None = None) -> None:
        body = {"time": time.time(), **(payload or {})}
        self.write_json(self._marker(name), body)

    def marker(self, name: str) -> dict | None:
        return self.read_json(self._marker(name))

    def has_marker(self, name: str) -> bool:
        return self.fs.exists(self.path(self._marker(name)))

    def markers(self) -> list[str]:
        return [n[: -len(".json")] for n in list_names(self.fs, self.path("markers")) if n.endswith(".json")]

    def request_stop(self, reason: str = "") -> None:
        self.set_marker("stop", {"reason": reason})

    def stop_requested(self) -> bool:
        return self.has_marker("stop")

    # metrics ----------------------------------------------------------------------------------
    def metrics(self, stream: str) -> "MetricsLog":
        return MetricsLog(self, stream)

    def read_metrics(self, stream: str) -> list[dict]:
        try:
            raw = read_bytes(self.fs, self.path(f"metrics/{stream}.jsonl"))
        except FileNotFoundError:
            return []
        out = []
        for line in raw.decode().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                break  # a line being appended right now
        return out


class MetricsLog:
    """Append-only JSONL metrics of one process. Local disk: appended and flushed per record.
    Object stores (no append): the whole stream is re-published atomically every `flush_every`."""

    def __init__(self, run: RunDir, stream: str, flush_every: int = 1):
        if not stream or not set(stream) <= MARKER_NAME_CHARS:
            raise ValueError(f"metrics stream {stream!r}: use lowercase letters, digits, '_', '.', '-'")
        self.run = run
        self.path = run.path(f"metrics/{stream}.jsonl")
        self._local = run.fs.protocol in ("file", "local") or "file" in run.fs.protocol
        self._lines: list[str] = [json.dumps(r) for r in run.read_metrics(stream)]
        self._pending = 0
        self.flush_every = flush_every
        if self._local:
            run.fs.makedirs(run.path("metrics"), exist_ok=True)

    def log(self, record: dict) -> None:
        line = json.dumps({"time": time.time(), **record})
        self._lines.append(line)
        if self._local:
            with open(self.path, "a") as f:
                f.write(line + "\n")
        else:
            self._pending += 1
            if self._pending >= self.flush_every:
                self.flush()

    def flush(self) -> None:
        if not self._local and self._pending:
            put_atomic(self.run.fs, self.path, ("\n".join(self._lines) + "\n").encode())
            self._pending = 0

    def __iter__(self) -> Iterator[dict]:
        return (json.loads(x) for x in self._lines)
