"""The side-by-side benches' own rules: the arms' order, what the TRL arm refuses to compare, and
the trainer's idle time the peer bench reports."""

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _peer():
    spec = importlib.util.spec_from_file_location("bench_peer", REPO / "bench" / "peer.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("bench_peer", module)
    spec.loader.exec_module(module)
    return module


def test_arms_run_in_a_palindrome_and_an_odd_number_of_repeats_is_refused():
    peer = _peer()
    assert peer.arm_order(["ours", "trl"], 1) == ["ours", "trl"]
    assert peer.arm_order(["ours", "trl"], 2) == ["ours", "trl", "trl", "ours"]
    assert peer.arm_order(["a", "b", "c"], 4) == ["a", "b", "c", "c", "b", "a", "a", "b", "c", "c", "b", "a"]
    for repeats in (0, 3, 5):
        with pytest.raises(ValueError, match="1 or an even number"):
            peer.arm_order(["ours", "trl"], repeats)


def test_the_trl_arm_refuses_settings_it_has_no_counterpart_for():
    from pipeline.config import load_config

    peer = _peer()
    cfg = load_config(str(REPO / "configs" / "tiny-grpo-long.yaml"))
    args = peer.trl_settings(cfg)
    assert args[args.index("--clip-eps") + 1] == repr(cfg.trainer.clip_eps)
    for setting, message in (("trainer.decoupled=true", "trainer.decoupled=True"),
                             ("trainer.update_epochs=2", "trainer.update_epochs=2"),
                             ("trainer.loss_agg=seq-mean-token-mean", "trainer.loss_agg")):
        with pytest.raises(SystemExit, match=message):
            peer.trl_settings(load_config(str(REPO / "configs" / "tiny-grpo-long.yaml"), [setting]))


def test_the_trainer_idle_time_counts_fresh_waits_after_the_first_step_and_the_replay_updates():
    peer = _peer()
    records = [{"event": "start"},
               {"step": 1, "timing_s/wait": 5.0, "replay/is_replay": 0},   # start-up: nothing to replay yet
               {"step": 2, "timing_s/wait": 0.25, "replay/is_replay": 0},
               {"step": 2, "replay/is_replay": 1},
               {"step": 3, "timing_s/wait": 0.5, "replay/is_replay": 0},
               {"step": 3, "replay/is_replay": 1}]
    assert peer.trainer_idle(records) == {"trainer_wait_s": 0.75, "replay_updates": 2}
    assert peer.trainer_idle(records[:2]) == {"trainer_wait_s": 0.0, "replay_updates": 0}
