"""Shared prompts: each prompt of a micro-batch goes through the model once, not once per completion.

The rows of a group (GRPO: 8 or 16 completions) share one prompt. One pass over each row's
`[prompt][response]` computes that prompt's hidden states once per row; here a micro-batch is two
passes instead:

1. its distinct prompts, [U, P] left-padded, keeping the attention cache;
2. its responses, [B, R] right-padded, at positions p_len + j, attending to their prompt's cache
   (cache rows gathered by prompt: the gradient of every row flows back into its prompt's pass).

The log-prob of response token 0 comes from the prompt pass's logits at p_len - 1, that of token
j > 0 from the response pass's column j - 1. The log-probs, and the gradient, are those of the one
pass over `[prompt][response]` up to float rounding; the work is U x P + B x R token positions
instead of B x (P + R): on the demo's batches (16 prompts of ~10 tokens, 8 answers of ~5 each) 2.3x
fewer. Rows pair up by group id and identical prompt tokens (a row whose prompt differs from its
group's first row's gets its own prompt).

Packing (`pack_shared`) keeps groups whole within a micro-batch, so that each prompt passes once;
the responses of a group then pad to its longest. `worth_sharing` picks the layout per batch: on
long, uneven answers and short prompts (the generation-heavy config: 11 prompt tokens, 40-72 answer
tokens) one pass over length-sorted rows does less work.
"""

from __future__ import annotations

import functools
import inspect

import torch

from .batch import Forward, TrainBatch, pack_micro_batches


@functools.cache
def _cache_arg(cls: type) -> str:
    """The name under which the model's forward takes an attention cache (`cache` since transformers
    5.2x, `past_key_values` before it and in models that ship their own code)."""
    return "cache" if "cache" in inspect.signature(cls.forward).parameters else "past_key_values"


def prompt_lengths(batch: TrainBatch) -> torch.Tensor:
    """Prompt tokens per row, [B] (the response is the last `mask.sum()` real tokens of a row)."""
    return batch.lengths - batch.mask.sum(-1).long()


