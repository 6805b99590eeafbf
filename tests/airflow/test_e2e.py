"""End to end with real Airflow components: api-server, scheduler, dag-processor and triggerer on
127.0.0.1, LocalExecutor, the real engine. (`airflow dags test` would deadlock sampler and trainer.)

One deployment serves the whole module; the runs are tiny (the built-in sort task, a dozen steps).
"""

import json
import os
import shutil
import signal
import tempfile
import time
from datetime import date, timedelta
from pathlib import Path

import pytest

from pipeline.rendezvous import free_port
from plugins.local.client import AirflowClient
from plugins.local.deployment import LocalAirflow

pytestmark = [pytest.mark.integration, pytest.mark.timeout(2400)]

STEPS, PHASES, REPLAY_EPOCHS, GROUPS_PER_STEP = 24, 2, 1, 16
TRAIN_CONF = {"config_file": "tiny-grpo.yaml", "steps": STEPS, "phases": PHASES, "replay_epochs": REPLAY_EPOCHS,
              "overrides": {"data.eval_size": 32, "trainer.groups_per_step": GROUPS_PER_STEP}}
RETRAIN_CONF = {"config_file": "tiny-grpo.yaml", "steps": 4, "phases": 2, "replay_epochs": 0,
                "overrides": {"data.eval_size": 16}}
RUN_TIMEOUT_S = 600  # the run takes 2-4 minutes here; a stuck one fails with the states seen


def engine_pids(role: str, run_url: str) -> list[int]:
    """Processes running `python -m pipeline <role> --run-dir <run_url>`."""
    want = ["-m", "pipeline", role, "--run-dir", run_url]
    pids = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv = cmdline.read_bytes().decode().split("\0")[:-1]
        except OSError:
            continue
        if any(argv[i:i + len(want)] == want for i in range(len(argv) - len(want) + 1)):
            pids.append(int(cmdline.parent.name))
    return pids


@pytest.fixture(scope="module")
def deployment():
    from pipeline.data import write_rows
    from pipeline.example import ensure_example
    from pipeline.builtin_tasks import make_rows

    # Not under pytest's basetemp: pytest removes old basetemps of *other* sessions on this machine,
    # which would delete the metadata DB of a deployment that outlives them.
    tmp = Path(tempfile.mkdtemp(prefix="rlhf-airflow-e2e-"))
    cache = Path(tempfile.gettempdir()) / "rlhf-airflow-e2e-cache"
    previous_cache = os.environ.get("RLHF_CACHE")
    os.environ["RLHF_CACHE"] = str(cache)
    ensure_example("sort", 0)  # build the tiny model once, before the components compete for the cores

    def write_prompts(days: list[str]) -> None:
        for i, day in enumerate(days):
            rows = make_rows("sort", 64, seed=100 + i, split="train")
            write_rows(rows, str(tmp / "prompts" / f"ds={day}" / "part-0.parquet"))

    af = LocalAirflow(home=tmp / "airflow", port=free_port(), runs_root=str(tmp / "runs"),
                      extra_env={"RLHF_PROMPTS_ROOT": str(tmp / "prompts"),
                                 "RLHF_NOTIFIER": f"file:{tmp / 'alerts.jsonl'}"})
    client = af.up(wait_s=300)
    try:
        for dag_id in ("rlhf_train", "rlhf_retrain"):
            client.wait_for_dag(dag_id, timeout_s=180)
        client.unpause("rlhf_train")  # rlhf_retrain: by its own test, which watches what unpausing does
        yield {"af": af, "client": client, "tmp": tmp, "write_prompts": write_prompts, "alerts": tmp / "alerts.jsonl"}
    finally:
        af.down()
        if previous_cache is None:
            os.environ.pop("RLHF_CACHE", None)
        else:
            os.environ["RLHF_CACHE"] = previous_cache
        if not os.environ.get("RLHF_KEEP_E2E"):
            shutil.rmtree(tmp, ignore_errors=True)


def tis_by_id(client: AirflowClient, dag_id: str, run_id: str) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for ti in client.task_instances(dag_id, run_id):
        out.setdefault(ti["task_id"], []).append(ti)
    return out


