"""Policy and value losses with the off-policy corrections.

All per-token tensors are [B, T] in the batch layout of `batch.py`, with a 0/1 `mask` over response
tokens. Three policies appear (Hilton et al. 2021, "decoupled PPO"; AReaL):

- behaviour mu: the sampler's policy that generated the tokens (`behavior_logprobs`, stored with
  each rollout; never recomputed by the trainer);
- proximal pi_prox: the trainer's policy at the start of this optimizer step (the trust region);
- current pi_theta: the policy being optimised.

Decoupled objective per token:  -w * min(r A, clip(r, 1-eps, 1+eps) A), with r = pi_theta / pi_prox
and w = min(pi_prox / mu, C) (truncated IS, per token or per sequence). With `decoupled=False`
the ratio is taken against mu directly (classic PPO: the ratio is the IS weight and its clip a
trust region around mu; stale tokens outside the region get no gradient). With one optimizer
update per batch pi_prox = pi_theta, so the decoupled clip binds only with `update_epochs` > 1;
on the tiny demo the behaviour-anchored clip learns more stably on fresh data (staleness <= 2),
and replay updates, whose data is older, learn more with the decoupled objective
(`step.replay_config`, bench/reuse.py).

Gradient accumulation: losses are sums divided by a denominator computed once for the whole
batch (`denominator`), so summing micro-batch losses gives exactly the full-batch loss.
"""

from __future__ import annotations

import torch

AGGREGATIONS = ("token-mean", "seq-mean-token-mean")


def denominator(mask: torch.Tensor, mode: str) -> float:
    """What `aggregate` divides by, for the whole batch: response tokens or sequences."""
    if mode == "token-mean":
        return max(float(mask.sum()), 1.0)
    if mode == "seq-mean-token-mean":
        return max(float((mask.sum(-1) > 0).sum()), 1.0)
    raise ValueError(f"trainer.loss_agg: unknown aggregation {mode!r}; use one of {', '.join(AGGREGATIONS)}")


def aggregate_sum(x: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """The numerator of `aggregate` (summable over micro-batches)."""
    if mode == "token-mean":
        return (x * mask).sum()
    if mode == "seq-mean-token-mean":
        return ((x * mask).sum(-1) / mask.sum(-1).clamp_min(1)).sum()
    raise ValueError(f"trainer.loss_agg: unknown aggregation {mode!r}; use one of {', '.join(AGGREGATIONS)}")


def aggregate(x: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """`token-mean`: mean over all response tokens of the batch (long answers weigh more);
    `seq-mean-token-mean`: mean over tokens of each sequence, then over sequences."""
    return aggregate_sum(x, mask, mode) / denominator(mask, mode)


def is_weights(prox_logprobs: torch.Tensor, behavior_logprobs: torch.Tensor, mask: torch.Tensor,
               level: str, clip: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Truncated importance weights of behaviour -> proximal policy.

    token: w_t = min(pi_prox(a_t) / mu(a_t), C); sequence: w = min(prod_t pi_prox / mu, C) on
    every token of the sequence; none: 1. Returns (truncated [B, T], raw untruncated [B, T]),
    both 1 off-response."""
    log_w = (prox_logprobs - behavior_logprobs) * mask
    if level == "token":
        raw = torch.exp(log_w.clamp(-20, 20))
    elif level == "sequence":
        raw = torch.exp(log_w.sum(-1, keepdim=True).clamp(-20, 20)).expand_as(mask)
    elif level == "none":
        raw = torch.ones_like(mask)
    else:
        raise ValueError(f"trainer.is_level: unknown level {level!r}; use token, sequence or none")
    raw = torch.where(mask > 0, raw, torch.ones_like(raw))
    return raw.clamp(max=clip), raw


def policy_loss(logprobs: torch.Tensor, prox_logprobs: torch.Tensor, behavior_logprobs: torch.Tensor,
                advantages: torch.Tensor, mask: torch.Tensor, *, clip_eps: float = 0.2, decoupled: bool = True,
                is_level: str = "token", is_clip: float = 1.0) -> tuple[torch.Tensor, dict]:
    """Per-token policy loss [B, T] and its statistics (sums and counts, see `StepStats`).

    `advantages` is [B] (per sequence) or [B, T]; `prox_logprobs` must carry no gradient."""
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1).expand_as(logprobs)
    m = mask > 0
    w, raw = is_weights(prox_logprobs, behavior_logprobs, mask, is_level if decoupled else "token", is_clip)
    anchor = prox_logprobs
    if not decoupled:
        # the ratio to the behaviour policy is itself the IS weight; `raw` stays as a diagnostic
        w, anchor = torch.ones_like(mask), behavior_logprobs
    ratio = torch.exp((logprobs - anchor).clamp(-20, 20))
    unclipped = ratio * advantages
    clipped = ratio.clamp(1 - clip_eps, 1 + clip_eps) * advantages
    per_token = -w * torch.minimum(unclipped, clipped)
    with torch.no_grad():
        stats = {
            "tokens": float(m.sum()),
            "clip_sum": float((unclipped > clipped)[m].float().sum()),
            "ratio_sum": float(ratio[m].sum()),
            "ratio_max": float(ratio[m].max()) if m.any() else 1.0,
            "is_sum": float(raw[m].sum()),
            "is_max": float(raw[m].max()) if m.any() else 1.0,
            "is_clipped": float((raw > is_clip)[m].float().sum()) if decoupled and is_level != "none" else 0.0,
        }
    return per_token, stats


def clipped_policy_loss(logprobs: torch.Tensor, behavior_logprobs: torch.Tensor, advantages: torch.Tensor,
                        mask: torch.Tensor, clip_eps: float = 0.2, agg: str = "token-mean") -> tuple[torch.Tensor, dict]:
    """Classic PPO clipped surrogate against the behaviour policy, aggregated: (loss, stats)."""
    per_token, s = policy_loss(logprobs, behavior_logprobs, behavior_logprobs, advantages, mask,
                               clip_eps=clip_eps, decoupled=False)
    loss = aggregate(per_token, mask, agg)
    n = max(s["tokens"], 1.0)
    return loss, {"actor/pg_loss": loss.item(), "actor/clip_frac": s["clip_sum"] / n,
                  "actor/ratio_mean": s["ratio_sum"] / n if s["tokens"] else 1.0, "actor/ratio_max": s["ratio_max"]}


def kl_k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k1 estimator of KL(pi || ref): logp - ref (unbiased, can be negative)."""
    return logprobs - ref_logprobs


def kl_k2(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k2 estimator of KL(pi || ref): 0.5 (logp - ref)^2 (>= 0, biased). As a loss, on
    tokens sampled from pi, its expected gradient is exactly that of KL(pi || ref) (Tang & Munos
    2025, arXiv 2506.09477): the penalty that keeps the policy near the reference."""
    return 0.5 * (logprobs - ref_logprobs) ** 2


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(pi || ref): exp(ref - logp) - (ref - logp) - 1 (>= 0, unbiased)."""
    d = (ref_logprobs - logprobs).clamp(-20, 20)
    return torch.exp(d) - d - 1


KL_ESTIMATORS = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}


def value_loss(values: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-token squared error 0.5 (V - target)^2, [B, T]; targets carry no gradient."""
    return 0.5 * (values - targets) ** 2
