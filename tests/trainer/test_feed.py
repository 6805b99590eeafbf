"""The trainer's read ahead (`FreshFeed`): step d+1's groups are read while step d trains, and
they are the groups a read at step d+1 would have returned; a stop or timeout it meets is raised
by the step that takes it; it ends with the loop."""

from __future__ import annotations

import os
import threading
import time

import pyarrow as pa
import pytest

from pipeline.trainer.feed import FreshFeed, TrainerStopped, wait_for_groups


class Run:
    def __init__(self):
        self.stop = False

    def stop_requested(self) -> bool:
        return self.stop


class Log:
    """A commit log of one-group shards g0, g1, ...: `commit()` appends one; reads are counted,
    and an optional gate holds every read until it is set."""

    def __init__(self, committed: int = 0):
        self.committed, self.reads, self.lock = committed, [], threading.Lock()
        self.gate = threading.Event()
        self.gate.set()

    def commit(self, n: int = 1) -> None:
        with self.lock:
            self.committed += n

    def read_fresh(self, cursor, groups):
        self.gate.wait()
        seq = (cursor or {"seq": 0})["seq"]
        with self.lock:
            self.reads.append((seq, threading.current_thread().name))
            end = min(self.committed, seq + groups)
        ids = [f"g{i}" for i in range(seq, end)]
        return pa.table({"group_id": pa.array(ids, pa.string())}), {"seq": end, "group": 0}


class Marks:
    def __init__(self):
        self.waits = 0

    def waiting(self) -> None:
        self.waits += 1


def groups_of(table: pa.Table) -> list[str]:
    return table.column("group_id").to_pylist()


def test_the_next_steps_groups_are_read_while_this_step_trains_and_are_the_same_groups():
    log = Log(committed=6)
    feed = FreshFeed(log, Run(), groups=2, poll_s=0.01, timeout_s=60)
    cursor, batches = None, []
    for step in range(3):
        table, cursor, waited = feed.take(cursor, ahead=step < 2)
        batches.append(groups_of(table))
        if step < 2:  # the read of the next step is under way (or done) before it is asked for
            deadline = time.time() + 10
            while not any(r[0] == cursor["seq"] and r[1] == "trainer-read-ahead" for r in log.reads):
                assert time.time() < deadline
                time.sleep(0.005)
    feed.close()
    inline = Log(committed=6)
    expected, c = [], None
    for _ in range(3):
        t, c, _ = wait_for_groups(inline, Run(), c, 2, poll_s=0.01, timeout_s=60)
        expected.append(groups_of(t))
    assert batches == expected == [["g0", "g1"], ["g2", "g3"], ["g4", "g5"]]
    assert cursor == {"seq": 6, "group": 0}


def test_a_step_whose_groups_are_late_waits_for_them_and_says_how_long_after_recording_its_progress():
    log, marks = Log(committed=2), Marks()
    feed = FreshFeed(log, Run(), groups=2, poll_s=0.01, timeout_s=60, marks=marks)
    _, cursor, _ = feed.take(None, ahead=True)
    threading.Timer(0.2, log.commit, args=(2,)).start()
    table, cursor, waited = feed.take(cursor, ahead=False)
    assert groups_of(table) == ["g2", "g3"] and 0.1 < waited < 5
    assert marks.waits >= 1  # told while it waits (`ConsumedMarks.waiting` records the mark if a bound needs it)


def test_a_stop_met_by_the_read_ahead_is_raised_by_the_step_that_takes_it(monkeypatch):
    from pipeline.rundir import RunDir

    monkeypatch.setattr(RunDir, "STOP_CHECK_S", 0.05)
    log, run = Log(committed=1), Run()
    feed = FreshFeed(log, run, groups=1, poll_s=0.01, timeout_s=60)
    _, cursor, _ = feed.take(None, ahead=True)
    run.stop = True
    with pytest.raises(TrainerStopped):
        feed.take(cursor, ahead=True)
    feed.close()


def test_a_timeout_met_by_the_read_ahead_is_raised_by_the_step_that_takes_it():
    feed = FreshFeed(Log(committed=1), Run(), groups=1, poll_s=0.01, timeout_s=0.1)
    _, cursor, _ = feed.take(None, ahead=True)
    with pytest.raises(TimeoutError, match="no fresh rollouts"):
        feed.take(cursor, ahead=False)


def test_closing_ends_a_read_ahead_that_waits_and_a_take_elsewhere_reads_from_there():
    log = Log(committed=1)
    feed = FreshFeed(log, Run(), groups=1, poll_s=0.01, timeout_s=600)
    _, cursor, _ = feed.take(None, ahead=True)  # reads ahead from g1, which never comes
    t0 = time.time()
    feed.close()
    assert time.time() - t0 < 2 and not any(t.name == "trainer-read-ahead" for t in threading.enumerate())

    log.commit(3)
    _, cursor, _ = feed.take({"seq": 1, "group": 0}, ahead=True)  # a read ahead from g2 starts
    table, _, _ = feed.take({"seq": 3, "group": 0}, ahead=False)  # not where it reads: read here
    assert groups_of(table) == ["g3"]
    assert not any(t.name == "trainer-read-ahead" for t in threading.enumerate())


def _until(cond, timeout_s: float = 10.0) -> None:
    deadline = time.time() + timeout_s
    while not cond():
        assert time.time() < deadline, "condition not met in time"
        time.sleep(0.005)


