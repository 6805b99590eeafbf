"""A sampler batch's groups: which are handed over (`sampler.oversample`) and their rollout records.

With `oversample` above 1, a batch generates the groups of `prompts_drawn` prompts and hands over
the `prompts_per_batch` groups whose rewards vary most (their standard deviation). A group whose
completions all score alike gives GRPO's group-normalised advantage nothing to learn from (DAPO's
dynamic sampling drops those and samples again); ranking by spread goes further and prefers the
prompts the policy solves only sometimes (online difficulty filtering). The trainer's batch shape
is unchanged: it trains on the same number of groups per step, chosen from more. The groups not
handed over are dropped; their completions count in the sampler's generated tokens.
"""

from __future__ import annotations

import json
import math
import uuid
from datetime import datetime, timezone

from ..buffer.schema import content_hash
from ..data import PromptRow
from ..scoring import BatchScores


def spread(rewards: list[float]) -> float:
    """The population standard deviation of a group's rewards."""
    mean = sum(rewards) / len(rewards)
    return math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))


def most_varied(batch: list[PromptRow], prompt_ids: list, groups: list, scored: BatchScores, keep: int):
    """The `keep` groups of the batch whose rewards vary most, in the batch's order (ties: the
    earlier first), with their prompts, prompt ids and scores; the batch as it is when it has no
    more than `keep` groups."""
    if len(groups) <= keep:
        return batch, prompt_ids, groups, scored
    starts = [0]
    for g in groups:
        starts.append(starts[-1] + len(g))
    rewards = [[s.reward for s in scored.scores[a:b]] for a, b in zip(starts, starts[1:])]
    chosen = sorted(sorted(range(len(groups)), key=lambda i: -spread(rewards[i]))[:keep])
    scores = [s for i in chosen for s in scored.scores[starts[i]:starts[i + 1]]]
    return ([batch[i] for i in chosen], [prompt_ids[i] for i in chosen], [groups[i] for i in chosen],
            BatchScores(scores, scored.errors, scored.timeouts, scored.extra_means))


def rollout_rows(batch: list[PromptRow], prompt_ids: list[list[int]], groups: list, scored: BatchScores,
                 version: int, sampler_id: str) -> list[dict]:
    """Rollout records of one batch (whole groups)."""
    scores = iter(scored.scores)
    rows = []
    now = datetime.now(timezone.utc)
    for p, ids, group in zip(batch, prompt_ids, groups):
        group_id = f"{p.prompt_id}-{uuid.uuid4().hex[:12]}"
        for c in group:
            s = next(scores)
            rows.append({
                "sample_id": uuid.uuid4().hex, "prompt_id": p.prompt_id, "group_id": group_id,
                "data_source": p.data_source, "prompt_token_ids": ids,
                "response_token_ids": c.token_ids, "response_text": c.text,
                "behavior_logprobs": c.logprobs, "reward": s.reward, "token_rewards": None,
                "reward_extra": json.dumps(s.extra) if s.extra else None,
                "finish_reason": c.finish_reason, "policy_version": version,
                "sampler_id": sampler_id, "created_at": now,
                "content_hash": content_hash(ids, c.token_ids),
                "tier": "l1", "replay_count": 0, "priority": 1.0,
            })
    return rows
