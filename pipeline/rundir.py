"""The run directory: the only place sampler, trainer, reshard tasks and Airflow meet.

Layout under the run URL (any fsspec URL, e.g. file:///data/runs/<run_id> or s3://b/runs/<run_id>):

    config.yaml              frozen config snapshot (create-only)
    data/train.parquet       staged prompts (verl columns)
    data/eval.parquet        staged held-out prompts
    buffer/                  replay buffer (tiers + commit log), see pipeline.buffer
    checkpoints/step_<N>/    trainer checkpoints (trainer layout)
    policy/v<K>/             policy versions in sampler layout, each committed by its manifest
    markers/<name>.json      phase done, replay gate open, stop, trainer/sampler state
    claims/<k>.json          prompt draw k (to "through"), claimed by one sampler replica (pipeline.sampler.claims)
    metrics/<proc>.jsonl     one metrics stream per process (+ metrics/<proc>/ parts, see pipeline.metrics)
    summary.json             written when the run finishes

Every object another process reads is published atomically (see pipeline.storage).
"""

from __future__ import annotations

import json
import os
import re
import time
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote

from .config import ConfigError, RunConfig, parse_config
from .locations import validate_run_id
from .storage import file_exists, is_temporary, join, list_names, put_atomic, put_if_absent, read_bytes, to_url, url_to_fs

if TYPE_CHECKING:
    from .metrics import MetricsLog

MARKER_NAME_CHARS = set("abcdefghijklmnopqrstuvwxyz0123456789_.-")


def new_run_id(prefix: str = "run") -> str:
    return f"{prefix}-{datetime.now(timezone.utc).strftime('%Y%m%d-%H%M%S')}-{int(time.time() * 1e6) % 1000:03d}"


def run_url_for(runs_root: str, run_id: str) -> str:
    """The run directory `run_id` under `runs_root` (a URL, or a path relative to the working folder)."""
    validate_run_url(runs_root, "runs root")
    if "://" not in runs_root:
        runs_root = os.path.abspath(runs_root)
    return join(runs_root, validate_run_id(run_id))


# run URLs and the roots they live under -------------------------------------------------------------
# Protocols that name the same store, for comparing a URL with a root.
_SAME_STORE = {"local": "file", "s3a": "s3", "gcs": "gs", "az": "abfs"}


def validate_run_url(url: str, field: str = "run directory") -> str:
    """Refuse a run directory or runs root with a '..' segment, also percent-encoded or between
    backslashes. fsspec resolves '..' before writing, so `file:///some/dir/../../etc` would become
    `/etc`; refusing is clearer than resolving, and nothing is written before this check."""
    path = url.split("://", 1)[-1]
    for _ in range(3):  # %2e%2e, and %252e%252e (encoded twice) ...
        path, before = unquote(path), path
        if path == before:
            break
    if ".." in re.split(r"[/\\]", path):
        raise ConfigError(f"{field}: {url!r} has a '..' segment; pass the absolute path of the folder itself, "
                          "without '..'")
    return url


def _location(url: str) -> tuple[str, tuple[str, ...]]:
    """(store, path segments) of a URL or local path, for comparisons; '.' and empty segments dropped.
    Nothing is decoded: a segment that is encoded differently is another name, hence not inside."""
    validate_run_url(url)
    protocol, sep, path = url.partition("://")
    if not sep:
        protocol, path = "file", os.path.abspath(url)
    protocol = protocol.lower()
    return _SAME_STORE.get(protocol, protocol), tuple(s for s in path.split("/") if s not in ("", "."))


def url_is_under(url: str, root: str) -> bool:
    """Whether `url` is `root` or lies inside it: same store, and root's path segments are a prefix
    of url's (`/data/runs2` is not under `/data/runs`). Raises ConfigError on a '..' segment."""
    store, path = _location(url)
    root_store, root_path = _location(root)
    return store == root_store and path[: len(root_path)] == root_path


