"""The local runner: sampler and trainer as two real OS processes exchanging data through files."""

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from pipeline.buffer import ReplayBuffer
from pipeline.policy import PolicyStore
from pipeline.rundir import RunDir

pytestmark = pytest.mark.integration


def _rlhf(spawn, *args, timeout=300):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return spawn.run([sys.executable, "-m", "pipeline", *args], capture_output=True, text=True, timeout=timeout,
                     env=env)


def archived_groups_in_commit_order(buffer, only: set[str]) -> list[list[float]]:
    """The rewards of each archived group among `only` (group ids), groups in the order the sampler
    committed them: L3 files keep the rows of a sampler shard in order, and a batch's rows share its
    creation time."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipeline.storage import url_to_fs

    fs, _ = url_to_fs(buffer.url)
    tables = []
    for url in buffer.archive_files():
        with fs.open(url_to_fs(url)[1], "rb") as f:
            tables.append(pq.read_table(f, columns=["group_id", "reward", "created_at"]))
    rows = [r for r in pa.concat_tables(tables).to_pylist() if r["group_id"] in only]
    order = sorted(range(len(rows)), key=lambda i: (rows[i]["created_at"], i))
    groups: dict[str, list[float]] = {}
    for i in order:
        groups.setdefault(rows[i]["group_id"], []).append(rows[i]["reward"])
    return list(groups.values())


def pq_read(url: str) -> dict:
    import pyarrow.parquet as pq

    from pipeline.storage import url_to_fs

    fs, path = url_to_fs(url)
    with fs.open(path, "rb") as f:
        return pq.read_table(f, columns=["prompt_id", "group_id", "created_at"]).to_pydict()


def test_two_processes_exchange_rollouts_and_policies(tmp_path, spawn):
    """With sampler.oversample: each batch generates 12 prompts' groups, hands over the 8 whose
    rewards vary most and archives the other 4."""
    run_dir = tmp_path / "runs" / "it-local"
    p = _rlhf(spawn, "run", "configs/tiny-test.yaml", "--run-dir", f"file://{run_dir}", "--no-progress",
              "--set", "trainer.steps=8", "--set", "sampler.oversample=1.5")
    assert p.returncode == 0, p.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    run = RunDir(str(run_dir))
    cfg = run.config()
    per_step = cfg.trainer.groups_per_step * cfg.sampler.group_size
    assert summary["steps"] == 8
    assert summary["samples_trained"] == 8 * per_step
    assert summary["samples_generated"] >= summary["samples_trained"]

    # Nothing the sampler generated was lost on the way: every row it handed over is committed and
    # finalize (the DAG's finalize step) archived all of L1 into L3, where the groups it did not
    # hand over went straight away, untrained.
    from pipeline.export import usage_counts

    buffer = ReplayBuffer(run.buffer_url)
    tiers = buffer.stats()["tiers"]
    left_out = summary["groups_dropped"] * cfg.sampler.group_size
    assert summary["groups_dropped"] > 0 and left_out == summary["samples_generated"] // 3
    assert tiers["l1"]["rows"] == 0 and tiers["l3"]["rows"] == summary["samples_generated"]
    assert summary["compaction"]["l1_shards_in"] > 0
    batches: dict = {}  # a batch's rows share their creation time, those it archived too
    for t in (pq_read(f) for f in buffer.archive_files()):
        for pid, gid, when in zip(t["prompt_id"], t["group_id"], t["created_at"]):
            batches.setdefault(when, {})[gid] = pid
    batches = [batches[when] for when in sorted(batches)]
    uses = usage_counts(run)  # the groups trained on: the first the sampler handed over, 8 per batch
    trained = [sum(g in uses for g in b) for b in batches]
    assert all(len(b) == 12 for b in batches) and set(uses) <= {g for b in batches for g in b}
    assert sum(trained) == 8 * cfg.trainer.groups_per_step and all(u == [1, 0] for u in uses.values())
    assert trained == sorted(trained, reverse=True) and max(trained) == 8
    assert summary["final_policy"]["version"] == 8 and summary["final_policy"]["verified"] is True

    # The trainer consumed exactly the sampler's rows, in commit order: each step's logged mean
    # reward is the mean reward of the next `groups_per_step` committed groups.
    trainer = [r for r in run.read_metrics("trainer") if "step" in r]
    groups = archived_groups_in_commit_order(buffer, set(uses))
    for i, rec in enumerate(trainer):
        rewards = [x for g in groups[i * cfg.trainer.groups_per_step:(i + 1) * cfg.trainer.groups_per_step] for x in g]
        assert len(rewards) == per_step
        assert rec["reward/mean"] == pytest.approx(sum(rewards) / len(rewards), abs=1e-6)
        assert rec["staleness/max"] <= cfg.sampler.max_staleness

    # Each batch drew the next 12 prompts of the run's stream and handed over 8 of their groups.
    from pipeline.data import read_prompts
    from pipeline.sampler.loop import PromptStream

    sampler = [r for r in run.read_metrics("sampler-0") if "sampler/batch" in r]
    assert cfg.sampler.prompts_drawn == 12 and all(r["sampler/groups_dropped"] == 4 for r in sampler)
    stream = PromptStream(read_prompts(run.child_url("data", "train.parquet")), cfg.seed)
    draws = []
    for d in sorted(r["sampler/draw"] for r in sampler):
        stream.position = d * 12
        draws.append({p.prompt_id for p in stream.take(12)})
    # batch k's groups, 8 handed over and 4 archived: the 12 prompts of draw k
    assert [set(b.values()) for b in batches] == draws

    # The sampler picked up new policy versions without restarting.
    assert any(r["sampler/policy_version"] >= 1 for r in sampler)
    assert any("timing_s/reload" in r for r in sampler)
    assert PolicyStore(run).latest() == 8
    assert summary["policy_versions"] == 8
    for key in ("eval_before", "eval_after", "reward_first", "reward_last", "generated_tokens", "trained_tokens",
                "wall_s", "sampler_busy_s", "trainer_busy_s", "overlap_s", "max_staleness_seen"):
        assert key in summary


@pytest.mark.parametrize("args,needle", [
    (["--set", "trainer.stepz=3"], "unknown config key 'trainer.stepz'"),
    (["--set", "trainer.lr=fast"], "trainer.lr"),
    (["--set", "reward.fn=nope"], "reward.fn: unknown reward 'nope'"),
    (["--set", "run_id=../../etc"], "run_id"),
    (["--set", "data.train=/nonexistent/train.parquet"], "data.train"),
])
def test_bad_input_fails_fast_with_one_line(tmp_path, spawn, args, needle):
    p = _rlhf(spawn, "prepare", "configs/tiny-test.yaml", "--runs-root", str(tmp_path), *args, timeout=120)
    assert p.returncode == 2
    lines = [line for line in p.stderr.strip().splitlines() if line]
    assert len(lines) == 1 and needle in lines[0], p.stderr
    assert list(tmp_path.iterdir()) == []  # nothing created


def test_dataset_missing_column_fails_before_model_load(tmp_path, spawn):
    from pipeline.data import write_rows
    from pipeline.builtin_tasks import make_rows

    rows = make_rows("digit", 4, 0, "train")
    for r in rows:
        del r["data_source"]
    bad = tmp_path / "bad.parquet"
    write_rows(rows, str(bad))
    p = _rlhf(spawn, "prepare", "configs/tiny-test.yaml", "--runs-root", str(tmp_path / "runs"),
              "--set", f"data.train={bad}", timeout=120)
    assert p.returncode == 2 and "lacks column 'data_source'" in p.stderr
    assert not (tmp_path / "runs").exists()


def _start_long_run(spawn, run_dir, ignore=()):
    """`rlhf run` of 100k steps, returned once the trainer has taken a step: (runner, run, children)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = spawn([sys.executable, "-m", "pipeline", "run", "configs/tiny-test.yaml", "--run-dir", str(run_dir),
                  "--no-progress", "--set", "trainer.steps=100000"],
                 env=env, ignore=ignore, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run = None
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:  # wait until the trainer has taken steps
        if (run_dir / "metrics" / "trainer.jsonl").exists():
            run = RunDir(str(run_dir))
            if any("step" in r for r in run.read_metrics("trainer")):
                break
        time.sleep(0.5)
    assert run is not None and proc.poll() is None, "trainer never started"
    children = psutil.Process(proc.pid).children(recursive=True)
    assert len(children) >= 2
    return proc, run, children


def _assert_stopped_cleanly(proc, run, children, sig):
    """Runner, sampler and trainer are gone within seconds, through the stop marker, with every
    batch the sampler logged committed to the buffer."""
    _, err = proc.communicate(timeout=20)
    assert proc.returncode == 128 + sig, err[-2000:]
    assert err.count("stopped by ") == 1, err[-2000:]  # the runner; its children did not need SIGTERM
    assert run.marker("stop")["reason"] == f"interrupted by {signal.Signals(sig).name}"
    gone, alive = psutil.wait_procs(children, timeout=5)
    assert not alive
    logged = sum(r["sampler/samples"] for r in run.read_metrics("sampler-0") if "sampler/samples" in r)
    committed, _ = ReplayBuffer(run.buffer_url).read_fresh(None, 1_000_000)
    assert committed.num_rows == logged


def _ignored_signals(pid: int) -> set[int]:
    """The signals a process ignores, from /proc/<pid>/status (Linux)."""
    with open(f"/proc/{pid}/status") as f:
        mask = int(next(line for line in f if line.startswith("SigIgn:")).split()[1], 16)
    return {s for s in range(1, 65) if mask >> (s - 1) & 1}


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=lambda s: s.name)
def test_stop_signal_stops_runner_sampler_and_trainer_with_shards_committed(tmp_path, spawn, sig):
    proc, run, children = _start_long_run(spawn, tmp_path / "runs" / "it-stop")
    proc.send_signal(sig)
    _assert_stopped_cleanly(proc, run, children, sig)


