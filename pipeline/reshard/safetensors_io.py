"""Streaming safetensors: parse a header, read one tensor into its own memory, write a file
tensor by tensor.

The format (8-byte little-endian header length, a JSON header of name -> dtype/shape/byte range,
then the raw bytes) is simple enough to stream directly, which `safetensors.torch.save_file` does
not do (it needs every tensor in memory) and `safe_open` does through mmap (file pages then count
in the process's memory). Files written here load with `safetensors`, transformers and vLLM.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass

import torch

from .files import OutFile, read_into
from .layout import ST_CODES, ST_DTYPES, ReshardError

MAX_HEADER = 100 << 20
PAGE = 4096


@dataclass(frozen=True)
class Entry:
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute offset in the file
    end: int


def read_header(f, where: str, file_size: int | None = None) -> dict[str, Entry]:
    """Tensor entries of an open safetensors file, validated (dtype known, ranges consistent)."""
    raw = f.read(8)
    if len(raw) != 8:
        raise ReshardError(f"{where}: not a safetensors file (shorter than 8 bytes)")
    (n,) = struct.unpack("<Q", raw)
    if n > MAX_HEADER:
        raise ReshardError(f"{where}: safetensors header of {n} bytes is implausible; the file is corrupt")
    try:
        header = json.loads(f.read(n))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ReshardError(f"{where}: unreadable safetensors header ({e}); the file is corrupt") from None
    base = 8 + n
    out: dict[str, Entry] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = ST_DTYPES[info["dtype"]]
            shape = tuple(int(x) for x in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise ReshardError(f"{where}: tensor {name!r} has an invalid or unsupported header entry {info!r}") from None
        numel = 1
        for s in shape:
            numel *= s
        if end - begin != numel * dtype.itemsize or begin < 0:
            raise ReshardError(f"{where}: tensor {name!r} byte range {begin}..{end} does not match shape {list(shape)}")
        if file_size is not None and base + end > file_size:
            raise ReshardError(f"{where}: tensor {name!r} lies past the end of the file; the file is truncated")
        out[name] = Entry(dtype, shape, base + begin, base + end)
    return out


def read_tensor(f, entry: Entry, where: str, out: torch.Tensor | None = None) -> torch.Tensor:
    """The tensor of `entry`, read into `out` (contiguous, right shape and dtype) when given."""
    t = torch.empty(entry.shape, dtype=entry.dtype) if out is None else out
    f.seek(entry.begin)
    read_into(f, t, where)
    return t


class SafetensorsWriter:
    """Writes one safetensors file whose tensor list is known up front: header first, then each
    tensor's bytes in the declared order as it arrives."""

    def __init__(self, out: OutFile, tensors: list[tuple[str, tuple[int, ...], torch.dtype]]):
        self.out = out
        header: dict = {"__metadata__": {"format": "pt"}}
        offset = 0
        self._order = []
        for name, shape, dtype in tensors:
            nbytes = dtype.itemsize
            for s in shape:
                nbytes *= s
            header[name] = {"dtype": ST_CODES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            self._order.append((name, tuple(shape), dtype, nbytes))
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        # Tensor data starts on a page boundary (safetensors pads its header with spaces to 8 bytes;
        # more spaces are as valid): bytes copied file to file between page-aligned offsets move
        # whole pages, which cost the kernel about half the CPU of a copy between shifted offsets.
        raw += b" " * (-(8 + len(raw)) % PAGE)
        out.write(struct.pack("<Q", len(raw)) + raw)
        self._next = 0

    def write(self, name: str, data: memoryview | None, segments: list | None = None) -> None:
        """Append tensor `name`: its bytes in memory (`data`, unchanged until the checksum pipe
        has hashed them), or `segments` (fd, offset, length) saying where its exact bytes already
        lie on local disk, to be copied in the kernel."""
        want, shape, dtype, nbytes = self._order[self._next]
        view = memoryview(data).cast("B") if data is not None else None
        got = len(view) if view is not None else sum(n for _, _, n in segments or [])
        if name != want or got != nbytes:
            raise RuntimeError(f"{self.out.path}: expected {want} ({nbytes} bytes), got {name} ({got} bytes)")
        if segments:
            self.out.copy_from(segments)
        elif view is None:
            raise RuntimeError(f"{self.out.path}: {name} has neither bytes in memory nor a source to copy from")
        else:
            self.out.write(view, stable=True)
        self._next += 1

    @property
    def done(self) -> bool:
        return self._next == len(self._order)
