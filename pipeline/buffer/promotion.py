"""Promotion into L2 warm: consumed groups that pass the quality filter become a new L2 shard,
and the tier's bound is applied in the same commit.

One commit holds the evictions, the new shard and (optionally) the consumer's L1 cursor, so a
trainer that dies between training on fresh data and recording it either promoted and recorded
both, or neither. Evictions are computed against the state the commit lands on: when another
process evicted first, the commit is recomputed (`shards_still_live` precondition).
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from .actions import Action, AddShard, MarkConsumed, PromotedGroup, RemoveShard
from .log import CommitConflict, shards_still_live
from .replay import GroupStats, group_stats, quality_filter
from .shards import conform, encode, group_layout, new_shard_path, policy_range, write_shard
from .state import BufferState

if TYPE_CHECKING:
    from .buffer import ReplayBuffer

PROMOTE_COUNTS = ("groups_in", "promoted", "no_variance", "threshold", "duplicate", "evicted_shards")


def promote(buf: "ReplayBuffer", table: pa.Table, cursor: tuple[int, int] | None, consumer: str) -> dict:
    """Commit the groups of `table` that pass the quality filter to L2 (see ReplayBuffer.promote);
    `cursor` is the consumer's parsed L1 position (seq, group) or None. Returns counts."""
    counts = dict.fromkeys(PROMOTE_COUNTS, 0)
    actions: list[Action] = []
    if table.num_rows:
        table, gsizes = group_layout(conform(table))
        stats = group_stats(table, gsizes)
        counts["groups_in"] = len(stats)
        picked, prio0 = _pick_groups(buf, stats, counts)
        if picked:
            actions.append(_write_l2_shard(buf, table, picked, prio0))
            counts["promoted"] = len(picked)
    if cursor is not None:
        actions.append(MarkConsumed(consumer, *cursor))
    if actions:
        counts["evicted_shards"] = _commit_with_evictions(buf, actions, counts["promoted"])
    return counts


def _pick_groups(buf: "ReplayBuffer", stats: list[GroupStats], counts: dict) -> tuple[list[GroupStats], float]:
    """The groups to promote (those the quality filter keeps whose key is not in L2 yet), and
    their initial priority: the highest in L2, so that each new group is drawn soon."""
    cfg = buf.config
    with buf.current_state() as st:
        known = set(st.l2_hashes) if cfg.l2_dedup else set()
        taken_keys = set(st.l2_groups)
        prio0 = max((g.priority for g in st.l2_groups.values()), default=1.0)
    kept, why = quality_filter(stats, known, cfg.l2_min_reward_std, cfg.l2_min_reward_mean,
                               cfg.l2_max_reward_mean, dedup=cfg.l2_dedup)
    counts.update(why)
    picked = []
    for gs in kept:
        if gs.key in taken_keys:  # the same group promoted twice (e.g. a replayed step)
            counts["duplicate"] += 1
        else:
            taken_keys.add(gs.key)
            picked.append(gs)
    return picked, prio0


def _write_l2_shard(buf: "ReplayBuffer", table: pa.Table, picked: list[GroupStats], prio0: float) -> AddShard:
    """Write the picked groups' rows as one L2 data file; returns the action that commits it."""
    cfg = buf.config
    idx = np.concatenate([np.arange(g.start, g.start + g.count) for g in picked])
    sub = table.take(pa.array(idx))
    sub = sub.set_column(sub.schema.get_field_index("tier"), "tier", pa.array(["l2"] * sub.num_rows, pa.string()))
    data = encode(sub, cfg.shard_compression)
    rel = new_shard_path("l2", "promote")
    write_shard(buf.fs, buf.root, rel, data, fsync=cfg.fsync)
    groups, start = [], 0
    for g in picked:
        groups.append(PromotedGroup(g.key, start, g.count, g.ghash, prio0))
        start += g.count
    return AddShard(rel, "l2", sub.num_rows, len(data), tuple(g.count for g in picked), policy_range(sub),
                    time.time(), tuple(groups))


def _commit_with_evictions(buf: "ReplayBuffer", actions: list[Action], incoming: int) -> int:
    """Commit `actions` after the L2 evictions they make necessary; returns the shards evicted."""
    while True:
        with buf.current_state() as st:
            evict = l2_evictions(st, incoming, buf.config.max_replays_per_group, buf.config.l2_max_groups)
            final = [dataclasses.replace(a, groups=st.groups_before(a.seq, a.group))
                     if isinstance(a, MarkConsumed) else a for a in actions]
            try:
                buf.commit([RemoveShard(p) for p in evict] + final,
                           precondition=shards_still_live(evict, "L2 shards"))
                return len(evict)
            except CommitConflict:
                continue  # another process evicted first: recompute against the new state


def l2_evictions(st: BufferState, incoming: int, max_replays: int, max_groups: int) -> list[str]:
    """L2 shards to remove: those whose groups all used up their replays, then the oldest until
    the tier fits `max_groups` with `incoming` more groups."""
    shards = st.tier_shards("l2")
    total = len(st.l2_groups) + incoming
    evict = []
    for info in shards:
        keys = st.l2_by_path.get(info.path, [])
        if all(st.l2_groups[k].replays >= max_replays for k in keys):
            evict.append(info.path)
            total -= len(keys)
    for info in shards:
        if total <= max_groups:
            break
        if info.path not in evict:
            evict.append(info.path)
            total -= len(st.l2_by_path.get(info.path, []))
    return evict
