"""L3 cold tier: compaction of consumed L1 shards into large zstd files, and archive retention.

Besides compaction, a sampler archives the groups it generated and did not hand over
(`sampler.oversample`) straight into L3 (`ShardWriter.write(..., archive=...)`), small files that
the next compaction merges: the archive holds the groups handed over and the others, trained on
or not (the lineage ledger names those trained on); a draw the staleness bound refuses (several
replicas) is dropped whole.

Files land under `l3/run=<run_id>/part-<id>.parquet` (Hive partitioning by run), each of up to
`compact_target_rows` rows ordered by `policy_version` (a group's rows stay together); a file's
version range is in the log and in its Parquet statistics, so a reader filtering on versions skips
whole files. A partition per version made a file per trainer step, no compaction at all: 3000
files of 17 KB for a 3000-step run. Archives written with `policy=<version>` folders read as before, with a `policy`
column. Only files named by the commit log are part of the archive: read it with
`archive_dataset(buf)` (pyarrow.dataset) or DuckDB on `archive_files(buf)`. A glob over `l3/`
also works after `vacuum`, which removes the leftovers of interrupted compactions.

Compaction is one commit per chunk: add the new L3 files and remove the inputs, on the condition
that every input is still live. If another compactor got there first the commit is abandoned and
its files become orphans for vacuum; readers never see rows twice.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.compute as pc

from ..config import ConfigError
from ..locations import validate_run_id
from .actions import AddShard, RemoveShard, resume_consumer
from .log import CommitConflict, shards_still_live
from .shards import encode, group_layout, policy_range, write_shard
from .state import ShardInfo

if TYPE_CHECKING:
    from .buffer import ReplayBuffer

log = logging.getLogger(__name__)


def run_id_of(buf: "ReplayBuffer") -> str:
    """The run a buffer belongs to: the name of the folder holding it (`<runs>/<run_id>/buffer`)."""
    parts = buf.root.rstrip("/").split("/")
    name = parts[-2] if len(parts) >= 2 else ""
    try:
        return validate_run_id(name)
    except ConfigError:
        return "default"


def archive_path(buf: "ReplayBuffer") -> str:
    """A new L3 file's path, relative to the buffer's root."""
    return f"l3/run={run_id_of(buf)}/part-{uuid.uuid4().hex}.parquet"


def as_archived(table: pa.Table) -> pa.Table:
    """Rollout rows as L3 holds them (their `tier` column says so)."""
    return table.set_column(table.schema.get_field_index("tier"), "tier", pa.array(["l3"] * table.num_rows))


def _chunks(shards: list[ShardInfo], max_rows: int) -> list[list[ShardInfo]]:
    out, cur, rows = [], [], 0
    for s in shards:
        if cur and rows + s.rows > max_rows:
            out.append(cur)
            cur, rows = [], 0
        cur.append(s)
        rows += s.rows
    if cur:
        out.append(cur)
    return out


def compact(buf: "ReplayBuffer", everything: bool = False, consumer: str = "trainer") -> dict:
    """Archive consumed L1 shards (all L1 shards with `everything`, e.g. when a run finishes) into
    L3 and merge small L3 files. Returns counts of what was done."""
    cfg = buf.config
    dropped = enforce_l3_limits(buf)["l3_dropped"]  # first: a merge would carry expired rows along
    st = buf.refresh()
    l1 = st.tier_shards("l1")
    if not everything:
        before = archivable_before(st, consumer)
        l1 = [s for s in l1 if before is not None and s.seq < before]
    small = [s for s in st.tier_shards("l3") if s.rows < cfg.compact_target_rows // 2]
    merge = small if len(small) >= 2 else []
    done = {"l1_shards_in": 0, "l3_files_in": 0, "l3_files_out": 0, "rows": 0, "conflicts": 0}
    for chunk in _chunks(l1, cfg.compact_target_rows) + _chunks(merge, cfg.compact_target_rows):
        try:
            out = _compact_chunk(buf, chunk)
        except CommitConflict as e:
            log.warning("buffer %s: compaction chunk skipped: %s", buf.url, e)
            done["conflicts"] += 1
            continue
        done["l1_shards_in"] += sum(1 for s in chunk if s.tier == "l1")
        done["l3_files_in"] += sum(1 for s in chunk if s.tier == "l3")
        done["l3_files_out"] += out
        done["rows"] += sum(s.rows for s in chunk)
    done["l3_dropped"] = dropped + enforce_l3_limits(buf)["l3_dropped"]
    return done


def archivable_before(st, consumer: str) -> int | None:
    """The L1 shard before which every shard was consumed and will not be read again: the
    consumer's recorded position, or where it resumes after a restart if that is behind (a
    trainer records its checkpoints' cursors there: groups it trained after its newest checkpoint
    are trained again when it restarts). None: nothing consumed yet."""
    cur = st.consumed.get(consumer)
    if cur is None:
        return None
    resume = st.consumed.get(resume_consumer(consumer))
    return min(int(cur["seq"]), int(resume["seq"])) if resume is not None else int(cur["seq"])


def _compact_chunk(buf: "ReplayBuffer", chunk: list[ShardInfo]) -> int:
    tables, inputs = [], []
    for info in chunk:
        t = buf.load_shard(info)  # a corrupt input is quarantined, not archived
        if t is not None:
            tables.append(t)
            inputs.append(info.path)
    if not inputs:
        return 0
    table = as_archived(pa.concat_tables(tables))
    table = table.take(pc.sort_indices(table, [("policy_version", "ascending")]))  # stable: groups stay whole
    table, gsizes = group_layout(table)
    data = encode(table, "zstd")
    rel = archive_path(buf)
    write_shard(buf.fs, buf.root, rel, data, fsync=True)  # inputs go once this commits
    # a merge of archive files keeps their newest time (retention goes by it); a compaction of L1 takes now
    t = max((s.t for s in chunk if s.tier == "l3"), default=None) or time.time()
    add = AddShard(rel, "l3", table.num_rows, len(data), tuple(gsizes), policy_range(table), t)
    buf.commit([*(RemoveShard(p) for p in inputs), add], precondition=shards_still_live(inputs, "compaction inputs"))
    return 1


def enforce_l3_limits(buf: "ReplayBuffer") -> dict:
    """Drop archive files past `l3_retention_s` (by their time: a merged file's is its newest
    input's), then those of the oldest policy versions until `l3_max_rows` holds (a merged file is
    committed last whatever its rows' age)."""
    cfg = buf.config
    st = buf.refresh()
    files = sorted(st.tier_shards("l3"), key=lambda s: (s.pv[0], s.pv[1]))  # oldest rows first
    now = time.time()
    drop = []
    if cfg.l3_retention_s is not None:
        drop = [s.path for s in files if now - s.t > cfg.l3_retention_s]
    if cfg.l3_max_rows is not None:
        rows = sum(s.rows for s in files if s.path not in drop)
        for s in files:
            if rows <= cfg.l3_max_rows:
                break
            if s.path not in drop:
                drop.append(s.path)
                rows -= s.rows
    if drop:
        try:
            buf.commit([RemoveShard(p) for p in drop], precondition=shards_still_live(drop, "archive files"))
        except CommitConflict:
            return {"l3_dropped": 0}
    return {"l3_dropped": len(drop)}


def archive_files(buf: "ReplayBuffer") -> list[str]:
    """URLs of the committed L3 files (what a DuckDB `read_parquet([...])` should read)."""
    st = buf.refresh()
    return [buf.fs.unstrip_protocol(f"{buf.root}/{s.path}") for s in st.tier_shards("l3")]


def archive_dataset(buf: "ReplayBuffer"):
    """The committed L3 archive as a `pyarrow.dataset.Dataset` with a `run` partition column (and
    `policy`, null but in files of an archive written in `policy=<version>` folders)."""
    import pyarrow.dataset as ds

    st = buf.refresh()
    paths = [f"{buf.root}/{s.path}" for s in st.tier_shards("l3")]
    return ds.dataset(paths, format="parquet", filesystem=buf.fs, partitioning="hive",
                      partition_base_dir=f"{buf.root}/l3")
