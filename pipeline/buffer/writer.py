"""The asynchronous rollout writer: generation hands shards to a bounded queue and moves on.

Two background threads form a pipeline. The first encodes each shard (zstd Parquet) and writes
its data file; the second commits the files to L1 in write order. Data files that pile up while a
commit is in flight are committed together in one log entry (group commit), and a commit waiting
on the disk (fsync) or the network overlaps the encoding of the next shards, so a slow store costs
fewer round trips instead of more waiting. `write` blocks only when the queue is full: that
back-pressure is the point of bounding it.

A writer given an `admit` check (several sampler replicas use one for the staleness bound) commits
a shard only if the check passes with the number of L1 groups committed before it, and drops it
otherwise (its file deleted, its tag in `dropped`). The check runs as the commit's precondition:
a commit succeeds only as the entry right after the state the check saw, and after a lost race it
runs again on the refreshed state, so it sees exactly the groups committed before the shard, every
other writer's included.

A shard may come with groups to archive (`write(..., archive=...)`: a sampler's groups that it
generated and did not hand over): they go straight to L3 as a zstd file of their own, committed in
the same log entry as the shard, and count in none of the writer's L1 figures. A shard the admit
check refuses is dropped with them.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

import pyarrow as pa
import pyarrow.compute as pc

from ..storage import delete, join
from .actions import AddShard
from .archive import archive_path, as_archived
from .log import CommitConflict
from .shards import conform, encode, group_layout, new_shard_path, policy_range, validate_writer_id, write_shard

if TYPE_CHECKING:
    from .buffer import ReplayBuffer

log = logging.getLogger(__name__)
_STOP = object()
# admit(groups committed to L1 before the shard, its log action) -> may it be committed there?
Admit = Callable[[int, AddShard], bool]


class _Refused(CommitConflict):
    """The admit check refused some of a commit's shards (`refused`) at the position they would take."""

    def __init__(self, refused: list[AddShard]):
        super().__init__(f"{len(refused)} shard(s) refused by the admit check")
        self.refused = refused