def test_a_bad_parameter_is_refused_with_400_and_no_run(deployment):
    client = deployment["client"]
    before = len(client.dag_runs("rlhf_train"))
    for bad in ({"steps": 0}, {"sampler_backend": "tgi"}, {"run_name": "../../etc"}):
        for _ in range(3):
            code, body = client.call("POST", "/api/v2/dags/rlhf_train/dagRuns", {"logical_date": None, "conf": bad})
            # SQLite, with the scheduler and dag-processor writing too, now and then fails the
            # request's transaction ("Database error", HTTP 500, rolled back): ask again
            if not (code == 500 and isinstance(body, dict) and body.get("detail", {}).get("reason") == "Database error"):
                break
            time.sleep(2)
        assert code == 400, (bad, body)
    assert len(client.dag_runs("rlhf_train")) == before


@pytest.fixture(scope="module")
def train_run(deployment):
    """Trigger rlhf_train over REST; SIGKILL the trainer's process once phase 0 is checkpointed."""
    client = deployment["client"]
    run_id = client.trigger("rlhf_train", TRAIN_CONF)["dag_run_id"]
    deadline = time.monotonic() + RUN_TIMEOUT_S
    run_url, killed = None, None
    while time.monotonic() < deadline:
        state = client.dag_run("rlhf_train", run_id)["state"]
        if state in ("success", "failed"):
            break
        if run_url is None:
            code, body = client.call("GET", f"/api/v2/dags/rlhf_train/dagRuns/{run_id}/taskInstances/prepare/xcomEntries/run_url")
            run_url = body["value"] if code == 200 else None
        if run_url and killed is None:
            from pipeline.rundir import RunDir

            run = RunDir(run_url)
            if run.has_marker("trainer_done"):
                pytest.fail("the trainer finished before it could be killed; raise STEPS")
            pids = engine_pids("trainer", run_url)
            if run.has_marker("phase_0.done") and pids:
                os.kill(pids[0], signal.SIGKILL)
                killed = {"pid": pids[0], "after_step": (run.marker("phase_0.done") or {}).get("step")}
        time.sleep(0.3)
    final = client.wait_for_run("rlhf_train", run_id, timeout_s=max(deadline - time.monotonic(), 1))
    return {"run_id": run_id, "state": final["state"], "run_url": run_url, "killed": killed,
            "tis": tis_by_id(client, "rlhf_train", run_id)}


def test_triggered_run_succeeds_with_every_phase_and_gate_task(train_run):
    tis = train_run["tis"]
    assert train_run["state"] == "success", {k: [t["state"] for t in v] for k, v in tis.items()}
    for task_id in ("prepare", "sampler", "trainer", "finalize", "stop_sampler"):
        assert [t["state"] for t in tis[task_id]] == ["success"], task_id
    assert sorted(t["map_index"] for t in tis["phase.wait_checkpoint"]) == list(range(PHASES))
    assert sorted(t["map_index"] for t in tis["phase.reshard"]) == list(range(PHASES))
    assert sorted(t["map_index"] for t in tis["replay_gate"]) == list(range(REPLAY_EPOCHS))
    for task_id in ("phase.wait_checkpoint", "phase.reshard", "replay_gate"):
        assert {t["state"] for t in tis[task_id]} == {"success"}, task_id
    assert [t["state"] for t in tis["watcher"]] == ["skipped"]


def test_sampler_and_trainer_ran_at_the_same_time(train_run):
    from datetime import datetime

    def span(task_id):
        ti = train_run["tis"][task_id][0]
        return datetime.fromisoformat(ti["start_date"]), datetime.fromisoformat(ti["end_date"])

    (s0, s1), (t0, t1) = span("sampler"), span("trainer")
    assert max(s0, t0) < min(s1, t1)


def test_each_phase_published_a_policy_that_verifies(train_run):
    from pipeline.policy import PolicyStore
    from pipeline.rundir import RunDir

    run = RunDir(train_run["run_url"])
    store = PolicyStore(run)
    for k in range(PHASES):
        marker = run.marker(f"phase_{k}.done")
        assert store.exists(int(marker["step"]))
        store.verify(int(marker["step"]))
    assert store.latest() == STEPS
    assert run.read_json("summary.json") is not None


