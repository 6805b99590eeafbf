"""Rollout rows -> padded training tensors, dynamic micro-batches, token log-probs of a causal LM.

Layout: each row is `[prompt][response][pad]` (right padding). Position t of `mask`,
`behavior_logprobs` and the computed `logprobs` refers to the token at t, predicted by the
logits at t - 1; only response tokens have mask 1.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import pyarrow as pa
import torch


@dataclass
class TrainBatch:
    input_ids: torch.Tensor          # [B, T] long
    attention_mask: torch.Tensor     # [B, T] long
    mask: torch.Tensor               # [B, T] float, 1 on response tokens
    behavior_logprobs: torch.Tensor  # [B, T] float, 0 off-response
    rewards: torch.Tensor            # [B]
    group_index: torch.Tensor        # [B] long, index into `group_ids`
    policy_version: torch.Tensor     # [B] long
    sample_weight: torch.Tensor      # [B] float, prioritized-replay importance weight (1 for fresh data)
    group_ids: list[str] = field(default_factory=list)  # [G] the buffer's group ids

    @property
    def num_tokens(self) -> int:
        return int(self.attention_mask.sum())

    @property
    def response_tokens(self) -> int:
        return int(self.mask.sum())

    @property
    def lengths(self) -> torch.Tensor:
        """Real (unpadded) tokens per row, [B]."""
        return self.attention_mask.sum(-1)

    def select(self, rows: torch.Tensor) -> "TrainBatch":
        """Rows `rows` (long [b]), trimmed to their own longest row."""
        width = max(int(self.lengths[rows].max()), 1) if rows.numel() else 1
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name == "group_ids":
                out[f.name] = v
            elif v.dim() == 2:
                out[f.name] = v[rows, :width]
            else:
                out[f.name] = v[rows]
        return TrainBatch(**out)

    def to(self, device) -> "TrainBatch":
        return TrainBatch(**{f.name: (getattr(self, f.name) if f.name == "group_ids" else getattr(self, f.name).to(device))
                             for f in fields(self)})


def collate(table: pa.Table, pad_id: int, sample_weight=None) -> TrainBatch:
    """Arrow rows (the rollout schema) -> TrainBatch; `sample_weight` [num_rows] or None (all 1)."""
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
    w = torch.ones(n) if sample_weight is None else torch.as_tensor(sample_weight, dtype=torch.float32).reshape(n)
    return TrainBatch(
        input_ids=ids, attention_mask=attn, mask=mask, behavior_logprobs=blp,
        rewards=torch.tensor(cols["reward"], dtype=torch.float32),
        group_index=torch.tensor([gid[g] for g in cols["group_id"]], dtype=torch.long),
        policy_version=torch.tensor(cols["policy_version"], dtype=torch.long),
        sample_weight=w, group_ids=list(gid),
    )


def shard_groups(batch: TrainBatch, rank: int, world: int) -> torch.Tensor:
    """Rows of the groups this rank trains on, [b] long. Every rank holds the same batch; groups
    (never split) are dealt to ranks largest first to the least loaded rank, by token count, so
    the assignment is deterministic and balanced."""
    G = len(batch.group_ids)
    tokens = torch.zeros(G).index_add_(0, batch.group_index, batch.lengths.float())
    load = [0.0] * world
    owner = [0] * G
    for g in sorted(range(G), key=lambda g: (-float(tokens[g]), g)):
        r = min(range(world), key=lambda r: (load[r], r))
        owner[g] = r
        load[r] += float(tokens[g])
    mine = torch.tensor([owner[int(g)] == rank for g in batch.group_index], dtype=torch.bool)
    return torch.nonzero(mine).flatten()


def pack_micro_batches(lengths: torch.Tensor, token_budget: int) -> list[torch.Tensor]:
    """Dynamic batching: rows grouped so that rows x longest row <= `token_budget` per micro-batch.

    `lengths` [B] real tokens per row. Rows are taken longest first (similar lengths share a
    micro-batch, so little padding); a row longer than the budget gets a micro-batch of its own.
    Returns a list of row-index tensors covering every row exactly once."""
    order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    out: list[list[int]] = []
    width = 0
    for i in order:
        n = int(lengths[i])
        if out and (len(out[-1]) + 1) * max(width, n) <= token_budget:
            out[-1].append(i)
            width = max(width, n)
        else:
            out.append([i])
            width = n
    return [torch.tensor(sorted(mb), dtype=torch.long) for mb in out]


def padding_ratio(lengths: torch.Tensor, micro_batches: list[torch.Tensor]) -> float:
    """Share of padded positions in the micro-batches: 1 - real tokens / (rows x width)."""
    padded = sum(len(mb) * int(lengths[mb].max()) for mb in micro_batches if len(mb))
    real = sum(int(lengths[mb].sum()) for mb in micro_batches)
    return 1.0 - real / padded if padded else 0.0


@dataclass
class Forward:
    logprobs: torch.Tensor                # [B, T], 0 off-response
    entropy: torch.Tensor | None = None   # [B, T]
    hidden: torch.Tensor | None = None    # [B, T, H] final hidden states (for the value head)


def forward(model, batch: TrainBatch, temperature: float, entropy: bool = False, hidden: bool = False) -> Forward:
    """Token log-probs under logits / temperature (and optionally entropy, hidden states)."""
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, output_hidden_states=hidden)
    logits = out.logits.float()[:, :-1] / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    picked = logp_all.gather(-1, batch.input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    res = Forward(torch.nn.functional.pad(picked, (1, 0)) * batch.mask)
    if entropy:
        ent = -(logp_all.exp() * logp_all).sum(-1)
        res.entropy = torch.nn.functional.pad(ent, (1, 0)) * batch.mask
    if hidden:
        # the state that predicts token t sits at t - 1: shift right so V[t] scores the prefix before t
        res.hidden = torch.nn.functional.pad(out.hidden_states[-1][:, :-1], (0, 0, 1, 0))
    return res


def token_logprobs(model, batch: TrainBatch, temperature: float) -> torch.Tensor:
    """log p(token_t | tokens_<t) under logits / temperature, [B, T] (position 0 is 0)."""
    return forward(model, batch, temperature).logprobs
