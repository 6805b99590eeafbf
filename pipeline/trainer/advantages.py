"""Advantage estimators, registered by name, and the token-level returns of the critic.

Sequence-level estimators (`ADVANTAGES`) take `rewards` [N] (one scalar per completion) and
`group_index` [N] (int id of each completion's group) and return advantages [N], broadcast over
the response tokens by the loss. Token-level estimators (`gae`, `vtrace`) take [B, T] tensors in
the batch layout of `batch.py` (position t = the token at t, 0 off-response).
"""

from __future__ import annotations

from typing import Callable

import torch

ADVANTAGES: dict[str, Callable[..., torch.Tensor]] = {}


def register(name: str):
    def deco(fn):
        ADVANTAGES[name] = fn
        return fn
    return deco


def _group_stats(rewards: torch.Tensor, group_index: torch.Tensor):
    """Per-row group size, group sum, unbiased group std and whether the group's rewards are all
    equal (a float sum of equal rewards divided by their count can miss them by an ulp, which the
    std normalisation would blow up into a spurious advantage), each [N]."""
    r = rewards.float()
    n_groups = int(group_index.max()) + 1 if group_index.numel() else 0
    count = torch.zeros(n_groups).index_add_(0, group_index, torch.ones_like(r))
    total = torch.zeros(n_groups).index_add_(0, group_index, r)
    mean = total / count.clamp_min(1)
    sq = torch.zeros(n_groups).index_add_(0, group_index, (r - mean[group_index]) ** 2)
    std = torch.where(count > 1, (sq / (count - 1).clamp_min(1)).sqrt(), torch.zeros_like(sq))
    hi = torch.full((n_groups,), -torch.inf).scatter_reduce(0, group_index, r, reduce="amax")
    lo = torch.full((n_groups,), torch.inf).scatter_reduce(0, group_index, r, reduce="amin")
    return count[group_index], total[group_index], std[group_index], (hi == lo)[group_index]


@register("grpo")
def grpo_advantages(rewards: torch.Tensor, group_index: torch.Tensor, std_normalize: bool = True,
                    eps: float = 1e-6, **_) -> torch.Tensor:
    """(r - mean_group(r)) / (std_group(r) + eps); without std normalisation: r - mean_group(r).

    The std is the unbiased sample std of the group, as in the GRPO paper and verl. A group whose
    rewards are all equal gets exactly zero advantage (no signal)."""
    count, total, std, flat = _group_stats(rewards, group_index)
    centred = rewards.float() - total / count
    adv = centred / (std + eps) if std_normalize else centred
    return torch.where(flat, torch.zeros_like(adv), adv)


@register("dr_grpo")
def dr_grpo_advantages(rewards: torch.Tensor, group_index: torch.Tensor, **_) -> torch.Tensor:
    """Dr. GRPO: r - mean_group(r), no std normalisation (removes the difficulty bias)."""
    return grpo_advantages(rewards, group_index, std_normalize=False)


@register("rloo")
def rloo_advantages(rewards: torch.Tensor, group_index: torch.Tensor, **_) -> torch.Tensor:
    """REINFORCE leave-one-out: r_i - mean_{j != i} r_j over the group (0 for a group of one, or
    one whose rewards are all equal)."""
    count, total, _, flat = _group_stats(rewards, group_index)
    r = rewards.float()
    loo = (total - r) / (count - 1).clamp_min(1)
    return torch.where((count > 1) & ~flat, r - loo, torch.zeros_like(r))


