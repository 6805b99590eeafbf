"""The sampler's reward step: a worker process with per-sample time limits and the error policy."""

import os

import pytest

from pipeline.config import ConfigError, RewardConfig
from pipeline.reward_worker import InlineRewards, RewardWorker
from pipeline.scoring import RewardError, RewardSample, RewardScorer, check_sources

USER_REWARD = '''
import os, time

def compute_score(*, data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "raise":
        raise ValueError("boom")
    if solution_str == "hang":
        time.sleep(60)
    if solution_str == "exit":
        os._exit(3)
    if solution_str == "nan":
        return float("nan")
    return {"score": float(solution_str in ground_truth), "gt_is_list": isinstance(ground_truth, list)}

def batched(data_sources, solution_strs, ground_truths, extra_infos):
    if "hang" in solution_strs:
        time.sleep(60)
    if "raise" in solution_strs:
        raise ValueError("boom")
    return [float(s in g) for s, g in zip(solution_strs, ground_truths)]
'''


@pytest.fixture
def user_fn(tmp_path):
    f = tmp_path / "user_reward.py"
    f.write_text(USER_REWARD)
    return lambda name="compute_score": f"{f}:{name}"


def _samples(*texts, truth=("a", "b")):
    return [RewardSample(f"p{i}", "my/source", [{"role": "user", "content": "q"}], t, list(truth), {"i": i})
            for i, t in enumerate(texts)]


def _scorer(spec, **kw):
    return RewardScorer(RewardConfig(fn=spec, **kw))


def test_raise_with_on_error_fail_names_the_sample(user_fn):
    with _scorer(user_fn(), on_error="fail") as scorer:
        with pytest.raises(RewardError, match=r"reward of sample 1 \(prompt p1, data_source 'my/source'\) "
                                              r"raised ValueError: boom; reward.on_error=fail"):
            scorer.score_batch(_samples("a", "raise", "b"))


def test_raise_with_on_error_zero_scores_0_and_counts(user_fn):
    with _scorer(user_fn(), on_error="zero") as scorer:
        out = scorer.score_batch(_samples("a", "raise", "nan", "b", "c"))
        assert [s.reward for s in out.scores] == [1.0, 0.0, 0.0, 1.0, 0.0]
        assert out.metrics() == {"reward/errors": 2, "reward/timeouts": 0, "reward/gt_is_list": 1.0}


def test_sleep_past_the_timeout_is_counted_and_the_rest_still_scored(user_fn):
    with _scorer(user_fn(), on_error="zero", timeout_s=1.0) as scorer:
        out = scorer.score_batch(_samples("a", "hang", "b", "exit", "c"))
        assert [s.reward for s in out.scores] == [1.0, 0.0, 1.0, 0.0, 0.0]
        assert (out.timeouts, out.errors) == (1, 1)  # the os._exit is an error of its own sample
        again = scorer.score_batch(_samples("b"))  # a fresh worker took over
        assert again.scores[0].reward == 1.0 and again.timeouts == 0


def test_timeout_with_on_error_fail_names_the_sample(user_fn):
    with _scorer(user_fn(), on_error="fail", timeout_s=0.5) as scorer:
        with pytest.raises(RewardError, match=r"sample 2 \(prompt p2, .*timed out after 0.5 s"):
            scorer.score_batch(_samples("a", "b", "hang"))


def test_a_hung_worker_is_killed_not_left_behind(user_fn):
    worker = RewardWorker(user_fn(), timeout_s=0.5)
    worker.wait_ready()
    pid = worker._proc.pid
    out = worker.score([("s", "hang", ["a"], None)])
    assert out[0].timed_out
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    worker.close()


def test_a_worker_that_died_between_batches_is_started_again(user_fn):
    import signal
    import time

    worker = RewardWorker(user_fn(), timeout_s=5)
    try:
        assert [o.score.reward for o in worker.score([("s", "a", ["a"], None)])] == [1.0]
        os.kill(worker._proc.pid, signal.SIGKILL)  # the OOM killer, between two batches
        time.sleep(0.2)
        assert [o.score.reward for o in worker.score([("s", "a", ["a"], None), ("s", "b", ["a"], None)])] == [1.0, 0.0]
    finally:
        worker.close()


def test_batched_reward_failure_falls_back_to_one_sample_at_a_time(user_fn):
    with _scorer(user_fn("batched"), on_error="zero", timeout_s=1.0) as scorer:
        out = scorer.score_batch(_samples("a", "hang", "b", "raise"))
        assert [s.reward for s in out.scores] == [1.0, 0.0, 1.0, 0.0]
        assert (out.timeouts, out.errors) == (1, 1)


def test_inline_rewards_follow_the_same_policy_without_a_process(user_fn):
    with _scorer(user_fn(), on_error="zero", timeout_s=None) as scorer:
        assert isinstance(scorer.rules, InlineRewards)
        out = scorer.score_batch(_samples("a", "raise"))
        assert [s.reward for s in out.scores] == [1.0, 0.0] and out.errors == 1


def test_a_reward_file_that_fails_to_import_is_a_config_error(tmp_path):
    f = tmp_path / "broken.py"
    f.write_text("raise RuntimeError('no such dependency')\n")
    with _scorer(f"{f}:compute_score") as scorer:
        with pytest.raises(ConfigError, match="importing .* failed: RuntimeError: no such dependency"):
            scorer.score_batch(_samples("a"))


def test_the_reward_worker_loads_without_the_config_layer():
    """A worker is started with each sampler and again after each timeout: it imports the reward
    modules only, not pipeline.config and pydantic (twice its start-up time)."""
    import subprocess
    import sys

    code = ("import sys, pipeline.reward_worker as w; w.load_reward_fn('digit'); "
            "print(sorted(m for m in ('pipeline.config', 'pydantic', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_auto_checks_every_data_source_before_sampling():
    check_sources(RewardConfig(), ["builtin/digit", "openai/gsm8k"])
    with pytest.raises(ConfigError, match=r"no built-in reward for data_source 'my/task'; known: "):
        check_sources(RewardConfig(), ["builtin/digit", "my/task"])
    check_sources(RewardConfig(fn="digit"), ["my/task"])  # a named reward scores any source


def test_a_reward_model_scoring_nan_stops_the_run_instead_of_training_on_it():
    scorer = RewardScorer.__new__(RewardScorer)  # the model path without loading one

    class Model:
        def score(self, messages, answers):
            return [0.5, float("nan"), 0.1]

    scorer.cfg, scorer.model, scorer.rules = RewardConfig(kind="model", model="/models/rm"), Model(), None
    with pytest.raises(RewardError, match="scored 1 of 3 samples nan"):
        scorer.score_batch(_samples("a", "b", "c"))
