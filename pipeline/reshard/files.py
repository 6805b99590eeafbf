"""Byte-level I/O on any fsspec URL: checksummed output files that appear whole or not at all,
and reads straight into tensor memory (no intermediate `bytes` copy of a large tensor)."""

from __future__ import annotations

import hashlib
import os
import uuid

import fsspec
import torch

from ..storage import is_local
from .layout import ReshardError

CHUNK = 16 << 20  # bytes per read/write call: large enough for disk speed, small enough for buffers


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, without a copy."""
    if not t.is_contiguous():
        raise ValueError("tensor_bytes needs a contiguous tensor")
    flat = t.reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy())


def read_into(f, t: torch.Tensor, where: str) -> None:
    """Fill contiguous tensor `t` from file object `f` at its current position."""
    view = tensor_bytes(t)
    done = 0
    while done < len(view):
        n = f.readinto(view[done : done + CHUNK])
        if not n:
            raise ReshardError(f"{where}: file ends early ({done} of {len(view)} bytes of a tensor); it is truncated")
        done += n


class OutFile:
    """A file written sequentially, checksummed as it is written, and published on `commit()`.

    Local disk: written to a hidden temporary name in the same folder, fsynced, then renamed, so a
    reader never sees a partial file. Object stores: a single PUT / multipart upload, which becomes
    visible only when complete."""

    def __init__(self, fs: fsspec.AbstractFileSystem, path: str):
        self.fs, self.path = fs, path
        self.sha = hashlib.sha256()
        self.bytes = 0
        if is_local(fs):
            folder, name = os.path.split(path)
            os.makedirs(folder, exist_ok=True)
            self._tmp = os.path.join(folder, f".{name}.tmp-{uuid.uuid4().hex}")
            self._f = open(self._tmp, "wb", buffering=0)
        else:
            self._tmp = None
            self._f = fs.open(path, "wb")

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        for i in range(0, len(view), CHUNK):
            part = view[i : i + CHUNK]
            self.sha.update(part)
            done = 0
            while done < len(part):
                done += self._f.write(part[done:])
        self.bytes += len(view)
        return len(view)

    def tell(self) -> int:
        return self.bytes

    def flush(self) -> None:
        """Bytes reach the file on each write; durability comes from `commit()`."""

    def commit(self) -> dict:
        """Publish the file; returns its manifest entry."""
        if self._tmp is not None:
            os.fsync(self._f.fileno())
            self._f.close()
            os.replace(self._tmp, self.path)
        else:
            self._f.close()
        return {"bytes": self.bytes, "sha256": self.sha.hexdigest()}

    def abort(self) -> None:
        try:
            self._f.close()
        except Exception:  # noqa: BLE001 - best effort cleanup of a failed write
            pass
        if self._tmp is not None and os.path.exists(self._tmp):
            os.unlink(self._tmp)


def open_read(fs: fsspec.AbstractFileSystem, path: str):
    """A binary file object; plain `open` on local disk (fastest), fsspec elsewhere."""
    if is_local(fs):
        return open(path, "rb", buffering=0)
    return fs.open(path, "rb", block_size=CHUNK)


def file_sha256(fs: fsspec.AbstractFileSystem, path: str) -> tuple[int, str]:
    h = hashlib.sha256()
    n = 0
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    with open_read(fs, path) as f:
        while True:
            k = f.readinto(view)
            if not k:
                break
            h.update(view[:k])
            n += k
    return n, h.hexdigest()
