"""The critic of PPO: a small value head on the policy's final hidden states.

Design: the head reads the policy trunk's last hidden state *detached*, so the value loss never
moves the policy weights (no tug of war between value and policy gradients in a shared trunk)
and the policy checkpoint stays a plain Hugging Face model. The head is an MLP
hidden -> hidden -> 1 with its own learning rate; in checkpoints its entries are keyed
`critic.<name>`, next to the policy's `model.<hf name>`.
"""

from __future__ import annotations

import torch
from torch import nn


class ValueHead(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.fc = nn.Linear(hidden, hidden)
        self.out = nn.Linear(hidden, 1)
        nn.init.zeros_(self.out.weight)
        nn.init.zeros_(self.out.bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """h [B, T, H] -> values [B, T]."""
        h = h.detach().to(self.fc.weight.dtype)  # the trunk may compute in bf16; the head in fp32
        return self.out(torch.tanh(self.fc(h))).squeeze(-1)


class ActorCritic(nn.Module):
    """The trained modules: `policy` (a Hugging Face causal LM) and an optional `critic`."""

    def __init__(self, policy: nn.Module, critic: ValueHead | None = None):
        super().__init__()
        self.policy = policy
        self.critic = critic
