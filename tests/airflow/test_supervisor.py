"""The embedded deployment's supervisor, on stand-in components (`sleep`), without Airflow."""

import os
import signal
import time

import pytest
from deployments import tear_down

from pipeline.processes import group_alive
from pipeline.rendezvous import free_port
from plugins.local.deployment import LocalAirflow


def _until(cond, timeout_s: float = 15.0, what: str = ""):
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


@pytest.fixture
def deployment(tmp_path):
    af = LocalAirflow(home=tmp_path / "home", port=free_port())
    af.start_supervisor({"scheduler": ["sleep", "300"], "triggerer": ["sleep", "300"]})
    try:
        yield af
    finally:
        tear_down(af)


def test_a_component_that_dies_is_restarted_and_status_counts_it(deployment):
    af = deployment
    first = af.pids()["scheduler"]
    os.killpg(first, signal.SIGKILL)
    _until(lambda: af.state()["components"]["scheduler"]["restarts"] == 1 and af.running().get("scheduler"),
           what="the scheduler to come back")
    scheduler = af.status()["components"]["scheduler"]
    assert scheduler["alive"] and scheduler["pid"] != first and scheduler["last_exit"] == -signal.SIGKILL
    assert af.status()["healthy"]


def test_a_held_component_stays_stopped_until_released(deployment):
    af = deployment
    af._stop("triggerer")
    time.sleep(1.5)  # longer than the first restart delay
    assert af.running()["triggerer"] is False and af.status()["healthy"] is False
    af._start("triggerer")
    assert af.running()["triggerer"] and af.state()["components"]["triggerer"]["restarts"] == 0


def test_status_shows_a_dead_component_when_the_supervisor_is_gone(deployment):
    af = deployment
    os.killpg(af.state()["pid"], signal.SIGKILL)
    os.killpg(af.pids()["triggerer"], signal.SIGKILL)
    _until(lambda: not af.running()["triggerer"], what="the triggerer to be gone")
    report = af.status()
    assert report["healthy"] is False and report["supervisor"]["alive"] is False
    assert report["components"]["triggerer"]["alive"] is False and report["components"]["scheduler"]["alive"]


def test_down_stops_the_supervisor_and_every_component(deployment):
    af = deployment
    groups = [af.state()["pid"], *af.pids().values()]
    assert sorted(af.down(grace_s=5)) == ["scheduler", "triggerer"]
    assert not any(group_alive(g) for g in groups)
    assert af.status()["healthy"] is False


def test_a_supervisor_that_fails_stops_the_components_it_started(tmp_path):
    import json
    import subprocess
    import sys

    home = tmp_path / "home"
    (home / "logs").mkdir(parents=True)
    # the first component starts; the second cannot (no such program): the supervisor fails
    (home / "supervisor-spec.json").write_text(json.dumps({"a": ["sleep", "300"], "b": [str(tmp_path / "missing")]}))
    proc = subprocess.run([sys.executable, "-m", "plugins.local.supervisor", str(home)], capture_output=True,
                          text=True, timeout=60)
    state = json.loads((home / "supervisor.json").read_text())
    started = state["components"]["a"]["pid"]
    try:
        assert proc.returncode != 0 and "missing" in proc.stderr
        assert started and not group_alive(started) and state["components"]["a"]["status"] == "stopped"
    finally:
        if started and group_alive(started):
            os.killpg(started, signal.SIGKILL)


# A stand-in for `airflow backfill create` over SQLite: like Airflow, it commits the backfill's row
# before writing the runs, and the first `locked` calls then fail with "database is locked".
FAKE_AIRFLOW = '''
import json, sys
path = sys.argv[1]
db = json.load(open(path))
if any(b["completed_at"] is None for b in db["backfills"]):
    sys.exit("AlreadyRunningBackfill: Another backfill is running for Dag d.")
db["backfills"].append({"id": len(db["backfills"]) + 1, "completed_at": None})
db["calls"] += 1
json.dump(db, open(path, "w"))
if db["calls"] <= db["locked"]:
    sys.exit("sqlite3.OperationalError: database is locked")
'''


class FakeBackfillApi:
    def __init__(self, path):
        self.path = path

    def request(self, method, path, body=None):
        import json

        db = json.loads(self.path.read_text())
        if method == "GET":
            return {"backfills": db["backfills"]}
        assert method == "PUT" and path.endswith("/cancel"), (method, path)
        ident = int(path.split("/")[-2])
        for b in db["backfills"]:
            if b["id"] == ident:
                b["completed_at"] = "now"
        self.path.write_text(json.dumps(db))
        return {}


def test_each_backfill_attempt_that_sqlite_refused_is_cancelled_before_the_next_with_the_scheduler_held(
        deployment, tmp_path):
    import json
    import sys

    af = deployment
    (tmp_path / "fake_airflow.py").write_text(FAKE_AIRFLOW)
    db = tmp_path / "db.json"
    db.write_text(json.dumps({"backfills": [], "calls": 0, "locked": 3}))
    af._airflow = lambda: [sys.executable, str(tmp_path / "fake_airflow.py"), str(db)]
    held = []
    stop = af._stop
    af._stop = lambda name: (stop(name), held.append(af.running()[name]))

    af._backfill_cli(["backfill", "create"], "d", FakeBackfillApi(db))
    backfills = json.loads(db.read_text())["backfills"]
    # three refused attempts, each cancelled; the fourth is the one left running
    assert [b["completed_at"] for b in backfills] == ["now", "now", "now", None]
    assert held == [False]  # the scheduler was held once, for the retries
    assert af.running()["scheduler"]  # and runs again

    db.write_text(json.dumps({"backfills": [], "calls": 0, "locked": 9}))
    with pytest.raises(Exception, match="database is locked"):
        af._backfill_cli(["backfill", "create"], "d", FakeBackfillApi(db), attempts=2)
    assert af.running()["scheduler"]
