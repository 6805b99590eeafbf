"""`rlhf parity`: the check a user runs against a published policy folder."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.vllm


def _parity(policy: str, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "pipeline", "parity", "--policy", policy, "--backend", "vllm",
                           "--prompts", "6", "--n", "2", "--max-new-tokens", "8", *extra],
                          capture_output=True, text=True, env=env, timeout=300)


def test_parity_command_reports_a_small_gap_and_exits_zero(model_dir):
    proc = _parity(model_dir)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["ok"] is True and report["tokens"] > 0
    assert report["mean_abs_gap"] < report["threshold"] == 1e-3

