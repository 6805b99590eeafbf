"""The lineage ledger: which rollout groups went into every optimizer update of a run.

    <run_dir>/lineage/part-<first>-<last>.parquet    rows of updates first..last (12 digits each)

One row per (update, group): `step` (the trainer step, as in the metrics: fresh step N and the
replay updates logged after it), `update` (optimizer updates after the batch: unique, increasing),
`version` (the first policy version whose weights hold the update: fresh step N and the replays
run right after it, before version N is checkpointed and published, both go into version N), `kind` (fresh | replay), `replay_epoch`, the group (`group_id`,
`prompt_id`, `policy_version` that generated it, `sampler_id`, `rows`, `reward_mean`) and its
importance weights (`is_weight`: the prioritized-replay weight, 1 for fresh data;
`batch_is_weight_mean`, `batch_is_weight_max`, `batch_is_clip_frac`: the truncated IS
behaviour->proximal statistics of the batch). "What data made policy K" = the rows with
`version <= K`. Query it with pyarrow (`read_ledger`) or DuckDB:
`SELECT ... FROM read_parquet('<run_dir>/lineage/*.parquet')`.

Rank 0 of the trainer buffers rows and writes a new part at every checkpoint, every
`FLUSH_EVERY` batches and when it stops; each part is published atomically (pipeline.storage). A
resumed trainer redoes the updates after its checkpoint, so it first rolls the ledger back to the
checkpoint's update count (as `rollback_metrics` does for the metrics): parts past it are deleted,
a part across it is rewritten truncated (`part-<first>-<count>`) before the old one goes. A reader
that finds both keeps, of the parts sharing a first update, the shortest: no row is counted twice
and none of a redone update survives.
"""

from __future__ import annotations

import re
import time

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from .storage import delete, list_names, parquet_from_bytes, put_atomic, read_bytes

FLUSH_EVERY = 50
PART_RE = re.compile(r"^part-(\d{12})-(\d{12})\.parquet$")
LEDGER_SCHEMA = pa.schema([
    ("step", pa.int64()), ("update", pa.int64()), ("version", pa.int64()), ("kind", pa.string()),
    ("replay_epoch", pa.int32()), ("group_id", pa.string()), ("prompt_id", pa.string()),
    ("policy_version", pa.int64()), ("sampler_id", pa.string()), ("rows", pa.int32()),
    ("reward_mean", pa.float64()), ("is_weight", pa.float64()), ("batch_is_weight_mean", pa.float64()),
    ("batch_is_weight_max", pa.float64()), ("batch_is_clip_frac", pa.float64()), ("time", pa.float64()),
])


def _parts(run) -> list[tuple[int, int, str]]:
    """(first, last, name) of the live parts, by first update (see the module docstring)."""
    best: dict[int, tuple[int, str]] = {}
    for name in list_names(run.fs, run.path("lineage")):
        m = PART_RE.match(name)
        if m:
            first, last = int(m.group(1)), int(m.group(2))
            if first not in best or last < best[first][0]:
                best[first] = (last, name)
    return sorted((first, last, name) for first, (last, name) in best.items())


def _read_part(run, name: str) -> pa.Table:
    return parquet_from_bytes(read_bytes(run.fs, run.path("lineage", name))).cast(LEDGER_SCHEMA)


def _write_part(run, table: pa.Table) -> None:
    first, last = pc.min(table["update"]).as_py(), pc.max(table["update"]).as_py()
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression="zstd")
    put_atomic(run.fs, run.path("lineage", f"part-{first:012d}-{last:012d}.parquet"), sink.getvalue().to_pybytes())


def rollback_lineage(run, updates: int) -> None:
    """Drop the rows of updates after `updates` (a resumed trainer redoes them)."""
    names = [n for n in list_names(run.fs, run.path("lineage")) if PART_RE.match(n)]
    for name in names:
        m = PART_RE.match(name)
        first, last = int(m.group(1)), int(m.group(2))
        if first > updates:
            delete(run.fs, run.path("lineage", name))
        elif last > updates:
            table = _read_part(run, name)
            table = table.filter(pc.less_equal(table["update"], updates))
            if table.num_rows:
                _write_part(run, table)
            delete(run.fs, run.path("lineage", name))


def read_ledger(run) -> pa.Table:
    """Every row of the ledger, by update."""
    tables = [_read_part(run, name) for _, _, name in _parts(run)]
    if not tables:
        return LEDGER_SCHEMA.empty_table()
    return pa.concat_tables(tables).sort_by([("update", "ascending"), ("group_id", "ascending")])


