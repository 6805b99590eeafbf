"""L1: asynchronous writes, whole groups in commit order, cursors that make consumption exactly-once."""

import json
import threading

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from rollout_factory import make_groups

from pipeline.buffer import ReplayBuffer
from pipeline.config import BufferConfig
from pipeline.storage import url_to_fs


def _write(buf, writer_id, shards):
    with buf.writer(writer_id) as w:
        for t in shards:
            w.write(t)


def test_round_trip_returns_every_row_in_commit_order(buffer_url, small_config):
    buf = ReplayBuffer(buffer_url, small_config)
    shards = [make_groups(f"s{i}", 3, seed=i) for i in range(7)]
    _write(buf, "w0", shards)
    table, cursor = buf.read_fresh(None, 1000)
    expected = pa.concat_tables(shards)
    assert table.column("sample_id").to_pylist() == expected.column("sample_id").to_pylist()
    assert table.column("reward").to_pylist() == expected.column("reward").to_pylist()
    assert buf.fresh_backlog(cursor) == 0
    assert buf.read_fresh(cursor, 10)[0].num_rows == 0


def test_reads_never_split_a_group(buffer_url, small_config):
    buf = ReplayBuffer(buffer_url, small_config)
    # rows of a group interleaved in the input: the shard stores them contiguously
    t = make_groups("a", 5, group_size=3)
    t = t.take(pa.array([0, 3, 6, 9, 12, 1, 4, 7, 10, 13, 2, 5, 8, 11, 14]))
    _write(buf, "w0", [t, make_groups("b", 4, group_size=3)])
    cursor, seen = None, []
    for size in [2, 1, 3, 2, 5]:
        table, cursor = buf.read_fresh(cursor, size)
        gids = table.column("group_id").to_pylist()
        groups = list(dict.fromkeys(gids))
        assert len(groups) <= size
        for g in groups:
            assert gids.count(g) == 3  # whole group
        seen.extend(groups)
    assert seen == [f"a-g{i}" for i in range(5)] + [f"b-g{i}" for i in range(4)]


def test_saved_cursor_rereads_exactly_the_same_rows(buffer_url, small_config):
    buf = ReplayBuffer(buffer_url, small_config)
    _write(buf, "w0", [make_groups(f"s{i}", 4, seed=i) for i in range(6)])
    _, cursor = buf.read_fresh(None, 7)
    saved = json.loads(json.dumps(cursor))  # what a trainer checkpoint stores
    first, after = buf.read_fresh(cursor, 5)
    # a new process (new handle) resuming from the saved cursor
    again, after2 = ReplayBuffer(buffer_url, small_config).read_fresh(saved, 5)
    assert again.column("sample_id").to_pylist() == first.column("sample_id").to_pylist()
    assert after2 == after


def test_consumption_is_exactly_once_across_restarts(buffer_url, small_config):
    buf = ReplayBuffer(buffer_url, small_config)
    shards = [make_groups(f"s{i}", 3, seed=i) for i in range(10)]
    w = buf.writer("w0")
    consumed, cursor = [], None
    for i, t in enumerate(shards):
        w.write(t)
        if i % 3 == 2:
            w.flush()
            reader = ReplayBuffer(buffer_url, small_config)  # "restarted trainer"
            table, cursor = reader.read_fresh(cursor, 4)
            consumed.extend(table.column("sample_id").to_pylist())
    w.close()
    while True:
        table, cursor = ReplayBuffer(buffer_url, small_config).read_fresh(cursor, 4)
        if table.num_rows == 0:
            break
        consumed.extend(table.column("sample_id").to_pylist())
    expected = pa.concat_tables(shards).column("sample_id").to_pylist()
    assert consumed == expected


def test_backlog_counts_unconsumed_groups(buffer_url, small_config):
    buf = ReplayBuffer(buffer_url, small_config)
    assert buf.fresh_backlog(None) == 0
    _write(buf, "w0", [make_groups("a", 3), make_groups("b", 5)])
    assert buf.fresh_backlog(None) == 8
    _, cursor = buf.read_fresh(None, 4)
    assert cursor == {"seq": 1, "group": 1}
    assert buf.fresh_backlog(cursor) == 4


def test_stats_count_rows_groups_and_shards(buffer_url, small_config):
    buf = ReplayBuffer(buffer_url, small_config)
    _write(buf, "w0", [make_groups("a", 3, group_size=2), make_groups("b", 5, group_size=2)])
    l1 = buf.stats()["tiers"]["l1"]
    assert (l1["rows"], l1["groups"], l1["shards"]) == (16, 8, 2)
    assert l1["bytes"] > 0


