"""torch.distributed.checkpoint (DCP) files, read and written one tensor at a time.

On disk a DCP checkpoint is a `.metadata` file (a pickled `Metadata`: for each key the global
shape, dtype and chunks, and for each chunk the file, byte offset and length) plus one
`__<rank>_0.distcp` file per saving rank, in which every chunk is a `torch.save` archive.

Reading: `.metadata` goes through an unpickler that admits only DCP's metadata classes, torch
sizes and dtypes (no arbitrary code from a shared folder). A chunk is opened with
`torch.load(map_location="meta", weights_only=True)`, which validates the archive and gives the
chunk's shape, strides and the offset of its raw bytes without reading them; the bytes are then read
straight into the destination tensor.

Writing `dcp:N` (what "world size N" means): every parameter is cut on dim 0 into N chunks of
ceil(d0 / N) rows (`torch.chunk`, the Shard(0) placement FSDP2 uses), and rank r's chunks go to
`__r_0.distcp`. That is byte-for-byte the layout an N-rank FSDP2 trainer saves, so each rank of
such a trainer loads from one file; DCP itself loads the checkpoint at any other world size.
"""

from __future__ import annotations

import io
import math
import pickle
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .checkpoint import dcp_module
from .files import OutFile, open_read, read_into
from .layout import MODEL_PREFIX, ReshardError, TensorSpec, dcp_rank_name

if TYPE_CHECKING:
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import Metadata

