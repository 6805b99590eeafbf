"""Chaos, short (bench/chaos.py --quick, local disk): the sampler, the trainer and the runner of a
real run are SIGKILLed at random moments; the resumed run still finishes, every fresh group is
trained exactly once, the buffer verifies and no process is left."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[2]


def test_sigkilled_local_run_finishes_with_every_fresh_group_trained_once(spawn):
    proc = spawn([sys.executable, str(REPO / "bench" / "chaos.py"), "--quick", "--mode", "local", "--seed", "1"],
                 cwd=str(REPO), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=540)
    lines = out.strip().splitlines()
    assert lines, err[-3000:]
    result = json.loads(lines[-1])
    run = result["runs_detail"][0]
    assert result["kills"] >= 3, err[-3000:]
    assert len(run["kills_by_target"]) >= 2, run["kills_by_target"]  # victims take turns
    assert result["runs"] == result["runs_succeeded"] == 1, run
    for key in ("groups_lost", "groups_trained_twice", "orphans", "verify_errors"):
        assert result[key] == 0, (key, run)
    # the figures come from data: every trainer step matched the groups it trained, the buffer's
    # own cursor agrees, and fresh groups were committed beyond what was trained
    assert run["unmatched_steps"] == 0 and run["steps_recorded_ok"] and run["buffer_consumed_ok"], run
    assert run["groups_trained"] == run["steps"] * run["groups_per_step"] <= run["groups_committed"], run
    assert run["retention_violations"] == [], run
    assert proc.returncode == 0, err[-3000:]
