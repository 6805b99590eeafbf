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
import threading
from collections import OrderedDict

import pyarrow as pa

from ..config import BufferConfig
from ..storage import to_url, url_to_fs
from .log import CommitLog
from .schema import ROLLOUT_SCHEMA
from .shards import CorruptShard, read_shard
from .state import TIERS, BufferState, ShardInfo
from .writer import ShardWriter

log = logging.getLogger(__name__)

_CACHE_SHARDS = 8


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
        self.log = CommitLog(self.fs, self.root, self.config.checkpoint_interval)
        self._cache: OrderedDict[str, pa.Table] = OrderedDict()
        self.evicted_unread_shards = 0  # L1 shards removed before this reader got to them

    # log access -------------------------------------------------------------------------------
    @property
    def state(self) -> BufferState:
        return self.log.state

    def refresh(self) -> BufferState:
        """Catch up with commits made since the last call (reads only the new log entries)."""
        with self._lock:
            self.log.refresh()
            return self.log.state

    def _log_for_write(self, writer_id: str) -> CommitLog:
        self.log.writer = writer_id
        return self.log

    def commit(self, actions: list[dict], precondition=None) -> int:
        with self._lock:
            return self.log.commit(actions, precondition)

    # writing ----------------------------------------------------------------------------------
    def writer(self, writer_id: str) -> ShardWriter:
        """An asynchronous L1 writer (background thread, queue of `config.writer_queue` shards)."""
        return ShardWriter(self, writer_id, self.config.writer_queue, self.config.shard_compression)

    # reading ----------------------------------------------------------------------------------
    def _load(self, info: ShardInfo) -> pa.Table:
        table = self._cache.get(info.path)
        if table is not None:
            self._cache.move_to_end(info.path)
            return table
        table = read_shard(self.fs, self.root, info.path)
        if table.num_rows != info.rows:
            raise CorruptShard(f"{self.root}/{info.path}: {table.num_rows} rows, the commit log says {info.rows}")
        self._cache[info.path] = table
        while len(self._cache) > _CACHE_SHARDS:
            self._cache.popitem(last=False)
        return table

    def quarantine(self, path: str, reason: str) -> None:
        """Take a bad shard out of its tier; it stays on storage for inspection, listed in stats."""
        log.error("buffer %s: quarantined shard %s/%s: %s", self.url, self.root, path, reason)
        self._cache.pop(path, None)
        with self._lock:
            if path in self.log.state.shards:
                self.log.commit([{"op": "quarantine", "path": path, "reason": reason[:2000]}])

    def load_shard(self, info: ShardInfo) -> pa.Table | None:
        """The shard's rows, or None after quarantining it when it is unreadable."""
        try:
            return self._load(info)
        except CorruptShard as e:
            self.quarantine(info.path, str(e))
            return None

    def read_fresh(self, cursor: dict | None, max_groups: int) -> tuple[pa.Table, dict]:
        """Up to `max_groups` whole L1 groups in commit order from `cursor`, and the next cursor."""
        if max_groups <= 0:
            raise ValueError(f"read_fresh: max_groups={max_groups}; pass a positive number of groups")
        seq, g = parse_cursor(cursor)
        with self._lock:
            st = self.refresh()
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

    # reporting --------------------------------------------------------------------------------
    def stats(self) -> dict:
        """Rows, bytes, shards and groups per tier, plus log position and bad shards."""
        with self._lock:
            st = self.refresh()
            tiers = {t: {"rows": 0, "bytes": 0, "shards": 0, "groups": 0} for t in TIERS}
            for info in st.shards.values():
                d = tiers[info.tier]
                d["rows"] += info.rows
                d["bytes"] += info.bytes
                d["shards"] += 1
                d["groups"] += info.groups
            return {
                "url": self.url,
                "version": st.version,
                "tiers": tiers,
                "l1_groups_committed": st.l1_groups_added,
                "consumed": dict(st.consumed),
                "quarantined": dict(st.quarantined),
            }
