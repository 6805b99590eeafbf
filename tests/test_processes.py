"""Process groups: alive, stopped together, and a leader told apart from a later process."""

import signal
import subprocess
import sys
import time

import pytest

from pipeline.processes import group_alive, identity_mismatch, process_identity, stop_group, stop_groups


def _group(code: str = "import time; time.sleep(60)") -> subprocess.Popen:
    # own session; default dispositions whatever the test runner inherited
    return subprocess.Popen([sys.executable, "-c", code], start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL))


@pytest.fixture
def groups():
    started: list[subprocess.Popen] = []
    yield lambda *a: started.append(_group(*a)) or started[-1]
    for p in started:
        if p.poll() is None:
            p.kill()
        p.wait()


def test_a_group_whose_leader_exited_unreaped_is_not_alive_and_keeps_its_exit_status(groups):
    p = groups("import sys; sys.exit(3)")
    deadline = time.monotonic() + 10
    while group_alive(p.pid):  # a zombie until reaped: not alive
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert p.wait(timeout=5) == 3  # nothing reaped it behind the Popen's back


def test_stop_groups_terminates_several_groups_within_one_grace_period(groups):
    procs = [groups() for _ in range(3)]
    t0 = time.monotonic()
    assert stop_groups([p.pid for p in procs], grace_s=20) == [p.pid for p in procs]
    assert time.monotonic() - t0 < 10  # SIGTERM went to all at once: no wait for the grace period
    assert [p.wait(timeout=5) for p in procs] == [-signal.SIGTERM] * 3
    assert not any(group_alive(p.pid) for p in procs)


def test_stopping_a_group_that_is_gone_says_so(groups):
    p = groups("pass")
    p.wait()
    assert stop_group(p.pid, grace_s=1) is False


def test_the_identity_of_a_live_leader_matches_and_a_stale_record_does_not(groups):
    p = groups()
    record = {"pgid": p.pid, **process_identity(p.pid)}
    assert identity_mismatch(record) is None
    assert "start_ticks differs" in identity_mismatch({**record, "start_ticks": record["start_ticks"] - 1})
    assert "boot_id differs" in identity_mismatch({**record, "boot_id": "another-boot"})
    assert identity_mismatch({"pgid": None}) == "no process group recorded"
    stop_group(p.pid, grace_s=5)
    p.wait()
    assert "is gone" in identity_mismatch(record)


def test_the_runner_stops_what_an_exited_child_left_in_its_group(groups):
    """torchrun's workers after the launcher died, an engine's subprocesses: still holding devices."""
    from pipeline.local_runner import _terminate

    p = groups("import subprocess, sys; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); sys.exit(1)")
    assert p.wait(timeout=10) == 1 and group_alive(p.pid)
    _terminate(p, grace_s=0.0)
    assert not group_alive(p.pid)


def test_engines_already_started_are_stopped_when_the_next_cannot_start(monkeypatch, tmp_path):
    import pipeline.local_runner as runner
    from pipeline.config import parse_config
    from pipeline.rundir import RunDir

    started = []

    def child(role, *a, **k):
        if role == "trainer":
            raise OSError("cannot fork: out of memory")
        started.append(_group())
        return started[-1]

    monkeypatch.setattr(runner, "_child", child)
    try:
        with pytest.raises(OSError, match="cannot fork"):
            runner._engines(RunDir(str(tmp_path / "r")), parse_config({"sampler": {"replicas": 2}}))
        assert len(started) == 2 and not any(group_alive(p.pid) for p in started)
    finally:
        for p in started:
            if p.poll() is None:
                p.kill()
            p.wait()
