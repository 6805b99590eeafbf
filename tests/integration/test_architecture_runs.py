"""A 2-phase `rlhf run` for every architecture family: a tiny random model of the family (built
offline from its transformers config class) goes through sampler, trainer, the reshard at each
phase end and finalize; tied embeddings stay tied in every checkpoint and published version."""

import json
import os
import sys

import pytest
import torch
from models_factory import model_with_shipped_code

from pipeline.example import ARCH_FAMILIES, ensure_tiny_arch
from pipeline.policy import PolicyStore
from pipeline.reshard import reshard, verify
from pipeline.reshard.checkpoint import load_model_weights
from pipeline.rundir import RunDir
from pipeline.weights import load_state_dict

pytestmark = pytest.mark.integration
EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"
TINY = ["trainer.steps=4", "trainer.phases=2", "trainer.groups_per_step=4", "sampler.group_size=4",
        "sampler.max_new_tokens=6", "data.eval_size=8", "data.train=builtin:sort", "data.eval=builtin:sort"]
# A random model's answers almost never score on a real task: this reward varies with the text, so
# every group has non-zero advantages and each step really updates the weights.
TEXT_REWARD = "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n" \
              "    return (sum(map(ord, solution_str)) % 7) / 6\n"


def _run(spawn, run_dir, model: str, *extra: str):
    reward = run_dir.parent / "text_reward.py"
    reward.write_text(TEXT_REWARD)
    sets = [x for kv in (*TINY, f"model.path={model}", f"reward.fn={reward}:compute_score", *extra)
            for x in ("--set", kv)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return spawn.run([sys.executable, "-m", "pipeline", "run", "configs/tiny-test.yaml", "--run-dir",
                      f"file://{run_dir}", "--no-progress", *sets], capture_output=True, text=True, timeout=300, env=env)


def _check_run(run_dir, model: str, tmp_path) -> None:
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 4
    assert summary["final_policy"]["version"] == 4 and summary["final_policy"]["verified"] is True
    assert summary["compaction"]["l1_shards_in"] > 0  # finalize archived L1
    run = RunDir(str(run_dir))
    store = PolicyStore(run)
    for version in (2, 4):  # each phase's checkpoint, resharded into the sampler's layout
        manifest = store.manifest(version)
        assert manifest["source_format"].startswith("dcp") and manifest["step"] == version
        assert store.verify(version).ok
    sampler = [r for r in run.read_metrics("sampler-0") if "sampler/batch" in r]
    assert any(r["sampler/policy_version"] >= 1 for r in sampler)  # it reloaded trained versions in place

    config = json.loads(open(os.path.join(model, "config.json")).read())
    tied = config.get("tie_word_embeddings", False)
    first, last = load_state_dict(store.local_dir(0)), load_state_dict(store.local_dir(4))
    assert first.keys() == last.keys() and (HEAD in last) is not tied
    assert any(not torch.equal(first[k], last[k]) for k in first)  # trained
    if tied:
        for step in (2, 4):
            weights = load_model_weights(run.path("checkpoints", f"step_{step}"))
            assert torch.equal(weights[HEAD], weights[EMBED])
    # the trained checkpoint also splits for a tensor-parallel sampler
    tp = str(tmp_path / "tp2")
    reshard(run.path("checkpoints", "step_4"), tp, to="tp:2")
    assert verify(tp).ok


@pytest.mark.parametrize("family", list(ARCH_FAMILIES))
def test_two_phase_run(family, tmp_path, spawn):
    model = ensure_tiny_arch(family)
    run_dir = tmp_path / "run"
    p = _run(spawn, run_dir, model)
    assert p.returncode == 0, p.stderr[-3000:]
    _check_run(run_dir, model, tmp_path)


def test_tied_model_stays_tied_under_fsdp2(tmp_path, spawn):
    model = ensure_tiny_arch("llama3")
    run_dir = tmp_path / "run"
    p = _run(spawn, run_dir, model, "trainer.nproc_per_node=2")
    assert p.returncode == 0, p.stderr[-3000:]
    assert RunDir(str(run_dir)).read_json("checkpoints/step_4/meta.json")["world_size"] == 2
    _check_run(run_dir, model, tmp_path)


def test_a_model_that_ships_its_code_runs_only_when_trusted(tmp_path, spawn):
    model = model_with_shipped_code(ensure_tiny_arch("qwen2"), str(tmp_path / "shipped"))
    refused = _run(spawn, tmp_path / "refused", model)
    assert refused.returncode == 2 and "set model.trust_remote_code: true" in refused.stderr
    assert not (tmp_path / "refused").exists()  # refused before the run directory was made
    run_dir = tmp_path / "run"
    p = _run(spawn, run_dir, model, "model.trust_remote_code=true")
    assert p.returncode == 0, p.stderr[-3000:]
    _check_run(run_dir, model, tmp_path)
    assert PolicyStore(RunDir(str(run_dir))).manifest(4)["architecture"] == "ShippedForCausalLM"
