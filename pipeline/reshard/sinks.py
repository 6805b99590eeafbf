"""Writers of the three layouts. A sink is told the full tensor list up front (so headers can be
written first), receives each whole tensor once in that order, and returns the manifest entries of
the files it published. Output layouts:

hf      config/tokenizer/generation files, `model.safetensors` or `model-0000i-of-0000k.safetensors`
        + `model.safetensors.index.json` when the weights exceed `max_shard_bytes`.
tp:N    the same metadata files plus `model-tp-rank-0000r-of-0000N.safetensors` for r < N. Each rank
        file holds every parameter under its Hugging Face name, as the slice that rank owns (rules
        in `arch`); the manifest's `tensors[name]` gives `shape` (full), `dtype`, `dim` (split
        dimension, null when replicated) and `ranges` ([start, stop) along `dim`, one per rank),
        or for fused tensors (Phi-3's qkv_proj, gate_up_proj) `segments` (per rank, the runs it
        holds, concatenated in that order).
dcp:N   the trainer checkpoint layout (see `checkpoint`): `dcp/` (see `dcp_io`), `hf/` with the
        metadata files, and `meta.json` {"step", "world_size": N, "policy_version", "format": "dcp"}
        written after the weights.
"""

from __future__ import annotations

import json

import torch

from ..weights import HF_INDEX, HF_SINGLE
from .arch import Architecture, Piece, piece_shape
from .checkpoint import encode_meta
from .dcp_io import DCPWriter
from .files import HashPipe, OutFile, slice_segments, tensor_bytes
from .layout import DCP_DIR, HF_META_DIR, META, ST_CODES, Format, TensorSpec, hf_shard_name, tp_rank_name
from .ring import TensorRing
from .safetensors_io import PAGE, SafetensorsWriter


class Sink:
    def __init__(self, fs, root: str, pipe: HashPipe | None = None):
        self.fs, self.root, self.pipe = fs, root, pipe
        self.files: dict[str, dict] = {}  # committed: relative path -> {"bytes", "xxh3_128"}
        self.manifest_fields: dict = {}
        self._open: list[OutFile] = []

    def _new(self, rel: str) -> OutFile:
        f = OutFile(self.fs, f"{self.root}/{rel}", self.pipe)
        self._open.append(f)
        return f

    def _commit(self, rel: str, f: OutFile) -> None:
        self.files[rel] = f.commit()
        self._open.remove(f)

    def put(self, rel: str, data: bytes) -> None:
        f = self._new(rel)
        f.write(data)
        self._commit(rel, f)

    def copy_meta(self, fs_src, meta_files: dict[str, str], prefix: str = "") -> None:
        for name, path in sorted(meta_files.items()):
            self.put(prefix + name, fs_src.cat_file(path))

    def wants_bytes(self, spec: TensorSpec) -> bool:
        """Whether writing `spec` needs the tensor in memory (else its source segments suffice)."""
        return True

    def order(self, specs: list[TensorSpec]) -> list[TensorSpec]:
        """The order in which the sink wants to receive the tensors."""
        return specs

    def write(self, spec: TensorSpec, t: torch.Tensor | None, segments: list | None = None) -> None:
        """Write the whole tensor `spec`: `t` in memory, or (t None) `segments` locating its bytes
        in local source files."""
        raise NotImplementedError

    def finish(self) -> None:
        """Publish whatever is still pending (indexes, markers)."""

    def abort(self) -> None:
        for f in list(self._open):
            f.abort()
        self._open.clear()

    def committed_paths(self) -> list[str]:
        return [f"{self.root}/{rel}" for rel in self.files]


class HFSink(Sink):
    def __init__(self, fs, root: str, specs: list[TensorSpec], max_shard_bytes: int, pipe: HashPipe | None = None):
        super().__init__(fs, root, pipe)
        groups: list[list[TensorSpec]] = [[]]
        size = 0
        for s in specs:
            if groups[-1] and size + s.nbytes > max_shard_bytes:
                groups.append([])
                size = 0
            groups[-1].append(s)
            size += s.nbytes
        groups = [page_multiples_first(g, [s.nbytes for s in g]) for g in groups]
        names = [HF_SINGLE] if len(groups) == 1 else [hf_shard_name(i, len(groups)) for i in range(len(groups))]
        self._groups = list(zip(names, groups))
        self._file_of = {s.name: n for n, g in self._groups for s in g}
        self._current: tuple[str, OutFile, SafetensorsWriter] | None = None
        self._next_group = 0
        self.total = sum(s.nbytes for s in specs)
        self._order = [s for g in groups for s in g]
        self.manifest_fields = {
            "tensors": {s.name: {"file": self._file_of[s.name], "shape": list(s.shape), "dtype": ST_CODES[s.dtype]} for s in specs}
        }

    def wants_bytes(self, spec: TensorSpec) -> bool:
        return False

    def order(self, specs: list[TensorSpec]) -> list[TensorSpec]:
        return self._order

    def write(self, spec: TensorSpec, t: torch.Tensor | None, segments: list | None = None) -> None:
        if self._current is None:
            name, group = self._groups[self._next_group]
            self._next_group += 1
            f = self._new(name)
            self._current = (name, f, SafetensorsWriter(f, [(s.name, s.shape, s.dtype) for s in group]))
        name, f, w = self._current
        w.write(spec.name, tensor_bytes(t) if t is not None else None, segments)
        if w.done:
            self._commit(name, f)
            self._current = None

    def finish(self) -> None:
        if len(self._groups) > 1:
            index = {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(self._file_of.items()))}
            self.put(HF_INDEX, json.dumps(index, indent=2).encode())


