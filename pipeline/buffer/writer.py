"""The asynchronous rollout writer: generation hands shards to a bounded queue and moves on.

A background thread encodes each shard (zstd Parquet), publishes the data file and commits it to
L1. Shards that pile up while a commit is in flight are committed together in one log entry
(group commit), so a slow store costs fewer round trips instead of more waiting. `write` blocks
only when the queue is full: that back-pressure is the point of bounding it.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import TYPE_CHECKING

import pyarrow as pa

from .shards import conform, encode, group_layout, new_shard_path, policy_range, validate_writer_id, write_shard

if TYPE_CHECKING:
    from .buffer import ReplayBuffer

_STOP = object()


class ShardWriter:
    """Commits rollout shards to L1 from a background thread. Not shared between threads."""

    def __init__(self, buffer: "ReplayBuffer", writer_id: str, queue_size: int, compression: str):
        self.buffer = buffer
        self.writer_id = validate_writer_id(writer_id)
        self.compression = compression
        self._q: queue.Queue = queue.Queue(maxsize=queue_size)
        self._error: BaseException | None = None
        self._closed = False
        self.commits: list[float] = []  # seconds per commit (data file + log entry), for metrics
        self.rows_written = 0
        self._thread = threading.Thread(target=self._run, name=f"buffer-writer-{writer_id}", daemon=True)
        self._thread.start()

    def write(self, table: pa.Table) -> None:
        """Queue a shard of whole groups in the rollout schema."""
        self._raise_if_failed()
        if self._closed:
            raise RuntimeError(f"buffer writer {self.writer_id!r} is closed")
        if table.num_rows == 0:
            return
        self._q.put(conform(table))

    def flush(self) -> None:
        """Block until every queued shard is committed; re-raise a background failure."""
        self._q.join()
        self._raise_if_failed()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._q.put(_STOP)
        self._thread.join()
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

    def _run(self) -> None:
        stop = False
        while not stop:
            item = self._q.get()
            batch, taken = [], 1
            if item is _STOP:
                stop = True
            else:
                batch.append(item)
            while not stop:  # group commit: take whatever else is already waiting
                try:
                    nxt = self._q.get_nowait()
                except queue.Empty:
                    break
                taken += 1
                if nxt is _STOP:
                    stop = True
                else:
                    batch.append(nxt)
            try:
                if batch and self._error is None:
                    self._commit(batch)
            except BaseException as e:  # surfaced on the caller's next write/flush/close
                self._error = e
            finally:
                for _ in range(taken):
                    self._q.task_done()

    def _commit(self, tables: list[pa.Table]) -> None:
        t0 = time.perf_counter()
        buf = self.buffer
        actions = []
        for table in tables:
            table, gsizes = group_layout(table)
            data = encode(table, self.compression)
            rel = new_shard_path("l1", self.writer_id)
            write_shard(buf.fs, buf.root, rel, data)
            actions.append({"op": "add", "path": rel, "tier": "l1", "rows": table.num_rows,
                            "bytes": len(data), "gsizes": gsizes, "pv": list(policy_range(table)),
                            "t": time.time()})
        with buf._lock:
            buf._log_for_write(self.writer_id).commit(actions)
        self.commits.append(time.perf_counter() - t0)
        self.rows_written += sum(t.num_rows for t in tables)
