"""Short `rlhf run`s through the sampler's reward step: verl data, the error policy, a reward model."""

import json
import os
import sys

import pytest

from pipeline.data import write_rows
from pipeline.rundir import RunDir

pytestmark = pytest.mark.integration


def _rlhf(spawn, run_dir, *sets, timeout=240):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    args = [a for s in sets for a in ("--set", s)]
    return spawn.run([sys.executable, "-m", "pipeline", "run", "configs/tiny-test.yaml", "--run-dir", str(run_dir),
                      "--no-progress", *args], capture_output=True, text=True, timeout=timeout, env=env)


def _batches(run_dir):
    return [r for r in RunDir(str(run_dir)).read_metrics("sampler-0") if "sampler/batch" in r]


VERL_REWARD = '''
def compute_score(*, data_source, solution_str, ground_truth, extra_info=None):
    if data_source != "my/verl-digits":
        raise ValueError(f"unexpected row: {data_source} {extra_info}")
    if isinstance(ground_truth, dict):
        digit, kind = ground_truth["digit"], "dict"
    elif isinstance(ground_truth, list):
        digit, kind = ground_truth[0], "list"
    else:
        raise TypeError(f"ground_truth arrived as {type(ground_truth).__name__}")
    text = solution_str.strip()
    return {"score": sum(c == digit for c in text) / max(len(text), 1), "gt_" + kind: 1.0}
'''


@pytest.mark.parametrize("kind", ["list", "dict"])
def test_verl_dataset_with_list_or_dict_ground_truths_and_a_keyword_only_reward_trains(
        tmp_path, spawn, digit_example, kind):
    import pyarrow.parquet as pq

    rows = pq.read_table(os.path.join(digit_example, "data", "train.parquet")).to_pylist()[:256]
    for r in rows:
        d = r["reward_model"]["ground_truth"]
        r["data_source"] = "my/verl-digits"
        r["reward_model"] = {"style": "rule",
                             "ground_truth": [d, f"digit {d}"] if kind == "list" else {"digit": d, "alias": f"d{d}"}}
    write_rows(rows, str(tmp_path / "train.parquet"))
    (tmp_path / "verl_reward.py").write_text(VERL_REWARD)
    run_dir = tmp_path / "run"
    p = _rlhf(spawn, run_dir, f"data.train={tmp_path / 'train.parquet'}", f"data.eval={tmp_path / 'train.parquet'}",
              f"reward.fn={tmp_path}/verl_reward.py:compute_score", "reward.on_error=fail", "trainer.steps=6")
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 6
    batches = _batches(run_dir)
    assert batches and all(b[f"reward/gt_{kind}"] == 1.0 and b["reward/errors"] == 0 for b in batches)


# Held-out evaluation (in finalize) calls reward.fn on the built-in test split: these rewards
# misbehave on training rows only, so that the sampler's policy is what the runs exercise.
RAISING_REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if extra_info["split"] == "train" and extra_info["index"] % 7 == 0:
        raise ValueError(f"boom on row {extra_info['index']}")
    return float(solution_str.strip()[:1] == ground_truth)
'''

FLAKY_REWARD = '''
import os, time

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if extra_info["split"] == "train":
        if extra_info["index"] % 7 == 0:
            raise ValueError(f"boom on row {extra_info['index']}")
        flag = os.path.join(os.path.dirname(__file__), "slept")
        if not os.path.exists(flag):  # the first sample that gets here hangs, once
            open(flag, "w").close()
            time.sleep(120)
    return float(solution_str.strip()[:1] == ground_truth)
'''


def test_raising_reward_with_on_error_fail_stops_the_run_naming_the_sample(tmp_path, spawn):
    (tmp_path / "raising.py").write_text(RAISING_REWARD)
    run_dir = tmp_path / "run"
    p = _rlhf(spawn, run_dir, f"reward.fn={tmp_path}/raising.py:compute_score", "reward.on_error=fail",
              "trainer.steps=50")
    assert p.returncode != 0
    assert "data_source 'builtin/digit') raised ValueError: boom on row" in p.stderr, p.stderr[-3000:]
    assert "reward.on_error=fail stops the run" in p.stderr
    failed = [r for r in RunDir(str(run_dir)).read_metrics("sampler-0") if r.get("event") == "reward_failed"]
    assert len(failed) == 1 and "(prompt " in failed[0]["error"]
    assert not (run_dir / "summary.json").exists()


def test_raising_and_hanging_reward_with_on_error_zero_counts_and_the_run_goes_on(tmp_path, spawn):
    (tmp_path / "flaky.py").write_text(FLAKY_REWARD)
    run_dir = tmp_path / "run"
    p = _rlhf(spawn, run_dir, f"reward.fn={tmp_path}/flaky.py:compute_score", "reward.on_error=zero",
              "reward.timeout_s=1", "trainer.steps=6")
    assert p.returncode == 0, p.stderr[-3000:]
    batches = _batches(run_dir)
    assert sum(b["reward/timeouts"] for b in batches) == 1
    assert sum(b["reward/errors"] for b in batches) > 0
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 6


def test_reward_model_run_on_the_tiny_task_raises_its_score(tmp_path, spawn, digit_example):
    """A tiny sequence classifier (built offline, it prefers the digit 7) is the only reward:
    the policy learns what it prefers."""
    from pipeline.example import build_tiny_reward_model

    rm = build_tiny_reward_model(str(tmp_path / "rm"), os.path.join(digit_example, "model"))
    run_dir = tmp_path / "run"
    p = _rlhf(spawn, run_dir, "reward.kind=model", f"reward.model={rm}", "trainer.steps=30")
    assert p.returncode == 0, p.stderr[-3000:]
    rewards = [b["reward/mean"] for b in _batches(run_dir)]
    assert len(rewards) >= 30
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last > first + 0.2, rewards
    trainer = [r for r in RunDir(str(run_dir)).read_metrics("trainer") if "step" in r]
    assert trainer[-1]["reward/mean"] > trainer[0]["reward/mean"]
