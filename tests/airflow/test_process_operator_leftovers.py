"""The supervising operator when the process exits but something it started still holds its output
pipe: the task ends promptly with the process's exit code, and what is left of its group is stopped."""

import os
import signal
import sys
import threading
import time

import psutil
import pytest

from plugins.operators import SupervisedProcessOperator


class FakeTI:
    try_number = 1


class Recording(SupervisedProcessOperator):
    output_drain_s = 1.0

    def __init__(self, **kwargs):
        super().__init__(kill_grace_s=5, **kwargs)
        self.lines = []

    def handle_line(self, line):
        self.lines.append(line)


def _alive(pid):
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _leaves_a_child(pidfile, exit_code, own_session=False):
    """The engine: starts a child that inherits its stdout, says something late and sleeps on, then
    exits with `exit_code` (a sampler whose reward left a program running)."""
    child = "import time; time.sleep(0.3); print('late', flush=True); time.sleep(60)"
    return [sys.executable, "-c",
            "import subprocess, sys\n"
            f"p = subprocess.Popen([sys.executable, '-c', {child!r}], start_new_session={own_session})\n"
            f"open({str(pidfile)!r}, 'w').write(str(p.pid))\n"
            f"print('done', flush=True)\n"
            f"sys.exit({exit_code})\n"]


def _execute(op):
    """Run the operator in a thread (a hang fails the test instead of the suite); (result, error, s)."""
    box = {}

    def run():
        try:
            box["result"] = op.execute({"ti": FakeTI()})
        except Exception as e:  # noqa: BLE001 - the test inspects it
            box["error"] = e

    started = time.monotonic()
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(20)
    return box, t.is_alive(), time.monotonic() - started


def _cleanup(op, pidfile):
    if pidfile.exists() and pidfile.read_text() and _alive(int(pidfile.read_text())):
        os.kill(int(pidfile.read_text()), signal.SIGKILL)
    if op._proc is not None and op._proc.poll() is None:
        os.killpg(op._proc.pid, signal.SIGKILL)


@pytest.mark.parametrize("exit_code", [0, 3])
def test_the_task_ends_when_the_process_exits_and_its_group_is_stopped(tmp_path, exit_code):
    pidfile = tmp_path / "child.pid"
    op = Recording(task_id="p", command=_leaves_a_child(pidfile, exit_code))
    try:
        box, hung, took = _execute(op)
        assert not hung, "the task waited for the end of output a leftover child still held"
        assert took < 12
        child = int(pidfile.read_text())
        assert not _alive(child), "the child left in the process group was not stopped"
        assert op.lines[:2] == ["done", "late"]  # what came within the drain is still logged
        if exit_code == 0:
            assert box["result"]["returncode"] == 0
        else:
            assert "exited with code 3" in str(box["error"])
    finally:
        _cleanup(op, pidfile)


def test_a_leftover_outside_the_group_does_not_hold_the_task(tmp_path):
    pidfile = tmp_path / "child.pid"
    op = Recording(task_id="p", command=_leaves_a_child(pidfile, 0, own_session=True))
    try:
        box, hung, took = _execute(op)
        assert not hung and took < 12
        assert box["result"]["returncode"] == 0 and op.lines[:2] == ["done", "late"]
    finally:
        _cleanup(op, pidfile)