# How a run is spread over processes and devices, or how often it saves, not what it learns: a run
# resumes with other values (more or fewer samplers, another trainer node count), which prepare records.
RESIZABLE = {"sampler": ("replicas", "threads"),
             "trainer": ("nnodes", "nproc_per_node", "rendezvous", "threads", "checkpoint_every_s"),
             "devices": ("sampler_share", "count")}


def run_differences(a: RunConfig, b: RunConfig) -> list[str]:
    """The settings (dotted keys) in which two configs differ, but for those of `RESIZABLE`: none
    when they are one run, perhaps spread differently."""
    da, db = a.model_dump(), b.model_dump()
    out = []
    for section in da:
        if not isinstance(da[section], dict):
            out += [section] if da[section] != db[section] else []
            continue
        out += [f"{section}.{k}" for k in da[section] if k not in RESIZABLE.get(section, ())
                and da[section][k] != db[section][k]]
    return out


def same_run(a: RunConfig, b: RunConfig) -> bool:
    """Whether two configs are one run, perhaps spread differently (they differ at most in `RESIZABLE`)."""
    return not run_differences(a, b)


def _at(config: RunConfig, key: str):
    value = config
    for part in key.split("."):
        value = getattr(value, part)
    return value.model_dump() if hasattr(value, "model_dump") else value


