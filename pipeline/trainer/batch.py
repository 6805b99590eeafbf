"""Rollout rows -> padded training tensors, and token log-probs of a causal LM.

Layout: each row is `[prompt][response][pad]` (right padding). Position t of `mask`,
`behavior_logprobs` and the computed `logprobs` refers to the token at t, predicted by the
logits at t - 1; only response tokens have mask 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa
import torch


@dataclass
class TrainBatch:
    input_ids: torch.Tensor          # [B, T] long
    attention_mask: torch.Tensor     # [B, T] long
    mask: torch.Tensor               # [B, T] float, 1 on response tokens
    behavior_logprobs: torch.Tensor  # [B, T] float, 0 off-response
    rewards: torch.Tensor            # [B]
    group_index: torch.Tensor        # [B] long
    policy_version: torch.Tensor     # [B] long

    @property
    def num_tokens(self) -> int:
        return int(self.attention_mask.sum())

    @property
    def response_tokens(self) -> int:
        return int(self.mask.sum())


def collate(table: pa.Table, pad_id: int) -> TrainBatch:
    cols = table.select(["prompt_token_ids", "response_token_ids", "behavior_logprobs", "reward",
                         "group_id", "policy_version"]).to_pydict()
    n = table.num_rows
    lengths = [len(p) + len(r) for p, r in zip(cols["prompt_token_ids"], cols["response_token_ids"])]
    width = max(lengths)
    ids = torch.full((n, width), pad_id, dtype=torch.long)
    attn = torch.zeros((n, width), dtype=torch.long)
    mask = torch.zeros((n, width), dtype=torch.float32)
    blp = torch.zeros((n, width), dtype=torch.float32)
    for i, (p, r, lp) in enumerate(zip(cols["prompt_token_ids"], cols["response_token_ids"], cols["behavior_logprobs"])):
        if len(lp) != len(r):
            raise ValueError(f"row {i}: {len(r)} response tokens but {len(lp)} behaviour log-probs")
        ids[i, : len(p) + len(r)] = torch.tensor(p + r)
        attn[i, : len(p) + len(r)] = 1
        mask[i, len(p): len(p) + len(r)] = 1
        blp[i, len(p): len(p) + len(r)] = torch.tensor(lp)
    gid = {g: k for k, g in enumerate(dict.fromkeys(cols["group_id"]))}
    return TrainBatch(
        input_ids=ids, attention_mask=attn, mask=mask, behavior_logprobs=blp,
        rewards=torch.tensor(cols["reward"], dtype=torch.float32),
        group_index=torch.tensor([gid[g] for g in cols["group_id"]], dtype=torch.long),
        policy_version=torch.tensor(cols["policy_version"], dtype=torch.long),
    )


def token_logprobs(model, batch: TrainBatch, temperature: float) -> torch.Tensor:
    """log p(token_t | tokens_<t) under logits / temperature, [B, T] (position 0 is 0)."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits.float()
    logp = torch.log_softmax(logits[:, :-1] / temperature, dim=-1)
    picked = logp.gather(-1, batch.input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return torch.nn.functional.pad(picked, (1, 0)) * batch.mask