@register("reinforce_pp")
def reinforce_pp_advantages(rewards: torch.Tensor, group_index: torch.Tensor, eps: float = 1e-8,
                            response_tokens: torch.Tensor | None = None, **_) -> torch.Tensor:
    """REINFORCE++-baseline (arXiv 2501.03262, eq. 10): r - mean_group(r), whitened over every
    response token of the batch, as verl and OpenRLHF do: each sequence's value counts once per
    response token (`response_tokens` [B]; None: once per sequence). Whitened per sequence
    instead, the group-centred values (mean 0) would only be rescaled: Dr. GRPO up to a constant."""
    centred = grpo_advantages(rewards, group_index, std_normalize=False)
    w = torch.ones_like(centred) if response_tokens is None else response_tokens.to(centred).clamp_min(0)
    n = float(w.sum())
    if n < 2:
        return centred
    mean = (w * centred).sum() / n
    var = (w * (centred - mean) ** 2).sum() / n * (n / (n - 1))  # unbiased, as verl's masked_whiten
    return (centred - mean) * torch.rsqrt(var + eps)


def token_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sequence reward placed on the last response token: [B] -> [B, T]."""
    T = mask.shape[1]
    pos = torch.arange(T).expand_as(mask)
    last = torch.where(mask > 0, pos, torch.full_like(pos, -1)).max(-1).values  # [B]
    out = torch.zeros_like(mask, dtype=torch.float32)
    rows = torch.arange(mask.shape[0])[last >= 0]
    out[rows, last[last >= 0]] = rewards.float()[last >= 0]
    return out


def gae(values: torch.Tensor, rewards: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float):
    """Generalised advantage estimation over response tokens.

    values, rewards, mask: [B, T]. V after the last response token is 0 (episode end).
    delta_t = r_t + gamma V_{t+1} - V_t;  A_t = delta_t + gamma lam A_{t+1}.
    Returns (advantages [B, T], returns = A + V [B, T]), 0 off-response."""
    _, returns = vtrace(values, rewards, mask, torch.zeros_like(values), gamma, lam, rho_bar=1.0, c_bar=1.0)
    return (returns - values.float()) * mask, returns


def vtrace(values: torch.Tensor, rewards: torch.Tensor, mask: torch.Tensor, log_rho: torch.Tensor,
           gamma: float, lam: float, rho_bar: float = 1.0, c_bar: float = 1.0):
    """V-trace targets (Espeholt et al. 2018) over response tokens, with lambda traces.

    log_rho [B, T] = log pi(a_t) - log mu(a_t) (target vs behaviour policy).
    rho_t = min(rho_bar, e^log_rho), c_t = lam * min(c_bar, e^log_rho),
    delta_t = rho_t (r_t + gamma V_{t+1} - V_t),
    v_t = V_t + delta_t + gamma c_t (v_{t+1} - V_{t+1}).
    Policy-gradient advantage r_t + gamma v_{t+1} - V_t, returned *without* its factor rho_t:
    the policy loss applies the truncated importance weight (`losses.is_weights`, clip C) itself.
    With pi = mu (log_rho = 0) and rho_bar, c_bar >= 1 the targets are GAE's: v = A^GAE + V.
    Returns (advantages [B, T], value targets v [B, T]), 0 off-response."""
    B, T = values.shape
    m = mask.float()
    ratio = torch.exp(log_rho.clamp(-20, 20)) * m
    rho = ratio.clamp(max=rho_bar)
    c = lam * ratio.clamp(max=c_bar)
    v = values.float() * m
    next_v = torch.zeros(B)          # V_{t+1} (0 past the end)
    next_target = torch.zeros(B)     # v_{t+1}
    targets = torch.zeros(B, T)
    adv = torch.zeros(B, T)
    for t in range(T - 1, -1, -1):
        on = m[:, t] > 0
        delta = rho[:, t] * (rewards[:, t] + gamma * next_v - v[:, t])
        tgt = v[:, t] + delta + gamma * c[:, t] * (next_target - next_v)
        adv[:, t] = torch.where(on, rewards[:, t] + gamma * next_target - v[:, t], adv[:, t])
        targets[:, t] = torch.where(on, tgt, targets[:, t])
        next_v = torch.where(on, v[:, t], next_v)
        next_target = torch.where(on, tgt, next_target)
    return adv * m, targets * m
