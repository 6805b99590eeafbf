"""The side-by-side benches' own rules: the arms' order, and what the TRL arm refuses to compare."""

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
