import torch
from trainer_rollouts import rollout_table

from pipeline.config import TrainerConfig
from pipeline.models import load_model, load_tokenizer
from pipeline.trainer.batch import collate, token_logprobs
from pipeline.trainer.critic import ActorCritic
from pipeline.trainer.step import train_step


def _table(tok, rewards, versions=None):
    return rollout_table(tok, rewards, versions)


def test_parameters_change_after_one_step(digit_example):
    torch.manual_seed(0)
    model = load_model(f"{digit_example}/model").train()
    tok = load_tokenizer(f"{digit_example}/model")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    batch = collate(_table(tok, [1.0, 0.0, 0.5, 0.0, 1.0, 1.0, 0.0, 0.2]), tok.pad_token_id)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    res = train_step(ActorCritic(model), None, opt, batch, TrainerConfig(), temperature=1.0)
    loss, stats = torch.tensor(res.loss), res.stats
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
    # every trainable matrix moved (rotary buffers are not parameters)
    params = {k for k, _ in model.named_parameters()}
    assert set(changed) >= params, sorted(params - set(changed))[:5]
    assert stats["actor/grad_norm"] > 0 and torch.isfinite(loss)


def test_no_update_when_groups_have_no_reward_variance(digit_example):
    model = load_model(f"{digit_example}/model").train()
    tok = load_tokenizer(f"{digit_example}/model")
    before = {k: v.clone() for k, v in model.named_parameters()}
    batch = collate(_table(tok, [0.5] * 8), tok.pad_token_id)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    res = train_step(ActorCritic(model), None, opt, batch, TrainerConfig(), temperature=1.0)
    loss, stats = torch.tensor(res.loss), res.stats
    assert loss.item() == 0.0 and stats["actor/grad_norm"] == 0.0
    assert all(torch.equal(v, before[k]) for k, v in model.named_parameters())


def test_collate_aligns_behaviour_logprobs_with_response_tokens(digit_example):
    tok = load_tokenizer(f"{digit_example}/model")
    t = _table(tok, [1.0, 0.0, 0.0, 0.0])
    b = collate(t, tok.pad_token_id)
    row = t.to_pylist()[2]
    p, r = len(row["prompt_token_ids"]), len(row["response_token_ids"])
    assert b.mask[2].tolist() == [0.0] * p + [1.0] * r + [0.0] * (b.mask.shape[1] - p - r)
    assert b.input_ids[2, p: p + r].tolist() == row["response_token_ids"]
    assert b.behavior_logprobs[2, p: p + r].tolist() == [-1.0] * r
    model = load_model(f"{digit_example}/model").eval()
    with torch.no_grad():
        lp = token_logprobs(model, b, 1.0)
        logits = model(input_ids=b.input_ids[2:3, : p + r]).logits[0]
    manual = torch.log_softmax(logits[p - 1], -1)[row["response_token_ids"][0]]
    assert torch.allclose(lp[2, p], manual, atol=1e-5)


def test_collate_lays_out_prompt_then_response_per_row_and_checks_the_log_probs():
    import pyarrow as pa
    import pytest

    rows = {"prompt_token_ids": [[9, 9], [1, 2, 3], [4]], "response_token_ids": [[9], [5, 6], [7, 8, 0]],
            "behavior_logprobs": [[-9.0], [-0.5, -0.6], [-0.7, -0.8, -0.1]], "reward": [0.0, 1.0, 0.5],
            "group_id": ["x", "g1", "g2"], "policy_version": [0, 3, 4]}
    table = pa.table(rows).slice(1)  # a slice: the list columns start at an offset
    b = collate(table, pad_id=99)
    assert b.input_ids.tolist() == [[1, 2, 3, 5, 6], [4, 7, 8, 0, 99]]
    assert b.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]
    assert b.mask.tolist() == [[0, 0, 0, 1, 1], [0, 1, 1, 1, 0]]
    assert torch.allclose(b.behavior_logprobs, torch.tensor([[0, 0, 0, -0.5, -0.6], [0, -0.7, -0.8, -0.1, 0]]))
    assert b.group_ids == ["g1", "g2"] and b.policy_version.tolist() == [3, 4]
    rows["behavior_logprobs"][2] = [-0.7]
    with pytest.raises(ValueError, match="row 1: 3 response tokens but 1 behaviour log-probs"):
        collate(pa.table(rows).slice(1), pad_id=99)
