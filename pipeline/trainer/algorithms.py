"""RL algorithms, registered by name: which advantage estimator, whether a critic is trained.

| name          | advantage                                  | critic |
|---------------|--------------------------------------------|--------|
| grpo          | group-normalised reward (std on/off by `std_normalize`) | no |
| dr_grpo       | group-centred reward, no std (Dr. GRPO)    | no     |
| rloo          | leave-one-out baseline                     | no     |
| reinforce_pp  | group-centred, whitened over the batch's response tokens | no |
| ppo           | token-level GAE or V-trace from a value head | yes  |

Every algorithm uses the same policy loss (`losses.policy_loss`): the decoupled clipped objective
with truncated importance weights from the stored behaviour log-probs.
"""

from __future__ import annotations

from dataclasses import dataclass

from .advantages import ADVANTAGES


@dataclass(frozen=True)
class Algorithm:
    name: str
    advantage: str | None  # a key of ADVANTAGES, or None for token-level critic advantages
    critic: bool = False


ALGORITHMS: dict[str, Algorithm] = {}


def register(algo: Algorithm) -> Algorithm:
    if algo.advantage is not None and algo.advantage not in ADVANTAGES:
        raise ValueError(f"algorithm {algo.name!r}: unknown advantage estimator {algo.advantage!r}")
    ALGORITHMS[algo.name] = algo
    return algo


register(Algorithm("grpo", "grpo"))
register(Algorithm("dr_grpo", "dr_grpo"))
register(Algorithm("rloo", "rloo"))
register(Algorithm("reinforce_pp", "reinforce_pp"))
register(Algorithm("ppo", None, critic=True))


def get_algorithm(name: str) -> Algorithm:
    if name not in ALGORITHMS:
        raise ValueError(f"trainer.algorithm: unknown {name!r}; use one of {', '.join(sorted(ALGORITHMS))}")
    return ALGORITHMS[name]