class RunDir:
    """A handle on one run directory. Cheap to construct; holds no open files.

    The names of the markers processes and orchestrators exchange live here, and only here."""

    STOP_MARKER = "stop"
    """Written to stop the run: the sampler, the trainer and waiting sensors obey it (`request_stop`)."""
    STOP_CHECK_S = 0.5
    """A waiting trainer looks for the stop marker at most this often (seconds); a sampler, for which
    a late stop costs at most a batch nobody trains on, every `pipeline.sampler.loop.STOP_CHECK_S`."""
    TRAINER_DONE_MARKER = "trainer_done"
    """Written by the trainer after its last step: {"step", "replay_epochs_skipped"}."""
    TRAINER_RENDEZVOUS_MARKER = "trainer_rendezvous"
    """Written by trainer node 0 of a multi-node trainer: {"endpoint", "time"} (`pipeline.rendezvous`)."""
    DRIVER_MARKER = "driver"
    """{"id"}: the orchestrator's run that drives this run directory now (in Airflow the DAG run id;
    see `take_over`)."""

    @staticmethod
    def trainer_started_marker(attempt: int | None) -> str:
        """Written when the trainer task of attempt `attempt` of a DAG run starts, holding the
        devices of the whole run: {"attempt", "time"}. The run's samplers start only after it
        (gang scheduling, `plugins/operators/rlhf.py`)."""
        return f"trainer_started_{int(attempt or 0)}"

    @staticmethod
    def phase_done_marker(phase: int) -> str:
        """Written by the trainer once the checkpoint closing phase `phase` is complete: {"step", "checkpoint"}."""
        return f"phase_{int(phase)}.done"

    @staticmethod
    def replay_gate_marker(epoch: int) -> str:
        """Written by the orchestrator to open replay epoch `epoch` (see pipeline.orchestration)."""
        return f"replay_gate_{int(epoch)}.open"

    @staticmethod
    def sampler_state_marker(sampler_id: str) -> str:
        """The state of one sampler replica: {"last_draw", "batches", "batch_s", "holding", "since"}
        (pipeline.sampler.claims)."""
        return f"sampler_state_{sampler_id.lower()}"

    def __init__(self, url: str):
        if not url:
            raise ConfigError("--run-dir: empty URL; pass a path or fsspec URL such as file:///tmp/runs/r1")
        self.fs, self.root = url_to_fs(validate_run_url(url))
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
        return file_exists(self.fs, self.path("config.yaml"))

    def prepared(self) -> bool:
        """Whether this run's preparation has ended (`prepare.json` is written)."""
        return file_exists(self.fs, self.path("prepare.json"))

    def wait_prepared(self, poll_s: float = 0.1) -> None:
        """Wait for the end of this run's preparation (`prepare.json`, its last write): an engine
        the local runner starts while it prepares a new run. Raises RuntimeError once the process
        that started this one is gone."""
        parent = os.getppid()
        while not self.prepared():
            if os.getppid() != parent:
                raise RuntimeError(f"{self.url}: the process that started this one stopped before the run was prepared")
            time.sleep(poll_s)

    def check_creatable(self) -> None:
        """Refuse a folder that holds files but is not a run directory (no config.yaml), such as
        `--run-dir /etc`. A missing or empty folder, or a run directory (a retried prepare), is fine;
        so are temporaries a killed writer left behind."""
        try:
            self.fs.invalidate_cache(self.root)
            entries = self.fs.ls(self.root, detail=False)
        except (FileNotFoundError, NotADirectoryError):
            return
        names = sorted({e.rstrip("/").rsplit("/", 1)[-1] for e in entries} - {""})
        names = [n for n in names if not is_temporary(n)]
        if not names or "config.yaml" in names:
            return
        if self.fs.isfile(self.root):
            raise ConfigError(f"run directory {self.url} is a file; choose a new or empty folder")
        shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
        raise ConfigError(f"run directory {self.url} is not empty and not a run directory (no config.yaml; "
                          f"holds {shown}); choose a new or empty folder")

    def create(self, config: RunConfig) -> bool:
        """Freeze `config` into the run directory. Returns False if the run already existed with the
        same config (a retried prepare, or a resume at another scale: settings of `RESIZABLE` may
        change, and the new ones are recorded); raises if it existed with a different one, or if the
        folder holds something else (see `check_creatable`)."""
        config = config.model_copy(update={"run_id": self.run_id})
        text = config.to_yaml().encode()
        self.check_creatable()
        if put_if_absent(self.fs, self.path("config.yaml"), text, own_check=False):  # compared below
            return True
        import yaml

        try:
            existing = self.config()
        except ConfigError as e:
            data = yaml.safe_load(read_bytes(self.fs, self.path("config.yaml")))
            if isinstance(data, dict) and set(data) & set(RunConfig.model_fields):
                raise ConfigError(f"run directory {self.url}: its config.yaml does not load ({e}); fix that setting "
                                  f"in {self.path('config.yaml')} to resume the run, or choose a new or empty "
                                  "folder") from None  # a run config this version does not take
            raise ConfigError(f"run directory {self.url} holds a config.yaml that is not a run config of "
                              f"rlhf-pipeline ({e}); choose a new or empty folder") from None
        except (ValueError, TypeError, yaml.YAMLError) as e:  # not a YAML mapping
            raise ConfigError(f"run directory {self.url} holds a config.yaml that is not a run config of "
                              f"rlhf-pipeline ({e}); choose a new or empty folder") from None
        differ = run_differences(existing, config)
        if differ:
            shown = ", ".join(f"{k} ({_at(existing, k)!r} there, {_at(config, k)!r} here)" for k in differ[:3])
            raise ConfigError(
                f"run directory {self.url} already holds a different config: {shown}"
                f"{f' and {len(differ) - 3} more' if len(differ) > 3 else ''}; resume it with its own settings, "
                "or choose another run_id or delete the old run"
            )
        if existing.model_dump() != config.model_dump():  # the same run at another scale
            put_atomic(self.fs, self.path("config.yaml"), text)
        return False

    def config(self) -> RunConfig:
        import yaml

        try:
            raw = read_bytes(self.fs, self.path("config.yaml"))
        except FileNotFoundError:
            raise ConfigError(f"{self.url} is not a run directory (no config.yaml); run `rlhf prepare` first") from None
        # written by `to_yaml`, whose strings read back the same under YAML 1.1 (this loader, as
        # snapshots were always read) and 1.2; a run took it as valid (`frozen`)
        return parse_config(yaml.safe_load(raw), frozen=True)

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
        return file_exists(self.fs, self.path(self._marker(name)))

    def markers(self) -> list[str]:
        return [n[: -len(".json")] for n in list_names(self.fs, self.path("markers")) if n.endswith(".json")]

    def request_stop(self, reason: str = "", *, by: str = "", attempt: int | None = None) -> None:
        """Ask the sampler, the trainer and the orchestrator's waiting sensors to stop; `by` names
        the writer. `attempt` marks a stop that ends one attempt of an unfinished run (the teardown
        after a trainer task that failed passes the orchestrator's attempt number, in Airflow the
        DAG run's clear count): for a later attempt (the failed run cleared in the UI) it is stale,
        and that attempt resumes the run. A stop without `attempt` (a user's, the local runner's,
        the one after the trainer finished) is final."""
        self.set_marker(self.STOP_MARKER, {"reason": reason, "by": by, "attempt": attempt})

    def delete_marker(self, name: str) -> None:
        from .storage import delete

        delete(self.fs, self.path(self._marker(name)))

    def stop_marker(self, attempt: int | None = None) -> dict | None:
        """The stop marker's payload; None when there is none, or when it is stale for `attempt`:
        it ended an earlier attempt (its `attempt` < `attempt`) and the trainer has not finished."""
        stop = self.marker(self.STOP_MARKER)
        if stop is None or attempt is None or stop.get("attempt") is None:
            return stop
        if int(stop["attempt"]) < int(attempt) and not self.has_marker(self.TRAINER_DONE_MARKER):
            return None
        return stop

    def take_over(self, driver: str) -> list[str]:
        """Record that `driver` (a DAG run id) now drives this run: a new DAG run that reuses the
        directory, to resume a failed run or to rerun it at another scale. Attempts are counted per
        DAG run (its clear count), so what another DAG run's attempts left would hold for this
        one's of the same number: a stop that ended one of its attempts (not a final stop: a
        user's, or the one after a finished trainer) and its `trainer_started_<n>` markers. Those
        are removed. Nothing happens when `driver` drives the run already (a retried or cleared
        prepare). Returns the names of the markers removed."""
        current = self.marker(self.DRIVER_MARKER)
        if current is not None and current.get("id") == driver:
            return []
        removed = [n for n in self.markers() if n.startswith("trainer_started_")]
        stop = self.marker(self.STOP_MARKER)
        if stop is not None and stop.get("attempt") is not None and not self.has_marker(self.TRAINER_DONE_MARKER):
            removed.append(self.STOP_MARKER)
        for name in removed:
            self.delete_marker(name)
        self.set_marker(self.DRIVER_MARKER, {"id": driver})
        return removed

    def stop_requested(self, attempt: int | None = None) -> bool:
        if attempt is None:
            return self.has_marker(self.STOP_MARKER)
        return self.stop_marker(attempt) is not None

    def clear_stale_stop(self, attempt: int | None) -> dict | None:
        """Remove the stop marker if it is stale for `attempt` (see `stop_marker`), before the
        engine processes of that attempt start: they poll `stop_requested()` and know nothing of
        attempts. Returns the removed payload, or None when there was nothing stale."""
        from .storage import delete

        stop = self.marker(self.STOP_MARKER)
        if stop is None or attempt is None or self.stop_marker(attempt) is not None:
            return None
        delete(self.fs, self.path(self._marker(self.STOP_MARKER)))
        return stop

    # metrics ----------------------------------------------------------------------------------
    def metrics(self, stream: str) -> "MetricsLog":
        """The writer of one metrics stream (see pipeline.metrics)."""
        from .metrics import MetricsLog

        return MetricsLog(self, stream)

    def read_metrics(self, stream: str) -> list[dict]:
        from .metrics import read_stream

        return read_stream(self, stream)

    def metric_streams(self) -> list[str]:
        from .metrics import stream_names

        return stream_names(self)