def ledger_files(run) -> list[str]:
    """URLs of the live parts (for DuckDB's `read_parquet([...])`)."""
    return [run.child_url("lineage", name) for _, _, name in _parts(run)]


def group_rows(table: pa.Table, weights=None) -> list[dict]:
    """Per group of a batch (rows in the rollout schema): its ids, generating version, reward."""
    cols = table.select(["group_id", "prompt_id", "policy_version", "sampler_id", "reward"]).to_pydict()
    w = np.ones(table.num_rows) if weights is None else np.asarray(weights, dtype=np.float64).reshape(-1)
    out: dict[str, dict] = {}
    for i, gid in enumerate(cols["group_id"]):
        g = out.setdefault(gid, {"group_id": gid, "prompt_id": cols["prompt_id"][i], "sampler_id": cols["sampler_id"][i],
                                 "policy_version": cols["policy_version"][i], "rows": 0, "reward_sum": 0.0,
                                 "is_weight": float(w[i])})
        g["policy_version"] = min(g["policy_version"], cols["policy_version"][i])
        g["rows"] += 1
        g["reward_sum"] += float(cols["reward"][i])
    return list(out.values())


class LineageWriter:
    """The ledger writer of rank 0 (other ranks get `NullLineage`)."""

    def __init__(self, run, resumed_updates: int):
        self.run = run
        rollback_lineage(run, resumed_updates)
        self.pending: list[dict] = []
        self.batches = 0

    def add(self, table: pa.Table, *, step: int, update: int, version: int, kind: str, stats: dict,
            weights=None, replay_epoch: int | None = None) -> None:
        """One trained batch: `table` its rows, `weights` their replay importance weights."""
        now = time.time()
        for g in group_rows(table, weights):
            self.pending.append({
                "step": step, "update": update, "version": version, "kind": kind, "replay_epoch": replay_epoch,
                "group_id": g["group_id"], "prompt_id": g["prompt_id"], "policy_version": g["policy_version"],
                "sampler_id": g["sampler_id"], "rows": g["rows"], "reward_mean": g["reward_sum"] / g["rows"],
                "is_weight": g["is_weight"], "batch_is_weight_mean": stats.get("is/weight_mean"),
                "batch_is_weight_max": stats.get("is/weight_max"), "batch_is_clip_frac": stats.get("is/clip_frac"),
                "time": now,
            })
        self.batches += 1
        if self.batches % FLUSH_EVERY == 0:
            self.flush()

    def flush(self) -> None:
        if self.pending:
            _write_part(self.run, pa.Table.from_pylist(self.pending, schema=LEDGER_SCHEMA))
            self.pending = []


class NullLineage:
    """Ranks other than 0: same methods, no output."""

    def add(self, *args, **kwargs) -> None:
        pass

    def flush(self) -> None:
        pass


# queries ------------------------------------------------------------------------------------------
def rows_of_step(ledger: pa.Table, step: int) -> pa.Table:
    """The batches logged at trainer step `step`: fresh step `step` and the replays right after it."""
    return ledger.filter(pc.equal(ledger["step"], step))


def check_version(ledger: pa.Table, version: int, where: str) -> None:
    """A version the ledger of run `where` has data for: 1 up to its newest (v0 is the model
    training started from, which no data made)."""
    from .config import ConfigError

    if version < 1:
        raise ConfigError(f"--version {version}: policy versions made by training start at 1 (v0 is the model trained from)")
    if ledger.num_rows == 0 or version > pc.max(ledger["version"]).as_py():
        raise ConfigError(f"--version {version}: the lineage ledger of {where} does not reach that version")


def groups_of_version(ledger: pa.Table, version: int) -> list[dict]:
    """What data made policy `version`: each group consumed by an update up to the one that
    produced it, with its fresh and replay uses and the steps that used it."""
    rows = ledger.filter(pc.less_equal(ledger["version"], version)).to_pylist()
    out: dict[str, dict] = {}
    for r in rows:
        g = out.setdefault(r["group_id"], {k: r[k] for k in ("group_id", "prompt_id", "policy_version", "sampler_id",
                                                             "rows", "reward_mean")} | {"fresh": 0, "replays": 0,
                                                                                         "steps": []})
        g["fresh" if r["kind"] == "fresh" else "replays"] += 1
        g["steps"].append(r["step"])
    return list(out.values())

