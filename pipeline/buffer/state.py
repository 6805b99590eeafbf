"""What the commit log says the buffer holds: the state obtained by replaying log actions in order.

The state is a pure function of the log: every process that has replayed the same versions holds
the same state, which is what makes cursors (L1 sequence numbers) and replay keys portable between
processes and across restarts. Checkpoints are this state serialised at one version.

Actions and their JSON are defined in actions.py; `BufferState.apply` replays one parsed entry.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field

from .actions import TIERS, AddShard, LogEntry, MarkConsumed, Quarantine, RecordReplays, RemoveShard, RestoreReplays

__all__ = ["TIERS", "BufferState", "ReplayGroup", "ShardInfo"]


@dataclass
class ShardInfo:
    """One committed, immutable data file."""

    path: str  # relative to the buffer root
    tier: str
    rows: int
    bytes: int
    gsizes: list[int]  # rows per group, in file order (groups are contiguous); empty for L3
    pv: tuple[int, int]  # min/max policy_version of its rows
    t: float  # commit time
    version: int  # log version that added it
    seq: int = -1  # position in the L1 stream (commit order); -1 outside L1
    g0: int = 0  # L1 groups committed before this shard (turns a cursor into a consumed-group count)
    ngroups: int = -1  # group count when gsizes is not kept (L3 files are not read group by group)

    @property
    def groups(self) -> int:
        return self.ngroups if self.ngroups >= 0 else len(self.gsizes)

    def to_json(self) -> dict:
        return {"path": self.path, "tier": self.tier, "rows": self.rows, "bytes": self.bytes,
                "gsizes": self.gsizes, "pv": list(self.pv), "t": self.t, "version": self.version,
                "seq": self.seq, "g0": self.g0, "ngroups": self.ngroups}

    @classmethod
    def from_json(cls, d: dict) -> "ShardInfo":
        return cls(d["path"], d["tier"], d["rows"], d["bytes"], list(d["gsizes"]), tuple(d["pv"]),
                   d["t"], d["version"], d.get("seq", -1), d.get("g0", 0), d.get("ngroups", -1))


@dataclass
class ReplayGroup:
    """One L2 group: where its rows are, how often it was replayed and its priority."""

    path: str
    start: int
    count: int
    ghash: str
    priority: float
    replays: int = 0


@dataclass
class BufferState:
    version: int = 0
    shards: dict[str, ShardInfo] = field(default_factory=dict)
    l1_seqs: list[int] = field(default_factory=list)  # sorted seqs of live L1 shards
    l1_by_seq: dict[int, str] = field(default_factory=dict)
    next_seq: int = 0
    l1_groups_added: int = 0  # groups ever committed to L1 (monotonic; the rate limiter's inserts)
    l2_groups: dict[str, ReplayGroup] = field(default_factory=dict)
    l2_hashes: set[str] = field(default_factory=set)
    l2_by_path: dict[str, list[str]] = field(default_factory=dict)
    replays_done: int = 0  # groups ever replayed from L2 (monotonic; the rate limiter's samples)
    consumed: dict[str, dict] = field(default_factory=dict)  # consumer -> cursor
    quarantined: dict[str, str] = field(default_factory=dict)  # path -> reason
    tombstones: dict[str, float] = field(default_factory=dict)  # removed path -> time removed

    # ------------------------------------------------------------------------------------------
    def apply(self, entry: LogEntry) -> None:
        """Replay the next entry of the log (its version must follow the state's)."""
        if entry.version != self.version + 1:
            raise RuntimeError(f"commit log: applying version {entry.version} on state at {self.version}")
        for a in entry.actions:
            if isinstance(a, AddShard):
                self._add(a, entry.version)
            elif isinstance(a, RemoveShard):
                self._remove(a.path, entry.time)
            elif isinstance(a, RecordReplays):
                self._replayed(a)
            elif isinstance(a, RestoreReplays):
                self._restored(a)
            elif isinstance(a, MarkConsumed):
                self.consumed[a.consumer] = {**a.cursor, "groups": a.groups}
            elif isinstance(a, Quarantine):
                self.quarantined[a.path] = a.reason
                self._remove(a.path, entry.time, tombstone=False)
            else:
                raise TypeError(f"commit log version {entry.version}: {a!r} is not a log action")
        self.version = entry.version

    def _add(self, a: AddShard, version: int) -> None:
        if a.path in self.shards:
            return  # idempotent: a shard is added once
        # archive files are never read group by group: their state keeps the count, not the sizes
        sizes, count = ([], a.num_groups) if a.tier == "l3" else (list(a.group_sizes), -1)
        info = ShardInfo(a.path, a.tier, a.rows, a.bytes, sizes, a.policy_versions, a.committed_at, version,
                         ngroups=count)
        if info.tier == "l1":
            info.seq = self.next_seq
            info.g0 = self.l1_groups_added
            self.next_seq += 1
            self.l1_seqs.append(info.seq)
            self.l1_by_seq[info.seq] = info.path
            self.l1_groups_added += info.groups
        elif info.tier == "l2":
            for g in a.promoted_groups:
                self._add_group(g.key, ReplayGroup(info.path, g.row_start, g.row_count, g.group_hash, g.priority))
        self.shards[info.path] = info

    def _replayed(self, a: RecordReplays) -> None:
        for k, p in zip(a.keys, a.priorities):
            g = self.l2_groups.get(k)
            if g is not None:
                g.priority = float(p)
                g.replays += 1
                self.replays_done += 1

    def _restored(self, a: RestoreReplays) -> None:
        for k, p, n in zip(a.keys, a.priorities, a.counts):
            g = self.l2_groups.get(k)
            if g is not None:
                g.priority = float(p)
                n = min(n, g.replays)
                g.replays -= n
            self.replays_done -= min(n, self.replays_done)  # an evicted group's too

    def _remove(self, path: str, t: float, tombstone: bool = True) -> None:
        info = self.shards.pop(path, None)
        if info is None:
            return
        if tombstone:
            self.tombstones[path] = t
        if info.tier == "l1":
            i = bisect.bisect_left(self.l1_seqs, info.seq)
            if i < len(self.l1_seqs) and self.l1_seqs[i] == info.seq:
                del self.l1_seqs[i]
            self.l1_by_seq.pop(info.seq, None)
        elif info.tier == "l2":
            for k in self.l2_by_path.pop(path, []):
                g = self.l2_groups.pop(k, None)
                if g is not None:
                    self.l2_hashes.discard(g.ghash)

    def _add_group(self, key: str, g: ReplayGroup) -> None:
        self.l2_groups[key] = g
        self.l2_hashes.add(g.ghash)
        self.l2_by_path.setdefault(g.path, []).append(key)

    # ------------------------------------------------------------------------------------------
    def groups_before(self, cursor_seq: int, cursor_group: int) -> int:
        """L1 groups committed before an L1 cursor position (consumed by a reader at that cursor)."""
        i = bisect.bisect_left(self.l1_seqs, cursor_seq)
        if i == len(self.l1_seqs):
            return self.l1_groups_added
        info = self.shards[self.l1_by_seq[self.l1_seqs[i]]]
        return info.g0 + (cursor_group if info.seq == cursor_seq else 0)

    def eligible(self, max_replays: int) -> int:
        return sum(1 for g in self.l2_groups.values() if g.replays < max_replays)

    def tier_shards(self, tier: str) -> list[ShardInfo]:
        if tier == "l1":
            return [self.shards[self.l1_by_seq[s]] for s in self.l1_seqs]
        return sorted((s for s in self.shards.values() if s.tier == tier), key=lambda s: (s.version, s.path))

    def to_json(self, tombstone_retention_s: float | None = None) -> dict:
        now = time.time()
        tombs = {p: t for p, t in self.tombstones.items()
                 if tombstone_retention_s is None or now - t < tombstone_retention_s}
        return {
            "version": self.version,
            "shards": [s.to_json() for s in self.shards.values()],
            "next_seq": self.next_seq,
            "l1_groups_added": self.l1_groups_added,
            "l2_groups": [[k, g.path, g.start, g.count, g.ghash, g.priority, g.replays]
                          for k, g in self.l2_groups.items()],
            "replays_done": self.replays_done,
            "consumed": self.consumed,
            "quarantined": self.quarantined,
            "tombstones": tombs,
        }

    @classmethod
    def from_json(cls, d: dict) -> "BufferState":
        st = cls(version=d["version"], next_seq=d["next_seq"], l1_groups_added=d["l1_groups_added"],
                 replays_done=d["replays_done"], consumed=d["consumed"], quarantined=d["quarantined"],
                 tombstones=d["tombstones"])
        for sj in d["shards"]:
            info = ShardInfo.from_json(sj)
            st.shards[info.path] = info
            if info.tier == "l1":
                st.l1_by_seq[info.seq] = info.path
        st.l1_seqs = sorted(st.l1_by_seq)
        for k, path, start, count, ghash, prio, replays in d["l2_groups"]:
            st._add_group(k, ReplayGroup(path, start, count, ghash, prio, replays))
        return st
