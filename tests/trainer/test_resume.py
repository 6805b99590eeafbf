"""Resume equivalence and FSDP2: real trainer processes fed from a pre-written buffer.

N = 3 steps, SIGKILL (the trainer kills itself right after step N + 1, i.e. after it trained on
and consumed fresh data that no checkpoint holds), restart on the same run directory, N more
steps: the parameters equal those of 2N uninterrupted steps. Run alone with `pytest -k resume`.
"""

from __future__ import annotations

import os
import signal
import sys

import pytest
import torch
from spawner import Spawner
from trainer_rollouts import synthetic_shard

from pipeline.buffer import ReplayBuffer
from pipeline.config import parse_config
from pipeline.models import load_tokenizer
from pipeline.policy import PolicyStore
from pipeline.orchestration import prepare
from pipeline.reshard.checkpoint import load_model_weights
from pipeline.trainer.checkpoint import list_checkpoints
from pipeline.trainer.loop import FAULT_ENV

N = 3
GROUPS, GROUP_SIZE = 4, 4

CONFIG = {
    "seed": 0,
    "model": {"path": "builtin:digit"},
    "data": {"train": "builtin:digit", "eval": "builtin:digit", "eval_size": 8},
    "reward": {"fn": "digit"},
    "sampler": {"group_size": GROUP_SIZE, "prompts_per_batch": GROUPS, "poll_s": 0.05, "max_staleness": 99},
    "trainer": {"steps": 2 * N, "groups_per_step": GROUPS, "checkpoint_every": N, "sync_every": 100,
                "lr": 3e-3, "micro_batch_tokens": 64, "wait_timeout_s": 60},
}


def make_run(path, config: dict | None = None, constant_reward: float | None = None) -> str:
    """A prepared run directory whose L1 already holds every step's groups, in a fixed order."""
    run = prepare(parse_config(config or CONFIG), run_url=str(path))
    tok = load_tokenizer(PolicyStore(run).local_dir(0))
    prompts = [tok(f"digits {i}: ", add_special_tokens=False)["input_ids"] for i in range(8)]
    buf = ReplayBuffer(run.buffer_url, run.config().buffer)
    with buf.writer("test") as w:
        for shard in range(2 * N + 1):
            w.write(synthetic_shard(tok, prompts, shard, GROUPS, GROUP_SIZE, seed=0, constant_reward=constant_reward))
    return run.url


