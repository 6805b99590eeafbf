"""Rule rewards in a worker process: per-sample timeouts, and a reward that raises or hangs never
takes the sampler down with it.

The sampler hands over one rollout batch per call and gets one reply with a result per sample:
the common path costs one round trip per batch. Before each sample the worker writes the
sample's index and start time into a small shared memory slot, so the sampler knows which
sample is running and since when without any message. A sample past `timeout_s` gets its worker
killed (a thread could not be); a fresh worker scores the others again (their results went with
the killed one) and the rest. A worker that dies (a crash, `os._exit` in user code) is handled
the same way, with the sample it was on named and its own exit code. `sys.exit` in a reward is
that sample's error, like an exception.

The worker runs in a session of its own, and stopping it (a timeout, a crash, `close`) SIGKILLs
its whole process group: a program the reward started (generated code looping forever) goes
with it instead of living on with the sampler's output pipe. Should the sampler die outright
(the OOM killer), the kernel kills the worker (`PR_SET_PDEATHSIG`) and a small guard process in
the worker's group kills what is left of the group.

A batched function gets the whole batch in one call, under a deadline of `timeout_s`. When that
call raises or times out, each sample is scored alone (a batch of one, `timeout_s` each): that
finds the culprit and keeps the other samples' scores.

`InlineRewards` is the same contract in the sampler's own process (`reward.timeout_s: null`):
exceptions are caught, nothing bounds the time.

What crosses the socket is our own rollout data going to our own worker process.
"""

from __future__ import annotations

import logging
import mmap
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection

from .config_yaml import ConfigError  # (not .config: the reward worker starts without pydantic)
from .rewards import RewardFunction, Score, load_reward_fn, to_score

log = logging.getLogger("rlhf.rewards")
Item = tuple  # (data_source, solution_str, ground_truth, extra_info)


@dataclass
class Outcome:
    """The result of scoring one sample: a score, or why there is none."""

    score: Score | None = None
    error: str | None = None  # one line: "ValueError: boom", "timed out after 10 s", ...
    detail: str = ""  # the traceback, when there is one
    timed_out: bool = False


def _failure(exc: BaseException) -> tuple:
    return ("err", f"{type(exc).__name__}: {exc}", traceback.format_exc())


def _score_one(fn: RewardFunction, item: Item) -> tuple:
    try:
        s = to_score(fn(*item))
        return ("ok", s.reward, s.extra)
    # the user's code: any error is that sample's outcome, `sys.exit` too (not Ctrl-C)
    except (Exception, SystemExit) as exc:  # noqa: BLE001
        return _failure(exc)


def _score_whole(fn: RewardFunction, items: list[Item]) -> list[tuple] | tuple:
    """One call of a batched function: a message per item, or one failure for the whole call."""
    try:
        outs = fn.call_batch(items)
    except (Exception, SystemExit) as exc:  # noqa: BLE001
        return _failure(exc)
    msgs = []
    for out in outs:
        try:
            s = to_score(out)
            msgs.append(("ok", s.reward, s.extra))
        except Exception as exc:  # noqa: BLE001 - one bad value fails its sample only
            msgs.append(_failure(exc))
    return msgs


def _outcome(msg: tuple) -> Outcome:
    if msg[0] == "ok":
        return Outcome(score=Score(msg[1], msg[2]))
    return Outcome(error=msg[1], detail=msg[2])


class _RuleRewards:
    """Scoring of a batch with the batched fallback; subclasses say where the function runs."""

    batched: bool

    def score(self, items: list[Item]) -> list[Outcome]:
        if not items:
            return []
        self.wait_ready()
        if not self.batched:
            return self._each(items)
        whole = self._whole(items)
        if isinstance(whole, list):
            return whole
        log.warning("batched reward call over %d samples failed (%s); scoring them one at a time",
                    len(items), whole.error)
        out = []
        for item in items:
            one = self._whole([item])
            out.append(one[0] if isinstance(one, list) else one)
        return out

    def wait_ready(self) -> None:
        pass

    def _each(self, items: list[Item]) -> list[Outcome]:
        raise NotImplementedError

    def _whole(self, items: list[Item]) -> list[Outcome] | Outcome:
        raise NotImplementedError

    def close(self) -> None:
        pass


