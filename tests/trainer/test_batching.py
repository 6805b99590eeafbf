"""Dynamic batching: micro-batches by token budget, accumulation equal to one big batch."""

import copy

import pyarrow as pa
import pytest
import torch
from trainer_rollouts import rollout_table as _table

from pipeline.config import TrainerConfig
from pipeline.models import load_model, load_tokenizer
from pipeline.trainer.batch import collate, forward, pack_micro_batches, padding_ratio, shard_groups
from pipeline.trainer.critic import ActorCritic, ValueHead
from pipeline.trainer.step import train_step


def test_packing_covers_every_row_once_within_the_budget():
    lengths = torch.tensor([5, 17, 3, 9, 9, 30, 2, 11])
    mbs = pack_micro_batches(lengths, token_budget=32)
    rows = torch.cat(mbs).tolist()
    assert sorted(rows) == list(range(8))
    for mb in mbs:
        assert len(mb) * int(lengths[mb].max()) <= 32 or len(mb) == 1
    # longest-first packing pads less than fixed-size chunks in arrival order
    fixed = [torch.arange(i, min(i + 2, 8)) for i in range(0, 8, 2)]
    assert padding_ratio(lengths, mbs) < padding_ratio(lengths, fixed)


def test_a_row_longer_than_the_budget_gets_its_own_micro_batch():
    mbs = pack_micro_batches(torch.tensor([50, 4, 4]), token_budget=16)
    assert [m.tolist() for m in mbs] == [[0], [1, 2]]


def test_groups_are_dealt_whole_to_ranks():
    b_index = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])

    class B:
        group_ids = ["a", "b", "c", "d"]
        group_index = b_index
        lengths = torch.tensor([4, 4, 9, 9, 2, 2, 5, 5])

    r0, r1 = shard_groups(B, 0, 2), shard_groups(B, 1, 2)
    assert sorted(r0.tolist() + r1.tolist()) == list(range(8))
    for rows in (r0, r1):
        groups = set(b_index[rows].tolist())
        assert all(set(torch.nonzero(b_index == g).flatten().tolist()) <= set(rows.tolist()) for g in groups)


def test_logits_start_at_the_first_response_column_with_the_same_log_probs_as_full_logits(digit_example):
    """The LM head runs from the column before the first response token on (`logits_to_keep`);
    log-probs and entropies are those of the full logits, for prompts of different lengths and a
    temperature. A model whose forward does not take `logits_to_keep` gets the full logits."""
    tok = load_tokenizer(f"{digit_example}/model")
    model = load_model(f"{digit_example}/model")
    table = _table(tok, [1.0, 0.0, 0.5, 0.2])
    long_prompt = tok("please say 7 now: ", add_special_tokens=False)["input_ids"]
    table = table.set_column(table.schema.get_field_index("prompt_token_ids"), "prompt_token_ids",
                             pa.array([table["prompt_token_ids"][0].as_py(), long_prompt] * 2,
                                      table.schema.field("prompt_token_ids").type))
    batch = collate(table, tok.pad_token_id)
    first = int(torch.nonzero(batch.mask.any(0)).flatten()[0])
    assert first == len(table["prompt_token_ids"][0]) > 1

    class FullLogits(torch.nn.Module):  # a model's own code without logits_to_keep
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, input_ids, attention_mask, output_hidden_states=False):
            return self.m(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=output_hidden_states)

    widths = []
    hook = model.lm_head.register_forward_hook(lambda mod, args, out: widths.append(args[0].shape[1]))
    try:
        for temperature in (1.0, 0.7):
            kept = forward(model, batch, temperature, entropy=True)
            full = forward(FullLogits(model), batch, temperature, entropy=True)
            assert torch.allclose(kept.logprobs, full.logprobs, atol=1e-6)
            assert torch.allclose(kept.entropy, full.entropy, atol=1e-6)
            assert (kept.logprobs != 0).sum() == batch.mask.sum()
    finally:
        hook.remove()
    T = batch.input_ids.shape[1]
    assert widths == [T - first + 1, T, T - first + 1, T]


@pytest.mark.parametrize("algorithm,agg", [("grpo", "token-mean"), ("rloo", "seq-mean-token-mean"), ("ppo", "token-mean")])
def test_gradient_accumulation_equals_one_big_batch(digit_example, algorithm, agg):
    torch.manual_seed(0)
    tok = load_tokenizer(f"{digit_example}/model")
    base = load_model(f"{digit_example}/model").train()
    critic = ValueHead(base.config.hidden_size) if algorithm == "ppo" else None
    if critic is not None:
        torch.nn.init.normal_(critic.out.weight, std=0.1)  # a critic with an opinion, so V-trace matters
    batch = collate(_table(tok, [1.0, 0.0, 0.5, 0.0, 1.0, 1.0, 0.0, 0.2], versions=[0, 0, 0, 0, 1, 1, 1, 1]),
                    tok.pad_token_id, sample_weight=torch.tensor([1.0] * 4 + [0.5] * 4))
    results = {}
    for budget in (10_000, 12):
        actor = ActorCritic(copy.deepcopy(base), copy.deepcopy(critic))
        opt = torch.optim.SGD(actor.parameters(), lr=0.5)
        # (rows one by one: shared prompts keep groups whole, see test_shared_prompts)
        tc = TrainerConfig(algorithm=algorithm, loss_agg=agg, micro_batch_tokens=budget, max_grad_norm=1e9,
                           share_prompts=False)
        res = train_step(actor, None, opt, batch, tc, temperature=1.0)
        results[budget] = (res, {k: v.detach().clone() for k, v in actor.named_parameters()})
    big, small = results[10_000], results[12]
    assert big[0].stats["trainer/micro_batches"] == 1 and small[0].stats["trainer/micro_batches"] >= 4
    assert abs(big[0].loss - small[0].loss) < 1e-6
    moved = max((big[1][k] - p).abs().max().item() for k, p in base.named_parameters() for k in [f"policy.{k}"])
    assert moved > 1e-4  # the update is not trivially zero
    for k in big[1]:
        assert torch.allclose(big[1][k], small[1][k], atol=1e-6), k
    assert torch.allclose(big[0].priorities, small[0].priorities, atol=1e-6)


def test_ppo_step_trains_the_value_head_toward_the_reward(digit_example):
    torch.manual_seed(0)
    tok = load_tokenizer(f"{digit_example}/model")
    policy = load_model(f"{digit_example}/model").train()
    actor = ActorCritic(policy, ValueHead(policy.config.hidden_size))
    opt = torch.optim.AdamW(actor.parameters(), lr=3e-3)
    batch = collate(_table(tok, [1.0] * 8), tok.pad_token_id)
    tc = TrainerConfig(algorithm="ppo", vf_coef=1.0)
    first = train_step(actor, None, opt, batch, tc, temperature=1.0)
    for _ in range(25):
        last = train_step(actor, None, opt, batch, tc, temperature=1.0)
    assert first.stats["critic/value_mean"] == 0.0  # zero-initialised output layer
    # every completion earned 1 (gamma = 1): the value of every prefix converges to 1
    assert abs(last.stats["critic/value_mean"] - 1.0) < 0.25
