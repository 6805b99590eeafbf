"""Bad data, vacuum (garbage collection) and verification."""

import io
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from rollout_factory import make_groups

import pipeline.buffer.vacuum as vacuum_module
from pipeline.buffer import ReplayBuffer
from pipeline.buffer.schema import SCHEMA_VERSION_KEY, SchemaError
from pipeline.buffer.shards import encode, new_shard_path, write_shard
from pipeline.config import BufferConfig
from pipeline.storage import join, list_files


@pytest.fixture(autouse=True)
def reader_elsewhere(monkeypatch):
    """These tests damage shards in the store after they were written. On object stores the
    writer's node keeps local copies that a reader beside it takes instead (`ShardCopies`, see
    test_fresh.py), which these would be: the readers here are on another node."""
    from pipeline.buffer.notices import ShardCopies

    monkeypatch.setattr(ShardCopies, "get", lambda self, rel, size: None)


def _buf(url, **kw):
    return ReplayBuffer(url, BufferConfig(checkpoint_interval=5, **kw))


def _write(buf, prefixes):
    with buf.writer("w") as w:
        for p in prefixes:
            w.write(make_groups(p, 2))


def _overwrite(buf, rel, data):
    buf.fs.pipe_file(join(buf.root, rel), data)


def _l1_paths(buf):
    return [i.path for i in buf.refresh().tier_shards("l1")]