def _prompts(batch: TrainBatch, p_len: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows heading each distinct prompt [U], each row's prompt index into them [B])."""
    ids = batch.input_ids
    (B, T), dev = ids.shape, ids.device
    rows = torch.arange(B, device=dev)
    _, group = torch.unique(batch.group_index, return_inverse=True)
    first = torch.full((int(group.max()) + 1 if B else 0,), B, dtype=torch.long, device=dev)
    first = first.scatter_reduce(0, group, rows, reduce="amin")[group]
    in_prompt = torch.arange(T, device=dev)[None] < p_len[:, None]
    same = (p_len == p_len[first]) & ((ids == ids[first]) | ~in_prompt).all(-1)
    head = torch.where(same, first, rows)
    heads, inv = torch.unique(head, return_inverse=True)
    return heads, inv


def shared_forward(model, batch: TrainBatch, temperature: float, entropy: bool = False) -> Forward:
    """`batch.forward`'s log-probs (and entropy) in two passes; see the module docstring."""
    dev = batch.input_ids.device
    p_len = prompt_lengths(batch)
    if bool((p_len < 1).any()):
        raise ValueError("shared prompts: a row has no prompt token to predict its first response token from")
    r_len = batch.mask.sum(-1).long()
    B, T = batch.input_ids.shape
    heads, inv = _prompts(batch, p_len)
    U, P, R = len(heads), int(p_len.max()), max(int(r_len.max()), 1)

    # Prompts left-padded: every prompt ends at column P - 1 (its last logits predict response token
    # 0), and a response token's distance to a prompt token in columns is its distance in positions
    # (what a sliding-window mask measures).
    shift = P - p_len[heads]
    cols = torch.arange(P, device=dev)[None] - shift[:, None]            # [U, P] the prompt's column, < 0: pad
    prompt_mask = (cols >= 0).long()
    prompt_ids = torch.gather(batch.input_ids[heads], 1, cols.clamp_min(0))
    first = model(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=cols.clamp_min(0), use_cache=True)
    cache = getattr(first, "cache", None) or getattr(first, "past_key_values", None)
    if cache is None:
        raise RuntimeError(f"{type(model).__name__} returned no attention cache; set trainer.share_prompts: false")
    last = first.logits[:, -1]  # predicts response token 0, [U, V]
    cache.batch_select_indices(inv.to(dev))

    # The second pass reads response tokens 0..R-2: the last one is predicted, never read. (It runs
    # even when R == 1, so that every rank makes the same passes: FSDP's collectives.)
    j = torch.arange(R, device=dev)
    valid = j[None] < r_len[:, None]                       # [B, R]
    at = (p_len[:, None] + j[None]).clamp_max(T - 1)       # the response's columns in the row layout
    resp = torch.gather(batch.input_ids, 1, at)
    n = max(R - 1, 1)
    mask = torch.cat([prompt_mask[inv], valid[:, :n].long()], dim=1)
    second = model(input_ids=resp[:, :n], attention_mask=mask, position_ids=p_len[:, None] + j[None, :n],
                   use_cache=True, **{_cache_arg(type(model)): cache})
    logits = torch.cat([last[inv][:, None], second.logits[:, :R - 1]], dim=1).float()  # column j predicts token j
    if temperature != 1.0:
        logits = logits / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    picked = logp_all.gather(-1, resp.unsqueeze(-1)).squeeze(-1)
    rows, js = torch.nonzero(valid, as_tuple=True)
    where = (rows, p_len[rows] + js)
    res = Forward(torch.zeros(B, T, device=dev, dtype=picked.dtype).index_put(where, picked[valid]))
    if entropy:
        ent = -(logp_all.exp() * logp_all).sum(-1)
        res.entropy = torch.zeros(B, T, device=dev, dtype=ent.dtype).index_put(where, ent[valid])
    return res


def pack_shared(batch: TrainBatch, rows: torch.Tensor, token_budget: int) -> list[torch.Tensor]:
    """Micro-batches of whole groups: groups taken longest first while groups x longest
    prompt + rows x longest response <= `token_budget` (a group over it alone). `rows`: long [b], the
    rows to pack (whole groups). Returns row-index tensors (into `batch`) covering `rows` once each."""
    p_len, r_len = prompt_lengths(batch).tolist(), batch.mask.sum(-1).long().tolist()
    gi = batch.group_index.tolist()
    members: dict[int, list[int]] = {}
    for i in rows.tolist():
        members.setdefault(gi[i], []).append(i)
    shape = {g: (max(p_len[i] for i in m), max(r_len[i] for i in m)) for g, m in members.items()}
    order = sorted(members, key=lambda g: (-sum(shape[g]), members[g][0]))
    out: list[list[int]] = []
    n_groups = n_rows = P = R = 0
    for g in order:
        m, (gp, gr) = members[g], shape[g]
        cost = (n_groups + 1) * max(P, gp) + (n_rows + len(m)) * max(R, gr)
        if out and cost <= token_budget:
            out[-1].extend(m)
            n_groups, n_rows, P, R = n_groups + 1, n_rows + len(m), max(P, gp), max(R, gr)
        else:
            out.append(list(m))
            n_groups, n_rows, P, R = 1, len(m), gp, gr
    return [torch.tensor(sorted(mb), dtype=torch.long) for mb in out]


# Per padded position, the two passes cost more than one (two model calls per micro-batch, attention
# to the gathered cache): 1.13-1.16x, measured on the demo's and the generation-heavy config's batches.
PASS_OVERHEAD = 1.15


def worth_sharing(batch: TrainBatch, token_budget: int) -> bool:
    """Whether shared prompts compute fewer positions (after PASS_OVERHEAD) than one pass over
    every row, for the whole batch (every rank holds it, so every rank decides the same)."""
    rows = torch.arange(len(batch.lengths))
    if not len(rows):
        return False
    plain = sum(len(mb) * int(batch.lengths[mb].max()) for mb in pack_micro_batches(batch.lengths, token_budget))
    p_len, r_len = prompt_lengths(batch), batch.mask.sum(-1).long()
    shared = sum(len(torch.unique(batch.group_index[mb])) * int(p_len[mb].max()) + len(mb) * int(r_len[mb].max())
                 for mb in pack_shared(batch, rows, token_budget))
    return shared * PASS_OVERHEAD < plain


def shared_padding_ratio(batch: TrainBatch, micro_batches: list[torch.Tensor]) -> float:
    """Share of padded positions in the two passes: 1 - real positions / (U x P + B x R)."""
    p_len, r_len = prompt_lengths(batch), batch.mask.sum(-1).long()
    real = padded = 0
    for mb in micro_batches:
        if not len(mb):
            continue
        heads = _prompts(batch.select(mb), p_len[mb])[0]
        real += int(p_len[mb][heads].sum()) + int(r_len[mb].sum())
        padded += len(heads) * int(p_len[mb].max()) + len(mb) * int(r_len[mb].max())
    return 1.0 - real / padded if padded else 0.0
