"""Scale-out on one machine: a pool of sampler replicas (one made slow) and a 2-node trainer
(two torchrun launchers meeting at a c10d rendezvous, gloo) that resumes at one node."""

import collections
import json
import os
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.buffer import ReplayBuffer
from pipeline.rundir import RunDir
from pipeline.storage import url_to_fs

pytestmark = pytest.mark.integration


def _rlhf(spawn, *args, env=None, timeout=400):
    env = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    return spawn.run([sys.executable, "-m", "pipeline", *args], capture_output=True, text=True, timeout=timeout,
                     env=env)


def _archived(run: RunDir) -> list[dict]:
    buffer = ReplayBuffer(run.buffer_url)
    fs, _ = url_to_fs(buffer.url)
    tables = []
    for url in buffer.archive_files():
        with fs.open(url_to_fs(url)[1], "rb") as f:
            tables.append(pq.read_table(f, columns=["group_id", "prompt_id", "sampler_id", "policy_version"]))
    return pa.concat_tables(tables).to_pylist()


def test_three_sampler_replicas_share_the_work_and_a_slow_one_holds_back_no_other(tmp_path, spawn):
    run_dir = tmp_path / "runs" / "replicas"
    p = _rlhf(spawn, "run", "configs/tiny-test.yaml", "--run-dir", f"file://{run_dir}", "--no-progress",
              "--set", "trainer.steps=16", "--set", "sampler.replicas=3",
              env={"RLHF_SAMPLER_DELAY_S": "sampler-2=1.0"})
    # The slow replica's batches often arrive past the staleness bound and are dropped: however
    # many are, the run goes on (a dropped or lost draw reserves no place in the order).
    assert p.returncode == 0, p.stderr[-3000:]
    run = RunDir(str(run_dir))
    cfg = run.config()
    summary = json.loads((run_dir / "summary.json").read_text())

    committed = collections.Counter(row["sampler_id"] for row in {r["group_id"]: r for r in _archived(run)}.values())
    streams = {sid: run.read_metrics(sid) for sid in ("sampler-0", "sampler-1", "sampler-2")}
    batches = {sid: [r for r in records if "sampler/draw" in r] for sid, records in streams.items()}
    # Every batch a replica made was either committed whole or dropped at commit and named.
    for sid, records in batches.items():
        made = {r["sampler/draw"] for r in records}
        dropped = [r["sampler/dropped_draw"] for r in streams[sid] if r.get("event") == "dropped_stale"]
        assert set(dropped) <= made and len(dropped) == len(set(dropped)), (sid, dropped)
        assert committed[sid] == (len(made) - len(dropped)) * cfg.sampler.prompts_per_batch, \
            (sid, sorted(made), dropped, committed, p.stderr[-4000:])
    # summary.json counts what the dropped batches held, within what was generated
    dropped_rows = sum(len([r for r in streams[sid] if r.get("event") == "dropped_stale"]) for sid in streams) \
        * cfg.sampler.prompts_per_batch * cfg.sampler.group_size
    assert summary["samples_dropped_stale"] == dropped_rows <= summary["samples_generated"]
    assert summary["samples_generated"] - dropped_rows == sum(committed.values()) * cfg.sampler.group_size
    # The fast replicas made the batches the slow one could not.
    assert len(batches["sampler-2"]) < min(len(batches["sampler-0"]), len(batches["sampler-1"])), batches
    assert committed["sampler-0"] > 0 and committed["sampler-1"] > 0

    # No prompt draw was generated twice: the batches the replicas logged name distinct draws.
    draws = [r["sampler/draw"] for records in batches.values() for r in records]
    assert len(draws) == len(set(draws)) and len(draws) >= 16

    # The staleness bound held across all replicas for every step the trainer took.
    trainer = [r for r in run.read_metrics("trainer") if "step" in r]
    assert len(trainer) == 16
    assert max(r["staleness/max"] for r in trainer) <= cfg.sampler.max_staleness
    assert summary["steps"] == 16 and summary["final_policy"]["verified"] is True