def test_writer_rejects_a_table_with_wrong_columns(buffer_url):
    buf = ReplayBuffer(buffer_url)
    with buf.writer("w0") as w:
        with pytest.raises(ValueError, match="missing columns"):
            w.write(make_groups("a", 1).drop_columns(["reward"]))


@pytest.mark.parametrize("bad", ["../x", "", "a/b"])
def test_writer_id_is_validated(buffer_url, bad):
    with pytest.raises(ValueError, match="writer_id"):
        ReplayBuffer(buffer_url).writer(bad)


def test_bad_cursor_names_the_value(buffer_url):
    buf = ReplayBuffer(buffer_url)
    with pytest.raises(ValueError, match="cursor"):
        buf.read_fresh({"seq": "x"}, 1)
    with pytest.raises(ValueError, match="past the end"):
        buf.read_fresh({"seq": 5, "group": 0}, 1)
    _write(buf, "w0", [make_groups("a", 2)])
    with pytest.raises(ValueError, match="only 2 groups"):
        buf.read_fresh({"seq": 0, "group": 2}, 1)


def test_opening_reads_a_checkpoint_not_the_whole_log(buffer_url, small_config):
    buf = ReplayBuffer(buffer_url, small_config)
    with buf.writer("w0") as w:
        for i in range(23):
            w.write(make_groups(f"s{i}", 1))
            w.flush()  # one commit per shard
    assert buf.state.version == 23
    fresh = ReplayBuffer(buffer_url, small_config)
    fresh.refresh()
    # checkpoint at 20 + entries 21..23
    assert fresh.log.files_read == 4
    assert fresh.fresh_backlog(None) == 23


def test_only_the_newest_log_checkpoints_stay_and_the_log_opens_the_same(buffer_url, small_config):
    """Each checkpoint holds the whole state, which grows with the run: all of them kept took space
    quadratic in the run's length (155 MB of a 1500-step run's 262 MB)."""
    from pipeline.buffer.log import KEPT_CHECKPOINTS

    buf = ReplayBuffer(buffer_url, small_config)
    every = small_config.checkpoint_interval
    with buf.writer("w0") as w:
        for i in range(every * (KEPT_CHECKPOINTS + 2) + 3):
            w.write(make_groups(f"s{i}", 1))
            w.flush()  # one commit per shard
    newest = every * (KEPT_CHECKPOINTS + 2)
    assert buf.log.checkpoint_versions() == [newest - every * k for k in reversed(range(KEPT_CHECKPOINTS))]
    fresh = ReplayBuffer(buffer_url, small_config)
    assert fresh.refresh().to_json() == buf.refresh().to_json()
    assert buf.verify()["ok"]


def test_with_several_writers_each_keeps_its_newest_log_checkpoints(tmp_path):
    """Appenders catch up before they checkpoint, so checkpoints land at any version: each writer
    deletes its own older ones, and the one the pointer names stays."""
    import time

    import fsspec

    from pipeline.buffer.actions import AddShard
    from pipeline.buffer.log import KEPT_CHECKPOINTS, CommitLog

    fs = fsspec.filesystem("file")
    logs = [CommitLog(fs, str(tmp_path), checkpoint_interval=5, writer=w, fsync=False) for w in "abc"]
    for i in range(200):
        for w, lg in zip("abc", logs):
            lg.commit([AddShard(f"l1/{w}-{i}.parquet", "l1", 1, 10, (1,), (0, 0), time.time())])
    reader = CommitLog(fs, str(tmp_path), checkpoint_interval=5)
    kept = reader.checkpoint_versions()
    assert len(kept) <= 3 * KEPT_CHECKPOINTS and reader.last_checkpoint() in kept
    reader.refresh()
    assert reader.state.version == 600 and reader.files_read <= 1 + 5


