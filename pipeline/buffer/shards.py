"""Rollout shards: immutable zstd Parquet files holding whole groups, contiguous by group.

Encoding checks the table against the rollout schema and makes each group's rows contiguous, so
the commit log can describe a shard by its group sizes and readers can slice whole groups without
scanning ids. Decoding checks the schema version first: a newer version is a hard error
(`SchemaError`), anything else unreadable is a `CorruptShard` that the buffer quarantines.
"""

from __future__ import annotations

import io
import logging
import time
import uuid

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ..locations import validate_name
from ..storage import is_local, join, parquet_from_bytes, put_atomic, read_bytes, write_local
from .schema import ROLLOUT_SCHEMA, SCHEMA_VERSION, SCHEMA_VERSION_KEY, SchemaError, check_schema

log = logging.getLogger(__name__)

class CorruptShard(ValueError):
    """A committed shard that cannot be read as rollouts (truncated, corrupt, wrong schema)."""


def validate_writer_id(writer_id: str) -> str:
    return validate_name(writer_id, "writer_id", max_len=64)


def conform(table: pa.Table) -> pa.Table:
    """`table` in exactly ROLLOUT_SCHEMA (column order, types, metadata) or a ValueError naming the
    columns that differ."""
    if table.schema.equals(ROLLOUT_SCHEMA) and table.schema.metadata == ROLLOUT_SCHEMA.metadata:
        return table  # the common case: built by schema.to_table or read from a shard
    missing = [f.name for f in ROLLOUT_SCHEMA if f.name not in table.schema.names]
    extra = [n for n in table.schema.names if n not in ROLLOUT_SCHEMA.names]
    if missing or extra:
        raise ValueError(f"rollout shard: missing columns {missing}, unexpected columns {extra}; "
                         "build it with pipeline.buffer.schema.to_table")
    table = table.select(ROLLOUT_SCHEMA.names)
    try:
        return table.cast(ROLLOUT_SCHEMA)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, ValueError) as e:
        raise ValueError(f"rollout shard: columns do not cast to the rollout schema ({e}); "
                         "build it with pipeline.buffer.schema.to_table") from None


def group_layout(table: pa.Table) -> tuple[pa.Table, list[int]]:
    """Reorder rows so each group is contiguous (groups in order of first appearance; rows keep
    their order inside a group). Returns the table and the rows per group."""
    if table.num_rows == 0:
        return table, []
    ids = table.column("group_id").combine_chunks()
    codes = pc.dictionary_encode(ids).indices.to_numpy(zero_copy_only=False)
    # dictionary_encode numbers groups in order of first appearance
    counts = np.bincount(codes)
    if np.all(codes[1:] >= codes[:-1]):
        return table, counts.tolist()
    order = np.argsort(codes, kind="stable")
    return table.take(pa.array(order)), counts.tolist()


def encode(table: pa.Table, compression: str) -> bytes:
    sink = io.BytesIO()
    pq.write_table(table, sink, compression=None if compression == "none" else compression,
                   row_group_size=max(1, table.num_rows))
    return sink.getvalue()


def new_shard_path(tier: str, writer_id: str) -> str:
    return f"{tier}/{writer_id}-{uuid.uuid4().hex}.parquet"


def write_shard(fs, root: str, rel: str, data: bytes, fsync: bool = False) -> None:
    """Write an immutable data file under a new unique name.

    No temporary file and rename: nobody reads a data file before a log entry names it, and that
    entry is written only after this returns, so a writer killed half-way leaves an orphan for vacuum,
    never a visible partial shard. Without fsync a machine crash (not a killed process) can leave
    a committed shard torn on a local disk; readers then quarantine it. The log entry that commits
    it is always fsynced."""
    path = join(root, rel)
    if not is_local(fs):
        put_atomic(fs, path, data)
        return
    write_local(path, data, fsync, mode="xb")  # names are unique: an existing file is a bug, not a race


def policy_range(table: pa.Table) -> tuple[int, int]:
    mm = pc.min_max(table.column("policy_version"))
    return int(mm["min"].as_py()), int(mm["max"].as_py())


READ_TRIES = 3
"""Tries of reading a shard's bytes when storage fails (a connection reset, NFS's ESTALE)."""


def read_shard(fs, root: str, rel: str, data: bytes | None = None) -> pa.Table:
    """A committed shard as a table in ROLLOUT_SCHEMA (parsed from `data` when given: its bytes,
    from a local copy). Raises SchemaError for a newer schema version, CorruptShard for anything
    else that is wrong with the file's content. Storage that fails to deliver the bytes is not bad
    content: the read is tried READ_TRIES times, then its OSError is raised as it is (the process
    fails and resumes, and the shard is not quarantined); FileNotFoundError at once."""
    path = join(root, rel)
    for attempt in range(READ_TRIES):
        if data is not None:
            break
        try:
            data = read_bytes(fs, path)
        except FileNotFoundError:
            raise
        except OSError as e:
            if attempt + 1 == READ_TRIES:
                raise
            log.warning("reading shard %s failed (%s); trying again", path, e)
            time.sleep(0.5 * 2 ** attempt)
    try:
        table = parquet_from_bytes(data)
    except (pa.ArrowInvalid, pa.ArrowException, OSError, ValueError) as e:
        raise CorruptShard(f"{path}: unreadable Parquet ({e})") from None
    meta = table.schema.metadata or {}
    raw = meta.get(SCHEMA_VERSION_KEY)
    if raw is not None and raw.isdigit() and int(raw) > SCHEMA_VERSION:
        check_schema(table.schema, path)  # raises the clear "upgrade" SchemaError
    try:
        check_schema(table.schema, path)
        return conform(table)
    except (SchemaError, ValueError) as e:
        raise CorruptShard(f"{path}: wrong schema ({e})") from None
