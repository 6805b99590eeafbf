"""The supervising operator: streams output, fails on a bad exit, stops the whole process group."""

import os
import subprocess
import sys
import threading
import time

import pytest

from plugins.operators import RlhfProcessOperator, SupervisedProcessOperator, engine_command, stop_process_group


class FakeTI:
    def __init__(self, try_number=1):
        self.try_number = try_number


class FakeStateStore:
    def __init__(self, value=None):
        self.value = {"supervised_process": value} if value else {}

    def get(self, key):
        return self.value.get(key)

    def set(self, key, value):
        self.value[key] = value


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is not alive
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


class Recording(SupervisedProcessOperator):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.lines = []

    def handle_line(self, line):
        self.lines.append(line)
        super().handle_line(line)


def python(code):
    return [sys.executable, "-c", code]


def test_streams_each_output_line_into_the_task_log():
    op = Recording(task_id="p", command=python("import sys\nfor i in range(3): print('step', i)\n"
                                               "print('warn', file=sys.stderr)"))
    result = op.execute({"ti": FakeTI()})
    assert op.lines == ["step 0", "step 1", "step 2", "warn"]
    assert result["returncode"] == 0


def test_child_gets_explicit_thread_counts_and_no_progress_bars(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    op = Recording(task_id="p", env={"EXTRA": "x"}, command=python(
        "import os; print(os.environ['OMP_NUM_THREADS'], os.environ['TQDM_DISABLE'], os.environ['EXTRA'])"))
    op.execute({"ti": FakeTI()})
    assert op.lines == ["1 1 x"]


def test_non_zero_exit_fails_the_task_quoting_the_last_lines():
    from airflow.sdk.exceptions import AirflowException

    op = SupervisedProcessOperator(task_id="p", command=python("print('loading'); print('boom: bad shard'); raise SystemExit(3)"))
    with pytest.raises(AirflowException, match=r"(?s)code 3.*boom: bad shard"):
        op.execute({"ti": FakeTI()})


def test_on_kill_stops_the_process_and_its_children(tmp_path):
    pidfile = tmp_path / "grandchild.pid"
    code = (f"import subprocess, sys, time\n"
            f"p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
            f"open({str(pidfile)!r}, 'w').write(str(p.pid))\n"
            f"print('started', flush=True)\n"
            f"time.sleep(60)\n")
    op = SupervisedProcessOperator(task_id="p", command=python(code), kill_grace_s=5)
    errors = []
    worker = threading.Thread(target=lambda: _run_expect_failure(op, errors))
    worker.start()
    deadline = time.monotonic() + 30
    while not pidfile.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    grandchild = int(pidfile.read_text())
    child = op._proc.pid
    assert alive(child) and alive(grandchild)
    op.on_kill()
    worker.join(timeout=30)
    assert not worker.is_alive()
    assert errors and "exited with code" in errors[0]  # killed by SIGTERM: the task fails
    deadline = time.monotonic() + 5
    while alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(child) and not alive(grandchild)


def _run_expect_failure(op, errors):
    try:
        op.execute({"ti": FakeTI()})
    except Exception as e:  # noqa: BLE001 - the test inspects it
        errors.append(str(e))


def test_a_retry_first_stops_the_orphaned_group_of_the_previous_try():
    orphan = subprocess.Popen(python("import time; time.sleep(60)"), start_new_session=True)
    try:
        import socket

        store = FakeStateStore({"host": socket.gethostname(), "pgid": orphan.pid})
        op = SupervisedProcessOperator(task_id="p", command=python("print('resumed')"), kill_grace_s=5)
        op.execute({"ti": FakeTI(try_number=2), "task_state_store": store})
        assert orphan.wait(timeout=10) != 0
        assert store.value["supervised_process"] is None  # cleared once the process is done
    finally:
        if orphan.poll() is None:
            orphan.kill()
            orphan.wait()


def test_stop_process_group_escalates_to_sigkill_when_sigterm_is_ignored():
    stubborn = subprocess.Popen(python("import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                                       "print('ready', flush=True)\ntime.sleep(60)"),
                                start_new_session=True, stdout=subprocess.PIPE, text=True)
    assert stubborn.stdout.readline().strip() == "ready"
    t0 = time.monotonic()
    assert stop_process_group(stubborn.pid, grace_s=1.0)
    assert stubborn.wait(timeout=10) == -9
    assert time.monotonic() - t0 < 8


def test_engine_roles_run_the_engine_cli_with_the_workers_interpreter():
    assert engine_command("trainer", "file:///r/x") == [sys.executable, "-m", "pipeline", "trainer", "--run-dir", "file:///r/x"]
    with pytest.raises(ValueError, match="role"):
        engine_command("shell", "file:///r/x")
    op = RlhfProcessOperator(task_id="trainer", role="trainer", run_url="{{ ti.xcom_pull('prepare', key='run_url') }}")
    assert "run_url" in op.template_fields
    with pytest.raises(ValueError, match="role"):
        RlhfProcessOperator(task_id="x", role="rm -rf", run_url="file:///r/x")
