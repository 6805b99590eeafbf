"""The trainer's waits for fresh groups and replay gates: how often they poll the buffer and look
for the stop marker (every look is a request on an object store), on a fake clock."""

from __future__ import annotations

import pyarrow as pa
import pytest

from pipeline.rundir import RunDir
from pipeline.trainer import feed
from pipeline.trainer.feed import TrainerStopped, wait_for_gate, wait_for_groups


class Clock:
    def __init__(self):
        self.now = 1000.0

    def time(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s


@pytest.fixture
def clock(monkeypatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(feed.time, "monotonic", c.time)  # waits go by the monotonic clock
    monkeypatch.setattr(feed.time, "sleep", c.sleep)
    return c


class Run:
    def __init__(self, clock: Clock, stop_at: float = float("inf"), gate_at: float = float("inf")):
        self.clock, self.stop_at, self.gate_at = clock, stop_at, gate_at
        self.stop_checks = self.gate_checks = 0

    def stop_requested(self) -> bool:
        self.stop_checks += 1
        return self.clock.now >= self.stop_at

    def has_marker(self, name: str) -> bool:
        self.gate_checks += 1
        return self.clock.now >= self.gate_at


class Buffer:
    """Empty until `at`, then one group."""

    def __init__(self, clock: Clock, at: float):
        self.clock, self.at, self.polls = clock, at, 0

    def read_fresh(self, cursor, groups):
        self.polls += 1
        if self.clock.now < self.at:
            return pa.table({"group_id": pa.array([], pa.string())}), cursor
        return pa.table({"group_id": ["g0"]}), {"seq": 1, "group": 0}


def test_a_long_wait_polls_less_and_less_often_and_picks_a_batch_up_soon(clock):
    """60 s of waiting at poll_s=0.02: before, 3,000 buffer polls and as many stop checks."""
    run, buf = Run(clock), Buffer(clock, at=clock.now + 60)
    _, cursor, waited = wait_for_groups(buf, run, None, 1, poll_s=0.02, timeout_s=600)
    assert cursor == {"seq": 1, "group": 0}
    assert 60 <= waited <= 60 + RunDir.STOP_CHECK_S
    assert buf.polls < 150  # 2 a second once the wait is long
    assert run.stop_checks <= 60 / RunDir.STOP_CHECK_S + 1


def test_a_short_wait_picks_a_batch_up_soon_and_does_not_look_for_the_stop_marker(clock):
    run, buf = Run(clock), Buffer(clock, at=clock.now + 0.3)
    _, _, waited = wait_for_groups(buf, run, None, 1, poll_s=0.02, timeout_s=600)
    assert waited <= 0.3 * 1.25 + 1e-9 and run.stop_checks == 0


def test_the_stop_marker_ends_a_wait_within_stop_check_s(clock):
    t0 = clock.now
    run = Run(clock, stop_at=t0 + 3)
    with pytest.raises(TrainerStopped):
        wait_for_groups(Buffer(clock, at=float("inf")), run, None, 1, poll_s=0.02, timeout_s=600)
    assert clock.now <= t0 + 3 + 2 * RunDir.STOP_CHECK_S


def test_a_stop_before_the_timeout_is_a_stop_not_a_timeout(clock):
    run = Run(clock, stop_at=clock.now + 0.05)  # between two looks, and the timeout comes first
    with pytest.raises(TrainerStopped):
        wait_for_groups(Buffer(clock, at=float("inf")), run, None, 1, poll_s=0.02, timeout_s=0.1)
    with pytest.raises(TimeoutError, match="no fresh rollouts"):
        wait_for_groups(Buffer(clock, at=float("inf")), Run(clock), None, 1, poll_s=0.02, timeout_s=5)


def test_gate_waits_are_paced_the_same_way(clock):
    run = Run(clock, gate_at=clock.now + 60)
    assert 60 <= wait_for_gate(run, 0, poll_s=0.02, timeout_s=600) <= 60 + RunDir.STOP_CHECK_S
    assert run.gate_checks < 150 and run.stop_checks <= 60 / RunDir.STOP_CHECK_S + 1
    with pytest.raises(TimeoutError, match="replay gate 0 stayed closed"):
        wait_for_gate(Run(clock), 0, poll_s=0.02, timeout_s=5)


class MarkingBuffer:
    def __init__(self, l1_full=lambda: False):
        self.marks: list[dict] = []
        self.l1_full = l1_full

    def rate_limiter(self):
        return self

    def mark_consumed(self, cursor: dict) -> None:
        self.marks.append(cursor)


def test_consumption_is_recorded_every_few_seconds_and_at_a_flush_unless_a_bound_reads_it(monkeypatch):
    from pipeline.config import BufferConfig

    now = [0.0]
    monkeypatch.setattr(feed.time, "monotonic", lambda: now[0])
    buf = MarkingBuffer()
    marks = feed.ConsumedMarks(buf, BufferConfig())
    for step in range(1, 11):  # ten steps of 0.5 s
        now[0] += 0.5
        marks.consumed({"seq": step, "group": 0})
    assert [m["seq"] for m in buf.marks] == [4, 8]  # every MARK_EVERY_S = 2 s
    marks.flush()  # a checkpoint, or the end of the loop
    marks.flush()
    assert [m["seq"] for m in buf.marks] == [4, 8, 10]
    marks.consumed({"seq": 11, "group": 0})
    marks.recorded()  # promote committed the cursor itself
    marks.flush()
    assert len(buf.marks) == 3

    bounded = MarkingBuffer()
    every = feed.ConsumedMarks(bounded, BufferConfig(max_fresh_backlog=64))  # the rate limiter reads the marks
    for step in range(1, 4):
        every.consumed({"seq": step, "group": 0})
    assert [m["seq"] for m in bounded.marks] == [1, 2, 3]


def test_a_waiting_trainer_records_what_it_consumed_once_l1_is_at_its_bound(clock):
    """A sampler held back by the `l1_max_rows` bound (rows not yet consumed) waits for the trainer
    to record what it consumed: a trainer that waited without recording it would wait for ever. Short of that bound a wait records nothing (each record is a commit, a request on object
    stores, that the sampler's next commit then has to catch up with)."""
    from pipeline.config import BufferConfig

    idle = MarkingBuffer()
    marks = feed.ConsumedMarks(idle, BufferConfig())
    marks.consumed({"seq": 7, "group": 0})
    wait_for_groups(Buffer(clock, at=clock.now + 30), Run(clock), None, 1, poll_s=0.02, timeout_s=600, marks=marks)
    assert idle.marks == []
    full_at = clock.now + 10  # L1 reaches the bound ten seconds into the wait
    filling = MarkingBuffer(l1_full=lambda: clock.now >= full_at)
    marks = feed.ConsumedMarks(filling, BufferConfig())
    marks.consumed({"seq": 7, "group": 0})
    wait_for_groups(Buffer(clock, at=clock.now + 30), Run(clock), None, 1, poll_s=0.02, timeout_s=600, marks=marks)
    assert filling.marks == [{"seq": 7, "group": 0}]


def test_a_step_of_the_wall_clock_does_not_end_a_wait(clock, monkeypatch):
    """The wall clock set forward an hour while the trainer waits (an NTP step): the wait goes on."""
    wall = [1e9]

    def stepping() -> float:
        wall[0] += 3600.0
        return wall[0]

    monkeypatch.setattr(feed.time, "time", stepping)
    run, buf = Run(clock), Buffer(clock, at=clock.now + 5)
    _, cursor, waited = wait_for_groups(buf, run, None, 1, poll_s=0.02, timeout_s=600)
    assert cursor == {"seq": 1, "group": 0} and 5 <= waited <= 5 + RunDir.STOP_CHECK_S