def test_killed_trainer_resumed_on_retry_without_training_a_rollout_twice(train_run):
    from pipeline.buffer import ReplayBuffer
    from pipeline.rundir import RunDir

    assert train_run["killed"] is not None, "the trainer process was never seen"
    assert train_run["tis"]["trainer"][0]["try_number"] >= 2
    run = RunDir(train_run["run_url"])
    consumed = ReplayBuffer(run.buffer_url, run.config().buffer).stats()["consumed"]["trainer"]
    assert consumed["groups"] == STEPS * GROUPS_PER_STEP  # each fresh group trained once: none twice, none skipped
    records = run.read_metrics("trainer")
    resumed = [r["resumed_step"] for r in records if "resumed_step" in r]
    assert resumed and resumed[-1] >= train_run["killed"]["after_step"]  # from a checkpoint, not from scratch
    assert max(r["step"] for r in records if "step" in r) == STEPS


def test_finalize_emitted_the_policy_asset_event(deployment, train_run):
    events = deployment["client"].request("GET", "/api/v2/assets/events?limit=100")["asset_events"]
    mine = [e for e in events if e.get("source_run_id") == train_run["run_id"]]
    assert len(mine) == 1
    assert mine[0]["extra"]["run_url"] == train_run["run_url"] and mine[0]["extra"]["version"] == STEPS


def test_dashboard_requires_a_token_and_reports_the_run(deployment, train_run):
    client = deployment["client"]
    path = f"/rlhf/api/dags/rlhf_train/runs/{train_run['run_id']}/status"
    assert client.call("GET", path, authenticated=False)[0] == 401
    code, status = client.call("GET", path)
    assert code == 200
    assert status["run_url"] == train_run["run_url"] and status["trainer_done"] is True
    assert all(p["done"] for p in status["phases"])
    assert status["curves"]["trainer"]["reward/mean"]
    page = f"/rlhf/dags/rlhf_train/runs/{train_run['run_id']}"
    assert client.call("GET", page, authenticated=False)[0] == 401


CHARTS = ("reward", "heldout", "kl", "clip", "is", "staleness_hist", "staleness", "throughput", "overlap", "buffer",
          "versions", "loss")
READ_CHARTS = ("(() => { const c = [...document.querySelectorAll('svg[data-chart]')];"
               " return c.length && JSON.stringify(Object.fromEntries(c.map(s => [s.dataset.chart, +s.dataset.points]))); })()")


def test_dashboard_draws_every_chart_with_data_in_a_real_browser(deployment, train_run):
    """Headless Chromium (DevTools protocol): log in through Airflow's token endpoint like the UI
    does, open the finished run's dashboard, read back how many points each SVG chart drew, on
    both x axes, and save a screenshot."""
    from urllib.parse import quote

    from devtools import Browser, chromium_path

    exe = chromium_path()
    assert exe, "chromium is missing: `make test` installs it (apt-get install chromium)"
    af = deployment["af"]
    user, password = af.credentials()
    artifacts = Path(os.environ.get("RLHF_TEST_ARTIFACTS") or Path(tempfile.gettempdir()) / "rlhf-test-artifacts")
    artifacts.mkdir(parents=True, exist_ok=True)
    url = f"{af.base_url}/rlhf/dags/rlhf_train/runs/{quote(train_run['run_id'], safe='')}"
    with Browser(exe) as browser:
        browser.goto(f"{af.base_url}/auth/login")
        login = json.dumps({"username": user, "password": password})
        assert browser.evaluate(
            "fetch('/auth/token', {method: 'POST', headers: {'Content-Type': 'application/json'}, body: " + json.dumps(login)
            + "}).then(r => r.json()).then(j => { document.cookie = '_token=' + j.access_token + '; path=/'; return !!j.access_token; })")
        browser.errors.clear()  # what counts is the dashboard's console
        browser.goto(url)
        counts = json.loads(browser.wait_for(READ_CHARTS, timeout_s=60))
        assert browser.evaluate("document.getElementById('state').textContent") == "success"
        assert browser.evaluate("document.getElementById('err').textContent") == ""
        shot = browser.screenshot(artifacts / "dashboard-step.png")
        print(f"\ndashboard screenshot: {shot}")
        assert set(counts) == set(CHARTS), counts
        empty = [name for name, n in counts.items() if n == 0]
        assert not empty, counts
        assert counts["reward"] >= STEPS and counts["heldout"] == 2 and counts["staleness_hist"] >= 1, counts
        browser.evaluate("(() => { const a = document.getElementById('axis'); a.value = 'time';"
                         " a.dispatchEvent(new Event('change')); })()")
        by_time = json.loads(browser.evaluate(READ_CHARTS))
        assert all(by_time[name] > 0 for name in CHARTS), by_time
        browser.screenshot(artifacts / "dashboard-time.png")
        assert browser.errors == []


