"""The reward worker's processes: what a reward function starts goes with the worker (timeout,
close, a sampler killed outright), `sys.exit` in a reward is that sample's error, and a worker that
dies reports its own exit code."""

import os
import signal
import sys
import time
from pathlib import Path

import psutil
import pytest

from pipeline.reward_worker import InlineRewards, Outcome, RewardWorker, _Lost

REPO = Path(__file__).resolve().parents[2]
REWARD = '''
import os, subprocess, sys, time

def _child(pidfile):
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    with open(pidfile, "w") as f:
        f.write(str(p.pid))

def spawn_and_hang(data_source, solution_str, ground_truth, extra_info=None):
    _child(solution_str)  # a code-execution reward running the model's endless program
    time.sleep(60)

def spawn_and_return(data_source, solution_str, ground_truth, extra_info=None):
    _child(solution_str)  # left running in the background
    return 1.0

def exits(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "exit":
        sys.exit(3)
    return 1.0

def dies(data_source, solution_str, ground_truth, extra_info=None):
    os._exit(7)
'''


@pytest.fixture
def fn(tmp_path):
    f = tmp_path / "procs_reward.py"
    f.write_text(REWARD)
    return lambda name: f"{f}:{name}"


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not _alive(pid)


def _wait_for(path: Path, seconds: float = 20.0) -> int:
    deadline = time.monotonic() + seconds
    while not (path.exists() and path.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return int(path.read_text())


def _kill(pid: int | None) -> None:
    if pid is not None and _alive(pid):
        os.kill(pid, signal.SIGKILL)


def test_a_timed_out_reward_takes_its_child_processes_with_it(fn, tmp_path):
    pidfile, child = tmp_path / "child.pid", None
    worker = RewardWorker(fn("spawn_and_hang"), timeout_s=1.0)
    try:
        worker.wait_ready()
        assert os.getsid(worker._proc.pid) == worker._proc.pid  # a session of its own
        [out] = worker.score([("s", str(pidfile), "1", None)])
        child = int(pidfile.read_text())
        assert out.timed_out
        assert _gone_within(child, 5), "the reward's child outlived the timed-out worker"
    finally:
        worker.close()
        _kill(child)


def test_closing_the_worker_stops_what_the_reward_left_running(fn, tmp_path):
    pidfile, child = tmp_path / "child.pid", None
    worker = RewardWorker(fn("spawn_and_return"), timeout_s=10.0)
    try:
        [out] = worker.score([("s", str(pidfile), "1", None)])
        child = int(pidfile.read_text())
        assert out.score.reward == 1.0 and _alive(child)
        worker.close()
        assert _gone_within(child, 5), "the reward's child outlived the closed worker"
    finally:
        worker.close()
        _kill(child)


def test_a_sampler_killed_outright_takes_the_worker_and_its_children_with_it(fn, tmp_path, spawn):
    pidfile = tmp_path / "child.pid"
    code = ("import sys; sys.path.insert(0, sys.argv[1])\n"
            "from pipeline.reward_worker import RewardWorker\n"
            "RewardWorker(sys.argv[2], timeout_s=60).score([('s', sys.argv[3], '1', None)])\n")
    sampler = spawn([sys.executable, "-c", code, str(REPO), fn("spawn_and_hang"), str(pidfile)], cwd=REPO)
    child = _wait_for(pidfile)
    worker = psutil.Process(child).ppid()
    assert worker != sampler.pid and psutil.Process(worker).ppid() == sampler.pid
    os.kill(sampler.pid, signal.SIGKILL)  # the OOM killer: no close(), no finally
    sampler.wait(10)
    assert _gone_within(worker, 5), "the worker outlived the sampler"
    assert _gone_within(child, 5), "the reward's child outlived the sampler"


@pytest.mark.parametrize("where", ["worker", "inline"])
def test_sys_exit_in_a_reward_is_that_samples_error(fn, where):
    rules = RewardWorker(fn("exits"), timeout_s=10.0) if where == "worker" else InlineRewards(fn("exits"))
    try:
        out = rules.score([("s", "a", "1", None), ("s", "exit", "1", None), ("s", "b", "1", None)])
        assert [o.score.reward if o.score else o.error for o in out] == [1.0, "SystemExit: 3", 1.0]
        assert getattr(rules, "restarts", 0) == 0  # the worker went on
    finally:
        rules.close()


def test_a_worker_that_dies_reports_its_own_exit_code(fn):
    worker = RewardWorker(fn("dies"), timeout_s=10.0)
    try:
        [out] = worker.score([("s", "a", "1", None)])
        assert out.error == "the reward worker died (exit code 7)"
    finally:
        worker.close()


class _LosesEverySample(RewardWorker):
    """A worker that dies on the first sample of every batch it is given (no processes)."""

    def __init__(self):
        self.batched, self.calls = False, 0

    def wait_ready(self):
        pass

    def _call(self, kind, items):
        self.calls += 1
        return _Lost(0, Outcome(error="the reward worker died (exit code 1)"))

    def close(self):
        pass


def test_thousands_of_lost_samples_do_not_overflow_the_stack():
    worker = _LosesEverySample()
    n = 3 * sys.getrecursionlimit()
    out = worker.score([("s", str(i), "1", None) for i in range(n)])
    assert len(out) == n and all(o.error == "the reward worker died (exit code 1)" for o in out)
    assert worker.calls == n
