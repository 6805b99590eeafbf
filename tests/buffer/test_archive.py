"""L3: compaction of consumed L1 shards into partitioned zstd files, readable by pyarrow and DuckDB."""

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
from rollout_factory import make_groups

from pipeline.buffer import ReplayBuffer
from pipeline.buffer.schema import ROLLOUT_SCHEMA
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


def test_archive_is_partitioned_by_run_and_readable_by_pyarrow_and_duckdb(tmp_path):
    url = str(tmp_path / "run-7" / "buffer")
    buf = ReplayBuffer(url, BufferConfig(checkpoint_interval=5))
    shards = _fill(buf, 5)
    out = buf.compact(everything=True)
    assert out["l1_shards_in"] == 5 and out["l3_files_out"] == 1
    [f] = buf.archive_files()
    assert "/l3/run=run-7/part-" in f
    assert pq.ParquetFile(f.removeprefix("file://")).metadata.row_group(0).column(0).compression == "ZSTD"
    t = buf.archive_dataset().to_table()
    assert sorted(t.column("sample_id").to_pylist()) == sorted(pa.concat_tables(shards).column("sample_id").to_pylist())
    assert set(t.column("run").to_pylist()) == {"run-7"}
    rows = duckdb.sql(f"select policy_version, count(*) from read_parquet(['{f.removeprefix('file://')}'], "
                      "hive_partitioning=true) group by policy_version order by policy_version").fetchall()
    assert rows == [(0, 3 * 8), (1, 2 * 8)]


def test_an_archive_file_holds_many_versions_sorted_with_whole_groups(tmp_path):
    """A partition per policy version made one archive file per trainer step: no compaction."""
    buf = ReplayBuffer(str(tmp_path / "r" / "buffer"), BufferConfig(checkpoint_interval=5))
    _fill(buf, 6, versions=(2, 0, 1))
    assert buf.compact(everything=True)["l3_files_out"] == 1
    [info] = buf.refresh().tier_shards("l3")
    t = buf.load_shard(info)
    assert t.column("policy_version").to_pylist() == sorted(t.column("policy_version").to_pylist())
    gids = t.column("group_id").to_pylist()
    assert all(gids[i:i + 4] == [gids[i]] * 4 for i in range(0, len(gids), 4))  # each group's 4 rows together
    assert tuple(info.pv) == (0, 2)


def test_an_archive_written_per_version_reads_with_new_files(tmp_path):
    """Files in `policy=<version>` folders (the earlier layout) and new ones form one dataset."""
    from pipeline.buffer.actions import AddShard
    from pipeline.buffer.shards import encode, group_layout, policy_range, write_shard

    buf = ReplayBuffer(str(tmp_path / "r" / "buffer"), BufferConfig(checkpoint_interval=5))
    old, sizes = group_layout(make_groups("old", 2, policy_version=3).set_column(
        ROLLOUT_SCHEMA.get_field_index("tier"), "tier", pa.array(["l3"] * 8)))
    data = encode(old, "zstd")
    write_shard(buf.fs, buf.root, "l3/run=r/policy=3/part-old.parquet", data)
    buf.commit([AddShard("l3/run=r/policy=3/part-old.parquet", "l3", 8, len(data), tuple(sizes), policy_range(old),
                         0.0)])
    _fill(buf, 2)
    buf.compact(everything=True)
    t = buf.archive_dataset().to_table()
    assert t.num_rows == 8 + 16 and set(t.column("policy").to_pylist()) == {3, None}
    assert buf.compact()["l3_files_in"] == 2  # the small files merge across the layouts
    assert buf.archive_dataset().to_table().num_rows == 24


def test_small_archive_files_are_merged(buffer_url):
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


def _day(buf, versions):
    with buf.writer("w") as w:
        for i, v in enumerate(versions):
            w.write(make_groups(f"v{v}-{i}", 2, policy_version=v, seed=v))
    buf.compact(everything=True)


def test_merged_archive_files_keep_their_age_for_retention_and_the_row_bound(tmp_path, monkeypatch):
    """Small files of three compactions, a day apart: a merge must neither carry rows past
    l3_retention_s along nor make old rows look newest to l3_max_rows."""
    from pipeline.buffer import archive

    clock = [1e9]
    monkeypatch.setattr(archive.time, "time", lambda: clock[0])
    url = str(tmp_path / "r" / "buffer")
    for d, versions in enumerate([[0, 1], [2, 3], [4, 5]]):
        clock[0] = 1e9 + d * 86400.0
        _day(ReplayBuffer(url, BufferConfig(checkpoint_interval=5, l3_retention_s=1.5 * 86400.0)), versions)
    left = ReplayBuffer(url).archive_dataset().to_table()
    assert sorted(set(left.column("policy_version").to_pylist())) == [2, 3, 4, 5]  # day 0's rows expired

    url = str(tmp_path / "s" / "buffer")
    _day(ReplayBuffer(url, BufferConfig(checkpoint_interval=5)), [0, 1])
    _day(ReplayBuffer(url, BufferConfig(checkpoint_interval=5)), [2, 3])
    _day(ReplayBuffer(url, BufferConfig(checkpoint_interval=5, l3_max_rows=40)), [4, 5])
    left = ReplayBuffer(url).archive_dataset().to_table()
    assert sorted(set(left.column("policy_version").to_pylist())) == [4, 5]  # the oldest rows went first