def test_an_admit_check_sees_the_groups_another_process_committed_since_the_writer_last_looked(buffer_url):
    ours, theirs = ReplayBuffer(buffer_url), ReplayBuffer(buffer_url)
    assert ours.committed_groups() == 0  # our view of the log, before the other process commits
    _write(theirs, "other", [make_groups("o", 4)])
    seen = []

    def admit(before, shard):  # room for 6 groups in all
        seen.append(before)
        return before + shard.num_groups <= 6

    with ours.writer("w0", admit=admit) as w:
        w.write(make_groups("a", 2), tag="a")
        w.flush()
        w.write(make_groups("b", 2), tag="b")
    assert w.dropped == ["b"] and w.pending_groups() == 0 and w.rows_written == 8
    assert 4 in seen and seen[-1] == 6  # "a" was checked at 4 (not at our stale 0), "b" at 6
    assert ReplayBuffer(buffer_url).committed_groups() == 6
    report = ReplayBuffer(buffer_url).verify()
    assert report["ok"] and report["unreferenced_files"] == 0  # the refused shard's file is gone


def _ids(*parts):
    return sorted({g for prefix, n in parts for g in make_groups(prefix, n).column("group_id").to_pylist()})


def test_groups_given_to_archive_go_to_l3_in_the_same_commit_and_count_in_no_l1_figure(buffer_url):
    """A sampler's groups that it generated and did not hand over (`sampler.oversample`)."""
    buf = ReplayBuffer(buffer_url, BufferConfig(shard_compression="snappy"))
    version = buf.refresh().version
    with buf.writer("w0") as w:  # queued together: one group commit, one L3 file per shard
        for k in range(3):
            w.write(make_groups(f"s{k}", 2), archive=make_groups(f"s{k}-left", 1))
        w.flush()
        assert w.groups_written == 6 and w.pending_groups() == 0 and w.rows_written == 24
    fresh = ReplayBuffer(buffer_url)
    assert 1 <= fresh.refresh().version - version <= 3 and fresh.committed_groups() == 6
    table, _ = fresh.read_fresh(None, 100)
    assert sorted(set(table.column("group_id").to_pylist())) == _ids(("s0", 2), ("s1", 2), ("s2", 2))
    archive = fresh.archive_dataset().to_table()
    assert sorted(set(archive.column("group_id").to_pylist())) == _ids(("s0-left", 1), ("s1-left", 1), ("s2-left", 1))
    assert set(archive.column("tier").to_pylist()) == {"l3"} and fresh.stats()["tiers"]["l3"]["rows"] == 12
    for url in fresh.archive_files():  # L3 is zstd whatever the shards' codec
        fs, path = url_to_fs(url)
        with fs.open(path, "rb") as f:
            assert pq.ParquetFile(f).metadata.row_group(0).column(0).compression == "ZSTD"
    assert fresh.verify()["ok"]


def test_a_shard_the_admit_check_refuses_is_dropped_with_its_groups_to_archive(buffer_url):
    buf = ReplayBuffer(buffer_url)
    version = buf.refresh().version

    def admit(before, shard):  # room for 3 groups
        return before + shard.num_groups <= 3

    with buf.writer("w0", admit=admit) as w:
        w.write(make_groups("a", 2), tag="a", archive=make_groups("a-left", 1))
        w.flush()
        w.write(make_groups("b", 2), tag="b", archive=make_groups("b-left", 2))  # past the bound
    assert w.dropped == ["b"] and w.pending_groups() == 0 and w.rows_written == 8
    fresh = ReplayBuffer(buffer_url)
    assert fresh.refresh().version == version + 1 and fresh.committed_groups() == 2
    assert sorted(set(fresh.archive_dataset().to_table().column("group_id").to_pylist())) == _ids(("a-left", 1))
    report = fresh.verify()
    assert report["ok"] and report["unreferenced_files"] == 0  # the refused shard's files are gone


