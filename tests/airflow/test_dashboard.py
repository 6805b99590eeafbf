"""The dashboard app enforces Airflow authentication itself and reports the run directory's state."""

import pytest
from fastapi.testclient import TestClient

from pipeline.rundir import RunDir
from plugins.dashboard.app import create_app, get_locator

DAG_ID, RUN_ID = "rlhf_train", "manual__2026-01-01T00:00:00+00:00"
STATUS = f"/api/dags/{DAG_ID}/runs/{RUN_ID}/status"
PAGE = f"/dags/{DAG_ID}/runs/{RUN_ID}"


@pytest.fixture(scope="module")
def auth_manager():
    """SimpleAuthManager over a migrated metadata DB (token checks look up revoked tokens)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from airflow.api_fastapi.app import init_auth_manager

    airflow = Path(sys.executable).with_name("airflow")
    subprocess.run([str(airflow), "db", "migrate"], check=True, capture_output=True, env=dict(os.environ), timeout=300)

    return init_auth_manager()


@pytest.fixture
def token(auth_manager):
    from airflow.api_fastapi.auth.managers.simple.user import SimpleAuthManagerUser

    return auth_manager.generate_jwt(SimpleAuthManagerUser(username="viewer", role="viewer"))


@pytest.fixture
def run(tmp_path):
    from pipeline.config import parse_config
    from pipeline.rundir import RunDir

    run = RunDir(f"file://{tmp_path}/runs/r1")
    run.create(parse_config({"trainer": {"steps": 4, "phases": 2, "replay_epochs": 1, "groups_per_step": 4},
                             "sampler": {"prompts_per_batch": 4}}))
    log = run.metrics("trainer")
    for step in (1, 2, 3):
        log.log({"step": step, "reward/mean": 0.1 * step, "perf/tokens_per_s": 1000.0})
    run.set_marker(RunDir.phase_done_marker(0), {"step": 2, "checkpoint": run.child_url("checkpoints", "step_2")})
    run.set_marker(RunDir.replay_gate_marker(0), {"eligible": 6})
    return run


@pytest.fixture
def client(run, auth_manager):
    app = create_app()
    app.dependency_overrides[get_locator] = lambda: (lambda d, r: run.url if (d, r) == (DAG_ID, RUN_ID) else None)
    return TestClient(app)


@pytest.mark.parametrize("path", [STATUS, PAGE])
def test_every_route_answers_401_without_a_token(client, path):
    assert client.get(path).status_code == 401


def test_a_forged_token_is_refused(client):
    assert client.get(STATUS, headers={"Authorization": "Bearer not-a-jwt"}).status_code in (401, 403)


def test_status_with_a_bearer_token_reports_phases_gates_and_curves(client, token, run):
    r = client.get(STATUS, headers={"Authorization": f"Bearer {token}"})
    assert r.status_code == 200
    s = r.json()
    assert s["run_url"] == run.url and s["dag_run_id"] == RUN_ID
    phases = [(p["kind"], p["index"], p["done"]) for p in s["phases"]]
    assert phases == [("phase", 0, True), ("phase", 1, False), ("replay_gate", 0, True)]
    assert s["curves"]["trainer"]["reward/mean"] == [[1, 0.1], [2, 0.2], [3, pytest.approx(0.3)]]
    assert s["config"]["phases"] == 2 and s["trainer_done"] is False


def test_the_ui_session_cookie_is_accepted(client, token):
    client.cookies.set("_token", token)
    r = client.get(PAGE)
    assert r.status_code == 200
    assert "text/html" in r.headers["content-type"]
    assert f"/api/dags/{DAG_ID}/runs/" in r.text and "<svg" in r.text


def test_an_unknown_run_is_404_not_a_guess_at_a_path(client, token):
    r = client.get(f"/api/dags/{DAG_ID}/runs/other/status", headers={"Authorization": f"Bearer {token}"})
    assert r.status_code == 404


def test_run_ids_are_escaped_in_the_page():
    from plugins.dashboard.page import render_page

    html = render_page("d", "<script>alert(1)</script>", "/rlhf/api/x</script>")
    assert "<script>alert(1)" not in html
    assert "x\\u003c/script>" in html
    # a placeholder inside the run id is not filled in again after the escaped id went in
    rid = "__STATUS_URL__<img src=x onerror=alert(1)>"
    html = render_page("d", rid, f"/rlhf/api/dags/d/runs/{rid}/status")
    assert "<img" not in html and html.count("__STATUS_URL__") == 3  # <title>, <h1>, the JS string


def test_status_carries_the_chart_data_of_the_page(client, token, run):
    log = run.metrics("trainer")
    log.log({"step": 4, "reward/mean": 0.5, "staleness/mean": 1.0, "staleness/hist": {"0": 3, "1": 5},
             "time/start": 10.0, "time/end": 11.0})
    log.flush()
    s = client.get(STATUS, headers={"Authorization": f"Bearer {token}"}).json()
    charts = s["charts"]
    trainer = charts["streams"]["trainer"]
    assert trainer["x"] == [1, 2, 3, 4] and len(trainer["t"]) == 4
    assert trainer["reward/mean"] == [pytest.approx(v) for v in (0.1, 0.2, 0.3, 0.5)]
    assert charts["staleness_hist"] == {"0": 3, "1": 5}
    assert [(e["kind"], e["index"], e["step"]) for e in charts["events"]] == [("phase", 0, 2), ("replay_gate", 0, 3)]  # the gate opened after step 3
    assert charts["versions"]["stored"] == len(s["policy"]["versions"])
    assert "state" in s  # the DAG run's state (None: this run is not in the metadata database)


def test_a_status_poll_reads_each_metrics_stream_once(run, monkeypatch):
    from collections import Counter

    from pipeline.metrics import StreamReader
    from plugins.hooks.run_dir import RunDirHook

    sampler = run.metrics("sampler-0")
    sampler.log({"sampler/batch": 1, "sampler/gen_tokens": 80, "time/start": 1.0, "time/end": 2.0})
    sampler.flush()
    reads, read = Counter(), StreamReader.read
    monkeypatch.setattr(StreamReader, "read", lambda self: reads.update([self.stream]) or read(self))
    status = RunDirHook(run.url).status()
    assert reads == {"trainer": 1, "sampler-0": 1}
    assert status["curves"]["trainer"]["reward/mean"][-1] == [3, pytest.approx(0.3)]
    assert status["charts"]["streams"]["sampler-0"]["x"] == [1]


def test_later_polls_parse_only_the_new_records_and_a_remade_run_is_read_from_its_start(run, monkeypatch):
    import shutil

    from pipeline import metrics
    from pipeline.config import parse_config
    from plugins.hooks.run_dir import RunDirHook

    run.write_json("prepare.json", {"created": 1.0})
    parsed, parse = [], metrics._parse
    monkeypatch.setattr(metrics, "_parse", lambda raw, out: parsed.append(raw.count(b"\n")) or parse(raw, out))

    def poll():
        parsed.clear()
        status = RunDirHook(run.url).status()  # a hook per poll, as the dashboard's requests make
        return [p[0] for p in status["curves"]["trainer"]["reward/mean"]]

    assert poll() == [1, 2, 3] and sum(parsed) == 3
    log = run.metrics("trainer")
    log.log({"step": 4, "reward/mean": 0.4})
    log.flush()
    assert poll() == [1, 2, 3, 4] and sum(parsed) == 1  # the one record logged since
    stats = RunDirHook(run.url).status()["buffer"]
    assert stats == RunDirHook(run.url).buffer_stats()  # the kept buffer follows its log like a new one

    shutil.rmtree(run.fs._strip_protocol(run.url))  # the run is deleted and made again at the same URL
    run.create(parse_config({"trainer": {"steps": 4}}))
    run.write_json("prepare.json", {"created": 2.0})
    log = run.metrics("trainer")
    log.log({"step": 1, "reward/mean": 0.5})
    log.flush()
    assert poll() == [1]


def test_long_streams_are_averaged_into_at_most_max_points():
    from plugins.dashboard.series import ranges, table

    records = [{"time": float(i), "step": i, "reward/mean": float(i % 2)} for i in range(1, 2001)]
    t = table(records, "step", ("reward/mean", "actor/kl"), limit=500)
    assert len(t["x"]) == 500 and t["x"][-1] == 2000 and "actor/kl" not in t
    assert set(t["reward/mean"]) == {0.5}  # buckets of 4 consecutive steps, averaged
    assert ranges([0, 398, 399, 400, 7]) == "v0, v7, v398-v400"


def test_buffer_history_replays_the_commit_log(tmp_path):
    from types import SimpleNamespace as NS

    from plugins.dashboard.series import BufferHistory

    entries = {1: NS(time=1.0, actions=(NS(op="add", path="a", tier="l1", rows=10),)),
               2: NS(time=2.0, actions=(NS(op="add", path="b", tier="l3", rows=10), NS(op="remove", path="a")))}
    log = NS(entry_versions=lambda: [1, 2], read_entry=entries.get, checkpoint_versions=lambda: [])
    h = BufferHistory()
    h.update(log)
    entries[3] = NS(time=3.0, actions=(NS(op="add", path="c", tier="l2", rows=4),))
    h.update(log)  # reads only the new entry
    assert h.series() == {"t": [1.0, 2.0, 3.0], "l1": [10, 0, 0], "l2": [0, 0, 4], "l3": [0, 10, 10]}


def test_buffer_history_after_a_vacuum_starts_from_the_checkpoint_and_keeps_its_size(tmp_path):
    """Entries before a checkpoint are vacuumed: the chart counted from zero at the first entry
    left, and ignored removals of shards it never saw added."""
    import sys
    from pathlib import Path

    from pipeline.buffer import ReplayBuffer
    from pipeline.buffer.logfiles import LOG_DIR, entry_name
    from pipeline.config import BufferConfig
    from plugins.dashboard.series import BufferHistory

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "buffer"))
    from rollout_factory import make_groups

    buf = ReplayBuffer(str(tmp_path / "buffer"), BufferConfig(checkpoint_interval=3))
    with buf.writer("s") as w:
        for i in range(5):
            w.write(make_groups(f"s{i}", 2))
    buf.refresh()
    buf.log.write_checkpoint()
    checkpoint = buf.state.version
    for v in range(1, checkpoint + 1):  # as vacuum does past the log retention
        (tmp_path / "buffer" / LOG_DIR / entry_name(v)).unlink(missing_ok=True)
    with buf.writer("s") as w:
        w.write(make_groups("s5", 2))
    h = BufferHistory()
    h.update(ReplayBuffer(str(tmp_path / "buffer")).log)
    assert h.series()["l1"][-1] == ReplayBuffer(str(tmp_path / "buffer")).stats()["tiers"]["l1"]["rows"]
    buf.compact(everything=True)  # removes L1 shards added before the entries left
    h.update(ReplayBuffer(str(tmp_path / "buffer")).log)
    stats = ReplayBuffer(str(tmp_path / "buffer")).stats()["tiers"]
    assert h.series()["l1"][-1] == stats["l1"]["rows"] == 0
    assert h.series()["l3"][-1] == stats["l3"]["rows"] > 0
    BufferHistory.MAX_KEPT, kept = 10, BufferHistory.MAX_KEPT
    try:
        h.points = [[float(i), 0, 0, 0] for i in range(11)]
        h.update(ReplayBuffer(str(tmp_path / "buffer")).log)
        assert len(h.points) <= 10 and h.points[-1][0] == 10.0
    finally:
        BufferHistory.MAX_KEPT = kept