def test_truncated_shard_is_quarantined_and_reading_goes_on(buffer_url):
    buf = _buf(buffer_url)
    _write(buf, ["a", "b", "c"])
    bad = _l1_paths(buf)[1]
    raw = buf.fs.cat_file(join(buf.root, bad))
    _overwrite(buf, bad, raw[: len(raw) // 2])
    reader = _buf(buffer_url)
    table, _ = reader.read_fresh(None, 10)
    assert sorted(set(table.column("sample_id").to_pylist())) == sorted(
        [f"{p}-g{i}-{j}" for p in "ac" for i in range(2) for j in range(4)])
    q = reader.stats()["quarantined"]
    assert list(q) == [bad] and "unreadable" in q[bad]
    assert buf.fs.exists(join(buf.root, bad))  # kept for inspection, never garbage-collected
    assert buf.vacuum(grace_s=0)["orphans_deleted"] == 0


def test_wrong_schema_shard_is_quarantined_with_its_path(buffer_url):
    buf = _buf(buffer_url)
    _write(buf, ["a", "b"])
    bad = _l1_paths(buf)[0]
    sink = io.BytesIO()
    pq.write_table(pa.table({"x": [1, 2]}), sink)
    _overwrite(buf, bad, sink.getvalue())
    table, _ = buf.read_fresh(None, 10)
    assert set(table.column("group_id").to_pylist()) == {"b-g0", "b-g1"}
    reason = buf.stats()["quarantined"][bad]
    assert "wrong schema" in reason and bad in reason


def test_newer_schema_version_is_a_clear_error(buffer_url):
    buf = _buf(buffer_url)
    _write(buf, ["a"])
    rel = _l1_paths(buf)[0]
    t = make_groups("a", 2)
    t = t.replace_schema_metadata({SCHEMA_VERSION_KEY: b"99"})
    _overwrite(buf, rel, encode(t, "zstd"))
    with pytest.raises(SchemaError, match="v99.*upgrade"):
        _buf(buffer_url).read_fresh(None, 10)


def test_killed_writer_leftovers_are_invisible_and_collected_after_grace(buffer_url):
    buf = _buf(buffer_url)
    _write(buf, ["a"])
    # a writer killed after publishing its data file but before committing it
    orphan = new_shard_path("l1", "dead")
    write_shard(buf.fs, buf.root, orphan, encode(make_groups("z", 2), "zstd"))
    assert buf.fresh_backlog(None) == 2
    assert buf.vacuum()["orphans_kept_young"] == 1  # within the grace period: it may still be committed
    assert buf.fs.exists(join(buf.root, orphan))
    out = buf.vacuum(grace_s=0)
    assert out["orphans_deleted"] == 1 and not buf.fs.exists(join(buf.root, orphan))
    assert buf.read_fresh(None, 10)[0].num_rows == 8


def test_vacuum_deletes_compacted_inputs_and_old_log_entries_and_reopening_still_works(buffer_url, monkeypatch):
    monkeypatch.setattr(vacuum_module, "MIN_LOG_RETENTION_S", 0.0)  # entries as old as an hour later
    buf = _buf(buffer_url)
    with buf.writer("w") as w:
        for i in range(12):
            w.write(make_groups(f"s{i}", 2))
            w.flush()  # one commit each: the log passes two checkpoints
    _, cursor = buf.read_fresh(None, 100)
    buf.mark_consumed(cursor)
    buf.compact()
    out = buf.vacuum(grace_s=0, log_retention_s=0)
    assert out["orphans_deleted"] >= 1 and out["log_entries_deleted"] >= 1
    names = [f.rel for f in list_files(buf.fs, join(buf.root, "l1"))]
    assert names == []
    again = _buf(buffer_url)
    assert again.stats()["tiers"]["l3"]["rows"] == 12 * 8
    assert again.verify()["ok"]


def test_verify_reports_every_problem_with_its_path(buffer_url):
    buf = _buf(buffer_url)
    _write(buf, ["a", "b", "c"])
    assert buf.verify()["ok"]
    p0, p1, _ = _l1_paths(buf)
    buf.fs.rm_file(join(buf.root, p0))
    _overwrite(buf, p1, b"not parquet")
    report = _buf(buffer_url).verify()
    assert not report["ok"]
    text = "\n".join(report["problems"])
    assert p0 in text and "missing" in text
    assert p1 in text and "unreadable" in text


def test_reader_far_behind_log_retention_reloads_the_checkpoint(buffer_url, monkeypatch):
    monkeypatch.setattr(vacuum_module, "MIN_LOG_RETENTION_S", 0.0)  # entries as old as an hour later
    buf = _buf(buffer_url)
    _write(buf, ["a"])
    behind = _buf(buffer_url)
    behind.refresh()
    with buf.writer("w") as w:
        for i in range(12):
            w.write(make_groups(f"s{i}", 1))
            w.flush()
    buf.vacuum(grace_s=0, log_retention_s=0)
    behind.log.pointer_check_interval_s = 0.0
    assert behind.fresh_backlog(None) == 2 + 12


def test_s3_style_lost_ack_is_not_a_second_commit(buffer_url):
    """A create-only PUT that succeeded but whose answer was lost is retried and gets 412. An add
    may then land twice in the log (it is idempotent); any other action must be recognised as
    ours by its transaction id and not committed again."""
    from pipeline.buffer import log as log_mod

    buf = _buf(buffer_url)
    real = log_mod.put_if_absent
    lose_next = {"on": True}

    def lost_ack(*args, **kwargs):
        if lose_next["on"]:
            lose_next["on"] = False
            real(*args, **kwargs)
            return False  # looks like someone else won
        return real(*args, **kwargs)

    log_mod.put_if_absent = lost_ack
    try:
        with buf.writer("w") as w:
            w.write(make_groups("a", 2, rewards=[[0, 1, 0, 1]] * 2))
        table, _ = buf.read_fresh(None, 10)
        buf.promote(table)
        lose_next["on"] = True
        buf.update_priorities(["a-g0"], [3.0])
    finally:
        log_mod.put_if_absent = real
    fresh = _buf(buffer_url)
    assert fresh.fresh_backlog(None) == 2 and fresh.stats()["tiers"]["l1"]["shards"] == 1
    assert fresh.read_fresh(None, 10)[0].num_rows == 8
    assert fresh.state.l2_groups["a-g0"].replays == 1


def test_torn_log_entry_after_a_machine_crash_counts_as_empty_and_fails_verify(tmp_path):
    """Without fsync a machine crash can leave the newest entry torn: the log goes on past it."""
    url = str(tmp_path / "buffer")
    buf = _buf(url)
    with buf.writer("w") as w:
        for p in ["a", "b", "c"]:
            w.write(make_groups(p, 2))
            w.flush()
    entry = tmp_path / "buffer" / "_log" / f"{2:020d}.json"
    entry.write_bytes(entry.read_bytes()[:10])
    again = _buf(url)
    table, _ = again.read_fresh(None, 10)
    assert sorted(set(g.split("-")[0] for g in table.column("group_id").to_pylist())) == ["a", "c"]
    report = again.verify()
    assert not report["ok"] and any("torn commit-log entry" in p for p in report["problems"])
    with again.writer("w2") as w:  # and the log still takes new commits
        w.write(make_groups("d", 1))
    assert again.fresh_backlog(None) == 2 + 2 + 1


def test_missing_committed_shard_is_quarantined_but_a_compacted_one_is_skipped(buffer_url):
    buf = _buf(buffer_url)
    _write(buf, ["a", "b"])
    p0, p1 = _l1_paths(buf)
    buf.fs.rm_file(join(buf.root, p1))  # lost from storage while still committed
    table, _ = buf.read_fresh(None, 10)
    assert set(table.column("group_id").to_pylist()) == {"a-g0", "a-g1"}
    assert "missing on storage" in buf.stats()["quarantined"][p1]
    # a reader whose view predates a compaction + vacuum does not quarantine what was archived
    stale = _buf(buffer_url)
    stale.refresh()
    buf.compact(everything=True)
    buf.vacuum(grace_s=0)
    info = stale.state.shards[p0]
    assert stale.load_shard(info) is None
    assert p0 not in stale.stats()["quarantined"]


def test_a_committer_idle_past_log_retention_catches_up_before_it_commits(buffer_url, monkeypatch):
    """Vacuum deleted the entries after an idle trainer's view: its commit must not take one of
    their numbers, where no reader looks (readers start from the newest checkpoint)."""
    import pipeline.buffer.log as log_module
    from pipeline.config import ConfigError

    with pytest.raises(ConfigError, match="log entries are kept at least 3600"):
        _buf(buffer_url).vacuum(grace_s=0, log_retention_s=0)
    monkeypatch.setattr(vacuum_module, "MIN_LOG_RETENTION_S", 0.0)  # as if the trainer idled for hours
    monkeypatch.setattr(log_module, "STALE_VIEW_S", 0.0)
    trainer = _buf(buffer_url)
    trainer.promote(make_groups("a", 2, rewards=[[0, 1, 0, 1], [1, 0, 0, 0]]))
    rb = trainer.sample_replay(2, step=0, rng_seed=0)
    with _buf(buffer_url).writer("sampler") as w:
        for i in range(5):
            w.write(make_groups(f"s{i}", 1))
            w.flush()
    assert _buf(buffer_url).vacuum(grace_s=3600, log_retention_s=0)["log_entries_deleted"] >= 1
    version = trainer.update_priorities(rb.keys, [5.0] * len(rb.keys))
    assert version > _buf(buffer_url).log.last_checkpoint()
    assert {g.replays for g in _buf(buffer_url).refresh().l2_groups.values()} == {1}
