"""Policy losses, registered by name. All take per-token tensors of shape [B, T] with a 0/1
`mask` over response tokens, and return (loss scalar, stats dict of floats)."""

from __future__ import annotations

from typing import Callable

import torch

LOSSES: dict[str, Callable[..., tuple[torch.Tensor, dict]]] = {}


def register(name: str):
    def deco(fn):
        LOSSES[name] = fn
        return fn
    return deco


def aggregate(x: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """`token-mean`: mean over all response tokens of the batch (long answers weigh more);
    `seq-mean-token-mean`: mean over tokens of each sequence, then over sequences."""
    if mode == "token-mean":
        return (x * mask).sum() / mask.sum().clamp_min(1)
    if mode == "seq-mean-token-mean":
        per_seq = (x * mask).sum(-1) / mask.sum(-1).clamp_min(1)
        return per_seq.mean()
    raise ValueError(f"unknown loss aggregation {mode!r}")


@register("grpo")
def clipped_policy_loss(logprobs: torch.Tensor, behavior_logprobs: torch.Tensor, advantages: torch.Tensor,
                        mask: torch.Tensor, clip_eps: float = 0.2, agg: str = "token-mean") -> tuple[torch.Tensor, dict]:
    """PPO clipped surrogate against the stored behaviour log-probs.

    ratio = exp(logp - logp_behaviour); loss = -min(ratio * A, clip(ratio, 1-eps, 1+eps) * A).
    `advantages` is [B] (per sequence) or [B, T]."""
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1).expand_as(logprobs)
    log_ratio = (logprobs - behavior_logprobs).clamp(-20, 20)
    ratio = torch.exp(log_ratio)
    unclipped = ratio * advantages
    clipped = ratio.clamp(1 - clip_eps, 1 + clip_eps) * advantages
    per_token = -torch.minimum(unclipped, clipped)
    loss = aggregate(per_token, mask, agg)
    with torch.no_grad():
        m = mask.bool()
        stats = {
            "actor/pg_loss": loss.item(),
            "actor/clip_frac": ((unclipped > clipped).float()[m].mean().item() if m.any() else 0.0),
            "actor/ratio_mean": ratio[m].mean().item() if m.any() else 1.0,
            "actor/ratio_max": ratio[m].max().item() if m.any() else 1.0,
        }
    return loss, stats


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(pi || ref): exp(ref - logp) - (ref - logp) - 1 (>= 0, unbiased)."""
    d = (ref_logprobs - logprobs).clamp(-20, 20)
    return torch.exp(d) - d - 1
