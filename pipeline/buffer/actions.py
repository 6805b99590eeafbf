"""The commit log's actions: one typed, immutable record per kind, and the one parser of entries.

Every writer of the log builds these and every reader gets them back from `LogEntry.from_json`,
which checks each field before any action is applied, so a bad entry never leaves a state
half-applied. The JSON is what the log has always held (readers of old buffers, and tools reading
entries with `json.loads`, see the same keys):

    {"op": "add", "path": "l1/w-..parquet", "tier": "l1", "rows": 64, "bytes": 9000,
     "gsizes": [8, 8, ...], "pv": [min, max], "t": 1700000000.0,
     "groups": [[key, row_start, row_count, group_hash, priority], ...]}   # l2 only
    {"op": "remove", "path": ...}                       # compaction, eviction, exhausted replays
    {"op": "prio", "keys": [...], "p": [...], "q": [...]}  # replayed once more: new (and old) priority
    {"op": "unreplay", "keys": [...], "p": [...], "n": [...]}  # replays taken back (a resumed trainer)
    {"op": "consumed", "consumer": "trainer", "cursor": {"seq": s, "group": g}, "groups": n}
    {"op": "quarantine", "path": ..., "reason": ...}

Archive (L3) adds of older buffers hold `"ngroups": N` (a count) instead of `"gsizes"`; they are
read as they are, and every add is now written with `"gsizes"`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Union

from .logfiles import LOG_FORMAT, is_int

TIERS = ("l1", "l2", "l3")


class MalformedEntry(ValueError):
    """A log entry with a missing field or a field of the wrong type; the message names it."""


class UnknownAction(Exception):
    """An action this version does not know (written by a newer rlhf-pipeline)."""

    def __init__(self, op: str):
        super().__init__(op)
        self.op = op


def _str(x) -> bool:
    return isinstance(x, str)


def _num(x) -> bool:  # a finite JSON number that converts to float
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return False
    try:
        return math.isfinite(x)
    except OverflowError:  # an int beyond float range
        return False


def _list_of(ok: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda x: isinstance(x, list) and all(ok(i) for i in x)


def _field(d: dict, name: str, ok: Callable[[Any], bool], what: str, default: Any = ...) -> Any:
    """d[name] after checking it; `default` when it is optional and absent."""
    if name not in d:
        if default is ...:
            raise MalformedEntry(f"({what}) has no {name!r}")
        return default
    if not ok(d[name]):
        raise MalformedEntry(f"({what}): invalid {name!r} {str(d[name])[:80]!r}")
    return d[name]


@dataclass(frozen=True)
class PromotedGroup:
    """One group of an L2 shard: where its rows are in the file, its completions' hash (dedup) and
    its initial priority. JSON: [key, row_start, row_count, group_hash, priority]."""

    key: str
    row_start: int
    row_count: int
    group_hash: str
    priority: float

    def to_json(self) -> list:
        return [self.key, self.row_start, self.row_count, self.group_hash, self.priority]

    @staticmethod
    def valid(g) -> bool:
        return isinstance(g, list) and len(g) == 5 and _str(g[0]) and is_int(g[1]) and is_int(g[2]) \
            and _str(g[3]) and _num(g[4])


@dataclass(frozen=True)
class AddShard:
    """A data file joins a tier. `group_sizes` are its rows per group, in file order."""

    op: ClassVar[str] = "add"
    path: str  # relative to the buffer root
    tier: str
    rows: int
    bytes: int
    group_sizes: tuple[int, ...]
    policy_versions: tuple[int, int]  # min and max policy_version of its rows
    committed_at: float
    promoted_groups: tuple[PromotedGroup, ...] = ()  # L2 only
    legacy_group_count: int | None = None  # "ngroups" of an older archive add (no sizes); only parsing sets it

    def __post_init__(self) -> None:
        if self.tier not in TIERS:
            raise ValueError(f"AddShard: tier {self.tier!r}; use one of {TIERS}")
        if self.legacy_group_count is not None and (self.group_sizes or self.tier != "l3"):
            raise ValueError("AddShard: legacy_group_count is for old archive adds only; pass group_sizes")

    @property
    def num_groups(self) -> int:
        return len(self.group_sizes) if self.legacy_group_count is None else self.legacy_group_count

    def to_json(self) -> dict:
        d = {"op": self.op, "path": self.path, "tier": self.tier, "rows": self.rows, "bytes": self.bytes,
             "gsizes": list(self.group_sizes), "pv": list(self.policy_versions), "t": self.committed_at}
        if self.legacy_group_count is not None:  # an old entry read back: it stays as it was
            del d["gsizes"]
            d["ngroups"] = self.legacy_group_count
        if self.tier == "l2" or self.promoted_groups:
            d["groups"] = [g.to_json() for g in self.promoted_groups]
        return d

    @classmethod
    def from_json(cls, d: dict) -> "AddShard":
        w = "add"
        tier = _field(d, "tier", lambda x: x in TIERS, w)
        sizes = _field(d, "gsizes", _list_of(is_int), w, None)
        count = _field(d, "ngroups", is_int, w, None)
        groups = _field(d, "groups", _list_of(PromotedGroup.valid), w, None)
        if sizes is None and (count is None or tier != "l3"):
            raise MalformedEntry(f"(add to {tier}) has no 'gsizes'")
        if sizes is not None and count is not None and count != len(sizes):
            raise MalformedEntry(f"(add): 'ngroups' {count} disagrees with the {len(sizes)} 'gsizes'")
        if tier == "l2" and groups is None:
            raise MalformedEntry("(add to l2) has no 'groups'")
        pv = _field(d, "pv", lambda x: _list_of(is_int)(x) and len(x) == 2, w)
        return cls(_field(d, "path", _str, w), tier, _field(d, "rows", is_int, w), _field(d, "bytes", is_int, w),
                   tuple(sizes or ()), (pv[0], pv[1]), _field(d, "t", _num, w),
                   tuple(PromotedGroup(k, s, n, h, float(p)) for k, s, n, h, p in groups or ()),
                   count if sizes is None else None)


@dataclass(frozen=True)
class RemoveShard:
    """A data file leaves its tier (compaction, eviction, archive retention)."""

    op: ClassVar[str] = "remove"
    path: str

    def to_json(self) -> dict:
        return {"op": self.op, "path": self.path}

    @classmethod
    def from_json(cls, d: dict) -> "RemoveShard":
        return cls(_field(d, "path", _str, "remove"))


@dataclass(frozen=True)
class RecordReplays:
    """L2 groups replayed once more, each with its new priority (and the one it replaced, which
    `RestoreReplays` puts back; absent in older logs)."""

    op: ClassVar[str] = "prio"
    keys: tuple[str, ...]
    priorities: tuple[float, ...]
    previous: tuple[float, ...] | None = None

    def to_json(self) -> dict:
        d = {"op": self.op, "keys": list(self.keys), "p": list(self.priorities)}
        return d if self.previous is None else {**d, "q": list(self.previous)}

    @classmethod
    def from_json(cls, d: dict) -> "RecordReplays":
        keys = _field(d, "keys", _list_of(_str), "prio")
        prev = _field(d, "q", _list_of(_num), "prio", None)
        return cls(tuple(keys), tuple(float(p) for p in _field(d, "p", _list_of(_num), "prio")),
                   None if prev is None else tuple(float(p) for p in prev))


@dataclass(frozen=True)
class RestoreReplays:
    """Replays taken back: each group's count drops by `counts` and its priority is `priorities`
    again. A resumed trainer writes it for the replays it redoes (`ReplayBuffer.restore_replays`)."""

    op: ClassVar[str] = "unreplay"
    keys: tuple[str, ...]
    priorities: tuple[float, ...]
    counts: tuple[int, ...]

    def to_json(self) -> dict:
        return {"op": self.op, "keys": list(self.keys), "p": list(self.priorities), "n": list(self.counts)}

    @classmethod
    def from_json(cls, d: dict) -> "RestoreReplays":
        keys, p = _field(d, "keys", _list_of(_str), "unreplay"), _field(d, "p", _list_of(_num), "unreplay")
        n = _field(d, "n", _list_of(is_int), "unreplay")
        if not len(keys) == len(p) == len(n):
            raise MalformedEntry(f"(unreplay): {len(keys)} keys, {len(p)} priorities, {len(n)} counts")
        return cls(tuple(keys), tuple(float(x) for x in p), tuple(n))


def resume_consumer(consumer: str) -> str:
    """The log's name for where `consumer` starts again after a restart (`ReplayBuffer.mark_resumable`)."""
    return f"{consumer}@resume"