def test_writers_racing_under_an_admit_check_commit_exactly_what_it_allows(buffer_url):
    """Two writers, each with its own view of the log, hand over shards as fast as they can: the
    check runs where each shard lands, so exactly the allowed number of groups is committed."""
    cap, per_writer = 7, 10
    writers = [ReplayBuffer(buffer_url).writer(f"w{i}", admit=lambda before, shard: before + shard.num_groups <= cap)
               for i in range(2)]

    def hand_over(i):
        for k in range(per_writer):
            writers[i].write(make_groups(f"w{i}-{k}", 1), tag=k)

    threads = [threading.Thread(target=hand_over, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for w in writers:
        w.close()
    assert ReplayBuffer(buffer_url).committed_groups() == cap
    assert sum(len(w.dropped) for w in writers) == 2 * per_writer - cap
    assert ReplayBuffer(buffer_url).verify()["unreferenced_files"] == 0


@pytest.mark.integration
def test_on_object_storage_a_reader_beside_the_writer_takes_the_shards_from_its_local_copies(s3_url, small_config,
                                                                                              monkeypatch):
    """The sampler's writer keeps a local copy of each shard it puts; the trainer on the same node
    reads committed shards from there, and from the store when the copy is not the shard's size."""
    from pipeline.buffer import shards as shards_mod

    downloads = []
    real = shards_mod.read_bytes
    monkeypatch.setattr(shards_mod, "read_bytes", lambda fs, path: downloads.append(path) or real(fs, path))
    shards = [make_groups(f"s{i}", 3, seed=i) for i in range(3)]
    _write(ReplayBuffer(s3_url, small_config), "w0", shards)
    reader = ReplayBuffer(s3_url, small_config)
    first, cursor = reader.read_fresh(None, 3)
    assert first.column("sample_id").to_pylist() == shards[0].column("sample_id").to_pylist() and downloads == []
    info = reader.state.shards[reader.state.l1_by_seq[reader.state.l1_seqs[1]]]
    with open(reader.shard_copies._path(info.path), "ab") as f:
        f.write(b"x")  # not the shard any more
    rest, _ = reader.read_fresh(cursor, 6)
    assert rest.column("sample_id").to_pylist() == pa.concat_tables(shards[1:]).column("sample_id").to_pylist()
    assert [p.rsplit("/", 1)[-1] for p in downloads] == [info.path.rsplit("/", 1)[-1]]


def test_storage_that_fails_to_deliver_a_shard_is_not_bad_data(tmp_path, small_config, monkeypatch):
    """A connection reset or NFS's ESTALE while a shard is read: tried again, and if it persists the
    read fails as it is; the shard is never quarantined, so the process that resumes reads it.
    (On local disk: a buffer on S3 reads the shards this process wrote from its local copies.)"""
    import pipeline.buffer.shards as shards

    buffer_url = f"file://{tmp_path}/buffer"

    monkeypatch.setattr(shards.time, "sleep", lambda s: None)
    buf = ReplayBuffer(buffer_url, small_config)
    _write(buf, "w0", [make_groups(f"s{i}", 2, seed=i) for i in range(3)])
    real, calls = shards.read_bytes, {"n": 0}

    def flaky(fs, path, fails):
        calls["n"] += 1
        if calls["n"] <= fails:
            raise ConnectionResetError(104, "Connection reset by peer")
        return real(fs, path)

    monkeypatch.setattr(shards, "read_bytes", lambda fs, path: flaky(fs, path, fails=1))
    table, _ = ReplayBuffer(buffer_url, small_config).read_fresh(None, 100)
    assert table.num_rows == 3 * 2 * 4  # every group, after one failed try

    calls["n"] = 0
    monkeypatch.setattr(shards, "read_bytes", lambda fs, path: flaky(fs, path, fails=shards.READ_TRIES))
    with pytest.raises(ConnectionResetError):
        ReplayBuffer(buffer_url, small_config).read_fresh(None, 100)
    monkeypatch.setattr(shards, "read_bytes", real)
    fresh = ReplayBuffer(buffer_url, small_config)
    assert fresh.stats()["quarantined"] == {} and fresh.read_fresh(None, 100)[0].num_rows == 3 * 2 * 4


def test_a_writer_whose_commit_failed_takes_no_more_shards(tmp_path, small_config, monkeypatch):
    """The shards queued behind a failed commit are not committed: a writer that went on taking
    shards would leave a gap its caller never hears of."""
    buf = ReplayBuffer(f"file://{tmp_path}/buffer", small_config)
    real, gate = buf.commit, threading.Event()

    def failing(*a, **k):
        gate.wait(5)
        raise OSError("503 SlowDown")

    monkeypatch.setattr(buf, "commit", failing)
    w = buf.writer("w")
    for name in ("a", "b", "c"):
        w.write(make_groups(name, 2))
    gate.set()
    with pytest.raises(RuntimeError, match="503 SlowDown.*takes no more shards"):
        w.flush()
    monkeypatch.setattr(buf, "commit", real)
    with pytest.raises(RuntimeError, match="commit failed"):
        w.write(make_groups("d", 2))
    with pytest.raises(RuntimeError, match="commit failed"):
        w.close()
    assert ReplayBuffer(f"file://{tmp_path}/buffer", small_config).read_fresh(None, 100)[0].num_rows == 0
