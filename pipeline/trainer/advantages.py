"""Advantage estimators, registered by name.

Shapes: `rewards` [N] (one scalar per completion), `group_index` [N] (int id of each completion's
group). Returns advantages [N], broadcast over response tokens by the loss.
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


@register("grpo")
def grpo_advantages(rewards: torch.Tensor, group_index: torch.Tensor, std_normalize: bool = True,
                    eps: float = 1e-6) -> torch.Tensor:
    """(r - mean_group(r)) / (std_group(r) + eps); without std normalisation: r - mean_group(r).

    The std is the unbiased sample std of the group, as in the GRPO paper and verl. A group whose
    rewards are all equal gets zero advantage (no signal)."""
    groups = torch.unique(group_index)
    adv = torch.zeros_like(rewards, dtype=torch.float32)
    for g in groups:
        m = group_index == g
        r = rewards[m].float()
        centred = r - r.mean()
        if std_normalize:
            std = r.std(unbiased=True) if r.numel() > 1 else torch.tensor(0.0)
            centred = centred / (std + eps)
        adv[m] = centred
    return adv