class ShardWriter:
    """Commits rollout shards to L1 from background threads. Not shared between threads."""

    def __init__(self, buffer: "ReplayBuffer", writer_id: str, queue_size: int, compression: str,
                 admit: Admit | None = None):
        self.buffer = buffer
        self.admit = admit  # read at each commit: may be set (never unset) while the writer runs
        self.writer_id = validate_writer_id(writer_id)
        self.compression = compression
        self._tables: queue.Queue = queue.Queue(maxsize=queue_size)
        self._files: queue.Queue = queue.Queue()  # bounded in effect by _tables
        self._error: BaseException | None = None
        self._skipped = 0  # shards dropped from the queues after a failure (never committed)
        self._closed = False
        self.commits: list[float] = []  # seconds per log commit, for metrics
        self.rows_written = 0
        self._pending = 0  # groups handed to write() and not yet committed (or failed)
        self.groups_written = 0  # groups handed to write() since it was opened
        self.dropped: list[Any] = []  # the tags of the shards the admit check refused, in commit order
        self._pending_lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._encode_loop, name=f"buffer-encode-{writer_id}", daemon=True),
            threading.Thread(target=self._commit_loop, name=f"buffer-commit-{writer_id}", daemon=True),
        ]
        for t in self._threads:
            t.start()

    def write(self, table: pa.Table, tag: Any = None, archive: pa.Table | None = None) -> None:
        """Queue a shard of whole groups in the rollout schema for L1; `tag` names it in `dropped`.
        `archive`: whole groups in the same schema that go to L3 instead, in the same commit."""
        self._raise_if_failed()
        if self._closed:
            raise RuntimeError(f"buffer writer {self.writer_id!r} is closed")
        if table.num_rows == 0:
            return  # (groups to archive come only with a shard)
        table = conform(table)
        archive = conform(archive) if archive is not None and archive.num_rows else None
        groups = pc.count_distinct(table.column("group_id")).as_py()
        with self._pending_lock:
            self._pending += groups
        self.groups_written += groups
        self._tables.put((table, tag, archive))

    def pending_groups(self) -> int:
        """Groups queued by `write` that are not committed yet."""
        with self._pending_lock:
            return self._pending

    def flush(self) -> None:
        """Block until every queued shard is committed; re-raise a background failure."""
        self._tables.join()
        self._files.join()
        self._raise_if_failed()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._tables.put(_STOP)
        for t in self._threads:
            t.join()
        self._raise_if_failed()

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------
    def _raise_if_failed(self) -> None:
        """A failure stays: the shards queued behind the one that failed were not committed either,
        so the writer refuses everything after it (each call raises); a new writer goes on."""
        if self._error is not None:
            err = self._error
            lost = f"; {self._skipped} shard(s) queued after it were not committed" if self._skipped else ""
            raise RuntimeError(f"buffer writer {self.writer_id!r}: commit failed: {err}{lost}; this writer "
                               "takes no more shards") from err

    def _encode_loop(self) -> None:
        while True:
            item = self._tables.get()
            try:
                if item is _STOP:
                    self._files.put(_STOP)
                    return
                if self._error is None:
                    table, tag, archive = item
                    self._files.put((self._prepare(table, archive), tag))
                else:
                    self._skipped += 1
            except BaseException as e:  # surfaced on the caller's next write/flush/close
                self._error = e
            finally:
                self._tables.task_done()

    def _prepare(self, table: pa.Table, archive: pa.Table | None) -> list[AddShard]:
        """Encode and write the data files (L1's, L3's); returns the log actions that will commit them."""
        buf, actions = self.buffer, []
        for tier, rows in (("l1", table), ("l3", archive)):
            if rows is None:  # (`write` passes no empty table)
                continue
            rows, gsizes = group_layout(rows if tier == "l1" else as_archived(rows))
            data = encode(rows, self.compression if tier == "l1" else "zstd")
            rel = new_shard_path("l1", self.writer_id) if tier == "l1" else archive_path(buf)
            write_shard(buf.fs, buf.root, rel, data, fsync=buf.config.fsync)
            if tier == "l1" and buf.shard_copies is not None:
                buf.shard_copies.keep(rel, data)
            actions.append(AddShard(rel, tier, rows.num_rows, len(data), tuple(gsizes), policy_range(rows),
                                    time.time()))
        return actions

    def _commit_loop(self) -> None:
        stop = False
        while not stop:
            batch = [self._files.get()]
            while True:  # group commit: take whatever else is already waiting
                try:
                    batch.append(self._files.get_nowait())
                except queue.Empty:
                    break
            items = [b for b in batch if b is not _STOP]
            stop = len(items) < len(batch)
            try:
                if items and self._error is not None:
                    self._skipped += len(items)
                elif items:
                    t0 = time.perf_counter()
                    committed = self._commit(items)
                    self.commits.append(time.perf_counter() - t0)
                    self.rows_written += sum(a.rows for a in committed if a.tier == "l1")
            except BaseException as e:
                self._error = e
            finally:
                with self._pending_lock:
                    self._pending -= sum(a.num_groups for acts, _ in items for a in acts if a.tier == "l1")
                for _ in batch:
                    self._files.task_done()

    def _commit(self, items: list[tuple[list[AddShard], Any]]) -> list[AddShard]:
        """Commit the shards as one entry, less those the admit check refuses; returns those committed."""
        actions, admit = [a for acts, _ in items for a in acts], self.admit
        tags = {acts[0].path: tag for acts, tag in items}  # the shard's (first), and its archived groups
        archived_with = {acts[0].path: acts[1:] for acts, _ in items}

        def check(st) -> None:
            position, refused = st.l1_groups_added, []
            for a in actions:
                if a.tier != "l1":
                    continue  # archived: no bound applies
                if admit(position, a):
                    position += a.num_groups
                else:
                    refused.append(a)
            if refused:
                raise _Refused(refused)

        while actions:  # without a check, the log's add-only append (no precondition)
            try:
                self.buffer.commit(actions, precondition=None if admit is None else check, writer=self.writer_id)
                return actions
            except _Refused as e:
                gone = [x for a in e.refused for x in (a, *archived_with[a.path])]
                for a in e.refused:
                    self._drop(a, tags[a.path], archived_with[a.path])
                actions = [a for a in actions if a not in gone]
        return []

    def _drop(self, action: AddShard, tag: Any, archived: list[AddShard]) -> None:
        log.info("buffer writer %s: shard %s (%d groups) refused by the admit check; dropped",
                 self.writer_id, action.path, action.num_groups)
        self.dropped.append(tag)
        for path in (action.path, *(a.path for a in archived)):
            try:  # no entry names it: nobody reads it (else vacuum removes it as an orphan)
                delete(self.buffer.fs, join(self.buffer.root, path))
            except OSError as e:
                log.warning("buffer writer %s: could not delete %s (%s); vacuum will", self.writer_id, path, e)
