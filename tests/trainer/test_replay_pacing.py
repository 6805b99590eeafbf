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