def test_run_started_with_sigint_ignored_keeps_ignoring_it_and_stops_on_sigterm(tmp_path, spawn):
    """`cmd &` in a script starts `rlhf run` with SIGINT ignored: it honours that (SIGTERM stops
    it), and gives the sampler and trainer explicit dispositions instead of the inherited ignore."""
    proc, run, children = _start_long_run(spawn, tmp_path / "runs" / "it-nohup", ignore=(signal.SIGINT,))
    assert signal.SIGINT in _ignored_signals(proc.pid)
    for child in children:
        assert not _ignored_signals(child.pid) & {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}, child.cmdline()
    proc.send_signal(signal.SIGINT)  # reaches it first, and must change nothing
    proc.send_signal(signal.SIGTERM)
    _assert_stopped_cleanly(proc, run, children, signal.SIGTERM)


def test_a_sigkilled_runner_leaves_no_sampler_or_trainer_behind(tmp_path, spawn):
    proc, run, children = _start_long_run(spawn, tmp_path / "runs" / "it-kill")
    proc.kill()
    gone, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, [c.cmdline() for c in alive]


def test_rerunning_an_interrupted_run_resumes_it_to_the_end(tmp_path, spawn):
    """The runner's own stop (it was interrupted) does not end the run for good: the same command
    again resumes it; the trainer's metrics then hold each step once, also when it was killed
    before its first checkpoint."""
    run_dir = tmp_path / "runs" / "it-resume"
    args = ["run", "configs/tiny-test.yaml", "--run-dir", str(run_dir), "--no-progress", "--set", "trainer.steps=6",
            "--set", "trainer.checkpoint_every=0"]
    env = dict(os.environ, OMP_NUM_THREADS="1", RLHF_TRAINER_KILL_AFTER_STEP="3")
    first = spawn.run([sys.executable, "-m", "pipeline", *args], env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode != 0
    run = RunDir(str(run_dir))
    assert run.marker("stop")["by"] == "runner"
    again = _rlhf(spawn, *args)
    assert again.returncode == 0, again.stderr[-2000:]
    steps = [r["step"] for r in run.read_metrics("trainer") if "step" in r]
    assert steps == list(range(1, 7))
    assert run.has_marker(RunDir.TRAINER_DONE_MARKER) and run.read_json("summary.json")["steps"] == 6


def test_a_run_that_cannot_be_prepared_stops_the_engines_started_beside_it(tmp_path, spawn):
    """`rlhf run` starts sampler and trainer while it prepares a new run; bad input ends them.

    The training prompts are a named pipe, so the preparation waits on reading them until the test
    has seen both engines (a preparation that fails in milliseconds could end before they show);
    then it reads bytes that are not Parquet."""
    train = tmp_path / "train.parquet"
    os.mkfifo(train)
    p = spawn([sys.executable, "-m", "pipeline", "run", "configs/tiny-test.yaml", "--run-dir", str(tmp_path / "r1"),
               "--no-progress", "--set", f"data.train={train}"],
              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    started, deadline = [], time.time() + 60
    while len(started) < 2 and p.poll() is None and time.time() < deadline:
        try:
            started = [c for c in psutil.Process(p.pid).children(recursive=True) if "--after-prepare" in c.cmdline()]
        except psutil.Error:
            pass
        time.sleep(0.05)
    while p.poll() is None and time.time() < deadline + 60:  # hand the reader its bytes once it opened the pipe
        try:
            fd = os.open(train, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:  # no reader yet
            time.sleep(0.05)
            continue
        os.write(fd, b"not parquet")
        os.close(fd)
        break
    _, err = p.communicate(timeout=120)
    assert len(started) >= 2, f"engines seen while the run was being prepared: {started}\n{err}"
    assert p.returncode == 2
    lines = [line for line in err.strip().splitlines() if line]
    assert len(lines) == 1 and "data.train" in lines[0], err
    gone, alive = psutil.wait_procs(started, timeout=5)
    assert not [q for q in alive if q.status() != psutil.STATUS_ZOMBIE]
    assert not (tmp_path / "r1").exists()


def test_a_users_stop_ends_the_run_in_one_line_and_stays_for_the_next_rerun(tmp_path, spawn):
    run_dir = f"file://{tmp_path}/runs/stopped"
    p = _rlhf(spawn, "prepare", "configs/tiny-test.yaml", "--run-dir", run_dir, "--set", "trainer.steps=2")
    assert p.returncode == 0, p.stderr[-3000:]
    RunDir(run_dir).request_stop("stopped from a notebook", by="alice")
    p = _rlhf(spawn, "run", "configs/tiny-test.yaml", "--run-dir", run_dir, "--no-progress", "--set", "trainer.steps=2")
    assert p.returncode == 1 and "Traceback" not in p.stderr
    assert "error: the trainer stopped before its last step (stopped from a notebook)" in p.stderr
    assert RunDir(run_dir).marker("stop")["by"] == "alice"  # not replaced by the runner's own stop


def test_a_stalled_trainer_stops_the_run_in_one_line(tmp_path, spawn):
    """No new trainer step for trainer.stall_timeout_s (here the sampler is held before its first
    batch): `rlhf run` stops the engines and says how to resume, as the trainer's Airflow task does."""
    run_dir = f"file://{tmp_path}/runs/stalled"
    p = spawn.run([sys.executable, "-m", "pipeline", "run", "configs/tiny-test.yaml", "--run-dir", run_dir,
                   "--no-progress", "--set", "trainer.stall_timeout_s=3"], capture_output=True, text=True,
                  timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1", RLHF_SAMPLER_DELAY_S="sampler-0=600"))
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr[-3000:]
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("error: the trainer stalled: no new trainer step for "), p.stderr[-3000:]
    assert "(trainer.stall_timeout_s=3); last step 0" in last and last.endswith(
        "The same command resumes the run from its last checkpoint"), last
    engines = [q for q in psutil.process_iter(["cmdline"]) if run_dir in " ".join(q.info["cmdline"] or [])]
    assert not engines, engines
    assert RunDir(run_dir).marker(RunDir.STOP_MARKER)["by"] == "runner"


STORAGE_DOWN = """
import sys, time
from pipeline import cli, progress
from pipeline.rundir import RunDir

def down(*args, **kwargs):
    raise OSError(5, "storage down")

def follow(run, procs, **kwargs):  # the storage fails once the trainer has taken a step
    while not [r for r in run.read_metrics("trainer") if "step" in r]:
        time.sleep(0.2)
    RunDir.has_marker = RunDir.request_stop = down
    down()

progress.follow = follow
sys.exit(cli.main(sys.argv[1:]))
"""


def test_a_storage_failure_stops_the_engines_and_says_how_to_resume(tmp_path, spawn):
    """The runner's stop marker cannot be written when its storage has failed: the engines are
    stopped by signal all the same, and the error is one line naming the storage and the rerun."""
    run_dir = f"file://{tmp_path}/runs/down"
    p = spawn.run([sys.executable, "-c", STORAGE_DOWN, "run", "configs/tiny-test.yaml", "--run-dir", run_dir,
                   "--no-progress", "--set", "trainer.steps=200"], capture_output=True, text=True, timeout=300,
                  env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert p.returncode == 1, p.stderr[-3000:]
    last = p.stderr.strip().splitlines()[-1]
    assert last == (f"error: {run_dir}: storage failed (OSError: [Errno 5] storage down); the engines are stopped. "
                    "The same command resumes the run from its last checkpoint"), p.stderr[-3000:]
    assert "could not write the stop marker" in p.stderr
    engines = [q for q in psutil.process_iter(["cmdline"]) if run_dir in " ".join(q.info["cmdline"] or [])]
    assert not engines, engines
    steps = [r["step"] for r in RunDir(run_dir).read_metrics("trainer") if "step" in r]
    assert 1 <= len(steps) < 200 and not RunDir(run_dir).has_marker(RunDir.TRAINER_DONE_MARKER)


def test_an_unreachable_object_store_is_one_line_not_a_traceback(tmp_path, spawn):
    env = {"FSSPEC_S3_ENDPOINT_URL": "http://127.0.0.1:9", "AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "x"}
    p = spawn.run([sys.executable, "-m", "pipeline", "run", "configs/tiny-test.yaml", "--run-dir", "s3://bucket/r1",
                   "--no-progress"], capture_output=True, text=True, timeout=120, env=dict(os.environ, **env))
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert p.stderr.strip().splitlines()[-1].startswith(
        "error: s3://bucket/r1: storage failed (EndpointConnectionError: Could not connect to the endpoint URL"), p.stderr
