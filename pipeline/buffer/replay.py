"""L2 warm tier: which consumed groups are worth replaying, and how replays are drawn.

Quality filter: GRPO learns nothing from a group whose rewards are all equal (every advantage is
zero), so only groups with reward spread above `l2_min_reward_std` are kept, optionally within
reward-mean thresholds, and a group whose completions (by content hash) are already in L2 is a
duplicate. Dedup is per group, not per row: identical completions inside one group are legitimate
samples of the policy and carry the group's statistics.

Sampling is proportional prioritized replay (Schaul et al. 2016): P(i) = p_i^α / Σ p_k^α over the
groups still eligible (replayed fewer than `max_replays_per_group` times), without replacement in
one batch; the bias is corrected by importance weights w_i = (N·P(i))^-β / max_k w_k with β
annealed linearly from `priority_beta0` to 1 over `priority_beta_steps` trainer steps.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from .state import ReplayGroup


@dataclass
class ReplayBatch:
    """Groups drawn from L2: rows, one importance weight per row, and the group keys to pass back
    to `update_priorities`."""

    table: pa.Table
    weights: np.ndarray  # float32 [num_rows]
    keys: list[str]
    probs: np.ndarray = field(default_factory=lambda: np.zeros(0))  # sampling probability per key
    beta: float = 1.0

    def __len__(self) -> int:
        return len(self.keys)


@dataclass
class GroupStats:
    key: str
    start: int
    count: int
    mean: float
    std: float
    ghash: str


def group_stats(table: pa.Table, gsizes: list[int]) -> list[GroupStats]:
    """Per-group reward statistics of a table whose groups are contiguous (see shards.group_layout)."""
    rewards = table.column("reward").to_numpy(zero_copy_only=False).astype(np.float64)
    ids = table.column("group_id").to_pylist()
    hashes = table.column("content_hash").to_pylist()
    out, start = [], 0
    for n in gsizes:
        r = rewards[start:start + n]
        h = hashlib.blake2b(digest_size=16)
        for x in sorted(hashes[start:start + n]):
            h.update(x.encode())
        out.append(GroupStats(ids[start], start, n, float(r.mean()), float(r.std()), h.hexdigest()))
        start += n
    return out


def quality_filter(groups: list[GroupStats], known_hashes: set[str], min_std: float,
                   min_mean: float | None, max_mean: float | None,
                   dedup: bool = True) -> tuple[list[GroupStats], dict]:
    """Groups to promote, and how many were dropped for each reason."""
    kept, seen = [], set(known_hashes)
    why = {"no_variance": 0, "threshold": 0, "duplicate": 0}
    for g in groups:
        if not g.std > min_std:
            why["no_variance"] += 1
        elif (min_mean is not None and g.mean < min_mean) or (max_mean is not None and g.mean > max_mean):
            why["threshold"] += 1
        elif dedup and g.ghash in seen:
            why["duplicate"] += 1
        else:
            seen.add(g.ghash)
            kept.append(g)
    return kept, why


def annealed_beta(step: int, beta0: float, steps: int) -> float:
    return 1.0 if steps <= 0 else float(beta0 + (1.0 - beta0) * min(1.0, max(step, 0) / steps))


def draw(groups: dict[str, ReplayGroup], max_replays: int, num_groups: int, alpha: float, beta: float,
         eps: float, rng_seed: int) -> tuple[list[str], np.ndarray, np.ndarray]:
    """Keys drawn by priority among eligible groups, their probabilities and importance weights.

    Deterministic for a given state and seed: keys are ordered before drawing."""
    keys = sorted(k for k, g in groups.items() if g.replays < max_replays)
    if not keys or num_groups <= 0:
        return [], np.zeros(0), np.zeros(0)
    p = np.array([groups[k].priority for k in keys], dtype=np.float64)
    p = (np.maximum(p, 0.0) + eps) ** alpha
    probs = p / p.sum()
    rng = np.random.default_rng(rng_seed)
    idx = rng.choice(len(keys), size=min(num_groups, len(keys)), replace=False, p=probs)
    n = len(keys)
    w_max = (n * probs.min()) ** -beta  # largest possible weight: normalises weights into (0, 1]
    weights = (n * probs[idx]) ** -beta / w_max
    return [keys[i] for i in idx], probs[idx], weights


def replays_to_restore(entries, st) -> "RestoreReplays | None":
    """What takes back the replays `entries` (the log after some version V) recorded: for each L2
    group they touched, the net count they added and the priority it had at V (the first touch's
    previous one; unknown in logs older than that field: the priority stays). A group evicted since
    is not there to draw again; its replays still leave the buffer's total (`replays_done`), which
    then matches what the lineage ledger lists. None: nothing to do."""
    from .actions import RecordReplays, RestoreReplays

    net: dict[str, int] = {}
    before: dict[str, float | None] = {}
    for e in entries:
        for a in e.actions:
            if isinstance(a, RecordReplays):
                prev, counts = a.previous or (None,) * len(a.keys), (1,) * len(a.keys)
            elif isinstance(a, RestoreReplays):
                prev, counts = (None,) * len(a.keys), tuple(-n for n in a.counts)
            else:
                continue
            for k, q, n in zip(a.keys, prev, counts):
                before.setdefault(k, q)
                net[k] = net.get(k, 0) + n
    keys, prios, counts = [], [], []
    for k, n in net.items():
        g = st.l2_groups.get(k)
        if g is None:  # evicted since (its shard used up): only the buffer's total count goes back
            if n > 0:
                keys.append(k)
                prios.append(0.0)
                counts.append(n)
            continue
        p = g.priority if before[k] is None else before[k]
        if n > 0 or p != g.priority:
            keys.append(k)
            prios.append(p)
            counts.append(max(n, 0))
    return RestoreReplays(tuple(keys), tuple(prios), tuple(counts)) if keys else None
