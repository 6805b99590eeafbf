"""Readers of the three layouts. Opening a source validates it completely (every shard present,
every tensor's bytes accounted for) before anything is written; `read(name)` then returns one whole
tensor, reading each of its bytes once.

Detection: a folder with `manifest.json` says its own format; a folder with `meta.json` is a
trainer checkpoint (`dcp/`, `hf/`, see `checkpoint`); a folder with safetensors weights is a Hugging
Face model.
"""

from __future__ import annotations

import io
import json
import math

import torch

from ..storage import is_local, list_names, read_bytes, url_to_fs
from ..weights import HF_INDEX, HF_SINGLE
from .checkpoint import CARRIED, read_meta
from .dcp_io import DCPReader
from .files import open_read, read_into
from .layout import DCP_DIR, HF_META_DIR, MANIFEST, META, Format, ReshardError, TensorSpec, is_weight_file, parse_format
from .safetensors_io import Entry, read_header, read_tensor


def _json(fs, path: str, what: str) -> dict:
    try:
        return json.loads(read_bytes(fs, path))
    except FileNotFoundError:
        raise ReshardError(f"{path}: missing {what}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ReshardError(f"{path}: invalid JSON in {what} ({e})") from None


class Source:
    """Common surface: format, specs, config, meta_files (name -> path), step, policy_version."""

    format: Format
    specs: list[TensorSpec]
    config: dict
    meta_files: dict[str, str]
    step: int | None = None
    policy_version: int | None = None
    copyable = False  # whether `locate` can find tensors' bytes in local files
    carried: dict = {}  # a trainer checkpoint's own meta.json entries, kept by a `dcp:N` copy of it

    def __init__(self, fs, root: str, url: str):
        self.fs, self.root, self.url = fs, root, url
        self._handles: dict[str, object] = {}

    def _meta_from(self, folder: str) -> None:
        self.meta_files = {
            n: f"{folder}/{n}" for n in list_names(self.fs, folder)
            if not is_weight_file(n) and self.fs.isfile(f"{folder}/{n}")
        }
        if "config.json" not in self.meta_files:
            raise ReshardError(f"{folder}: no config.json; the model's config must travel with its weights")
        self.config = _json(self.fs, self.meta_files["config.json"], "model config")

    def _file(self, path: str):
        if path not in self._handles:
            self._handles[path] = open_read(self.fs, path)
        return self._handles[path]

    def _headers(self, paths: list[str]) -> dict[str, dict[str, Entry]]:
        out = {}
        for p in paths:
            if not self.fs.exists(p):
                raise ReshardError(f"{p}: shard file missing; the checkpoint is incomplete")
            out[p] = read_header(self._file(p), p, self.fs.size(p))
        return out

    def read(self, name: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """The whole tensor `name`, filled into `out` (contiguous, its shape and dtype) if given."""
        raise NotImplementedError

    def locate(self, name: str) -> list[tuple[int, int, int]] | None:
        """Where the raw bytes of tensor `name` lie in local files, in order, without reading them:
        (fd, offset, length) each. None when they are not plain runs of local bytes (then `read`)."""
        return None

    def close(self) -> None:
        for f in self._handles.values():
            f.close()
        self._handles.clear()


class HFSource(Source):
    def __init__(self, fs, root: str, url: str, manifest: dict | None):
        super().__init__(fs, root, url)
        self.copyable = is_local(fs)
        self.format = Format("hf")
        self._meta_from(root)
        if fs.exists(f"{root}/{HF_INDEX}"):
            weight_map = _json(fs, f"{root}/{HF_INDEX}", "safetensors index").get("weight_map") or {}
            if not weight_map:
                raise ReshardError(f"{root}/{HF_INDEX}: empty weight_map")
            for f in weight_map.values():
                if "/" in f or f.startswith("."):
                    raise ReshardError(f"{root}/{HF_INDEX}: file name {f!r} points outside the folder")
        elif fs.exists(f"{root}/{HF_SINGLE}"):
            weight_map = None
        else:
            raise ReshardError(f"{root}: no {HF_SINGLE} or {HF_INDEX} (only safetensors weights are read, never pickles)")
        files = sorted(set(weight_map.values())) if weight_map else [HF_SINGLE]
        headers = self._headers([f"{root}/{f}" for f in files])
        self._where: dict[str, tuple[str, Entry]] = {}
        for path, entries in headers.items():
            for name, e in entries.items():
                self._where[name] = (path, e)
        for name, f in (weight_map or {}).items():
            if name not in headers[f"{root}/{f}"]:
                raise ReshardError(f"{root}/{f}: tensor {name!r} listed in {HF_INDEX} is missing from the file")
        self.specs = [TensorSpec(n, e.shape, e.dtype) for n, (_, e) in self._where.items()]
        if manifest:
            self.step, self.policy_version = manifest.get("step"), manifest.get("version")

    def read(self, name: str, out: torch.Tensor | None = None) -> torch.Tensor:
        path, entry = self._where[name]
        return read_tensor(self._file(path), entry, path, out)

    def locate(self, name: str) -> list[tuple[int, int, int]] | None:
        path, entry = self._where[name]
        f = self._file(path)
        return [(f.fileno(), entry.begin, entry.end - entry.begin)] if isinstance(f, io.FileIO) else None


class TPSource(Source):
    def __init__(self, fs, root: str, url: str, manifest: dict):
        super().__init__(fs, root, url)
        self.format = parse_format(manifest["format"])
        self._meta_from(root)
        self.step, self.policy_version = manifest.get("step"), manifest.get("version")
        n = self.format.degree
        rank_files = manifest.get("rank_files") or []
        if len(rank_files) != n:
            raise ReshardError(f"{root}/{MANIFEST}: lists {len(rank_files)} rank files for tp:{n}")
        for f in rank_files:
            if not isinstance(f, str) or "/" in f or f.startswith("."):
                raise ReshardError(f"{root}/{MANIFEST}: rank file name {f!r} points outside the folder")
        self._paths = [f"{root}/{f}" for f in rank_files]
        headers = self._headers(self._paths)
        self._plan: dict[str, dict] = manifest.get("tensors") or {}
        self.specs = []
        self._segments: dict[str, list[list[tuple[int, int]]]] = {}
        for name, t in self._plan.items():
            spec = TensorSpec(name, tuple(t["shape"]), _dtype(t["dtype"], root))
            segments = _rank_segments(root, name, t, n)
            for r, path in enumerate(self._paths):
                e = headers[path].get(name)
                if e is None:
                    raise ReshardError(f"{path}: tensor {name!r} of rank {r} is missing; the shard is incomplete")
                want = _piece_shape(spec, t.get("dim"), segments[r])
                if e.shape != want or e.dtype != spec.dtype:
                    raise ReshardError(f"{path}: {name!r} has shape {list(e.shape)}, the manifest implies {list(want)}")
            _check_tiling(root, name, spec, t.get("dim"), [seg for rank in segments for seg in rank])
            self._segments[name] = segments
            self.specs.append(spec)
        self._headers_by_path = headers

    def read(self, name: str, out: torch.Tensor | None = None) -> torch.Tensor:
        t = self._plan[name]
        spec = TensorSpec(name, tuple(t["shape"]), _dtype(t["dtype"], self.root))
        dim = t.get("dim")
        if dim is None:  # replicated: every rank holds the same bytes; read rank 0's
            return read_tensor(self._file(self._paths[0]), self._headers_by_path[self._paths[0]][name], self._paths[0], out)
        out = torch.empty(spec.shape, dtype=spec.dtype) if out is None else out
        row = spec.dtype.itemsize * math.prod(spec.shape[1:])
        seen = set()
        for r, segments in enumerate(self._segments[name]):
            path = self._paths[r]
            entry = self._headers_by_path[path][name]
            f = self._file(path)
            piece, at = None, 0
            for start, stop in segments:
                if (start, stop) not in seen and stop > start:  # a replicated KV head: its first rank is enough
                    seen.add((start, stop))
                    dest = out.narrow(dim, start, stop - start)
                    if dim == 0:  # rows of the rank's slice lie in one run of its file
                        f.seek(entry.begin + at * row)
                        read_into(f, dest, path)
                    else:
                        piece = read_tensor(f, entry, path) if piece is None else piece
                        dest.copy_(piece.narrow(dim, at, stop - start))
                at += stop - start
        return out


class DCPSource(Source):
    def __init__(self, fs, root: str, url: str, meta: dict):
        super().__init__(fs, root, url)
        if meta.get("format") != "dcp":
            raise ReshardError(f"{root}/{META}: format {meta.get('format')!r}, expected 'dcp'")
        self._meta_from(f"{root}/{HF_META_DIR}")
        self.copyable = is_local(fs)
        self.reader = DCPReader(fs, f"{root}/{DCP_DIR}")
        self.specs = self.reader.specs
        if not self.specs:
            raise ReshardError(f"{root}/{DCP_DIR}: no 'model.*' entries; not a trainer checkpoint of model weights")
        self.format = Format("dcp", int(meta.get("world_size") or self.reader.world_size))
        self.step, self.policy_version = meta.get("step"), meta.get("policy_version")
        self.carried = {k: meta[k] for k in CARRIED if k in meta}

    def read(self, name: str, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.reader.read(name, out)

    def locate(self, name: str) -> list[tuple[int, int, int]] | None:
        return self.reader.locate(name)

    def close(self) -> None:
        self.reader.close()
        super().close()


def open_source(url: str) -> Source:
    fs, root = url_to_fs(url)
    if not fs.isdir(root):
        raise ReshardError(f"source {url!r} does not exist or is not a folder")
    if fs.exists(f"{root}/{MANIFEST}"):
        manifest = _json(fs, f"{root}/{MANIFEST}", "manifest")
        fmt = parse_format(manifest.get("format", "hf"))
        if fmt.kind == "tp":
            return TPSource(fs, root, url, manifest)
        if fmt.kind == "dcp":
            meta = read_meta(fs, root)
            if meta is None:
                raise ReshardError(f"{root}/{META}: missing checkpoint meta.json")
            return DCPSource(fs, root, url, meta)
        return HFSource(fs, root, url, manifest)
    meta = read_meta(fs, root)
    if meta is not None:
        return DCPSource(fs, root, url, meta)
    if fs.exists(f"{root}/{DCP_DIR}"):
        raise ReshardError(f"{url}: has dcp/ but no {META}; the checkpoint is incomplete (still being written or crashed)")
    return HFSource(fs, root, url, None)


def _dtype(code: str, where: str) -> torch.dtype:
    from .layout import ST_DTYPES

    if code not in ST_DTYPES:
        raise ReshardError(f"{where}/{MANIFEST}: unknown dtype {code!r}")
    return ST_DTYPES[code]


def _rank_segments(root: str, name: str, t: dict, n: int) -> list[list[tuple[int, int]]]:
    """Each rank's [start, stop) runs along the split dim, from `ranges` (one run per rank) or
    `segments` (fused tensors, several runs per rank)."""
    try:
        if "segments" in t:
            out = [[(int(a), int(b)) for a, b in rank] for rank in t["segments"]]
        else:
            out = [[(int(a), int(b))] for a, b in t["ranges"]]
    except (KeyError, TypeError, ValueError):
        raise ReshardError(f"{root}/{MANIFEST}: tensor {name!r} has no valid ranges or segments") from None
    if len(out) != n or any(a < 0 or b < a for rank in out for a, b in rank):
        raise ReshardError(f"{root}/{MANIFEST}: tensor {name!r} lists {len(out)} rank slices for tp:{n}, or a bad range")
    return out


def _piece_shape(spec: TensorSpec, dim, segments) -> tuple[int, ...]:
    if dim is None:
        return tuple(spec.shape)
    shape = list(spec.shape)
    shape[dim] = sum(b - a for a, b in segments)
    return tuple(shape)


def _check_tiling(root: str, name: str, spec: TensorSpec, dim, ranges) -> None:
    if dim is None:
        return
    end = 0
    for start, stop in sorted({tuple(r) for r in ranges if r[1] > r[0]}):
        if start != end:
            raise ReshardError(f"{root}/{MANIFEST}: ranks of {name!r} leave rows {end}..{start} uncovered; a shard is missing")
        end = stop
    if end != spec.shape[dim]:
        raise ReshardError(f"{root}/{MANIFEST}: ranks of {name!r} cover {end} of {spec.shape[dim]} along dim {dim}")
