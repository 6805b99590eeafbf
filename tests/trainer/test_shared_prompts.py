"""Shared prompts (`trainer.share_prompts`): each distinct prompt passes once per micro-batch; the
log-probs, entropies and gradients are those of one pass over every row, for every architecture."""

import copy

import pytest
import torch
from trainer_rollouts import synthetic_shard

from pipeline.config import TrainerConfig
from pipeline.example import ARCH_FAMILIES, ensure_tiny_arch
from pipeline.models import load_model, load_tokenizer
from pipeline.trainer.batch import collate, forward
from pipeline.trainer.critic import ActorCritic
from pipeline.trainer.prefix import pack_shared, shared_forward, shared_padding_ratio, worth_sharing
from pipeline.trainer.step import train_step


def _batch(tok, seed=1, groups=3, group_size=4, prompts=None):
    texts = prompts or ["sort 3 1 2:", "sort 9 8 7 6 5 4 3 2 1 0 9 8 7:", "x"]
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    return collate(synthetic_shard(tok, ids, 0, groups, group_size, seed=seed, max_len=6), tok.pad_token_id)


def _grads(model, f):
    model.zero_grad()
    (f.logprobs.sum() + 0.5 * f.entropy.sum()).backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("family", sorted(ARCH_FAMILIES))
def test_two_passes_give_the_log_probs_entropies_and_gradient_of_one(family):
    path = ensure_tiny_arch(family)
    tok, model = load_tokenizer(path), load_model(path)
    batch = _batch(tok)
    plain = forward(model, batch, 0.9, entropy=True)
    g_plain = _grads(model, plain)
    shared = forward(model, batch, 0.9, entropy=True, share=True)
    g_shared = _grads(model, shared)
    assert torch.equal(shared.logprobs != 0, batch.mask > 0)
    torch.testing.assert_close(shared.logprobs, plain.logprobs, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(shared.entropy, plain.entropy, atol=1e-5, rtol=1e-4)
    for a, b in zip(g_shared, g_plain):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_a_row_whose_prompt_differs_from_its_groups_gets_its_own_prompt(digit_example):
    tok = load_tokenizer(f"{digit_example}/model")
    model = load_model(f"{digit_example}/model")
    batch = _batch(tok)
    other = tok("say 7: ", add_special_tokens=False)["input_ids"]
    ids = batch.input_ids.clone()
    ids[1, :len(other)] = torch.tensor(other)  # row 1 (group 0) now starts differently, same prompt length
    batch.input_ids = ids
    torch.testing.assert_close(shared_forward(model, batch, 1.0).logprobs, forward(model, batch, 1.0).logprobs,
                               atol=1e-5, rtol=1e-4)


def test_packing_keeps_groups_whole_within_the_budget(digit_example):
    tok = load_tokenizer(f"{digit_example}/model")
    batch = _batch(tok, groups=6, group_size=4)
    rows = torch.arange(len(batch.lengths))
    mbs = pack_shared(batch, rows, token_budget=60)
    assert sorted(torch.cat(mbs).tolist()) == rows.tolist()
    p_len = batch.lengths - batch.mask.sum(-1).long()
    for mb in mbs:
        groups = set(batch.group_index[mb].tolist())
        assert set(torch.nonzero(torch.isin(batch.group_index, torch.tensor(sorted(groups)))).flatten().tolist()) \
            == set(mb.tolist())
        cost = len(groups) * int(p_len[mb].max()) + len(mb) * int(batch.mask[mb].sum(-1).max())
        assert cost <= 60 or len(groups) == 1
    assert len(mbs) > 1
    assert 0.0 <= shared_padding_ratio(batch, mbs) < 1.0


def test_a_train_step_with_shared_prompts_makes_the_same_update(digit_example):
    tok = load_tokenizer(f"{digit_example}/model")
    base = load_model(f"{digit_example}/model")
    batch = _batch(tok, groups=4, group_size=4)
    batch.rewards = torch.rand(len(batch.rewards), generator=torch.Generator().manual_seed(0))
    out = {}
    for share in (False, True):
        model = copy.deepcopy(base)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        tc = TrainerConfig(share_prompts=share, micro_batch_tokens=64, steps=1)
        res = train_step(ActorCritic(model), None, opt, batch, tc, 1.0)
        out[share] = (res, [p.detach().clone() for p in model.parameters()])
    assert out[True][0].stats["trainer/shared_prompts"] == 1 and out[False][0].stats["trainer/shared_prompts"] == 0
    assert out[True][0].stats["trainer/micro_batches"] > 1
    assert out[True][0].loss == pytest.approx(out[False][0].loss, rel=1e-4, abs=1e-6)
    for a, b in zip(out[True][1], out[False][1]):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)


def test_shared_prompts_are_used_where_they_save_work(digit_example):
    """Long prompts, short answers: shared. One-token prompts with answers of uneven length (whole
    groups pad to their longest answer): one pass over length-sorted rows."""
    tok = load_tokenizer(f"{digit_example}/model")
    assert worth_sharing(_batch(tok, groups=4, group_size=8, prompts=["sort 9 8 7 6 5 4 3 2 1 0 9 8 7:"]), 4096)
    assert not worth_sharing(_batch(tok, groups=4, group_size=8, prompts=["x"]), 4096)
