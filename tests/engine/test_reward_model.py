"""The reward model: a tiny sequence classifier built offline, scoring prompt + completion in batches."""

import os

import pytest
import torch

from pipeline.config import ConfigError, RewardConfig
from pipeline.example import build_tiny_reward_model
from pipeline.reward_model import RewardModel, check_device
from pipeline.scoring import RewardSample, RewardScorer

PROMPT = [{"role": "user", "content": "say 3:"}]


@pytest.fixture(scope="module")
def rm_dir(digit_example, tmp_path_factory):
    return build_tiny_reward_model(str(tmp_path_factory.mktemp("rm") / "rm"), os.path.join(digit_example, "model"))


def test_tiny_reward_model_scores_the_share_of_its_target_token(rm_dir):
    rm = RewardModel(rm_dir, batch_size=3)
    texts = ["12", "7", "77", "7777777", "1111117"]
    scores = rm.score([PROMPT] * len(texts), texts)
    assert scores[0] < 0.2 < scores[1] < scores[2] < scores[3]
    assert scores[4] < scores[1]  # one 7 among many other digits counts for less
    # batching and padding change nothing: each scored alone gives the same numbers
    alone = [rm.score([PROMPT], [t])[0] for t in texts]
    assert scores == pytest.approx(alone, abs=1e-5)


def test_reward_model_text_uses_the_chat_template_with_the_completion_as_assistant_turn(rm_dir):
    rm = RewardModel(rm_dir)
    text, templated = rm.text_of(PROMPT, "777")
    assert templated and text == "say 3:777"
    assert rm.text_of("plain prompt ", "x") == ("plain prompt x", False)


def test_reward_model_options_sigmoid_and_label(rm_dir):
    raw = RewardModel(rm_dir).score([PROMPT], ["77"])[0]
    squashed = RewardModel(rm_dir, sigmoid=True).score([PROMPT], ["77"])[0]
    assert squashed == pytest.approx(float(torch.sigmoid(torch.tensor(raw))), abs=1e-6)
    with pytest.raises(ConfigError, match="reward.model_label: 1 but the model has 1 label"):
        RewardModel(rm_dir, label=1)


def test_not_a_classifier_folder_is_a_config_error(tmp_path):
    with pytest.raises((ConfigError, FileNotFoundError), match="reward.model|does not exist"):
        RewardModel(str(tmp_path / "nothing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="reward.model: .* is not a Hugging Face sequence-classification"):
        RewardModel(str(tmp_path / "empty"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_device_without_cuda_is_a_config_error():
    with pytest.raises(ConfigError, match="reward.device: 'cuda:0' but torch sees no CUDA device"):
        check_device("cuda:0")


def test_scorer_with_kind_model_scores_batches(rm_dir):
    with RewardScorer(RewardConfig(kind="model", model=rm_dir, batch_size=2)) as scorer:
        out = scorer.score_batch([RewardSample(f"p{i}", "builtin/digit", PROMPT, t, "3") for i, t in
                                  enumerate(["1", "7", "77"])])
    r = [s.reward for s in out.scores]
    assert r[0] < r[1] < r[2] and out.errors == out.timeouts == 0


def test_kind_model_needs_a_model():
    from pipeline.config import parse_config

    with pytest.raises(ConfigError, match="reward.kind=model needs reward.model"):
        parse_config({"reward": {"kind": "model"}})
