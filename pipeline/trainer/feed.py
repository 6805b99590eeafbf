"""What the trainer waits on: fresh groups from L1 (read one step ahead) and replay gates.

A fresh step's groups are the next `groups_per_step` whole groups in commit order from the
trainer's cursor, so which groups step d+1 trains on is known as soon as step d's are read: only
when they are read can change. `FreshFeed` reads them while step d trains (a thread that waits
and reads like the step would), and the step takes them when it starts. On object storage the
reads of a step (the commit log, then its shards: several requests) then cost the trainer
nothing on its critical path; on a local disk little either way.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from typing import Callable, TypeVar

import pyarrow as pa

from ..buffer import ReplayBuffer, bounds_consumer_progress
from ..rundir import RunDir

T = TypeVar("T")
log = logging.getLogger("rlhf.trainer")

MARK_EVERY_S = 2.0
FIRST_TAKE_STEADY_S = 5.0  # see FreshFeed


class TrainerStopped(Exception):
    """The stop marker appeared while waiting for data or a replay gate."""


def agreed(world, wait: Callable[[], T]) -> T:
    """`wait()` (a read of fresh groups, a replay gate) on every rank, then the ranks act alike.
    Each rank reads and checks the stop marker on its own: one that stopped or failed while another
    got its data would leave that one waiting in a collective (gloo fails it, NCCL hangs until its
    watchdog). A failure on any rank fails every rank, else a timeout, else a stop stops them all."""
    if not world.distributed:
        return wait()
    outcome, result, error = 0, None, None
    try:
        result = wait()
    except TrainerStopped as e:
        outcome, error = 1, e
    except TimeoutError as e:
        outcome, error = 2, e
    except Exception as e:  # noqa: BLE001 - every rank raises below
        outcome, error = 3, e
    agreed_outcome = world.max_int(outcome)
    if agreed_outcome == outcome and error is not None:
        raise error
    if error is not None:  # another rank's outcome wins: this rank's own is logged, not lost
        log.error("rank %d: %s: %s (another rank's outcome is raised)", world.rank, type(error).__name__, error)
    if agreed_outcome == 1:
        raise TrainerStopped("another rank met the stop marker")
    if agreed_outcome == 2:
        raise TimeoutError("another rank timed out waiting for data or a replay gate") from error
    if agreed_outcome == 3:
        raise RuntimeError("another rank failed while reading data or waiting for a replay gate; see its log") from error
    return result


class GaveWay(Exception):
    """A replay update stopped between two micro-batches for fresh data (`trainer.replay_yield`)."""


class _Cancelled(Exception):
    """A read ahead was given up (the trainer ended, or its cursor moved elsewhere)."""


class _Wait:
    """The pace of a trainer's wait: it polls every `poll_s` at first, then every quarter of the
    time waited so far, up to `RunDir.STOP_CHECK_S` (a new batch is picked up at most a quarter
    later than it would be otherwise; an idle wait costs few requests), and looks for the stop
    marker at most every `RunDir.STOP_CHECK_S` and before it times out. With `signal` (a read
    ahead's), a sleep ends when it is set: it raises `_Cancelled` if the read was given up, and
    otherwise (the trainer has begun to wait for it) polls at once and paces its polls from then.
    `steady_s`: it polls every `poll_s` for its first `steady_s` seconds (`math.inf`: throughout,
    for a wait whose end is wanted at once even when it is long)."""

    def __init__(self, run: RunDir, poll_s: float, timeout_s: float, signal: "_Signal | None" = None,
                 steady_s: float = 0.0):
        self.run, self.poll_s, self.timeout_s, self.signal, self.steady_s = run, poll_s, timeout_s, signal, steady_s
        self.t0 = self.stop_checked = time.monotonic()  # a step of the wall clock ends no wait

    def waited(self) -> float:
        return time.monotonic() - self.t0

    def sleep(self, timeout_message) -> None:
        """Raise TrainerStopped or TimeoutError (`timeout_message()`), else sleep before the next poll."""
        now = time.monotonic()
        waited = now - self.t0
        if waited > self.timeout_s or now - self.stop_checked >= RunDir.STOP_CHECK_S:
            self.stop_checked = now
            if self.run.stop_requested():
                raise TrainerStopped()
        if waited > self.timeout_s:
            raise TimeoutError(timeout_message())
        if waited < self.steady_s:
            pause = self.poll_s
        else:
            pause = max(self.poll_s, min(waited / 4, RunDir.STOP_CHECK_S))
        if self.signal is None:
            time.sleep(pause)
        elif self.signal.event.wait(pause):
            self.signal.event.clear()  # before reading `stopped`: a stop set after it wakes the next sleep
            if self.signal.stopped:
                raise _Cancelled()
            self.t0 = time.monotonic()


class _Signal:
    """Ends a read ahead's sleep: `stop` gives the read up; `hurry` says the trainer now waits for
    it. A read ahead starts with the step before the one it is for, so by the time that step ends
    it has "waited" a whole step and backed off to polls a quarter of a step apart: without the
    hurry, groups committed just after the step's end would be picked up that much later."""

    def __init__(self):
        self.event = threading.Event()
        self.stopped = False

    def stop(self) -> None:
        self.stopped = True
        self.event.set()

    def hurry(self) -> None:
        self.event.set()


class ConsumedMarks:
    """The trainer's L1 position recorded in the buffer log (`ReplayBuffer.mark_consumed`).

    A rate-limiter bound that reads it (`bounds_consumer_progress`) gets it after every step.
    Otherwise it is recorded at most every MARK_EVERY_S, at every checkpoint, at the end of the
    loop, and while the trainer waits for fresh groups with L1 at its `l1_max_rows` bound (a
    sampler held back there waits for this record to move on): each mark is a commit, on object storage a write for the trainer and a read for
    every other process of the run, and one more round for a sampler whose commit it got in
    before. Compaction then sees the trainer's progress up to MARK_EVERY_S later, and archives
    nothing past the newest checkpoint's cursor, where a restarted trainer reads again
    (`ReplayBuffer.mark_resumable`)."""

    def __init__(self, buffer: ReplayBuffer, bc):
        self.buffer = buffer
        self.every_s = 0.0 if bounds_consumer_progress(bc) else MARK_EVERY_S
        self._cursor: dict | None = None
        self._at = time.monotonic()

    def consumed(self, cursor: dict) -> None:
        self._cursor = cursor
        if time.monotonic() - self._at >= self.every_s:
            self.flush()

    def recorded(self) -> None:
        """A commit of the caller's (`promote` with its cursor) has recorded the position."""
        self._cursor, self._at = None, time.monotonic()

    def flush(self) -> None:
        if self._cursor is not None:
            self.buffer.mark_consumed(self._cursor)
            self.recorded()

    def waiting(self) -> None:
        """The trainer waits for fresh groups (called before it waits and at each of its polls):
        record the position if a sampler may be held back by a bound that reads it."""
        if self._cursor is not None and (self.every_s == 0.0 or self.buffer.rate_limiter().l1_full()):
            self.flush()


def wait_for_groups(buffer: ReplayBuffer, run: RunDir, cursor: dict | None, groups: int,
                    poll_s: float, timeout_s: float, marks: ConsumedMarks | None = None,
                    signal: _Signal | None = None, steady_s: float = 0.0) -> tuple[pa.Table, dict | None, float]:
    """Read exactly `groups` fresh groups (blocking). Returns (table, new cursor, seconds waited).
    While it waits, `marks` records what was consumed if a sampler may be waiting for that
    (`ConsumedMarks.waiting`). `steady_s`: poll every `poll_s` for that long before backing off
    (`_Wait`)."""
    parts: list[pa.Table] = []
    have = 0
    wait = _Wait(run, poll_s, timeout_s, signal, steady_s)
    while have < groups:
        table, cursor = buffer.read_fresh(cursor, groups - have)
        if table.num_rows:
            parts.append(table)
            have += len(set(table.column("group_id").to_pylist()))
            continue
        if marks is not None:
            marks.waiting()
        wait.sleep(lambda: f"no fresh rollouts for {timeout_s:.0f}s (have {have}/{groups} groups); is the sampler "
                           "running? At its start it checks every training prompt's length (it logs how far it got): "
                           "raise trainer.wait_timeout_s for a slow start or slow samplers")
    return pa.concat_tables(parts), cursor, wait.waited()


def wait_for_gate(run: RunDir, epoch: int, poll_s: float, timeout_s: float) -> float:
    wait = _Wait(run, poll_s, timeout_s)
    while not run.has_marker(RunDir.replay_gate_marker(epoch)):
        wait.sleep(lambda: f"replay gate {epoch} stayed closed for {timeout_s:.0f}s; the orchestrator opens it "
                           f"(markers/{RunDir.replay_gate_marker(epoch)}.json) once L2 holds enough eligible groups")
    return wait.waited()


class _ReadAhead:
    """One read of `groups` groups from `cursor` on a thread of its own."""

    def __init__(self, feed: FreshFeed, cursor: dict | None):
        self.cursor, self.signal, self.done = cursor, _Signal(), threading.Event()
        self.result: tuple | None = None
        self.error: BaseException | None = None
        self.ended_at: float | None = None  # time.monotonic() when the read ended
        self.thread = threading.Thread(target=self._run, args=(feed,), name="trainer-read-ahead", daemon=True)
        self.thread.start()

    def _run(self, feed: FreshFeed) -> None:
        try:
            self.result = wait_for_groups(feed.buffer, feed.run, self.cursor, feed.groups, feed.poll_s,
                                          feed.timeout_s, signal=self.signal,
                                          steady_s=math.inf if feed.steady else 0.0)
        except BaseException as e:  # re-raised by the step that takes it
            self.error = e
        finally:
            self.ended_at = time.monotonic()
            self.done.set()

    def stop(self) -> None:
        self.signal.stop()
        self.thread.join()


class FreshFeed:
    """The groups of each fresh step, the next step's read while this one trains.

    `take(cursor, ahead)` returns (table, next cursor, seconds the caller waited): the read started
    from `cursor` by the previous take, else one made now; with `ahead`, it then starts reading
    the next step's groups. A stop marker or a timeout met by a read ahead is raised by the take
    that wanted it, as it would be by a read made then. Only the caller (`marks`) records what
    was consumed, while it waits. `steady`: the read ahead polls every `poll_s` however long it
    waits, so that `ready` turns true within a poll of the groups' commit (the trainer acts on it
    in the middle of a step: `BorrowedThreads`); otherwise it backs off like any wait until the
    trainer takes it, and polls at once then (`_Signal`).

    The first take of the process polls every `poll_s` for its first `FIRST_TAKE_STEADY_S`: it
    waits while the sampler starts (1-2.5 s in the demo), and backing off it had polled 0.3-0.5 s
    apart by then and picked the run's first batch up 0.2-0.4 s after its commit. Once per run (or
    resume), that is at most `FIRST_TAKE_STEADY_S / poll_s` requests."""

    def __init__(self, buffer: ReplayBuffer, run: RunDir, groups: int, poll_s: float, timeout_s: float,
                 marks: ConsumedMarks | None = None, steady: bool = False):
        self.buffer, self.run, self.groups = buffer, run, groups
        self.poll_s, self.timeout_s, self.marks, self.steady = poll_s, timeout_s, marks, steady
        self._ahead: _ReadAhead | None = None
        self._arrivals: deque[float] = deque(maxlen=9)  # when the last steps' reads ended; empty before the first

    def take(self, cursor: dict | None, ahead: bool) -> tuple[pa.Table, dict | None, float]:
        pending = self._ahead
        if pending is not None and pending.cursor != cursor:
            self.close()  # read from a position the trainer left (it does not, short of a bug)
            pending = None
        if pending is None:
            table, nxt, waited = wait_for_groups(self.buffer, self.run, cursor, self.groups, self.poll_s,
                                                 self.timeout_s, self.marks,
                                                 steady_s=0.0 if self._arrivals else FIRST_TAKE_STEADY_S)
            self._arrivals.append(time.monotonic())
        else:
            t0 = time.monotonic()
            if not pending.done.is_set():
                pending.signal.hurry()
            while not pending.done.is_set():  # interrupted (a signal), the read stays for close() to end
                if self.marks is not None:
                    self.marks.waiting()
                pending.done.wait(self.poll_s)
            self._ahead = None
            waited = time.monotonic() - t0
            if pending.error is not None:
                raise pending.error
            table, nxt, _ = pending.result
            self._arrivals.append(pending.ended_at)
        if ahead:
            self._ahead = _ReadAhead(self, nxt)
        return table, nxt, waited

    def ready(self) -> bool:
        """The next step's read has ended (a take now would not wait): its groups are here, or the
        stop or timeout it met is."""
        pending = self._ahead
        return pending is not None and pending.done.is_set()

    def expected_in(self) -> float | None:
        """Seconds until the next step's groups are expected (negative: overdue): the last step's
        read ended at a, and the next one should end a median interval of the last steps' after
        it. None until three reads have ended."""
        a = self._arrivals
        if len(a) < 3:
            return None
        gaps = sorted(later - earlier for earlier, later in zip(list(a)[:-1], list(a)[1:]))
        return a[-1] + gaps[len(gaps) // 2] - time.monotonic()

    def close(self) -> None:
        """Give up a read ahead (the loop ended): its thread ends within one poll."""
        pending, self._ahead = self._ahead, None
        if pending is not None:
            pending.stop()


class ReplayPace:
    """Whether a yielding replay epoch (`trainer.replay_yield`) starts its next update: only when
    the update is expected to end before the next fresh step's groups come (`FreshFeed.expected_in`),
    at the pace of the last replay updates (of the last fresh steps until one has run, which costs
    more: a replay trains on part of its rows). Started on every chance instead, an update under
    way when the groups come holds the fresh step back until its micro-batch ends, and its work so
    far is thrown away; an update started on a wrong guess still gives way there (`GaveWay`)."""

    SMOOTHING = 0.3  # weight of the newest duration in the running estimates

    def __init__(self):
        self.seconds: dict[str, float | None] = {"fresh": None, "replay": None}

    def took(self, kind: str, seconds: float) -> None:
        old = self.seconds[kind]
        self.seconds[kind] = seconds if old is None else old + self.SMOOTHING * (seconds - old)

    def fits(self, expected_in: float | None) -> bool:
        cost = self.seconds["replay"] if self.seconds["replay"] is not None else self.seconds["fresh"]
        return expected_in is None or cost is None or expected_in >= cost
