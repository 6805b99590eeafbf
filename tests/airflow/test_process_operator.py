"""The supervising operator: streams output, fails on a bad exit, stops the whole process group."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from pipeline.processes import process_identity, process_start_ticks, stop_group
from plugins.operators import RlhfProcessOperator, SupervisedProcessOperator, engine_command
from plugins.operators.process import engine_environment


class FakeTI:
    def __init__(self, try_number=1):
        self.try_number = try_number


class FakeStateStore:
    def __init__(self, value=None):
        self.value = {"supervised_process": value} if value else {}
        self.written = []

    def get(self, key):
        return self.value.get(key)

    def set(self, key, value):
        self.value[key] = value
        self.written.append(value)


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


def test_the_record_of_a_process_group_identifies_its_leader():
    store = FakeStateStore()
    op = SupervisedProcessOperator(task_id="p", command=python("print('x')"))
    op.execute({"ti": FakeTI(), "task_state_store": store})
    record = store.written[0]
    assert record["pgid"] > 0 and record["host"] == socket.gethostname()
    assert record["boot_id"] == open("/proc/sys/kernel/random/boot_id").read().strip()
    assert isinstance(record["start_ticks"], int) and record["start_ticks"] > 0
    assert store.value["supervised_process"] is None  # cleared once the process is done


def test_a_retry_first_stops_the_orphaned_group_of_the_previous_try():
    orphan = subprocess.Popen(python("import time; time.sleep(60)"), start_new_session=True)
    try:
        store = FakeStateStore({"pgid": orphan.pid, **process_identity(orphan.pid)})
        op = SupervisedProcessOperator(task_id="p", command=python("print('resumed')"), kill_grace_s=5)
        op.execute({"ti": FakeTI(try_number=2), "task_state_store": store})
        assert orphan.wait(timeout=10) != 0
        assert store.value["supervised_process"] is None  # cleared once the process is done
    finally:
        if orphan.poll() is None:
            os.killpg(orphan.pid, signal.SIGKILL)
            orphan.wait()


@pytest.mark.parametrize("wrong", [
    {"start_ticks": "other"},  # the pid came back for another process (a container restart)
    {"boot_id": "00000000-0000-0000-0000-000000000000"},  # the machine rebooted
    {"host": "another-worker"},
    {"start_ticks": None},  # a record that cannot identify the process
], ids=["start-time", "boot-id", "host", "no-start-time"])
def test_a_retry_does_not_kill_a_stranger_that_holds_the_recorded_pid(wrong):
    stranger = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        record = {"pgid": stranger.pid, **process_identity(stranger.pid), **wrong}
        if record["start_ticks"] == "other":
            record["start_ticks"] = process_start_ticks(stranger.pid) - 1
        op = SupervisedProcessOperator(task_id="p", command=python("print('resumed')"), kill_grace_s=5)
        op.execute({"ti": FakeTI(try_number=2), "task_state_store": FakeStateStore(record)})
        assert alive(stranger.pid)
    finally:
        if stranger.poll() is None:
            os.killpg(stranger.pid, signal.SIGKILL)
        stranger.wait()


SECRETS = {
    "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": "postgresql://airflow:db-password@postgres/airflow",
    "AIRFLOW__CORE__FERNET_KEY": "fernet-key",
    "AIRFLOW__API_AUTH__JWT_SECRET": "jwt-secret",
    "AIRFLOW_CONN_WAREHOUSE": "postgres://user:password@warehouse/db",
    "AIRFLOW_VAR_API_TOKEN": "token",
    "CELERY_BROKER_URL": "redis://:password@redis:6379/0",
    "MY_SERVICE_SQL_ALCHEMY_URL": "mysql://u:p@h/db",
}
NEEDED = {
    "OMP_NUM_THREADS": "3", "AWS_ACCESS_KEY_ID": "AKIAEXAMPLE", "AWS_SECRET_ACCESS_KEY": "s3-secret",
    "RLHF_RUNS_ROOT": "s3://bucket/runs", "CUDA_VISIBLE_DEVICES": "1", "HF_HOME": "/cache/hf",
    "GOOGLE_APPLICATION_CREDENTIALS": "/secrets/gcs.json", "LC_ALL": "C.UTF-8",
}


def test_the_process_gets_what_the_engine_needs_and_none_of_airflows_secrets(monkeypatch, tmp_path):
    for name, value in {**SECRETS, **NEEDED}.items():
        monkeypatch.setenv(name, value)
    dump = tmp_path / "env.json"
    op = SupervisedProcessOperator(task_id="p", env={"EXTRA": "x"}, command=python(
        f"import json, os; json.dump(dict(os.environ), open({str(dump)!r}, 'w'))"))
    op.execute({"ti": FakeTI()})
    env = json.loads(dump.read_text())
    assert sorted(set(SECRETS) & set(env)) == []
    assert [k for k in env if k.startswith("AIRFLOW")] == []  # AIRFLOW_HOME and the rest too
    assert {k: env.get(k) for k in NEEDED} == NEEDED
    assert env["EXTRA"] == "x" and env["PATH"] == os.environ["PATH"] and env["TQDM_DISABLE"] == "1"


def test_a_deployment_may_pass_more_variables_but_never_airflows():
    worker = {"WANDB_API_KEY": "k", "WANDB_PROJECT": "p", "MLFLOW_TRACKING_URI": "http://mlflow",
              "AIRFLOW__CORE__FERNET_KEY": "f", "RLHF_DB_CONN_URL": "x", "PATH": "/bin"}
    env = engine_environment(worker, pass_env=["WANDB_*", "MLFLOW_TRACKING_URI", "AIRFLOW*", "RLHF_DB_CONN_URL"])
    assert {k for k in worker if k in env} == {"WANDB_API_KEY", "WANDB_PROJECT", "MLFLOW_TRACKING_URI", "PATH"}
    assert "WANDB_API_KEY" not in engine_environment(worker)
    # the operator's own `env` is the DAG author's explicit choice: applied last
    assert engine_environment(worker, {"OMP_NUM_THREADS": 4})["OMP_NUM_THREADS"] == "4"


def test_stop_group_escalates_to_sigkill_when_sigterm_is_ignored():
    stubborn = subprocess.Popen(python("import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                                       "print('ready', flush=True)\ntime.sleep(60)"),
                                start_new_session=True, stdout=subprocess.PIPE, text=True)
    assert stubborn.stdout.readline().strip() == "ready"
    t0 = time.monotonic()
    assert stop_group(stubborn.pid, grace_s=1.0)
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