def trainer(run_url: str, nproc: int = 1, kill_after: int | None = None) -> int:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    env.pop(FAULT_ENV, None)
    if kill_after is not None:
        env[FAULT_ENV] = str(kill_after)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"] \
        if nproc > 1 else [sys.executable]
    # torchrun's workers, too, are killed if it fails or times out
    proc = Spawner().run([*launcher, "-m", "pipeline", "trainer", "--run-dir", run_url], env=env,
                         capture_output=True, text=True, timeout=300)
    if kill_after is None and proc.returncode != 0:
        raise AssertionError(f"trainer failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc.returncode


def final_weights(run_url: str) -> dict[str, torch.Tensor]:
    from pipeline.rundir import RunDir

    cks = list_checkpoints(RunDir(run_url))
    assert cks and cks[-1].step == 2 * N, [c.step for c in cks]
    return load_model_weights(cks[-1].url)


def assert_same(a: dict, b: dict, atol: float) -> None:
    assert a.keys() == b.keys()
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst <= atol, f"max parameter difference {worst:.3g} > {atol}"


def moved(a: dict, run_url: str) -> float:
    """Largest parameter change from policy v0 (the test must not compare two untrained models)."""
    from safetensors.torch import load_file

    from pipeline.rundir import RunDir

    v0 = load_file(os.path.join(PolicyStore(RunDir(run_url)).local_dir(0), "model.safetensors"))
    return max((a[k] - v0[k]).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """2N steps without interruption, one process and two (FSDP2), computed once per module."""
    root = tmp_path_factory.mktemp("uninterrupted")
    out = {}

    def get(nproc: int) -> dict:
        if nproc not in out:
            url = make_run(root / f"run-np{nproc}")
            trainer(url, nproc)
            out[nproc] = final_weights(url)
        return out[nproc]

    return get


def _killed_then_resumed(tmp_path, nproc: int, resume_nproc: int, compact: bool = False) -> tuple[str, dict]:
    url = make_run(tmp_path / "run")
    rc = trainer(url, nproc, kill_after=N + 1)
    assert rc != 0, "the trainer should have been killed"
    if nproc == 1:
        assert rc == -signal.SIGKILL
    from pipeline.rundir import RunDir

    run = RunDir(url)
    assert [c.step for c in list_checkpoints(run)] == [N]
    assert not run.has_marker("trainer_done")
    if compact:  # `rlhf buffer compact` by hand, with step N + 1's position recorded (one shard a step)
        buf = ReplayBuffer(run.buffer_url, run.config().buffer)
        buf.mark_consumed({"seq": N + 1, "group": 0})
        assert buf.compact()["l1_shards_in"] == N  # not shard N, which the restart from step N reads
    trainer(url, resume_nproc)
    steps = [r["step"] for r in run.read_metrics("trainer") if "step" in r]
    assert steps == list(range(1, 2 * N + 1)), steps  # no step skipped, none counted twice
    return url, final_weights(url)


def test_resume_after_sigkill_and_a_compaction_equals_uninterrupted_single_process(tmp_path, uninterrupted):
    url, resumed = _killed_then_resumed(tmp_path, 1, 1, compact=True)
    ref = uninterrupted(1)
    assert moved(ref, url) > 1e-3
    assert_same(resumed, ref, atol=1e-6)


@pytest.mark.integration
def test_resume_after_sigkill_equals_uninterrupted_torchrun_two_processes(tmp_path, uninterrupted):
    _, resumed = _killed_then_resumed(tmp_path, 2, 2)
    assert_same(resumed, uninterrupted(2), atol=1e-5)


@pytest.mark.integration
def test_resume_at_a_different_world_size(tmp_path, uninterrupted):
    """Checkpoint written by 2 FSDP2 ranks, resumed by 1 process."""
    _, resumed = _killed_then_resumed(tmp_path, 2, 1)
    assert_same(resumed, uninterrupted(1), atol=1e-4)


@pytest.mark.integration
def test_two_process_fsdp_run_makes_the_same_updates_as_one_process(uninterrupted):
    """Same data, same config: FSDP2 over 2 CPU processes learns exactly what 1 process learns."""
    one, two = uninterrupted(1), uninterrupted(2)
    assert_same(two, one, atol=1e-4)


@pytest.mark.parametrize("every_s, kept", [(0.0, [2 * N]), (1e-9, [2 * N - 2, 2 * N - 1, 2 * N])])
def test_a_trainer_checkpoints_once_checkpoint_every_s_have_passed(tmp_path, every_s, kept):
    """Without checkpoint_every and with one phase, a killed run restarted from step 0: now a
    checkpoint follows the first step that ends checkpoint_every_s after the last one (the newest
    keep_checkpoints of them stay, beside the phase's)."""
    from pipeline.rundir import RunDir

    tc = {**CONFIG["trainer"], "checkpoint_every": 0, "checkpoint_every_s": every_s, "keep_checkpoints": 2}
    url = make_run(tmp_path / "run", {**CONFIG, "trainer": tc})
    trainer(url)
    assert [c.step for c in list_checkpoints(RunDir(url))] == kept


def test_a_resumed_trainer_publishes_the_version_its_checkpoint_was_taken_for(tmp_path):
    """Killed after the checkpoint of step N but before version N was committed (its background
    publication had not finished), the trainer publishes version N when it resumes from that
    checkpoint: a fixed-lag sampler that is scheduled to generate with exactly it would wait for
    it forever."""
    from safetensors.torch import load_file

    from pipeline.rundir import RunDir

    url = make_run(tmp_path / "run", {**CONFIG, "trainer": {**CONFIG["trainer"], "sync_every": N}})
    assert trainer(url, kill_after=N + 1) != 0
    run, store = RunDir(url), PolicyStore(RunDir(url))
    [ck] = list_checkpoints(run)
    at_checkpoint = load_model_weights(ck.url)
    if store.exists(N):  # the publication got through before the kill: undo it, as a kill before it would
        run.fs.rm(store.url(N), recursive=True)
    assert not store.exists(N)
    trainer(url)
    assert store.exists(N) and store.manifest(N)["step"] == N
    assert_same(load_file(os.path.join(store.local_dir(N), "model.safetensors")), at_checkpoint, atol=0.0)


def test_a_resumed_trainer_takes_back_and_redoes_the_replays_after_its_checkpoint(tmp_path):
    """A replay epoch after every step, one replay per group. Killed after step N + 1 and its
    replays, the trainer resumes from step N's checkpoint: it takes back the replay counts and
    priorities recorded since, then redoes them. The weights equal an uninterrupted run's, and the
    buffer counts each replay once, as the lineage ledger lists it (before, the killed attempt's
    replays stayed counted: groups used up by them were not drawn again)."""
    from pipeline.lineage import read_ledger
    from pipeline.rundir import RunDir

    config = {**CONFIG, "trainer": {**CONFIG["trainer"], "replay_epochs": 2 * N},
              "buffer": {"max_replays_per_group": 1}}

    def replays(url: str) -> tuple[int, int, int]:
        """(buffer's count, the ledger's replayed groups, those of steps up to N + 1)"""
        run = RunDir(url)
        ledger = read_ledger(run).to_pylist()
        counted = ReplayBuffer(run.buffer_url, run.config().buffer).refresh().replays_done
        listed = [r for r in ledger if r["kind"] == "replay"]
        return counted, len(listed), sum(r["step"] <= N + 1 for r in listed)

    def make_gated_run(path) -> str:
        url = make_run(path, config)
        for e in range(2 * N):  # the orchestrator's gates, open from the start
            RunDir(url).set_marker(RunDir.replay_gate_marker(e), {"eligible": GROUPS})
        return url

    ref = make_gated_run(tmp_path / "uninterrupted")
    trainer(ref)
    url = make_gated_run(tmp_path / "run")
    assert trainer(url, kill_after=N + 1) == -signal.SIGKILL
    counted, _, _ = replays(url)
    ref_counted, ref_listed, ref_by_kill = replays(ref)
    up_to_checkpoint = sum(r["kind"] == "replay" and r["step"] <= N for r in read_ledger(RunDir(ref)).to_pylist())
    assert counted == ref_by_kill > up_to_checkpoint  # the killed attempt replayed after its checkpoint
    trainer(url)
    assert replays(url) == (ref_counted, ref_listed, ref_by_kill) and ref_counted == ref_listed
    assert_same(final_weights(url), final_weights(ref), atol=1e-6)
