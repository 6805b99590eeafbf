"""Held-out evaluation scores with the run's reward policy (timeouts, errors), as training does."""

import pytest

from pipeline.config import RewardConfig
from pipeline.data import PromptRow
from pipeline.evaluate import evaluate
from pipeline.models import load_tokenizer
from pipeline.sampler.backend import Completion
from pipeline.scoring import RewardError, RewardScorer


class Echo:
    """A backend stand-in: answers every prompt with its own index."""

    def generate(self, prompts, n, params):
        return [[Completion(token_ids=[1], logprobs=[0.0], text=str(i), finish_reason="stop")]
                for i, _ in enumerate(prompts)]


def _prompts(n):
    return [PromptRow(prompt_id=f"p{i}", data_source="mine", messages=f"say {i}", ground_truth=str(i),
                      extra_info=None) for i in range(n)]


@pytest.fixture
def reward_file(tmp_path):
    path = tmp_path / "reward.py"
    path.write_text("def compute_score(*, data_source, solution_str, ground_truth, extra_info=None):\n"
                    "    if solution_str == '2':\n        raise ValueError('cannot score 2')\n"
                    "    return float(solution_str == ground_truth)\n")
    return str(path)


def test_a_reward_that_raises_in_evaluation_scores_zero_and_is_counted(digit_example, reward_file):
    tok = load_tokenizer(f"{digit_example}/model")
    scorer = RewardScorer(RewardConfig(fn=f"{reward_file}:compute_score", on_error="zero", timeout_s=10))
    try:
        out = evaluate(Echo(), tok, _prompts(4), scorer, max_new_tokens=2)
    finally:
        scorer.close()
    assert out["n"] == 4 and out["score"] == 0.75 and out["reward_errors"] == 1


def test_a_reward_that_raises_in_evaluation_fails_naming_the_sample_under_fail(digit_example, reward_file):
    tok = load_tokenizer(f"{digit_example}/model")
    scorer = RewardScorer(RewardConfig(fn=f"{reward_file}:compute_score", on_error="fail", timeout_s=10))
    try:
        with pytest.raises(RewardError, match="p2"):
            evaluate(Echo(), tok, _prompts(4), scorer, max_new_tokens=2)
    finally:
        scorer.close()