def test_a_scheduler_that_dies_is_restarted_and_status_counts_it(deployment):
    """The deployment's supervisor brings a dead component back (an upstream scheduler bug once
    killed it on a backfill/schedule race) and `rlhf airflow status` reports the restart."""
    af, client = deployment["af"], deployment["client"]
    before = af.status()["components"]["scheduler"]
    os.killpg(before["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 120
    while True:
        now = af.status()
        scheduler = now["components"]["scheduler"]
        health = (now.get("health") or {}).get("scheduler") or {}
        if scheduler["alive"] and scheduler["pid"] != before["pid"] and health.get("status") == "healthy":
            break
        assert time.monotonic() < deadline, now
        time.sleep(2)
    assert scheduler["restarts"] == before["restarts"] + 1 and scheduler["last_exit"] == -signal.SIGKILL


def wait_for_runs(client: AirflowClient, dag_id: str, runs: list[dict], timeout_s: float, want=("success", "failed")) -> list[dict]:
    """The runs again once each is in a state of `want`; fails with the states seen at the deadline."""
    ids = [r["dag_run_id"] for r in runs]
    deadline = time.monotonic() + timeout_s
    while True:
        now = [client.dag_run(dag_id, run_id) for run_id in ids]
        if all(r["state"] in want for r in now):
            return now
        assert time.monotonic() < deadline, {r["dag_run_id"]: r["state"] for r in now}
        time.sleep(3)


def scheduled_run(client: AirflowClient, dag_id: str, timeout_s: float = 180) -> dict:
    deadline = time.monotonic() + timeout_s
    while not (runs := [r for r in client.dag_runs(dag_id) if r["run_type"] == "scheduled"]):
        assert time.monotonic() < deadline, [(r["dag_run_id"], r["run_type"], r["state"]) for r in client.dag_runs(dag_id)]
        time.sleep(2)
    return runs[0]


def test_backfill_reruns_a_date_that_already_ran_and_gives_each_date_its_own_run_directory(deployment):
    """Unpausing rlhf_retrain (@weekly, catchup=False) makes the scheduler run the latest interval
    at once; its prompts are not there yet, so that run fails. A backfill over that date and the
    week before must then give both dates a run (reprocess "completed"). The dates are the
    scheduler's, not the calendar's, so the test reasons the same way on every day of the week."""
    af, client = deployment["af"], deployment["client"]
    client.unpause("rlhf_retrain")
    first = scheduled_run(client, "rlhf_retrain")
    assert wait_for_runs(client, "rlhf_retrain", [first], timeout_s=300)[0]["state"] == "failed"
    latest = date.fromisoformat(first["logical_date"][:10])
    days = [(latest - timedelta(weeks=1)).isoformat(), latest.isoformat()]
    deployment["write_prompts"](days)

    deployment["failed_retrain_run"] = first["dag_run_id"]
    runs = af.backfill("rlhf_retrain", days[0], days[1], conf=RETRAIN_CONF, max_active_runs=1)
    assert [r["logical_date"][:10] for r in runs] == days  # every date named has its run, at once
    assert first["dag_run_id"] in [r["dag_run_id"] for r in runs]  # the date that ran is run again
    runs = wait_for_runs(client, "rlhf_retrain", runs, timeout_s=900)
    assert [r["state"] for r in runs] == ["success", "success"], runs
    runs_root = deployment["tmp"] / "runs"
    made = sorted(p.name for p in runs_root.iterdir() if p.name.startswith("rlhf_retrain-"))
    assert made == [f"rlhf_retrain-{day}" for day in days]
    for name in made:
        assert (runs_root / name / "summary.json").exists()
    registry = json.loads((runs_root / "registry" / "rlhf_retrain.json").read_text())["runs"]
    assert sorted(registry) == days
    assert registry[days[0]]["started_from"] is None
    assert registry[days[1]]["started_from"] == registry[days[0]]["policy_url"]  # from the last published policy


def test_each_failed_run_sent_exactly_one_alert(deployment):
    """The DAG's failure callback (run by the dag-processor) sent one `run_failed` alert for the
    scheduled retrain run that failed, none for its successful rerun nor for the training run
    whose trainer was killed and retried."""
    failed_run = deployment.get("failed_retrain_run")
    assert failed_run, "runs after the backfill test"
    path = deployment["alerts"]
    deadline = time.monotonic() + 60
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(1)
    alerts = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    assert [(a["event"], a["dag_id"], a["run_id"]) for a in alerts] == [("run_failed", "rlhf_retrain", failed_run)], alerts
    from urllib.parse import quote

    assert alerts[0]["dashboard"].endswith(f"/rlhf/dags/rlhf_retrain/runs/{quote(failed_run, safe='')}"), alerts[0]


GANG_CONF = {"config_file": "tiny-grpo.yaml", "steps": 4, "phases": 1, "replay_epochs": 0,
             "overrides": {"data.eval_size": 16, "sampler.replicas": 3}}
# the second run's trainer is two nodes: the `trainer` task and one mapped `trainer_node` task
GANG_CONFS = [GANG_CONF, {**GANG_CONF, "trainer_nodes": 2}]


def test_two_runs_on_a_pool_too_small_for_both_run_one_after_the_other(deployment):
    """Gang scheduling: with one device slot, each run's trainer holds it for the run and its three
    samplers start only once that trainer runs, so one run waits and both finish (two samplers
    holding the slots for trainers that never start would wait until the 12 h timeout)."""
    from pipeline.devices import DEVICE_POOL
    from pipeline.rundir import RunDir

    client = deployment["client"]
    def set_slots(n: int):  # deferred tasks hold no slot (include_deferred false): the samplers wait so
        return client.call("PATCH", f"/api/v2/pools/{DEVICE_POOL}",
                           {"pool": DEVICE_POOL, "slots": n, "include_deferred": False})

    code, body = set_slots(1)
    assert code == 200, body
    try:
        run_ids = [client.trigger("rlhf_train", conf)["dag_run_id"] for conf in GANG_CONFS]
        finals = [client.wait_for_run("rlhf_train", r, timeout_s=RUN_TIMEOUT_S) for r in run_ids]
    finally:
        set_slots(deployment["af"].pool_slots)
    tis = [tis_by_id(client, "rlhf_train", r) for r in run_ids]
    assert [f["state"] for f in finals] == ["success", "success"], [{k: [t["state"] for t in v] for k, v in t.items()}
                                                                   for t in tis]
    from datetime import datetime

    spans = sorted((datetime.fromisoformat(t["trainer"][0]["start_date"]),
                    datetime.fromisoformat(t["trainer"][0]["end_date"])) for t in tis)
    assert spans[0][1] <= spans[1][0]  # the second trainer waited for the slot the first one held
    for run_id, t in zip(run_ids, tis):
        assert sorted(s["map_index"] for s in t["sampler"]) == [0, 1, 2]
        run = RunDir(client.xcom("rlhf_train", run_id, "prepare", "run_url"))
        started = run.marker(RunDir.trainer_started_marker(0))["time"]
        draws = {}
        for sid in ("sampler-0", "sampler-1", "sampler-2"):
            records = run.read_metrics(sid)
            first = min(r["time"] for r in records if r.get("event") == "start")
            assert first >= started  # no sampler held a device before its run's trainer held the slot
            draws[sid] = [r["sampler/draw"] for r in records if "sampler/draw" in r]
        every = [d for ds in draws.values() for d in ds]
        assert len(every) == len(set(every))  # the three replicas never generated the same prompt draw
        # How many batches each replica makes depends on when the executor starts its task; how
        # replicas share the work, a slow one among them, is tests/integration/test_scale_out_runs.py's.
        bound = run.config().sampler.max_staleness
        assert max(r["staleness/max"] for r in run.read_metrics("trainer") if "step" in r) <= bound
    nodes = [r["world_size"] for t, r_id in zip(tis, run_ids) for r in
             RunDir(client.xcom("rlhf_train", r_id, "prepare", "run_url")).read_metrics("trainer")
             if r.get("event") == "start"]
    assert nodes == [1, 2]  # the 2-node trainer's tasks met in one rendezvous: one world of two ranks
    assert [(t["map_index"], t["state"]) for t in tis[1]["trainer_node"]] == [(0, "success")]