def test_ready_says_whether_the_next_steps_groups_have_arrived():
    """What `trainer.replay_yield` asks before each replay update: not ready while the next
    step's groups are still being waited for, ready once they are read, and never without a read
    ahead (after the last step a replay epoch has no fresh step to give way to)."""
    log = Log(committed=2)
    feed = FreshFeed(log, Run(), groups=2, poll_s=0.01, timeout_s=60)
    assert not feed.ready()
    _, cursor, _ = feed.take(None, ahead=True)
    time.sleep(0.1)
    assert not feed.ready()  # g2, g3 are not committed yet
    log.commit(2)
    _until(feed.ready)
    table, cursor, waited = feed.take(cursor, ahead=False)
    assert groups_of(table) == ["g2", "g3"] and waited < 1.0
    assert not feed.ready()


def test_ready_when_the_read_ahead_met_a_stop():
    run = Run()
    feed = FreshFeed(Log(committed=2), run, groups=2, poll_s=0.01, timeout_s=60)
    _, cursor, _ = feed.take(None, ahead=True)
    run.stop = True
    _until(feed.ready)  # the take would not wait: it raises what the read met
    with pytest.raises(TrainerStopped):
        feed.take(cursor, ahead=False)


def test_a_steady_read_ahead_keeps_polling_at_poll_s_however_long_it_waits():
    """`steady` (for `trainer.borrow_threads`, which acts on `ready` in the middle of a step): a
    read ahead that has waited a while still sees a commit within a poll or so; a wait that backs
    off polls every quarter of the time waited so far."""
    reads = {}
    for steady in (False, True):
        log = Log(committed=2)
        feed = FreshFeed(log, Run(), groups=2, poll_s=0.01, timeout_s=60, steady=steady)
        _, cursor, _ = feed.take(None, ahead=True)
        time.sleep(1.2)
        reads[steady] = len(log.reads)
        log.commit(2)
        t0 = time.time()
        _until(feed.ready)
        if steady:
            assert time.time() - t0 < 0.25
        feed.close()
    assert reads[True] >= 40 and reads[False] <= 30, reads


def test_a_read_ahead_backed_off_during_the_step_polls_at_once_when_the_trainer_takes_it():
    """The read ahead starts with the step before its own: by that step's end it has waited a
    whole step and polls a quarter of that apart. The take hurries it: groups committed just
    after a poll are read within a poll or so of the take, not a quarter-step later."""
    log = Log(committed=2)
    feed = FreshFeed(log, Run(), groups=2, poll_s=0.01, timeout_s=60)
    _, cursor, _ = feed.take(None, ahead=True)
    time.sleep(2.0)  # "the step": the read ahead now sleeps ~0.5 s between polls
    polled = len(log.reads)
    _until(lambda: len(log.reads) > polled)  # it has just polled: its next poll is ~0.5 s away
    log.commit(2)
    table, _, waited = feed.take(cursor, ahead=False)
    assert groups_of(table) == ["g2", "g3"]
    assert waited < 0.2, waited


def test_the_first_take_polls_at_poll_s_for_its_first_seconds():
    """The first take of a run waits while the sampler starts: groups committed after 2 s of it
    are read within a poll or so, not up to a quarter of the wait (0.5 s) later. The read ahead
    for the next step, which no one waits for yet, backs off (few requests while a step trains)."""
    log, run = Log(), Run()
    feed = FreshFeed(log, run, groups=2, poll_s=0.01, timeout_s=60)
    got = {}
    taker = threading.Thread(target=lambda: got.update(r=feed.take(None, ahead=True)), daemon=True)
    taker.start()
    try:
        time.sleep(2.0)
        polled = len(log.reads)
        assert polled > 100  # every 10 ms (backing off, ~25 polls in 2 s)
        _until(lambda: len(log.reads) > polled)  # it has just polled
        log.commit(2)
        t0 = time.time()
        taker.join(timeout=5)
        assert time.time() - t0 < 0.15 and groups_of(got["r"][0]) == ["g0", "g1"]
        time.sleep(1.0)  # the read ahead for the next step: nothing committed, nobody waiting on it
        assert len(log.reads) - polled < 40, len(log.reads) - polled
    finally:
        run.stop = True  # a take still waiting ends at its next stop check
        taker.join(timeout=5)
        feed.close()


@pytest.mark.parametrize("outcome, expected", [("stop", "TrainerStopped"), ("timeout", "TimeoutError"),
                                               ("error", "OSError"), ("data", "groups")])
def test_ranks_that_read_on_their_own_act_alike(tmp_path, outcome, expected):
    """Rank 0 meets the stop marker (or a timeout, or a storage error) while rank 1 gets its data:
    both stop, or both fail, instead of rank 1 training on alone into a collective."""
    import json
    import sys

    from spawner import Spawner

    worker = os.path.join(os.path.dirname(__file__), "agreed_worker.py")
    outs = [str(tmp_path / f"rank{r}.json") for r in range(2)]
    with Spawner() as spawn:
        procs = [spawn([sys.executable, worker, str(r), str(tmp_path / "store"), outcome, outs[r]],
                       env=dict(os.environ, OMP_NUM_THREADS="1")) for r in range(2)]
        assert [p.wait(timeout=60) for p in procs] == [0, 0]
    got = [json.load(open(o)) for o in outs]
    other = {"TrainerStopped": "TrainerStopped", "TimeoutError": "TimeoutError", "OSError": "RuntimeError",
             "groups": "groups"}[expected]
    assert got == [expected, other]
