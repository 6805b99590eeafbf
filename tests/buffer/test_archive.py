"""L3: compaction of consumed L1 shards into partitioned zstd files, readable by pyarrow and DuckDB."""

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
from rollout_factory import make_groups

from pipeline.buffer import ReplayBuffer
from pipeline.config import BufferConfig


def _fill(buf, n, versions=(0, 1)):
    shards = [make_groups(f"s{i}", 2, policy_version=versions[i % len(versions)], seed=i) for i in range(n)]
    with buf.writer("w") as w:
        for t in shards:
            w.write(t)
    return shards


def test_compaction_archives_only_consumed_shards(buffer_url):
    buf = ReplayBuffer(buffer_url, BufferConfig(checkpoint_interval=5))
    _fill(buf, 6)
    table, cursor = buf.read_fresh(None, 7)  # shards 0..2 consumed, shard 3 half
    buf.mark_consumed(cursor)
    out = buf.compact()
    assert out["l1_shards_in"] == 3
    st = buf.stats()["tiers"]
    assert st["l1"]["shards"] == 3 and st["l3"]["rows"] == 3 * 2 * 4
    # the trainer keeps reading from its cursor; nothing it has not read was archived
    rest, _ = buf.read_fresh(cursor, 100)
    assert rest.num_rows == (12 - 7) * 4


def test_archive_is_partitioned_by_run_and_policy_and_readable_by_pyarrow_and_duckdb(tmp_path):
    url = str(tmp_path / "run-7" / "buffer")
    buf = ReplayBuffer(url, BufferConfig(checkpoint_interval=5))
    shards = _fill(buf, 5)
    out = buf.compact(everything=True)
    assert out["l1_shards_in"] == 5 and out["l3_files_out"] == 2
    files = buf.archive_files()
    assert all("/l3/run=run-7/policy=" in f for f in files)
    for f in files:
        assert pq.ParquetFile(f.removeprefix("file://")).metadata.row_group(0).column(0).compression == "ZSTD"
    t = buf.archive_dataset().to_table()
    assert sorted(t.column("sample_id").to_pylist()) == sorted(pa.concat_tables(shards).column("sample_id").to_pylist())
    assert set(t.column("run").to_pylist()) == {"run-7"}
    assert all(a == b for a, b in zip(t.column("policy").to_pylist(), t.column("policy_version").to_pylist()))
    file_list = ", ".join(f"'{f.removeprefix('file://')}'" for f in files)
    rows = duckdb.sql(f"select policy, count(*) from read_parquet([{file_list}], hive_partitioning=true) "
                      "group by policy order by policy").fetchall()
    assert rows == [(0, 3 * 8), (1, 2 * 8)]


def test_small_archive_files_of_a_partition_are_merged(buffer_url):
    buf = ReplayBuffer(buffer_url, BufferConfig(checkpoint_interval=5, compact_target_rows=1000))
    files = []
    for i in range(4):
        _fill(buf, 1, versions=(4,))
        buf.compact(everything=True)
        files.append(buf.stats()["tiers"]["l3"]["shards"])
    assert max(files) <= 2  # a partition never accumulates small files
    buf.compact()
    after = buf.stats()["tiers"]["l3"]
    assert after["shards"] == 1 and after["rows"] == 4 * 8
    assert buf.archive_dataset().to_table().num_rows == 32


def test_l3_retention_drops_oldest_files_first(buffer_url):
    buf = ReplayBuffer(buffer_url, BufferConfig(checkpoint_interval=5, l3_max_rows=10, compact_target_rows=8))
    _fill(buf, 1, versions=(0,))
    buf.compact(everything=True)
    _fill(buf, 1, versions=(1,))
    out = buf.compact(everything=True)
    assert out["l3_dropped"] == 1
    remaining = buf.archive_dataset().to_table()
    assert set(remaining.column("policy_version").to_pylist()) == {1}


def test_compaction_conflict_leaves_no_duplicate_rows(buffer_url):
    """Two compactors race on the same inputs: one commit wins, the other is abandoned."""
    import pytest

    from pipeline.buffer import CommitConflict
    from pipeline.buffer.archive import _compact_chunk

    cfg = BufferConfig(checkpoint_interval=5)
    a, b = ReplayBuffer(buffer_url, cfg), ReplayBuffer(buffer_url, cfg)
    _fill(a, 4)
    planned = b.refresh().tier_shards("l1")  # b plans with the same view as a ...
    a.compact(everything=True)  # ... and a commits first
    with pytest.raises(CommitConflict):
        _compact_chunk(b, planned)
    t = b.archive_dataset().to_table()
    assert t.num_rows == 4 * 8 and len(set(t.column("sample_id").to_pylist())) == 32
    assert b.stats()["tiers"]["l1"]["shards"] == 0


def test_compaction_keeps_what_a_reader_restarting_from_its_checkpoint_reads_again(buffer_url):
    buf = ReplayBuffer(buffer_url, BufferConfig(checkpoint_interval=5))
    _fill(buf, 6)
    _, checkpointed = buf.read_fresh(None, 4)  # shards 0-1: the newest checkpoint's cursor
    buf.mark_resumable(checkpointed)
    _, live = buf.read_fresh(checkpointed, 6)  # shards 2-4 read after it and recorded
    buf.mark_consumed(live)
    assert buf.compact()["l1_shards_in"] == 2
    # restarted from the checkpoint, the reader finds every group it read after it
    again, _ = buf.read_fresh(checkpointed, 100)
    assert again.num_rows == (12 - 4) * 4
    buf.mark_resumable(live)  # a later checkpoint lets the rest go
    assert buf.compact()["l1_shards_in"] == 3
