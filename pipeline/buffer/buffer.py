"""ReplayBuffer: the one channel between sampler and trainer, on any fsspec URL.

    buf = ReplayBuffer("s3://bucket/runs/r1/buffer", cfg.buffer)
    with buf.writer("sampler-0") as w:           # sampler: asynchronous L1 commits
        w.write(shard)
    table, cursor = buf.read_fresh(cursor, 16)   # trainer: each L1 group once, in commit order

L1 reading is addressed by a cursor {"seq": s, "group": g}: every L1 shard gets a sequence number
from its position in the commit log, so the cursor means "all groups before group g of shard s were
consumed". The trainer stores it in its checkpoint; reading again from it returns the same rows,
which is what makes fresh consumption exactly-once across restarts.
"""

from __future__ import annotations

import bisect
import logging
import math
import threading
from collections import OrderedDict
from contextlib import contextmanager
from typing import Iterator, Sequence

import numpy as np
import pyarrow as pa

from ..config import BufferConfig
from ..storage import to_url, url_to_fs
from .actions import Action, MarkConsumed, Quarantine, RecordReplays, resume_consumer
from .log import CommitLog
from .notices import ShardCopies
from .promotion import promote
from .replay import ReplayBatch, annealed_beta, draw, replays_to_restore
from .schema import ROLLOUT_SCHEMA
from .shards import CorruptShard, read_shard
from .state import TIERS, BufferState, ShardInfo
from .writer import ShardWriter

log = logging.getLogger(__name__)

_CACHE_SHARDS = 64


def parse_cursor(cursor: dict | None) -> tuple[int, int]:
    """(seq, group) of a cursor; None is the beginning of the L1 stream."""
    if cursor is None:
        return 0, 0
    try:
        seq, group = int(cursor["seq"]), int(cursor["group"])
    except (TypeError, KeyError, ValueError):
        raise ValueError(f"buffer cursor: invalid value {cursor!r}; pass None or a cursor returned "
                         "by read_fresh, e.g. {'seq': 3, 'group': 0}") from None
    if seq < 0 or group < 0:
        raise ValueError(f"buffer cursor: negative position in {cursor!r}; pass a cursor returned by read_fresh")
    return seq, group