@dataclass(frozen=True)
class MarkConsumed:
    """A reader's position in the L1 stream: every group before group `group` of L1 shard `seq`
    is consumed; `groups` counts them (the rate limiter's measure of the reader's progress)."""

    op: ClassVar[str] = "consumed"
    consumer: str
    seq: int
    group: int
    groups: int = 0

    @property
    def cursor(self) -> dict:
        return {"seq": self.seq, "group": self.group}

    def to_json(self) -> dict:
        return {"op": self.op, "consumer": self.consumer, "cursor": self.cursor, "groups": self.groups}

    @classmethod
    def from_json(cls, d: dict) -> "MarkConsumed":
        cursor = _field(d, "cursor", lambda c: isinstance(c, dict) and is_int(c.get("seq"))
                        and is_int(c.get("group")), "consumed")
        return cls(_field(d, "consumer", _str, "consumed"), cursor["seq"], cursor["group"],
                   _field(d, "groups", is_int, "consumed", 0))


@dataclass(frozen=True)
class Quarantine:
    """A bad shard, or an unusable log entry (`path` under `_log/`), taken out with the reason."""

    op: ClassVar[str] = "quarantine"
    path: str
    reason: str

    def to_json(self) -> dict:
        return {"op": self.op, "path": self.path, "reason": self.reason}

    @classmethod
    def from_json(cls, d: dict) -> "Quarantine":
        return cls(_field(d, "path", _str, "quarantine"), _field(d, "reason", _str, "quarantine"))