class TPSink(Sink):
    def __init__(self, fs, root: str, specs: list[TensorSpec], arch: Architecture, n: int,
                 pipe: HashPipe | None = None):
        super().__init__(fs, root, pipe)
        self.n = n
        self._pieces = {s.name: arch.tp_pieces(s, n) for s in specs}
        self._ranges = {s.name: [p.byte_ranges(s) for p in self._pieces[s.name]] for s in specs}
        self._order = page_multiples_first(specs, [sum(e - b for b, e in self._ranges[s.name][0]) for s in specs])
        gathered = [s.nbytes for s in specs if self.wants_bytes(s)]
        self._staging = TensorRing(2 * max(gathered)) if gathered else None
        self._writers = []
        for r in range(n):
            decl = []
            for s in self._order:
                decl.append((s.name, piece_shape(s, self._pieces[s.name][r]), s.dtype))
            f = self._new(tp_rank_name(r, n))
            self._writers.append((tp_rank_name(r, n), f, SafetensorsWriter(f, decl)))
        self.manifest_fields = {
            "tp_size": n,
            "rank_files": [tp_rank_name(r, n) for r in range(n)],
            "tensors": {s.name: tp_entry(s, self._pieces[s.name]) for s in specs},
        }

    def wants_bytes(self, spec: TensorSpec) -> bool:
        return any(len(r) > 1 for r in self._ranges[spec.name])  # dim-1 slices and fused blocks are gathered in memory

    def write(self, spec: TensorSpec, t: torch.Tensor | None, segments: list | None = None) -> None:
        data = tensor_bytes(t) if t is not None else None
        for p, ranges, (_, _, w) in zip(self._pieces[spec.name], self._ranges[spec.name], self._writers):
            if len(ranges) == 1:  # one run of the source bytes: copied file to file when it lies on disk
                begin, end = ranges[0]
                w.write(spec.name, data[begin:end] if data is not None else None,
                        segments and slice_segments(segments, begin, end))
            else:  # a run per row (a dim-1 slice) or per block (fused): gathered into the staging ring, written at once
                buf = self._staging.take(piece_shape(spec, p), spec.dtype)
                at = 0
                for start, stop in p.segments:
                    buf.narrow(p.dim, at, stop - start).copy_(t.narrow(p.dim, start, stop - start))
                    at += stop - start
                w.write(spec.name, tensor_bytes(buf))
                del buf
                if self.pipe is not None:
                    self.pipe.then(self._staging.release)  # reused once its checksum is computed
                else:
                    self._staging.release()

    def order(self, specs: list[TensorSpec]) -> list[TensorSpec]:
        return self._order

    def finish(self) -> None:
        for name, f, _ in self._writers:
            self._commit(name, f)
        if self._staging is not None:
            self._staging.stop()


class DCPSink(Sink):
    def __init__(self, fs, root: str, n: int, meta: dict, save_id: str):
        super().__init__(fs, root)
        self.meta = meta
        self.writer = DCPWriter(fs, f"{root}/{DCP_DIR}", n, save_id)
        self.manifest_fields = {"world_size": n}

    def write(self, spec: TensorSpec, t: torch.Tensor, segments: list | None = None) -> None:
        self.writer.write(spec, t)

    def finish(self) -> None:
        for rel, entry in self.writer.commit().items():
            self.files[f"{DCP_DIR}/{rel}"] = entry
        self.put(META, encode_meta(self.meta))  # last: the checkpoint's own commit point

    def abort(self) -> None:
        self.writer.abort()
        super().abort()


def tp_entry(spec: TensorSpec, pieces: list[Piece]) -> dict:
    """The manifest's description of one tensor of a tp:N output: `ranges` gives each rank's
    [start, stop) along `dim` ([0, 0] when replicated); a fused tensor, whose rank slices are
    several runs, gives them as `segments` (per rank, a list of [start, stop], in file order)."""
    entry = {"shape": list(spec.shape), "dtype": ST_CODES[spec.dtype], "dim": pieces[0].dim}
    if any(len(p.segments) > 1 for p in pieces):
        entry["segments"] = [[list(seg) for seg in p.segments] for p in pieces]
    else:
        entry["ranges"] = [list(p.segments[0]) if p.dim is not None else [0, 0] for p in pieces]
    return entry


def page_multiples_first(specs: list[TensorSpec], sizes: list[int]) -> list[TensorSpec]:
    """`specs` with those whose bytes (`sizes`) are a whole number of pages first, each group in
    its given order. Written from a page boundary, all of these then start on one, so the bulk of
    the bytes is copied page-aligned; the small tensors (norms, biases) follow."""
    return [s for s, n in zip(specs, sizes) if n % PAGE == 0] + [s for s, n in zip(specs, sizes) if n % PAGE]


def make_sink(fmt: Format, fs, root: str, specs, arch: Architecture, *, max_shard_bytes: int, meta: dict, save_id: str,
              pipe: HashPipe | None = None) -> Sink:
    if fmt.kind == "hf":
        return HFSink(fs, root, specs, max_shard_bytes, pipe)
    if fmt.kind == "tp":
        return TPSink(fs, root, specs, arch, fmt.degree, pipe)
    return DCPSink(fs, root, fmt.degree, meta, save_id)


META_PREFIX = {"hf": "", "tp": "", "dcp": HF_META_DIR + "/"}