class ReplayBuffer:
    """A handle on one buffer directory. Thread-safe; one per process is enough."""

    def __init__(self, url: str, config: BufferConfig | None = None):
        if not url:
            raise ValueError("buffer url: empty; pass a path or fsspec URL such as file:///tmp/run/buffer")
        self.config = config or BufferConfig()
        self.fs, self.root = url_to_fs(url)
        self.url = to_url(self.fs, self.root)
        self._lock = threading.RLock()
        self.log = CommitLog(self.fs, self.root, self.config.checkpoint_interval,
                             tombstone_retention_s=self.config.orphan_grace_s, fsync=self.config.fsync)
        self._cache: OrderedDict[str, pa.Table] = OrderedDict()  # recently read shards
        self._cache_lock = threading.Lock()
        self.evicted_unread_shards = 0  # L1 shards removed before this reader got to them
        # on object stores: the L1 shards of this node's writers, also on local disk (notices.py)
        self.shard_copies = ShardCopies(self.url) if self.log.remote else None

    # log access -------------------------------------------------------------------------------
    @property
    def state(self) -> BufferState:
        return self.log.state

    def refresh(self, poll: bool = False) -> BufferState:
        """Catch up with commits made since the last call (reads only the new log entries); `poll`:
        for a reader waiting for new commits (`CommitLog.refresh`)."""
        with self._lock:
            self.log.refresh(poll)
            return self.log.state

    @contextmanager
    def current_state(self, refresh: bool = True) -> Iterator[BufferState]:
        """The state caught up with the log (`refresh` False: as of the last refresh or commit of
        this process, one request less), held still for the block: no other thread of this
        process applies a commit to it meanwhile (commits from inside the block are fine)."""
        with self._lock:
            yield self.refresh() if refresh else self.log.state

    def commit(self, actions: Sequence[Action], precondition=None, writer: str | None = None) -> int:
        """Commit log actions (see actions.py) as one entry; returns its version. `writer` names
        the committer in the entry; `precondition` is re-checked after a lost race."""
        with self._lock:
            return self.log.commit(actions, precondition, writer)

    # writing ----------------------------------------------------------------------------------
    def writer(self, writer_id: str, admit=None) -> ShardWriter:
        """An asynchronous L1 writer (background thread, queue of `config.writer_queue` shards);
        `admit` checks each shard against the groups committed before it (see writer.py)."""
        return ShardWriter(self, writer_id, self.config.writer_queue, self.config.shard_compression, admit)

    # reading ----------------------------------------------------------------------------------
    def _load(self, info: ShardInfo) -> pa.Table:
        with self._cache_lock:
            table = self._cache.get(info.path)
            if table is not None:
                self._cache.move_to_end(info.path)
                return table
        copy = self.shard_copies.get(info.path, info.bytes) if self.shard_copies is not None else None
        table = read_shard(self.fs, self.root, info.path, copy)
        if table.num_rows != info.rows:
            raise CorruptShard(f"{self.root}/{info.path}: {table.num_rows} rows, the commit log says {info.rows}")
        with self._cache_lock:
            self._cache[info.path] = table
            while len(self._cache) > _CACHE_SHARDS:
                self._cache.popitem(last=False)
        return table

    def quarantine(self, path: str, reason: str) -> None:
        """Take a bad shard out of its tier; it stays on storage for inspection, listed in stats."""
        log.error("buffer %s: quarantined shard %s/%s: %s", self.url, self.root, path, reason)
        with self._cache_lock:
            self._cache.pop(path, None)
        with self._lock:
            if path in self.log.state.shards:
                self.log.commit([Quarantine(path, reason[:2000])])

    def load_shard(self, info: ShardInfo) -> pa.Table | None:
        """The shard's rows, or None after quarantining it when it is unreadable."""
        try:
            return self._load(info)
        except CorruptShard as e:
            self.quarantine(info.path, str(e))
            return None
        except FileNotFoundError:
            # removed by compaction or eviction (and vacuum) since our view of the log: skip it;
            # still committed yet missing on storage: bad data like any other
            if info.path in self.refresh().shards:
                self.quarantine(info.path, f"{self.root}/{info.path}: committed in version "
                                           f"{info.version} but missing on storage")
            return None

    def read_fresh(self, cursor: dict | None, max_groups: int) -> tuple[pa.Table, dict]:
        """Up to `max_groups` whole L1 groups in commit order from `cursor`, and the next cursor.

        Reads the log only when the commits already seen hold fewer than `max_groups` groups past
        the cursor: a reader that is behind costs no log request per batch."""
        if max_groups <= 0:
            raise ValueError(f"read_fresh: max_groups={max_groups}; pass a positive number of groups")
        seq, g = parse_cursor(cursor)
        with self._lock:
            st = self.log.state
            if not self.log.is_open or self._known_groups(st, seq, g, max_groups) < max_groups:
                st = self.refresh(poll=True)  # only when the commits already seen cannot fill the batch
            if seq > st.next_seq:
                raise ValueError(f"buffer cursor {cursor!r} is past the end of {self.url} "
                                 f"(next L1 sequence {st.next_seq}); was it saved for another buffer?")
            seqs = list(st.l1_seqs[bisect.bisect_left(st.l1_seqs, seq):])
            infos = [st.shards[st.l1_by_seq[s]] for s in seqs[: max_groups + 1]]
        if infos and infos[0].seq != seq and seq < infos[0].seq:
            self.evicted_unread_shards += infos[0].seq - seq
            log.warning("buffer %s: L1 shards %d..%d were removed before being read; skipping them",
                        self.url, seq, infos[0].seq - 1)
        if infos and infos[0].seq != seq:
            g = 0
        elif infos and g >= infos[0].groups:
            raise ValueError(f"buffer cursor {cursor!r}: shard {seq} has only {infos[0].groups} groups; "
                             "pass a cursor returned by read_fresh")
        pieces: list[pa.Table] = []
        need = max_groups
        for info in infos:
            if need == 0:
                break
            start = g if info.seq == seq else 0
            table = self.load_shard(info)
            take = min(info.groups - start, need)
            if table is not None:
                row0 = sum(info.gsizes[:start])
                pieces.append(table.slice(row0, sum(info.gsizes[start:start + take])))
                need -= take
            if table is None or start + take == info.groups:
                seq, g = info.seq + 1, 0
            else:
                seq, g = info.seq, start + take
        if not pieces:
            return ROLLOUT_SCHEMA.empty_table(), {"seq": seq, "group": g}
        return pa.concat_tables(pieces), {"seq": seq, "group": g}

    @staticmethod
    def _known_groups(st: BufferState, seq: int, g: int, limit: int) -> int:
        """L1 groups from cursor (seq, g) in state `st`, counted up to `limit`."""
        if seq > st.next_seq:
            return 0
        total = 0
        for s in st.l1_seqs[bisect.bisect_left(st.l1_seqs, seq):]:
            n = st.shards[st.l1_by_seq[s]].groups
            total += n - g if s == seq else n
            if total >= limit:
                break
        return total

    def fresh_backlog(self, cursor: dict | None) -> int:
        """Groups committed to L1 and not yet consumed from `cursor`."""
        seq, g = parse_cursor(cursor)
        with self._lock:
            st = self.refresh()
            i = bisect.bisect_left(st.l1_seqs, seq)
            total = 0
            for s in st.l1_seqs[i:]:
                n = st.shards[st.l1_by_seq[s]].groups
                total += n - g if s == seq else n
            return max(total, 0)

    def committed_groups(self) -> int:
        """Groups ever committed to L1 (monotonic: compaction and eviction do not lower it)."""
        with self._lock:
            return self.refresh().l1_groups_added

    def mark_consumed(self, cursor: dict, consumer: str = "trainer") -> int:
        """Record a reader's L1 position in the log: compaction archives only what was consumed,
        and the rate limiter measures the reader's progress from it."""
        seq, g = parse_cursor(cursor)
        with self._lock:
            st = self.refresh()
            return self.log.commit([MarkConsumed(consumer, seq, g, st.groups_before(seq, g))])

    def mark_resumable(self, cursor: dict, consumer: str = "trainer") -> int:
        """Record where the reader would start again after a restart (its newest checkpoint's
        cursor, or where it started): compaction archives no L1 shard at or past it, so a reader
        resumed behind its recorded position still finds every group it has to redo in L1."""
        return self.mark_consumed(cursor, resume_consumer(consumer))

    # L2 warm ----------------------------------------------------------------------------------
    def promote(self, table: pa.Table, cursor: dict | None = None, consumer: str = "trainer") -> dict:
        """Commit the groups of `table` (consumed fresh data) that pass the quality filter to L2.

        With `cursor`, the consumer's L1 position is recorded in the same commit. Also applies the
        L2 bound: groups that used up their replays leave first, then the oldest shards. Returns
        counts (see promotion.py)."""
        return promote(self, table, None if cursor is None else parse_cursor(cursor), consumer)

    def sample_replay(self, num_groups: int, step: int, rng_seed: int) -> ReplayBatch:
        """Up to `num_groups` eligible L2 groups drawn by priority, with per-row importance weights.

        The same state, step and seed give the same batch. Call `update_priorities(batch.keys, ...)`
        after training on it: that is what counts the replay."""
        cfg = self.config
        beta = annealed_beta(step, cfg.priority_beta0, cfg.priority_beta_steps)
        with self._lock:
            st = self.refresh()
            keys, probs, weights = draw(st.l2_groups, cfg.max_replays_per_group, num_groups,
                                        cfg.priority_alpha, beta, cfg.priority_eps, rng_seed)
            picked = [(k, st.l2_groups[k], st.shards[st.l2_groups[k].path]) for k in keys]
        pieces, row_w, kept, kept_p = [], [], [], []
        for (key, grp, info), p, w in zip(picked, probs, weights):
            table = self.load_shard(info)
            if table is None:
                continue
            pieces.append(table.slice(grp.start, grp.count))
            row_w.append(np.full(grp.count, w, dtype=np.float32))
            kept.append(key)
            kept_p.append(p)
        if not pieces:
            return ReplayBatch(ROLLOUT_SCHEMA.empty_table(), np.zeros(0, np.float32), [], np.zeros(0), beta)
        return ReplayBatch(pa.concat_tables(pieces), np.concatenate(row_w), kept, np.array(kept_p), beta)

    def update_priorities(self, keys: list[str], priorities) -> int:
        """Set new priorities for replayed groups and count one replay each (append-only log)."""
        pr = [float(p) for p in np.asarray(priorities, dtype=np.float64).reshape(-1)]
        if len(pr) != len(keys):
            raise ValueError(f"update_priorities: {len(keys)} keys but {len(pr)} priorities; pass one per key")
        bad = [p for p in pr if not math.isfinite(p) or p < 0]
        if bad:
            raise ValueError(f"update_priorities: priorities must be finite and >= 0, got {bad[:3]}; "
                             "use e.g. the mean absolute advantage of the group")
        if not keys:
            return self.state.version
        with self._lock:  # only the trainer sets priorities: its own view has them, once it holds the groups
            st = self.log.state
            if not all(k in st.l2_groups for k in keys):
                st = self.refresh()
            prev = tuple(st.l2_groups[k].priority if k in st.l2_groups else p for k, p in zip(keys, pr))
        return self.commit([RecordReplays(tuple(keys), tuple(pr), prev)])

    def restore_replays(self, since_version: int) -> int:
        """Take back the replays recorded after log version `since_version`, and the priorities
        they set: a trainer resumed from a checkpoint taken at that version redoes them. Returns
        the replays taken back; -1 when the log after that version is gone (vacuumed), in which
        case nothing is changed."""
        with self._lock:
            st = self.refresh()
            if st.replays_done == 0:  # none to take back (nor a priority one set)
                return 0
            entries = self.log.read_entries(since_version + 1, st.version) if st.version > since_version else []
            if len(entries) != st.version - since_version:
                return -1
            action = replays_to_restore(entries, st)
        if action is None:
            return 0
        self.commit([action])
        return sum(action.counts)

    def eligible_replay_groups(self) -> int:
        """L2 groups that may still be replayed (fewer than max_replays_per_group replays)."""
        with self._lock:
            return self.refresh().eligible(self.config.max_replays_per_group)

    # maintenance ------------------------------------------------------------------------------
    def compact(self, everything: bool = False) -> dict:
        """Archive consumed L1 shards into L3 (all of L1 with `everything`) and apply L3 limits."""
        from .archive import compact

        return compact(self, everything)

    def vacuum(self, grace_s: float | None = None, log_retention_s: float | None = None) -> dict:
        """Delete orphaned files and old log entries (see vacuum.py for what is safe to delete)."""
        from .vacuum import vacuum

        return vacuum(self, grace_s, log_retention_s)

    def verify(self) -> dict:
        from .vacuum import verify

        return verify(self)

    def rate_limiter(self, consumer: str = "trainer"):
        from .ratelimit import RateLimiter

        return RateLimiter(self, consumer)

    def archive_files(self) -> list[str]:
        from .archive import archive_files

        return archive_files(self)

    def archive_dataset(self):
        from .archive import archive_dataset

        return archive_dataset(self)

    # reporting --------------------------------------------------------------------------------
    def stats(self, current_version: int | None = None) -> dict:
        """Rows, bytes, shards and groups per tier, staleness (rows by policy versions behind
        `current_version`, default the newest version in the buffer) and L2 replay counts."""
        with self._lock:
            st = self.refresh()
            tiers = {t: {"rows": 0, "bytes": 0, "shards": 0, "groups": 0} for t in TIERS}
            newest = -1
            for info in st.shards.values():
                d = tiers[info.tier]
                d["rows"] += info.rows
                d["bytes"] += info.bytes
                d["shards"] += 1
                d["groups"] += info.groups
                newest = max(newest, info.pv[1])
            now_v = newest if current_version is None else current_version
            staleness: dict[str, int] = {}
            for s in st.l1_seqs:
                info = st.shards[st.l1_by_seq[s]]
                k = str(max(now_v - info.pv[0], 0))
                staleness[k] = staleness.get(k, 0) + info.rows
            replays: dict[str, int] = {}
            for g in st.l2_groups.values():
                replays[str(g.replays)] = replays.get(str(g.replays), 0) + 1
            return {
                "url": self.url,
                "version": st.version,
                "tiers": tiers,
                "l1_groups_committed": st.l1_groups_added,
                "l2_eligible_groups": st.eligible(self.config.max_replays_per_group),
                "replays_done": st.replays_done,
                "l1_staleness_rows": dict(sorted(staleness.items(), key=lambda kv: int(kv[0]))),
                "l2_replay_groups": dict(sorted(replays.items(), key=lambda kv: int(kv[0]))),
                "consumed": dict(st.consumed),
                "quarantined": dict(st.quarantined),
            }
