"""The `spawn` fixture (tests/conftest.py): nothing a test started outlives it, pass, fail or timeout."""

import os
import signal
import subprocess
import sys

import psutil

# A process that starts a grandchild in a session of its own (as the local runner starts its
# sampler and trainer), then sleeps or, like a runner killed by a signal, exits at once.
INNER = '''
import signal, sys, time

MARK = {mark!r}
CHILD = (
    "import subprocess, sys, time\\n"
    "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)', sys.argv[1]], start_new_session=True)\\n"
    "time.sleep(float(sys.argv[2]))\\n"
)


def test_fails_after_its_process_died(spawn):
    p = spawn([sys.executable, "-c", CHILD, MARK, "0"])
    p.wait()
    assert False


def test_times_out(spawn):
    spawn([sys.executable, "-c", CHILD, MARK, "120"])
    time.sleep(60)


def test_dispositions_are_the_defaults(spawn):
    p = spawn([sys.executable, "-c", "import signal; print(signal.getsignal(signal.SIGINT) is signal.default_int_handler, "
               "signal.getsignal(signal.SIGHUP) == signal.SIG_DFL)"], stdout=-1, text=True)
    assert p.communicate(timeout=30)[0].split() == ["True", "True"]
'''


def _marked(mark: str) -> list[psutil.Process]:
    out = []
    for q in psutil.process_iter():
        try:
            if mark in q.cmdline():
                out.append(q)
        except psutil.Error:
            pass
    return out


def test_spawn_kills_what_a_failed_or_timed_out_test_started(tmp_path, spawn):
    mark = f"spawn-fixture-{tmp_path.name}-{os.getpid()}"
    (tmp_path / "test_inner.py").write_text(INNER.format(mark=mark))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")]))
    # the inner session starts with SIGINT and SIGHUP ignored, as under `nohup make test &`
    inner = spawn([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "conftest", "--timeout=5",
                   "--rootdir", str(tmp_path), str(tmp_path / "test_inner.py")],
                  env=env, cwd=tmp_path, ignore=(signal.SIGINT, signal.SIGHUP), stdout=subprocess.PIPE,
                  stderr=subprocess.STDOUT, text=True)
    out, _ = inner.communicate(timeout=120)
    assert "2 failed, 1 passed" in out, out[-3000:]
    assert "Timeout" in out, out[-3000:]
    left = _marked(mark)
    for q in left:
        q.kill()
    assert not left, [q.cmdline() for q in left]
