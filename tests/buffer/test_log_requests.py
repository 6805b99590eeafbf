"""What the commit log asks of remote storage: the requests an appender makes for the tip hint,
and those a polling reader skips thanks to the commit notices of its node.

memory:// stands in for an object store (`remote` forced on); the log module's storage calls are
counted by path."""

from __future__ import annotations

import uuid
from collections import Counter

import pytest

from pipeline.buffer import log as log_mod
from pipeline.buffer.actions import AddShard, MarkConsumed
from pipeline.buffer.log import CommitLog
from pipeline.buffer import notices as notices_mod
from pipeline.buffer.logfiles import TIP, entry_name
from pipeline.buffer.notices import REMOTE_POLL_S, CommitNotices
from pipeline.storage import url_to_fs


@pytest.fixture
def calls(monkeypatch) -> Counter:
    """(function, file name) -> count, for the log module's reads and writes."""
    seen: Counter = Counter()
    for name in ("read_bytes", "put_atomic", "put_if_absent"):
        real = getattr(log_mod, name)

        def counted(fs, path, *a, _real=real, _name=name, **k):
            seen[(_name, path.rsplit("/", 1)[-1])] += 1
            return _real(fs, path, *a, **k)

        monkeypatch.setattr(log_mod, name, counted)
    return seen


def _logs(*writers: str) -> list[CommitLog]:
    fs, root = url_to_fs(f"memory://logs/{uuid.uuid4().hex}")
    logs = [CommitLog(fs, root, checkpoint_interval=0, writer=w) for w in writers]
    for lg in logs:
        lg.remote = True  # what an object store gets
        lg.open()
    return logs


def _add(lg: CommitLog, name: str) -> int:
    return lg.commit([AddShard(f"l1/{name}.parquet", "l1", 2, 10, (2,), (0, 0), 0.0)])


def _tip(calls: Counter) -> int:
    return calls[("read_bytes", TIP)] + calls[("put_atomic", TIP)]


def test_one_appender_racing_the_trainers_commits_never_touches_the_tip(calls):
    """The trainer's `commit` writes no tip, so it cannot help the sampler that loses races to it.
    Before: every lost race (one or two an append here) made the appender read and write the tip
    for its next 16 appends."""
    sampler, trainer = _logs("sampler", "trainer")
    for i in range(20):
        _add(sampler, f"s{i}")
        for _ in range(1 + i % 2):  # one or two commits of the trainer's between two appends
            trainer.refresh()
            trainer.commit([MarkConsumed("trainer", i, 0, 0)], precondition=lambda st: None)
    # a second lost race in one append reads the tip once; the tip it then finds is its own
    assert calls[("read_bytes", TIP)] <= 10 and calls[("put_atomic", TIP)] <= 1
    assert sampler._contended == 0


def test_appenders_racing_each_other_share_the_tip(calls):
    """An appender that keeps losing to another appender starts from the tip that one wrote."""
    a, b = _logs("a", "b")
    for i in range(3):
        _add(a, f"a{i}")  # 1..3
    assert _add(b, "b0") == 4  # lost 1 and 2, found no tip, then lost 3: publishes one
    assert calls[("put_atomic", TIP)] == 1 and b._contended == 0
    _add(b, "b1"), _add(b, "b2")  # 5, 6
    assert _add(a, "a3") == 7  # lost 4 and 5, then starts past b's tip (4): lost 6
    assert a._contended == log_mod._CONTENDED_APPENDS  # the tip was b's: contending with an appender
    before = _tip(calls)
    _add(b, "b3")  # 8: b is not contended (it has not lost twice since)
    assert _tip(calls) == before
    assert _add(a, "a4") == 9  # reads the tip (its own, 7) and writes 9
    assert _tip(calls) == before + 2
    assert a._contended == log_mod._CONTENDED_APPENDS - 1


def _beside(lg: CommitLog, node: str) -> CommitLog:
    """`lg` as a process of node `node` (a folder standing for that node's local disk)."""
    lg._notices = CommitNotices(lg.dir, uuid.uuid4().hex[:12], root=node)
    return lg


@pytest.fixture
def clock(monkeypatch) -> list[float]:
    now = [1000.0]
    monkeypatch.setattr(notices_mod.time, "monotonic", lambda: now[0])
    return now


def _entry_reads(calls: Counter) -> int:
    """Reads of log entries from the store (found or not)."""
    return sum(n for (fn, name), n in calls.items() if fn == "read_bytes" and name[:20].isdigit())


def test_a_polling_reader_beside_the_writer_reads_its_entries_from_the_notices(calls, clock, tmp_path):
    sampler, trainer = _logs("sampler-0", "")
    _beside(sampler, str(tmp_path)), _beside(trainer, str(tmp_path))
    base = _entry_reads(calls)  # opening
    _add(sampler, "a")
    assert len(trainer.refresh(poll=True)) == 1
    assert _entry_reads(calls) == base + 1  # the entry from the notice; the store asked past it (the first poll)
    for _ in range(20):
        assert trainer.refresh(poll=True) == []
    assert _entry_reads(calls) == base + 1  # the notice names nothing past what it read: the store is not asked
    _add(sampler, "b"), _add(sampler, "c")
    got = trainer.refresh(poll=True)
    assert [e.actions[0].path for e in got] == ["l1/b.parquet", "l1/c.parquet"] and _entry_reads(calls) == base + 1
    assert trainer.refresh() == [] and _entry_reads(calls) == base + 2  # not polling: it asks the store, to the end
    clock[0] += REMOTE_POLL_S  # and a poll asks at least every REMOTE_POLL_S, for writers not met yet
    assert trainer.refresh(poll=True) == [] and _entry_reads(calls) == base + 3
    assert trainer.state.version == 3 and set(trainer.state.shards) == {f"l1/{n}.parquet" for n in "abc"}


def test_a_writer_on_another_node_makes_every_poll_ask_the_store(calls, clock, tmp_path):
    sampler, trainer = _logs("sampler-1", "")
    _beside(sampler, str(tmp_path / "node-b")), _beside(trainer, str(tmp_path / "node-a"))
    _add(trainer, "t")  # the trainer's own commits leave a notice on its node
    trainer.refresh()
    _add(sampler, "a")
    clock[0] += REMOTE_POLL_S
    assert len(trainer.refresh(poll=True)) == 1  # met at the periodic probe
    before = _entry_reads(calls)
    for _ in range(5):
        trainer.refresh(poll=True)
    assert _entry_reads(calls) == before + 5
    _add(sampler, "b")
    assert len(trainer.refresh(poll=True)) == 1


def test_a_notice_of_a_process_that_is_gone_does_not_count(calls, clock, tmp_path, monkeypatch):
    sampler, trainer = _logs("sampler-0", "")
    _beside(sampler, str(tmp_path)), _beside(trainer, str(tmp_path))
    _add(sampler, "a")
    assert len(trainer.refresh(poll=True)) == 1
    monkeypatch.setattr(notices_mod, "_alive", lambda pid: False)  # its writer was killed, or wrote an earlier log
    before = _entry_reads(calls)
    for _ in range(3):
        assert trainer.refresh(poll=True) == []
    assert _entry_reads(calls) == before + 3
