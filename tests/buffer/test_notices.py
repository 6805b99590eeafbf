"""Commit notices and shard copies on local disk: what they hold, and that old ones go."""

import json
import os
import time

from pipeline.buffer.notices import KEPT_ENTRY_BYTES, SHARD_COPY_S, STALE_S, CommitNotices, ShardCopies


def _age(path: str, seconds: float) -> None:
    t = time.time() - seconds
    os.utime(path, (t, t))


def test_a_notice_holds_the_newest_small_entries_and_names_a_large_one_without_it(tmp_path):
    n = CommitNotices("s3://b/run/buffer/_log", "p1", root=str(tmp_path))
    for v in range(1, 12):
        n.committed(v, "sampler-0", json.dumps({"v": v}).encode())
    n.committed(12, "sampler-0", b"x" * (KEPT_ENTRY_BYTES + 1))  # a compaction's long list of shards
    doc = json.load(open(n.path))
    assert doc["v"] == 12 and doc["writers"] == ["sampler-0"] and doc["pid"] == os.getpid()
    assert sorted(map(int, doc["entries"])) == list(range(4, 12))  # the newest 8 it could hold
    reader = CommitNotices("s3://b/run/buffer/_log", "p2", root=str(tmp_path))
    assert reader.poll(0) == (True, None)  # its first poll reads the store to the end
    reader._probed = float("inf")  # the next one (every REMOTE_POLL_S) not due
    assert reader.poll(11) == (True, 12) and reader.entry(11) == b'{"v": 11}' and reader.entry(12) is None
    assert reader.poll(12) == (False, 12)


def test_notices_and_shard_copies_of_other_logs_are_deleted_once_old(tmp_path):
    old_notice = tmp_path / "log-notices" / "oldlog" / "gone.json"
    old_notice.parent.mkdir(parents=True)
    old_notice.write_text("{}")
    _age(str(old_notice), STALE_S + 60)
    CommitNotices("s3://b/run/buffer/_log", "p1", root=str(tmp_path)).committed(1, "w", b"{}")
    assert not old_notice.parent.exists()
    copies = ShardCopies("s3://b/run/buffer", root=str(tmp_path))
    other = ShardCopies("s3://b/other/buffer", root=str(tmp_path))
    other.keep("l1/a.parquet", b"abc")
    _age(other._path("l1/a.parquet"), SHARD_COPY_S + 60)
    other.keep("l1/b.parquet", b"abcd")
    copies.keep("l1/c.parquet", b"abcde")  # its first copy prunes every buffer's old ones
    assert other.get("l1/a.parquet", 3) is None and other.get("l1/b.parquet", 4) == b"abcd"
    assert copies.get("l1/c.parquet", 5) == b"abcde" and copies.get("l1/c.parquet", 4) is None