class InlineRewards(_RuleRewards):
    def __init__(self, spec: str, batched: bool | None = None):
        self.fn = load_reward_fn(spec, batched)
        self.batched = self.fn.batched

    def _each(self, items):
        return [_outcome(_score_one(self.fn, item)) for item in items]

    def _whole(self, items):
        msgs = _score_whole(self.fn, items)
        return [_outcome(m) for m in msgs] if isinstance(msgs, list) else _outcome(msgs)


def _die_with_parent(parent_pid: int) -> None:
    """Linux: the kernel kills this worker when the sampler dies, even mid-hang in user code."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent_pid:  # the parent was gone before prctl took effect
        os._exit(1)


def _guard(parent_pid: int, fds: tuple[int, ...]) -> None:
    """Fork a guard into the worker's group: once the sampler or the worker is gone, it SIGKILLs
    the group (what the reward started; the worker, if the kernel did not already). A process, not
    a thread: user code holding the GIL (a regex backtracking forever) cannot stop it."""
    worker_pid = os.getpid()
    if os.fork():
        return
    try:
        for fd in fds:  # the sampler sees the worker's end of the socket close when the worker dies
            os.close(fd)
        select.select([os.pidfd_open(parent_pid), os.pidfd_open(worker_pid)], [], [])
    except (AttributeError, OSError):  # no pidfd (not Linux >= 5.3), or one of them is gone:
        while os.getppid() == worker_pid:  # watch the worker (it dies with the sampler)
            time.sleep(0.5)
    finally:
        os.killpg(0, signal.SIGKILL)
        os._exit(0)


_SLOT = struct.Struct("<dq")  # start time (time.monotonic), index of the running sample (-1: none)


class _Progress:
    """The shared slot: the worker writes the time first, then the index; the sampler reads the
    index on both sides of the time, so it never pairs one sample's index with another's time."""

    def __init__(self, fd: int):
        self.map = mmap.mmap(fd, _SLOT.size)

    def start(self, index: int) -> None:
        self.map[:8] = struct.pack("<d", time.monotonic())
        self.map[8:] = struct.pack("<q", index)

    def read(self) -> tuple[int, float]:
        while True:
            before = self.map[8:]
            started, index = _SLOT.unpack(self.map[:])
            if self.map[8:] == before:
                return index, started


def worker_main(fd: int, progress_fd: int, parent_pid: int) -> None:
    """The worker process: load the function named in the first message, then score batches."""
    # a SIGINT ends the worker quietly (Ctrl-C reaches the sampler, which unwinds and closes it)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    _die_with_parent(parent_pid)
    _guard(parent_pid, (fd, progress_fd))
    for inherited in (fd, progress_fd):  # not passed on to what the reward runs
        os.set_inheritable(inherited, False)
    conn, progress = Connection(fd), _Progress(progress_fd)
    spec, batched = conn.recv()
    try:
        fn = load_reward_fn(spec, batched)
    except Exception as exc:  # noqa: BLE001 - reported to the sampler, which fails with it
        conn.send(("load_error", str(exc) if isinstance(exc, ConfigError) else f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", fn.batched))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        kind, items = msg
        if kind == "each":
            reply = []
            for i, item in enumerate(items):
                progress.start(i)
                reply.append(_score_one(fn, item))
        else:
            progress.start(0)
            reply = _score_whole(fn, items)
        conn.send(reply)


@dataclass
class _Lost:
    """The worker is gone while on sample `index`: it timed out or died; the reply is lost."""

    index: int
    outcome: Outcome


class RewardWorker(_RuleRewards):
    """The reward function in a fresh interpreter (`python -m pipeline.reward_worker`): no torch
    threads, locks or `__main__` inherited from the sampler; a socket pair carries the messages."""

    def __init__(self, spec: str, batched: bool | None = None, timeout_s: float = 10.0,
                 start_timeout_s: float = 300.0):
        self.spec, self._batched_cfg, self.timeout_s = spec, batched, timeout_s
        self.start_timeout_s = start_timeout_s
        self._proc: subprocess.Popen | None = None
        self._conn: Connection | None = None
        self._ready = False
        self.batched = bool(batched)  # until the worker says what it loaded
        self.restarts = -1
        self._slot_file = tempfile.TemporaryFile()
        self._slot_file.truncate(_SLOT.size)
        self._progress = _Progress(self._slot_file.fileno())
        self._start()  # loads while the sampler loads its model or generates its first batch

    def _start(self) -> None:
        ours, theirs = socket.socketpair()
        # this package first on the path: the worker runs the same code as the sampler
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])]))
        fds = (theirs.fileno(), self._slot_file.fileno())
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "pipeline.reward_worker", *map(str, fds), str(os.getpid())],
                pass_fds=fds, env=env, stdin=subprocess.DEVNULL, start_new_session=True)
        finally:
            theirs.close()
        self._conn = Connection(ours.detach())
        self._conn.send((self.spec, self._batched_cfg))
        self._ready = False
        self.restarts += 1

    def wait_ready(self) -> None:
        """Block until the worker has loaded the reward function; ConfigError if it could not.
        A worker that died since the last batch (the OOM killer, a stray signal) is started again."""
        if self._ready and self._proc is not None and self._proc.poll() is not None:
            log.warning("reward worker for %s exited with code %s between batches; starting a new one",
                        self.spec, self._kill())
        if self._proc is None:
            self._start()
        if self._ready:
            return
        if not self._conn.poll(self.start_timeout_s):
            self._kill()
            raise RuntimeError(f"reward.fn: the reward worker did not load {self.spec!r} within "
                               f"{self.start_timeout_s:g} s")
        try:
            msg = self._conn.recv()
        except (EOFError, OSError):
            code = self._kill()
            raise RuntimeError(f"reward.fn: the reward worker exited with code {code} while loading "
                               f"{self.spec!r}") from None
        if msg[0] == "load_error":
            self._kill()
            raise ConfigError(msg[1])
        self._ready, self.batched = True, msg[1]

    def _kill(self, wait_s: float = 0.0) -> int | None:
        """Stop the worker and its whole process group; the worker's exit code (-9: killed). A
        worker on its way out gets `wait_s` to exit, so that its own exit code is reported."""
        proc, self._proc, self._ready = self._proc, None, False
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if proc is None:
            return None
        try:
            proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            pass
        # The worker's pid names its group: while a member lives that number is not reused, so
        # this reaches the worker if still there and what the reward started, also after reaping.
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            return proc.wait(5)
        except subprocess.TimeoutExpired:
            return None

    def _call(self, kind: str, items: list[Item]) -> list | tuple | _Lost:
        """Send `items` and wait for the reply, giving each sample `timeout_s` from its start."""
        self.wait_ready()
        sent = time.monotonic()
        self._progress.start(-1)
        try:
            self._conn.send((kind, items))
        except OSError:  # died after the check above: once more with a new worker
            self._kill()
            self.wait_ready()
            self._conn.send((kind, items))
        while True:
            index, started = self._progress.read()
            wait = (started if index >= 0 else sent) + self.timeout_s - time.monotonic()
            try:
                if wait > 0 and self._conn.poll(wait):
                    return self._conn.recv()
            except (EOFError, OSError):
                index = self._progress.read()[0]  # the sample it was on when it died
                code = self._kill(wait_s=1.0)
                return _Lost(max(index, 0), Outcome(error=f"the reward worker died (exit code {code})"))
            if self._progress.read() == (index, started):  # still on the same sample: past its time
                self._kill()
                return _Lost(max(index, 0), Outcome(error=f"timed out after {self.timeout_s:g} s", timed_out=True))

    def _each(self, items):
        out: list[Outcome | None] = [None] * len(items)
        todo = list(range(len(items)))  # a fresh worker scores again those before a lost sample
        while todo:
            reply = self._call("each", [items[i] for i in todo])
            if not isinstance(reply, _Lost):
                for i, msg in zip(todo, reply):
                    out[i] = _outcome(msg)
                break
            out[todo.pop(reply.index)] = reply.outcome
        return out

    def _whole(self, items):
        reply = self._call("batch", items)
        if isinstance(reply, _Lost):
            return reply.outcome
        return [_outcome(m) for m in reply] if isinstance(reply, list) else _outcome(reply)

    def close(self) -> None:
        if self._proc is not None and self._proc.poll() is None and self._conn is not None:
            try:
                self._conn.send(None)
                self._proc.wait(2)
            except (OSError, ValueError, subprocess.TimeoutExpired):
                pass
        self._kill()
        self._progress.map.close()
        self._slot_file.close()


def rule_rewards(spec: str, batched: bool | None, timeout_s: float | None) -> _RuleRewards:
    """The worker when a time limit is set, else the inline runner."""
    return InlineRewards(spec, batched) if timeout_s is None else RewardWorker(spec, batched, timeout_s)


if __name__ == "__main__":
    worker_main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
