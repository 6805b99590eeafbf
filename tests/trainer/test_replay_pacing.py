"""`trainer.replay_yield`: a replay epoch gives way to fresh data, so that replay fills only time
the trainer would spend waiting for the sampler; a real trainer process on a buffer the test fills."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
from trainer_rollouts import synthetic_shard

from pipeline.buffer import ReplayBuffer
from pipeline.config import parse_config
from pipeline.models import load_tokenizer
from pipeline.orchestration import open_replay_gate, prepare
from pipeline.policy import PolicyStore
from pipeline.rundir import RunDir
from pipeline.trainer.feed import FreshFeed, ReplayPace
from pipeline.trainer.loop import Trainer

STEPS, GROUPS, GROUP_SIZE = 3, 4, 4


def replays(run: RunDir) -> list[dict]:
    return [r for r in run.read_metrics("trainer") if r.get("replay/is_replay") == 1]


@pytest.mark.integration
def test_replay_runs_only_while_the_next_fresh_groups_are_missing(tmp_path, spawn):
    """One replay epoch is due after every fresh step. Step 2's groups are in L1 when step 1 ends
    (read while step 1 trained): no replay. Step 3's are not when step 2 ends: the epoch replays
    while the trainer would wait, and step 3 runs once they are written. After step 3, the last,
    there is no fresh step to wait for: no replay."""
    import test_resume as tr

    cfg = {**tr.CONFIG, "trainer": {**tr.CONFIG["trainer"], "steps": STEPS, "replay_epochs": STEPS,
                                    "checkpoint_every": 0, "replay_yield": True},
           "buffer": {"max_replays_per_group": 1}}
    run = prepare(parse_config(cfg), run_url=str(tmp_path / "run"))
    tok = load_tokenizer(PolicyStore(run).local_dir(0))
    prompts = [tok(f"digits {i}: ", add_special_tokens=False)["input_ids"] for i in range(8)]
    buf = ReplayBuffer(run.buffer_url, run.config().buffer)

    def write_step(shard: int) -> None:
        with buf.writer("test") as w:
            w.write(synthetic_shard(tok, prompts, shard, GROUPS, GROUP_SIZE, seed=0))

    write_step(0)
    write_step(1)
    for e in range(STEPS):  # the orchestrator's part (the gate sensors), done up front
        open_replay_gate(run, e, None)
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    proc = spawn([sys.executable, "-m", "pipeline", "trainer", "--run-dir", run.url], env=env,
                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not replays(run):  # the trainer, done with step 2, replays while it waits for step 3
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        assert time.time() < deadline, "no replay while step 3's groups were missing"
        time.sleep(0.1)
    write_step(2)
    assert proc.wait(timeout=120) == 0, proc.stderr.read()[-3000:]
    fresh = [r["step"] for r in run.read_metrics("trainer") if r.get("replay/is_replay") == 0]
    assert fresh == [1, 2, 3]
    assert {r["step"] for r in replays(run)} == {2}


class TwoRanks:
    """World of rank 0 with one other rank whose own read ahead has (1) or has not (0) ended."""

    def __init__(self, other: int):
        self.other = other

    def max_int(self, n: int) -> int:
        return max(n, self.other)


def _fresh_due(step: int, ready: bool, other: int) -> bool:
    me = SimpleNamespace(state=SimpleNamespace(step=step), tc=SimpleNamespace(steps=STEPS),
                         feed=SimpleNamespace(ready=lambda: ready), world=TwoRanks(other))
    return Trainer.fresh_due(me)


def test_every_rank_gives_way_once_any_rank_has_the_next_fresh_groups():
    """Each rank reads ahead on its own, so their reads end at different moments: a rank whose read
    has not ended gives way with the one whose has (alone, it would enter a replay update whose
    collectives the other never joins)."""
    assert _fresh_due(1, ready=False, other=1)
    assert _fresh_due(1, ready=True, other=0)
    assert not _fresh_due(1, ready=False, other=0)
    assert _fresh_due(STEPS, ready=False, other=0)  # after the last fresh step


def test_a_replay_update_starts_only_when_it_should_end_before_the_next_fresh_groups():
    """In a run whose trainer is the slower side the next groups are due about as a step ends:
    an update started then would hold the fresh step back and be thrown away."""
    pace = ReplayPace()
    assert pace.fits(0.05)  # nothing measured: it tries (an update still gives way between micro-batches)
    pace.took("fresh", 0.4)
    assert not pace.fits(0.3) and pace.fits(0.45) and pace.fits(None)
    pace.took("replay", 0.2)  # once a replay has run, its own pace (it trains on part of its rows)
    assert pace.fits(0.3) and not pace.fits(0.1) and not pace.fits(-0.05)


def test_the_next_fresh_groups_are_expected_a_median_interval_after_the_last():
    import test_feed as tf

    log = tf.Log(committed=8)
    feed = FreshFeed(log, tf.Run(), groups=1, poll_s=0.01, timeout_s=60)
    cursor = None
    for _ in range(2):
        _, cursor, _ = feed.take(cursor, ahead=False)
        assert feed.expected_in() is None  # fewer than three arrivals: no guess
        time.sleep(0.3)
    _, cursor, _ = feed.take(cursor, ahead=False)
    assert 0.15 < feed.expected_in() <= 0.3 + 0.05
    time.sleep(0.4)
    assert feed.expected_in() < 0  # overdue


def test_every_rank_gives_way_when_any_rank_expects_the_fresh_groups_before_an_update_would_end():
    def gives_way(fits: bool, other: int) -> bool:
        me = SimpleNamespace(pace=SimpleNamespace(fits=lambda expected: fits), feed=SimpleNamespace(expected_in=lambda: 0.1),
                             fresh_due=lambda: False, world=TwoRanks(other))
        return Trainer._replay_gives_way(me)

    assert not gives_way(fits=True, other=0)
    assert gives_way(fits=False, other=0) and gives_way(fits=True, other=1)
