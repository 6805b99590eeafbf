"""A sampler batch's groups: which are handed over (`sampler.oversample`) and their rollout records.

With `oversample` above 1, a batch generates the groups of `prompts_drawn` prompts and hands over
the `prompts_per_batch` groups whose rewards vary most (their standard deviation). A group whose
completions all score alike gives GRPO's group-normalised advantage nothing to learn from (DAPO's
dynamic sampling drops those and samples again); ranking by spread goes further and prefers the
prompts the policy solves only sometimes (online difficulty filtering). The trainer's batch shape
is unchanged: it trains on the same number of groups per step, chosen from more. The groups not
handed over go to the archive (L3) in the same commit as those handed over (all correct, all
wrong: data for SFT or for studying the task, which `rlhf export` reads with the rest); their
completions count in the sampler's generated tokens.
"""

from __future__ import annotations

import json
import math
import uuid
from datetime import datetime, timezone

import pyarrow as pa

from ..buffer.schema import content_hash, to_table
from ..data import PromptRow
from ..scoring import BatchScores


def spread(rewards: list[float]) -> float:
    """The population standard deviation of a group's rewards."""
    mean = sum(rewards) / len(rewards)
    return math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))


def most_varied(batch: list[PromptRow], prompt_ids: list, groups: list, scored: BatchScores, keep: int):
    """The `keep` groups of the batch whose rewards vary most, and the others: two tuples (prompts,
    prompt ids, groups, scores), each in the batch's order (ties: the earlier kept first). A batch
    of no more than `keep` groups is kept as it is, and the second is None."""
    if len(groups) <= keep:
        return (batch, prompt_ids, groups, scored), None
    starts = [0]
    for g in groups:
        starts.append(starts[-1] + len(g))
    rewards = [[s.reward for s in scored.scores[a:b]] for a, b in zip(starts, starts[1:])]
    chosen = set(sorted(range(len(groups)), key=lambda i: -spread(rewards[i]))[:keep])

    def part(which: list[int]):
        scores = [s for i in which for s in scored.scores[starts[i]:starts[i + 1]]]
        return ([batch[i] for i in which], [prompt_ids[i] for i in which], [groups[i] for i in which],
                BatchScores(scores, scored.errors, scored.timeouts, scored.extra_means))
    return part(sorted(chosen)), part([i for i in range(len(groups)) if i not in chosen])


def shard_tables(kept: tuple, left: tuple | None, version: int, sampler_id: str) -> tuple[pa.Table, pa.Table | None]:
    """A batch's rollout shard (the groups handed over) and the groups to archive (`most_varied`'s
    two parts; None: none), with one creation time."""
    now = datetime.now(timezone.utc)
    return (to_table(rollout_rows(*kept, version, sampler_id, now)),
            to_table(rollout_rows(*left, version, sampler_id, now)) if left else None)


def rollout_rows(batch: list[PromptRow], prompt_ids: list[list[int]], groups: list, scored: BatchScores,
                 version: int, sampler_id: str, now: datetime) -> list[dict]:
    """Rollout records of one batch (whole groups), created `now`."""
    scores = iter(scored.scores)
    rows = []
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