def test_a_two_node_trainer_learns_like_the_one_node_trainer(tmp_path, spawn):
    out = {}
    for nodes in (1, 2):
        run_dir = tmp_path / "runs" / f"nodes-{nodes}"
        # on-policy (max_staleness 0): each batch comes from the version before its step, so both
        # runs train on the same rollouts and differ only by how the ranks sum their gradients;
        # 12 steps: on-policy, the greedy held-out score of tiny-test moves between steps 8 and 12
        p = _rlhf(spawn, "run", "configs/tiny-test.yaml", "--run-dir", f"file://{run_dir}", "--no-progress",
                  "--set", "trainer.steps=12", "--set", f"trainer.nnodes={nodes}", "--set", "sampler.max_staleness=0")
        assert p.returncode == 0, p.stderr[-3000:]
        starts = [r for r in RunDir(str(run_dir)).read_metrics("trainer") if r.get("event") == "start"]
        assert [r["world_size"] for r in starts] == [nodes]
        out[nodes] = json.loads((run_dir / "summary.json").read_text())
    for s in out.values():
        assert s["eval_after"] > s["eval_before"]
    assert abs(out[2]["eval_after"] - out[1]["eval_after"]) <= 0.05


def test_a_two_node_trainer_resumes_at_one_node(tmp_path, spawn):
    run_dir = tmp_path / "runs" / "nodes"
    args = ["run", "configs/tiny-test.yaml", "--run-dir", f"file://{run_dir}", "--no-progress",
            "--set", "trainer.steps=8", "--set", "trainer.checkpoint_every=2"]
    # two nodes until the trainer is killed after step 5 (last checkpoint: step 4)
    p = _rlhf(spawn, *args, "--set", "trainer.nnodes=2", env={"RLHF_TRAINER_KILL_AFTER_STEP": "5"})
    assert p.returncode != 0
    run = RunDir(str(run_dir))
    starts = [r for r in run.read_metrics("trainer") if r.get("event") == "start"]
    assert starts[0]["world_size"] == 2

    # the same run on one node resumes from that checkpoint and finishes
    p = _rlhf(spawn, *args, "--set", "trainer.nnodes=1")
    assert p.returncode == 0, p.stderr[-3000:]
    starts = [r for r in run.read_metrics("trainer") if r.get("event") == "start"]
    assert starts[-1]["world_size"] == 1 and starts[-1]["resumed_step"] == 4
    assert run.config().trainer.nnodes == 1  # prepare recorded the new scale
    steps = [r["step"] for r in run.read_metrics("trainer") if "step" in r]
    assert steps == list(range(1, 9))  # metrics of the steps after the checkpoint were rolled back
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 8 and summary["final_policy"]["verified"] is True


def test_a_replica_lost_mid_run_leaves_the_others_to_finish_it(tmp_path, spawn):
    import signal
    import time

    import psutil

    run_dir = tmp_path / "runs" / "lost"
    proc = spawn([sys.executable, "-m", "pipeline", "run", "configs/tiny-test.yaml", "--run-dir", f"file://{run_dir}",
                  "--no-progress", "--set", "trainer.steps=12", "--set", "sampler.replicas=3"],
                 env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess_devnull(), stderr=subprocess_devnull())
    run = RunDir(f"file://{run_dir}")
    deadline, victim = time.time() + 120, None
    while victim is None and time.time() < deadline and proc.poll() is None:
        if (run_dir / "config.yaml").exists() and any("sampler/draw" in r for r in run.read_metrics("sampler-1")):
            victim = next(p for p in psutil.process_iter(["cmdline"])
                          if p.info["cmdline"] and p.info["cmdline"][-2:] == ["--sampler-id", "sampler-1"])
            victim.send_signal(signal.SIGKILL)
        time.sleep(0.05)
    assert victim is not None, "sampler-1 made no batch before the run ended"
    assert proc.wait(timeout=300) == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 12
    draws = [r["sampler/draw"] for sid in ("sampler-0", "sampler-1", "sampler-2")
             for r in run.read_metrics(sid) if "sampler/draw" in r]
    assert len(draws) == len(set(draws))


def subprocess_devnull():
    import subprocess

    return subprocess.DEVNULL
