"""Phases, replay gates and the checkpoint layout, with a real trainer process on a pre-written buffer."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from pipeline.buffer import ReplayBuffer
from pipeline.config import TrainerConfig
from pipeline.policy import PolicyStore
from pipeline.reshard.checkpoint import load_model_weights
from pipeline.rundir import RunDir
from pipeline.trainer.checkpoint import checkpoint_dir, list_checkpoints, prune
from pipeline.orchestration import advance
from pipeline.trainer.phases import phase_end_steps, replay_epoch_steps


def test_phase_and_replay_schedules():
    tc = TrainerConfig(steps=12, phases=3, replay_epochs=2)
    assert phase_end_steps(tc) == {4: 0, 8: 1, 12: 2}
    assert replay_epoch_steps(tc) == [6, 12]
    assert replay_epoch_steps(TrainerConfig(steps=2, replay_epochs=4)) == [1, 1, 2, 2]
    with pytest.raises(ValueError, match="trainer.phases=5 does not divide trainer.steps=12"):
        TrainerConfig(steps=12, phases=5)


def _wait(cond, timeout: float, what: str, proc=None):
    t0 = time.time()
    while not cond():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"trainer exited ({proc.returncode}) while waiting for {what}:\n{proc.stderr.read()[-3000:]}")
        if time.time() - t0 > timeout:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


@pytest.mark.integration
def test_trainer_waits_for_the_replay_gate_then_replays_and_phases_reach_the_sampler(tmp_path, spawn):
    import test_resume as tr

    tr_config = {**tr.CONFIG, "trainer": {**tr.CONFIG["trainer"], "steps": 4, "phases": 2, "replay_epochs": 1,
                                          "checkpoint_every": 0, "sync_every": 1},
                 "buffer": {"max_replays_per_group": 1}}
    url = tr.make_run(tmp_path / "run", tr_config)
    run = RunDir(url)
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    proc = spawn([sys.executable, "-m", "pipeline", "trainer", "--run-dir", url], env=env,
                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    # replay epoch 0 is due after fresh step 4 (the last); its gate is closed: the trainer must wait
    fresh = lambda: [r for r in run.read_metrics("trainer") if r.get("replay/is_replay") == 0]  # noqa: E731
    _wait(lambda: len(fresh()) == 4, 120, "4 fresh steps", proc)
    assert run.has_marker(run.phase_done_marker(0)) and not run.has_marker(run.phase_done_marker(1))
    assert PolicyStore(run).exists(1) and not PolicyStore(run).exists(2)  # in-phase publish, not the boundary
    time.sleep(2.0)
    assert proc.poll() is None and not any(r.get("replay/is_replay") for r in run.read_metrics("trainer"))
    did = advance(run)  # the local runner's orchestration: reshard phase 0, open the gate
    assert any("published policy v2" in d for d in did) and any("replay gate 0" in d for d in did)
    _wait(lambda: run.has_marker(run.TRAINER_DONE_MARKER), 120, "the end of training", proc)
    assert proc.wait(timeout=60) == 0
    replays = [r for r in run.read_metrics("trainer") if r.get("replay/is_replay") == 1]
    assert replays and all(0 < r["replay/weight_mean"] <= 1 for r in replays)

    st = ReplayBuffer(run.buffer_url, run.config().buffer).refresh()
    replayed = [g for g in st.l2_groups.values() if g.replays > 0]
    assert len(replayed) >= run.config().trainer.groups_per_step  # priorities and replay counts written back
    assert any(g.priority != 1.0 for g in replayed)
    # the last phase's checkpoint reaches the sampler through the reshard path, with its exact weights
    advance(run)
    store = PolicyStore(run)
    assert store.exists(4)
    from safetensors.torch import load_file

    published = load_file(os.path.join(store.local_dir(4), "model.safetensors"))
    ck = [c for c in list_checkpoints(run) if c.step == 4][0]
    assert ck.meta == {"step": 4, "world_size": 1, "policy_version": 4, "format": "dcp", "kind": "phase",
                       "buffer_version": ck.meta["buffer_version"]}
    assert ReplayBuffer(run.buffer_url).refresh().version >= ck.meta["buffer_version"] > 0
    saved = load_model_weights(ck.url)
    assert all(torch.equal(published[k], saved[k]) for k in saved)


def test_replay_epochs_without_eligible_groups_are_skipped_not_waited_for(tmp_path):
    """Groups without reward variance never reach L2: the gate could never open, so the trainer
    must finish (and say which epochs it skipped) instead of waiting for it."""
    import test_resume as tr

    config = {**tr.CONFIG, "trainer": {**tr.CONFIG["trainer"], "steps": 2, "replay_epochs": 2, "checkpoint_every": 0,
                                       "wait_timeout_s": 5}}
    url = tr.make_run(tmp_path / "run", config, constant_reward=0.5)
    tr.trainer(url)
    run = RunDir(url)
    assert run.marker(run.TRAINER_DONE_MARKER)["replay_epochs_skipped"] == [0, 1]
    assert not any(r.get("replay/is_replay") for r in run.read_metrics("trainer"))


def test_checkpoint_layout_is_what_the_reshard_reader_expects(tmp_path):
    import test_resume as tr

    url = tr.make_run(tmp_path / "run")
    tr.trainer(url)
    run = RunDir(url)
    ck = list_checkpoints(run)[-1]
    names = set(os.listdir(ck.path))
    assert names == {"dcp", "hf", "meta.json"}
    assert "config.json" in os.listdir(f"{ck.path}/hf") and not any(n.endswith(".safetensors") for n in os.listdir(f"{ck.path}/hf"))
    weights = load_model_weights(ck.url)
    assert "lm_head.weight" in weights and "model.embed_tokens.weight" in weights
    try:
        from pipeline.reshard.sources import open_source
    except ImportError:
        pytest.skip("pipeline.reshard is not installed in this tree")
    src = open_source(ck.url)
    try:
        assert {s.name for s in src.specs} == set(weights)
        assert torch.equal(src.read("lm_head.weight"), weights["lm_head.weight"])
    finally:
        src.close()


def test_incomplete_checkpoints_are_invisible_and_retention_keeps_phase_checkpoints(tmp_path):
    run = RunDir(str(tmp_path / "r1"))
    for step, kind in [(2, "phase"), (4, "periodic"), (6, "periodic"), (8, "periodic")]:
        d = checkpoint_dir(run, step)
        os.makedirs(f"{d}/dcp")
        run.write_json(f"checkpoints/step_{step}/meta.json", {"step": step, "kind": kind})
    os.makedirs(f"{checkpoint_dir(run, 10)}/dcp")  # killed while saving: no meta.json
    assert [c.step for c in list_checkpoints(run)] == [2, 4, 6, 8]
    prune(run, keep=2)
    assert [c.step for c in list_checkpoints(run)] == [2, 6, 8]
    assert os.path.isdir(checkpoint_dir(run, 10))  # newer than every complete one: may still be in progress


def test_trainer_keeps_the_newest_policy_versions_plus_v0_and_phase_versions(tmp_path):
    import test_resume as tr

    config = {**tr.CONFIG, "trainer": {**tr.CONFIG["trainer"], "steps": 6, "phases": 2, "sync_every": 1,
                                       "checkpoint_every": 0, "keep_policy_versions": 2}}
    url = tr.make_run(tmp_path / "run", config)
    tr.trainer(url)
    run = RunDir(url)
    store = PolicyStore(run)
    assert store.versions() == [0, 4, 5]  # in-phase v1, v2 deleted once two newer ones were committed
    advance(run)  # the phase boundaries reach the sampler afterwards: kept, and never counted against K
    assert store.versions() == [0, 3, 4, 5, 6]
    assert sorted(n for n in os.listdir(run.path("policy")) if n.startswith("v")) == \
        [f"v{v:06d}" for v in (0, 3, 4, 5, 6)]


def test_every_in_phase_version_is_up_before_the_last_phase_marker(tmp_path, monkeypatch):
    """The orchestrator publishes the final version once it sees the last phase marker; an
    in-phase version still uploading then would land after it and move latest.json back."""
    import time

    import test_resume as tr
    from pipeline.trainer.distributed import World
    from pipeline.trainer.loop import Trainer

    config = {**tr.CONFIG, "trainer": {**tr.CONFIG["trainer"], "steps": 4, "phases": 1, "sync_every": 1,
                                       "checkpoint_every": 0}}
    url = tr.make_run(tmp_path / "run", config)
    publish = PolicyStore.publish_model

    def slowly(self, version, *a, **k):
        time.sleep(0.5)  # an upload to object storage
        return publish(self, version, *a, **k)

    monkeypatch.setattr(PolicyStore, "publish_model", slowly)
    seen, set_marker = {}, RunDir.set_marker

    def record(self, name, payload=None):
        if name == RunDir.phase_done_marker(0):
            seen["versions"] = PolicyStore(self).versions()
        return set_marker(self, name, payload)

    monkeypatch.setattr(RunDir, "set_marker", record)
    Trainer(RunDir(url), World()).run_loop()
    assert seen["versions"][-1] == 3  # the last in-phase version, committed before the marker


def test_a_resumed_trainer_writes_the_marker_of_a_phase_it_closed_but_did_not_mark(tmp_path, monkeypatch):
    """A publication failing at the last step fails the trainer after the phase checkpoint and before
    its marker; without the marker the orchestrator never published that phase's policy."""
    import test_resume as tr
    from pipeline.trainer.distributed import World
    from pipeline.trainer.loop import Trainer

    config = {**tr.CONFIG, "trainer": {**tr.CONFIG["trainer"], "steps": 4, "phases": 2, "sync_every": 1,
                                       "checkpoint_every": 0}}
    run = RunDir(tr.make_run(tmp_path / "run", config))
    publish = PolicyStore.publish_model

    def flaky(self, version, *a, **k):
        if version == 3:
            raise OSError("storage unavailable")
        return publish(self, version, *a, **k)

    monkeypatch.setattr(PolicyStore, "publish_model", flaky)
    with pytest.raises(Exception, match="storage unavailable|publishing"):
        Trainer(run, World()).run_loop()
    assert [c.step for c in list_checkpoints(run)] == [2, 4] and not run.has_marker(RunDir.phase_done_marker(1))
    monkeypatch.setattr(PolicyStore, "publish_model", publish)
    Trainer(run, World()).run_loop()  # resumed at step 4: nothing left to train
    assert run.marker(RunDir.phase_done_marker(1))["step"] == 4
    advance(run)
    assert PolicyStore(run).latest() == 4
