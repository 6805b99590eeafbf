"""The asynchronous rollout writer: generation hands shards to a bounded queue and moves on.

Two background threads form a pipeline. The first encodes each shard (zstd Parquet) and writes
its data file; the second commits the files to L1 in write order. Data files that pile up while a
commit is in flight are committed together in one log entry (group commit), and a commit waiting
on the disk (fsync) or the network overlaps the encoding of the next shards, so a slow store costs
fewer round trips instead of more waiting. `write` blocks only when the queue is full: that
back-pressure is the point of bounding it.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.compute as pc

from .actions import AddShard
from .shards import conform, encode, group_layout, new_shard_path, policy_range, validate_writer_id, write_shard

if TYPE_CHECKING:
    from .buffer import ReplayBuffer

_STOP = object()


class ShardWriter:
    """Commits rollout shards to L1 from background threads. Not shared between threads."""

    def __init__(self, buffer: "ReplayBuffer", writer_id: str, queue_size: int, compression: str):
        self.buffer = buffer
        self.writer_id = validate_writer_id(writer_id)
        self.compression = compression
        self._tables: queue.Queue = queue.Queue(maxsize=queue_size)
        self._files: queue.Queue = queue.Queue()  # bounded in effect by _tables
        self._error: BaseException | None = None
        self._closed = False
        self.commits: list[float] = []  # seconds per log commit, for metrics
        self.rows_written = 0
        self._pending = 0  # groups handed to write() and not yet committed (or failed)
        self.groups_written = 0  # groups handed to write() since it was opened
        self._pending_lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._encode_loop, name=f"buffer-encode-{writer_id}", daemon=True),
            threading.Thread(target=self._commit_loop, name=f"buffer-commit-{writer_id}", daemon=True),
        ]
        for t in self._threads:
            t.start()

    def write(self, table: pa.Table) -> None:
        """Queue a shard of whole groups in the rollout schema."""
        self._raise_if_failed()
        if self._closed:
            raise RuntimeError(f"buffer writer {self.writer_id!r} is closed")
        if table.num_rows == 0:
            return
        table = conform(table)
        groups = pc.count_distinct(table.column("group_id")).as_py()
        with self._pending_lock:
            self._pending += groups
        self.groups_written += groups
        self._tables.put(table)

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
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError(f"buffer writer {self.writer_id!r}: commit failed: {err}") from err

    def _encode_loop(self) -> None:
        while True:
            item = self._tables.get()
            try:
                if item is _STOP:
                    self._files.put(_STOP)
                    return
                if self._error is None:
                    self._files.put(self._prepare(item))
            except BaseException as e:  # surfaced on the caller's next write/flush/close
                self._error = e
            finally:
                self._tables.task_done()

    def _prepare(self, table: pa.Table) -> AddShard:
        """Encode and write the data file; returns the log action that will commit it."""
        table, gsizes = group_layout(table)
        data = encode(table, self.compression)
        rel = new_shard_path("l1", self.writer_id)
        buf = self.buffer
        write_shard(buf.fs, buf.root, rel, data, fsync=buf.config.fsync)
        return AddShard(rel, "l1", table.num_rows, len(data), tuple(gsizes), policy_range(table), time.time())

    def _commit_loop(self) -> None:
        stop = False
        while not stop:
            batch = [self._files.get()]
            while True:  # group commit: take whatever else is already waiting
                try:
                    batch.append(self._files.get_nowait())
                except queue.Empty:
                    break
            actions = [a for a in batch if a is not _STOP]
            stop = len(actions) < len(batch)
            try:
                if actions and self._error is None:
                    t0 = time.perf_counter()
                    self.buffer.commit(actions, writer=self.writer_id)
                    self.commits.append(time.perf_counter() - t0)
                    self.rows_written += sum(a.rows for a in actions)
            except BaseException as e:
                self._error = e
            finally:
                with self._pending_lock:
                    self._pending -= sum(a.num_groups for a in actions)
                for _ in batch:
                    self._files.task_done()