Action = Union[AddShard, RemoveShard, RecordReplays, RestoreReplays, MarkConsumed, Quarantine]
ACTION_TYPES = (AddShard, RemoveShard, RecordReplays, RestoreReplays, MarkConsumed, Quarantine)
ACTIONS: dict[str, type] = {c.op: c for c in ACTION_TYPES}  # op (the JSON "op") -> action type


def parse_actions(items) -> tuple[Action, ...]:
    """The typed actions of an entry's "actions" list. MalformedEntry names the first bad one;
    UnknownAction (checked after every known action is well-formed) the first op this version
    does not know."""
    if not isinstance(items, list):
        raise MalformedEntry(f"'actions' is {type(items).__name__}, not a list")
    out, unknown = [], None
    for i, a in enumerate(items):
        if not isinstance(a, dict) or not _str(a.get("op")):
            raise MalformedEntry(f"action {i} is not an object with an 'op'")
        kind = ACTIONS.get(a["op"])
        if kind is None:
            unknown = unknown or a["op"]
            continue
        try:
            out.append(kind.from_json(a))
        except MalformedEntry as e:
            raise MalformedEntry(f"action {i} {e}") from None
    if unknown is not None:
        raise UnknownAction(unknown)
    return tuple(out)


@dataclass(frozen=True)
class LogEntry:
    """One numbered commit: its actions, applied together or not at all."""

    version: int
    time: float  # commit time; removal times come from it, so every reader sees the same
    actions: tuple[Action, ...]
    txn: str | None = None  # recognises our own commit after a lost answer to its create-only write
    writer: str = ""

    def to_json(self) -> dict:
        return {"format": LOG_FORMAT, "v": self.version, "txn": self.txn, "time": self.time,
                "writer": self.writer, "actions": [a.to_json() for a in self.actions]}

    @classmethod
    def from_json(cls, doc: dict) -> "LogEntry":
        """The entry a document holds (format and number already checked by the reader).
        Raises MalformedEntry or UnknownAction."""
        if not is_int(doc.get("v")):
            raise MalformedEntry(f"invalid or missing 'v' {str(doc.get('v'))[:80]!r}")
        if not _num(doc.get("time")):
            raise MalformedEntry(f"invalid or missing 'time' {str(doc.get('time'))[:80]!r}")
        actions = parse_actions(doc.get("actions"))
        txn, writer = doc.get("txn"), doc.get("writer")
        return cls(doc["v"], float(doc["time"]), actions, txn if _str(txn) else None, writer if _str(writer) else "")
