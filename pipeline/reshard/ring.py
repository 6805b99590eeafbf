"""A fixed ring of memory that tensors are read into and released from in order.

Why not `torch.empty` per tensor: a fresh large allocation is fresh pages, and the kernel faults
each one in on first touch; for a reshard that touches every byte once, those faults cost more
system time than the read itself. The ring is allocated once (with transparent huge pages where the
kernel offers them), reused for every tensor, and its size is the cap on bytes in flight between
the reader and the writer, so peak memory is the ring, whatever the model size.
"""

from __future__ import annotations

import collections
import mmap
import threading

import torch

ALIGN = 64


class TensorRing:
    def __init__(self, capacity: int):
        self.capacity = -(-max(capacity, ALIGN) // ALIGN) * ALIGN
        # private, not shared: shared anonymous memory is shmem, which takes huge pages only where
        # shmem_enabled allows (commonly never); private memory takes them on MADV_HUGEPAGE
        self._map = mmap.mmap(-1, self.capacity, flags=mmap.MAP_PRIVATE)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                self._map.madvise(mmap.MADV_HUGEPAGE)
            except OSError:
                pass  # not offered by this kernel: plain pages work the same
        self._buf = torch.frombuffer(self._map, dtype=torch.uint8)
        self._live: collections.deque[tuple[int, int]] = collections.deque()  # (start, end), oldest first
        self._cond = threading.Condition()
        self._stopped = False

    def _fits(self, n: int) -> int | None:
        if not self._live:
            return 0 if n <= self.capacity else None
        oldest, newest = self._live[0][0], self._live[-1]
        if newest[0] >= oldest:  # live bytes are [oldest, newest end): room before them, or after them
            if n <= oldest:
                return 0  # the front first: the memory in use stays small and warm when tensors are small
            return newest[1] if newest[1] + n <= self.capacity else None
        return newest[1] if newest[1] + n <= oldest else None  # wrapped: room is [newest end, oldest)

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """A tensor of `shape`/`dtype` in the ring; waits for releases; None once stopped."""
        nbytes = dtype.itemsize
        for s in shape:
            nbytes *= s
        n = -(-max(nbytes, 1) // ALIGN) * ALIGN
        if n > self.capacity:
            raise ValueError(f"a tensor of {nbytes} bytes does not fit a ring of {self.capacity}; size the ring to the largest")
        with self._cond:
            while (start := self._fits(n)) is None and not self._stopped:
                self._cond.wait()
            if self._stopped:
                return None
            self._live.append((start, start + n))
        return self._buf[start : start + nbytes].view(dtype).view(shape)

    def release(self) -> None:
        """Free the oldest tensor still held (tensors are released in the order they were taken)."""
        with self._cond:
            self._live.popleft()  # once empty, the next tensor starts at the front again
            self._cond.notify_all()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
