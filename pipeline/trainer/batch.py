"""Rollout rows -> padded training tensors, dynamic micro-batches, token log-probs of a causal LM.

Layout: each row is `[prompt][response][pad]` (right padding). Position t of `mask`,
`behavior_logprobs` and the computed `logprobs` refers to the token at t, predicted by the
logits at t - 1; only response tokens have mask 1.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field, fields

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
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
    truncated: torch.Tensor          # [B] bool, cut off at the sampler's max_new_tokens (finish_reason "length")
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
    n = table.num_rows
    cols = {c: table.column(c).combine_chunks() for c in ("prompt_token_ids", "response_token_ids", "behavior_logprobs")}
    p_len, r_len, lp_len = (pc.list_value_length(cols[c]).to_numpy(zero_copy_only=False).astype(np.int64)
                            for c in ("prompt_token_ids", "response_token_ids", "behavior_logprobs"))
    bad = np.nonzero(lp_len != r_len)[0]
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"row {i}: {r_len[i]} response tokens but {lp_len[i]} behaviour log-probs")
    lengths = p_len + r_len
    width = int(lengths.max()) if n else 0
    cols_idx = np.arange(width)
    in_row = cols_idx[None, :] < lengths[:, None]
    in_resp = in_row & (cols_idx[None, :] >= p_len[:, None])
    ids = np.full((n, width), pad_id, dtype=np.int64)
    # each row: its prompt tokens then its response tokens, as laid out by the masks in row-major order
    prompt_pos = in_row & ~in_resp
    ids[prompt_pos] = _flat(cols["prompt_token_ids"], np.int64)
    ids[in_resp] = _flat(cols["response_token_ids"], np.int64)
    blp = np.zeros((n, width), dtype=np.float32)
    blp[in_resp] = _flat(cols["behavior_logprobs"], np.float32)
    groups = table.column("group_id").to_pylist()
    gid = {g: k for k, g in enumerate(dict.fromkeys(groups))}
    w = torch.ones(n) if sample_weight is None else torch.as_tensor(sample_weight, dtype=torch.float32).reshape(n)
    return TrainBatch(
        input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(in_row.astype(np.int64)),
        mask=torch.from_numpy(in_resp.astype(np.float32)), behavior_logprobs=torch.from_numpy(blp),
        rewards=torch.tensor(table.column("reward").to_pylist(), dtype=torch.float32),
        group_index=torch.tensor([gid[g] for g in groups], dtype=torch.long),
        policy_version=torch.tensor(table.column("policy_version").to_pylist(), dtype=torch.long),
        sample_weight=w, truncated=torch.from_numpy(
            pc.equal(table.column("finish_reason"), "length").to_numpy(zero_copy_only=False).astype(bool)),
        group_ids=list(gid),
    )


def _flat(lists: pa.Array, dtype) -> np.ndarray:
    """The values of a list array, row after row (offsets respected)."""
    return lists.flatten().to_numpy(zero_copy_only=False).astype(dtype, copy=False)


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


def forward(model, batch: TrainBatch, temperature: float, entropy: bool = False, hidden: bool = False,
            share: bool = False) -> Forward:
    """Token log-probs under logits / temperature (and optionally entropy, hidden states).
    `share`: each distinct prompt passes once (`pipeline.trainer.prefix`; not with `hidden`).

    Logits are computed from the column before the first response token on (`logits_to_keep`,
    where the model takes it): the LM head and log-softmax skip the prompt columns before it,
    a third of the work of a short-answer batch's head."""
    if share and not hidden:
        from .prefix import shared_forward

        return shared_forward(model, batch, temperature, entropy)
    skip = _prompt_columns(batch) if _keeps_logits(model) else 0
    keep = {"logits_to_keep": batch.input_ids.shape[1] - skip} if skip else {}
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, output_hidden_states=hidden, **keep)
    logits = out.logits.float()[:, :-1]  # column j predicts the token at skip + 1 + j
    if temperature != 1.0:  # (a copy of the logits, and one more in the backward pass)
        logits = logits / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    picked = logp_all.gather(-1, batch.input_ids[:, skip + 1:].unsqueeze(-1)).squeeze(-1)
    res = Forward(torch.nn.functional.pad(picked, (skip + 1, 0)) * batch.mask)
    if entropy:
        ent = -(logp_all.exp() * logp_all).sum(-1)
        res.entropy = torch.nn.functional.pad(ent, (skip + 1, 0)) * batch.mask
    if hidden:
        # the state that predicts token t sits at t - 1: shift right so V[t] scores the prefix before t
        res.hidden = torch.nn.functional.pad(out.hidden_states[-1][:, :-1], (0, 0, 1, 0))
    return res


def _prompt_columns(batch: TrainBatch) -> int:
    """Leading columns whose logits predict no response token: the first response column - 1."""
    cols = torch.nonzero(batch.mask.any(0)).flatten()
    return max(0, int(cols[0]) - 1) if len(cols) else 0


def _keeps_logits(model) -> bool:
    """Whether the model's forward takes `logits_to_keep` (transformers' causal LMs do; a model
    that ships its own code may not)."""
    return _forward_takes_logits_to_keep(type(model))


@functools.cache
def _forward_takes_logits_to_keep(cls: type) -> bool:
    return "logits_to_keep" in inspect.signature(cls.forward).parameters


def token_logprobs(model, batch: TrainBatch, temperature: float) -> torch.Tensor:
    """log p(token_t | tokens_<t) under logits / temperature, [B, T] (position 0 is 0)."""
    return forward(model, batch, temperature).logprobs
