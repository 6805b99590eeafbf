"""`rlhf run` with `sampler.backend=vllm`: sampler and trainer processes, reloads in place, parity."""

import json
import os
import subprocess
import sys

import pytest

from pipeline.rundir import RunDir
from pipeline.sampler.parity import GAP_ALARM

pytestmark = [pytest.mark.vllm, pytest.mark.integration]


def test_local_run_on_vllm_reloads_each_version_in_place_with_matching_logprobs(tmp_path):
    run_dir = tmp_path / "runs" / "vllm-run"
    steps = 5
    # max_staleness=0: every batch comes from the newest policy, so the trainer compares each
    # version's behaviour log-probs with its own recompute (actor/logprob_gap) on every step.
    proc = subprocess.run(
        [sys.executable, "-m", "pipeline", "run", "configs/tiny-test.yaml", "--run-dir", f"file://{run_dir}",
         "--no-progress", "--set", "sampler.backend=vllm", "--set", "sampler.max_staleness=0",
         "--set", f"trainer.steps={steps}"],
        capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == steps

    run = RunDir(str(run_dir))
    sampler = [r for r in run.read_metrics("sampler-0") if "sampler/batch" in r]
    reloaded = sorted({r["sampler/policy_version"] for r in sampler if "timing_s/reload" in r})
    assert len(reloaded) >= steps - 1  # one engine, several versions loaded into it
    assert all(r["timing_s/reload"] > 0 for r in sampler if "timing_s/reload" in r)
    assert all(r["sampler/tokens_per_s"] > 0 and r["sampler/batch_size"] > 0 for r in sampler)

    gaps = [r["actor/logprob_gap"] for r in run.read_metrics("trainer") if "actor/logprob_gap" in r]
    assert len(gaps) == steps
    assert max(gaps) < GAP_ALARM