METADATA = ".metadata"
_ALLOWED = {
    ("torch.distributed.checkpoint.metadata", n) for n in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch.serialization", "_get_layout"),
    ("torch", "Size"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"),
    ("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise ReshardError(f"DCP .metadata refers to {module}.{name}, which a checkpoint index never needs; refusing it")


def read_metadata(fs, path: str) -> Metadata:
    M = dcp_module().metadata
    try:
        with open_read(fs, path) as f:
            md = _MetadataUnpickler(io.BytesIO(f.read())).load()
    except FileNotFoundError:
        raise ReshardError(f"{path}: missing; the DCP checkpoint is incomplete") from None
    if not isinstance(md, M.Metadata):
        raise ReshardError(f"{path}: not a DCP metadata file")
    return md


class _Slice(io.RawIOBase):
    """A read-only, seekable window [start, start+length) of an open file."""

    def __init__(self, f, start: int, length: int):
        self.f, self.start, self.length, self.pos = f, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = pos if whence == 0 else self.pos + pos if whence == 1 else self.length + pos
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, buf) -> int:
        n = max(0, min(len(buf), self.length - self.pos))
        if n == 0:
            return 0
        self.f.seek(self.start + self.pos)
        got = self.f.readinto(memoryview(buf)[:n])
        self.pos += got
        return got


@dataclass
class _Chunk:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    info: _StorageInfo


class DCPReader:
    """The model parameters (keys `model.<hf name>`) of a DCP checkpoint folder."""

    def __init__(self, fs, folder: str):
        self.fs, self.folder = fs, folder
        md = read_metadata(fs, f"{folder}/{METADATA}")
        M = dcp_module().metadata
        self.specs: list[TensorSpec] = []
        self._chunks: dict[str, list[_Chunk]] = {}
        for key, item in md.state_dict_metadata.items():
            if not key.startswith(MODEL_PREFIX) or isinstance(item, M.BytesStorageMetadata):
                continue
            name = key[len(MODEL_PREFIX):]
            spec = TensorSpec(name, tuple(item.size), item.properties.dtype)
            chunks = []
            for c in item.chunks:
                info = md.storage_data.get(M.MetadataIndex(key, c.offsets))
                if info is None:
                    raise ReshardError(f"{folder}: chunk {list(c.offsets)} of {key!r} has no storage entry; metadata is corrupt")
                if getattr(info, "transform_descriptors", None):
                    raise ReshardError(f"{folder}: {key!r} is stored with transforms {info.transform_descriptors}; save without them")
                chunks.append(_Chunk(tuple(c.offsets), tuple(c.sizes), info))
            _check_cover(folder, key, spec, chunks)
            self.specs.append(spec)
            self._chunks[name] = chunks
        files = sorted({c.info.relative_path for cs in self._chunks.values() for c in cs})
        for rel in files:
            if "/" in rel or rel.startswith("."):
                raise ReshardError(f"{folder}: metadata points outside the checkpoint ({rel!r})")
            if not fs.exists(f"{folder}/{rel}"):
                raise ReshardError(f"{folder}/{rel}: shard file missing; the checkpoint is incomplete (copy it or re-save)")
        self.world_size = len(files)
        self._by_name = {s.name: s for s in self.specs}
        self._open: dict[str, object] = {}

    def read(self, name: str, out: torch.Tensor | None = None) -> torch.Tensor:
        spec, chunks = self._by_name[name], self._chunks[name]
        out = torch.empty(spec.shape, dtype=spec.dtype) if out is None else out
        for c in chunks:
            dest = out[tuple(slice(o, o + s) for o, s in zip(c.offsets, c.sizes))]
            self._read_chunk(c, dest, f"{self.folder}/{c.info.relative_path} ({MODEL_PREFIX}{name})")
        return out

    def _file(self, rel: str):
        if rel not in self._open:
            self._open[rel] = open_read(self.fs, f"{self.folder}/{rel}")
        return self._open[rel]

    def locate(self, name: str) -> list[tuple[int, int, int]] | None:
        """Where the raw bytes of `name` lie, in row-major order, without reading them: one
        (fd, offset, length) per dim-0 chunk. None unless every chunk is a plain slab on local disk."""
        spec, out = self._by_name[name], []
        for c in sorted(self._chunks[name], key=lambda c: c.offsets):
            if any(o != 0 for o in c.offsets[1:]) or tuple(c.sizes[1:]) != tuple(spec.shape[1:]):
                return None
            f, window, raw = self._parse_chunk(c, spec.dtype, c.sizes, f"{self.folder}/{c.info.relative_path}")
            if raw is None or not isinstance(f, io.FileIO):
                return None
            out.append((f.fileno(), c.info.offset + raw, math.prod(c.sizes) * spec.dtype.itemsize))
        return out

    def _parse_chunk(self, c: _Chunk, dtype: torch.dtype, sizes, where: str):
        """(file, window, offset in the window of the chunk's raw bytes), validated; the offset is
        None unless the record holds exactly those bytes, contiguous (not a view of a larger
        storage)."""
        f = self._file(c.info.relative_path)
        window = _Slice(f, c.info.offset, c.info.length)
        try:
            meta = torch.load(window, map_location="meta", weights_only=True)
        except Exception as e:  # noqa: BLE001 - any unreadable archive is the same user-facing problem
            raise ReshardError(f"{where}: unreadable chunk at byte {c.info.offset} ({e}); the shard is corrupt") from None
        if not isinstance(meta, torch.Tensor) or tuple(meta.shape) != tuple(sizes) or meta.dtype != dtype:
            raise ReshardError(
                f"{where}: chunk holds {getattr(meta, 'dtype', type(meta))} {list(getattr(meta, 'shape', []))}, "
                f"metadata says {dtype} {list(sizes)}; mismatched shape"
            )
        storage = meta.untyped_storage()
        plain = meta.is_contiguous() and meta.storage_offset() == 0 and storage.nbytes() == math.prod(sizes) * dtype.itemsize
        return f, window, getattr(storage, "_checkpoint_offset", None) if plain else None

    def _read_chunk(self, c: _Chunk, dest: torch.Tensor, where: str) -> None:
        _, window, raw = self._parse_chunk(c, dest.dtype, dest.shape, where)
        if raw is not None and dest.is_contiguous():
            window.seek(raw)
            read_into(window, dest, where)
            return
        window.seek(0)  # a view-saved or strided chunk: let torch rebuild it, then copy
        dest.copy_(torch.load(window, map_location="cpu", weights_only=True))

    def close(self) -> None:
        for f in self._open.values():
            f.close()
        self._open.clear()


def _check_cover(folder: str, key: str, spec: TensorSpec, chunks: list[_Chunk]) -> None:
    total = 0
    for c in chunks:
        if len(c.offsets) != len(spec.shape) or any(o < 0 or o + s > d for o, s, d in zip(c.offsets, c.sizes, spec.shape)):
            raise ReshardError(f"{folder}: chunk {list(c.offsets)}+{list(c.sizes)} of {key!r} lies outside its shape {list(spec.shape)}")
        n = 1
        for s in c.sizes:
            n *= s
        total += n
    if total != spec.numel:
        raise ReshardError(
            f"{folder}: chunks of {key!r} cover {total} of {spec.numel} elements; a shard is missing from the checkpoint"
        )
    if len(chunks) > 1 and spec.shape:  # equal volume and no overlap: they tile the tensor exactly
        lo = torch.tensor([list(c.offsets) for c in chunks])
        hi = lo + torch.tensor([list(c.sizes) for c in chunks])
        meet = ((lo[:, None, :] < hi[None, :, :]) & (lo[None, :, :] < hi[:, None, :])).all(-1)
        meet.fill_diagonal_(False)
        if meet.any():
            i, j = (int(x) for x in meet.nonzero()[0])
            raise ReshardError(f"{folder}: chunks {list(chunks[i].offsets)} and {list(chunks[j].offsets)} of {key!r} "
                               "overlap, so part of the tensor is in no shard; the checkpoint is corrupt")


def dim0_chunks(length: int, n: int) -> list[tuple[int, int]]:
    """(start, size) per rank of torch.chunk / FSDP2 Shard(0); empty ranks get size 0."""
    step = -(-length // n) if length else 0
    return [(min(r * step, length), max(0, min((r + 1) * step, length) - min(r * step, length))) for r in range(n)]


class DCPWriter:
    """Writes the `dcp/` folder of an N-rank checkpoint tensor by tensor (see the module doc)."""

    def __init__(self, fs, folder: str, world_size: int, save_id: str):
        self.fs, self.folder, self.n, self.save_id = fs, folder, world_size, save_id
        self.files = [OutFile(fs, f"{folder}/{dcp_rank_name(r)}") for r in range(world_size)]
        self.state_md: dict = {}
        self.storage: dict = {}
        self.planner: dict = {}

    def write(self, spec: TensorSpec, t: torch.Tensor) -> None:
        dcp = dcp_module()
        M, StorageInfo = dcp.metadata, dcp.filesystem._StorageInfo
        key = MODEL_PREFIX + spec.name
        chunks = []
        for r, (start, size) in enumerate(dim0_chunks(spec.shape[0], self.n) if spec.shape else [(0, 1)]):
            if size == 0:
                continue
            offsets = (start,) + (0,) * (len(spec.shape) - 1) if spec.shape else ()
            sizes = (size,) + tuple(spec.shape[1:]) if spec.shape else ()
            part = t.narrow(0, start, size) if spec.shape and self.n > 1 else t
            if part.untyped_storage().nbytes() != part.nbytes:
                # torch.save writes a view's whole storage: a chunk of a tensor, or a tensor that lies
                # in the reshard's shared read buffer, would carry all of it into the file
                part = part.clone()
            out = self.files[r]
            begin = out.tell()
            torch.save(part, out)
            self.storage[M.MetadataIndex(key, torch.Size(offsets), 0)] = StorageInfo(dcp_rank_name(r), begin, out.tell() - begin)
            chunks.append(M.ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)))
            del part
        self.state_md[key] = M.TensorStorageMetadata(M.TensorProperties(dtype=spec.dtype), torch.Size(spec.shape), chunks)
        self.planner[key] = ("model", spec.name)

    def commit(self) -> dict[str, dict]:
        """Publish the rank files, then `.metadata` (DCP's own commit point)."""
        M = dcp_module().metadata
        entries = {dcp_rank_name(r): f.commit() for r, f in enumerate(self.files)}
        md = M.Metadata(
            state_dict_metadata=self.state_md, planner_data=self.planner, storage_data=self.storage,
            storage_meta=M.StorageMeta(checkpoint_id=None, save_id=self.save_id, load_id=None), version="1.0.0",
        )
        out = OutFile(self.fs, f"{self.folder}/{METADATA}")
        try:
            out.write(pickle.dumps(md, protocol=4))
            entries[METADATA] = out.commit()
        except BaseException:
            out.abort()
            raise
        return entries

    def abort(self) -> None:
        for f in self.files:
            f.abort()
