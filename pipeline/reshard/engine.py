"""`reshard(src, dst, to=...)`: one pass from any layout to any layout.

Order of work, so that bad input leaves no output and a retried task does no work:
1. open and validate the source completely (shards, shapes, architecture, TP degree);
2. if DST already holds a manifest: verify it and return it (same request) or refuse (different);
3. stream: tensors whose bytes pass through unchanged go file to file (`copy_file_range`); the
   others are read by a reader thread into a reused ring of memory (the largest such tensor +
   up to 64 MB) while this thread writes the previous one; checksums are computed on a third thread;
4. publish the manifest create-only (the commit). On any error the files written are removed.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import logging
import queue
import threading
import time

import torch

from ..storage import list_names, put_if_absent, url_to_fs
from .arch import EMBED, LM_HEAD, Architecture
from .checkpoint import checkpoint_meta
from .files import HashPipe
from .ring import TensorRing
from .layout import MANIFEST, MANIFEST_VERSION, ST_CODES, ReshardError, TensorSpec, ordered, parse_format
from .manifest import encode, read_manifest, verify
from .sinks import META_PREFIX, make_sink
from .sources import open_source

log = logging.getLogger(__name__)
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # Hugging Face's default shard size
RING_SLACK = 64 << 20
_RESERVED = {"format", "version", "step", "source_format", "architecture", "files", "tensors", "manifest_version",
             "tp_size", "rank_files", "world_size", "source_url"}


def ring_capacity(specs) -> int:
    """The largest tensor plus some slack, so small tensors keep flowing while a big one is written."""
    largest = max((s.nbytes for s in specs), default=0)
    return largest + min(largest, RING_SLACK)


@contextlib.contextmanager
def _objects_frozen():
    """Keep the objects that exist now (torch's and transformers' hundreds of thousands, in a
    process that just imported them) out of garbage collection while the stream runs: a single
    full collection over them took 0.11 s, a sixth of a 1.3 GB reshard, and frees nothing here."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _stream(source, sink, specs, pipe: HashPipe | None = None, capacity: int | None = None,
            log_every_s: float = 30.0) -> None:
    with _objects_frozen():
        _stream_tensors(source, sink, specs, pipe, capacity, log_every_s)


def _stream_tensors(source, sink, specs, pipe, capacity, log_every_s) -> None:
    # Where the sink can copy a tensor's bytes file to file, they never pass through memory, so the
    # ring is sized by the tensors that do (the largest of those, not of the model). A tensor the
    # source unexpectedly cannot locate on disk and that exceeds the ring gets memory of its own.
    read = [s for s in specs if not source.copyable or sink.wants_bytes(s)]
    ring = TensorRing(capacity or ring_capacity(read))
    q: queue.Queue = queue.Queue()

    def produce():
        try:
            for spec in specs:
                if not sink.wants_bytes(spec) and (where := source.locate(spec.name)):
                    q.put((spec, None, where, False))  # copied file to file; never held in memory
                    continue
                own = spec.nbytes > ring.capacity
                t = torch.empty(spec.shape, dtype=spec.dtype) if own else ring.take(spec.shape, spec.dtype)
                if t is None:
                    return
                t = source.read(spec.name, t)
                q.put((spec, t, None, not own))
            q.put(None)
        except BaseException as e:  # noqa: BLE001 - handed to the writer thread, which raises it
            q.put(e)

    reader = threading.Thread(target=produce, name="reshard-reader", daemon=True)
    reader.start()
    done_bytes, total, last = 0, sum(s.nbytes for s in specs), time.monotonic()
    try:
        while True:
            item = q.get()
            if item is None:
                break
            if isinstance(item, BaseException):
                raise item
            spec, tensor, segments, held = item
            sink.write(spec, tensor, segments)
            del tensor, item
            if held and pipe is not None:
                pipe.then(ring.release)  # the memory returns once its checksum is computed
            elif held:
                ring.release()
            done_bytes += spec.nbytes
            if time.monotonic() - last > log_every_s:
                last = time.monotonic()
                log.info("reshard: %.0f%% (%.2f of %.2f GB)", 100 * done_bytes / total, done_bytes / 1e9, total / 1e9)
        if pipe is not None:
            pipe.drain()
    finally:
        ring.stop()
        reader.join()


def _same_request(existing: dict, fmt: str, version, step, arch: str, specs, source_url: str | None) -> bool:
    """Whether DST's committed output is what this call would write: the same layout, version and
    step, the same architecture, and (where the manifest lists them) the same tensors and shapes.
    An output with neither version nor step (a model folder converted as it is) also names its
    source: another fine-tune of the same base has the same shapes."""
    if (existing.get("format"), existing.get("version"), existing.get("step")) != (fmt, version, step):
        return False
    if existing.get("architecture", arch) != arch:
        return False
    if source_url is not None and existing.get("source_url", source_url) != source_url:
        return False
    listed = existing.get("tensors")
    dtypes = {s.name: ST_CODES[s.dtype] for s in specs}  # an entry without a dtype matches any
    return not isinstance(listed, dict) or {n: (list(t.get("shape", [])), t.get("dtype", dtypes.get(n)))
                                            for n, t in listed.items()} == \
        {s.name: (list(s.shape), dtypes[s.name]) for s in specs}


def reshard(src_url: str, dst_url: str, to: str = "hf", *, policy_version: int | None = None,
            max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, extra: dict | None = None,
            dtype: torch.dtype | None = None) -> dict:
    """Reshard the checkpoint at `src_url` into layout `to` at `dst_url`; returns the manifest.
    `dtype`: cast the floating-point tensors to it (the others, and by default all, keep theirs)."""
    return publish(src_url, dst_url, to, policy_version=policy_version, max_shard_bytes=max_shard_bytes, extra=extra,
                   dtype=dtype)[0]


def publish(src_url: str, dst_url: str, to: str = "hf", *, policy_version: int | None = None,
            max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, extra: dict | None = None,
            known_new: bool = False, dtype: torch.dtype | None = None) -> tuple[dict, bool]:
    """`reshard`, also saying whether this call committed the output (False: it already existed).
    `known_new`: the caller has just seen DST without a manifest, so it is not read again (the
    create-only commit still decides between concurrent publishers)."""
    fmt = parse_format(to)
    if max_shard_bytes < 1:
        raise ReshardError(f"max_shard_bytes: {max_shard_bytes} must be positive")
    if dtype is not None and not dtype.is_floating_point:
        raise ReshardError(f"dtype: {dtype} is not a floating-point dtype; only floating tensors are cast")
    fs, root = url_to_fs(dst_url)
    source = _Cast.maybe(open_source(src_url), dtype)
    try:
        if source.fs.protocol == fs.protocol and (root == source.root or root.startswith(source.root.rstrip("/") + "/")):
            raise ReshardError(f"destination {dst_url!r} is the source or inside it; choose another folder")
        arch = Architecture.from_config(source.config, source.url)
        arch.check(source.specs, source.url)
        source = _Renamed(source, arch.output_names([s.name for s in source.specs], fmt.kind))
        if fmt.kind == "tp":
            arch.check_tp(fmt.degree, source.specs)
        version = policy_version if policy_version is not None else source.policy_version
        step = source.step if source.step is not None else (extra or {}).get("step")

        identity = source.url if version is None and step is None else None
        existing = None if known_new else read_manifest(fs, root)
        if existing is not None:
            if not _same_request(existing, str(fmt), version, step, arch.name, source.specs, identity):
                raise ReshardError(
                    f"{dst_url} already holds {existing.get('format')} step {existing.get('step')} version "
                    f"{existing.get('version')} of {existing.get('architecture')}, not {fmt} step {step} version "
                    f"{version} of these {arch.name} weights; choose another destination"
                )
            verify(dst_url).raise_if_bad()
            return existing, False
        _check_tied(source, arch)  # reads two tensors: after the retry above, which has nothing to do
        header = {"format": str(fmt), "version": version, "step": step, "source_format": str(source.format),
                  "architecture": arch.name, "manifest_version": MANIFEST_VERSION,
                  **({"source_url": identity} if identity is not None else {})}
        return _write(source, fs, root, fmt, arch, header, max_shard_bytes, extra)
    finally:
        source.close()


class _Cast:
    """The source with its floating-point tensors cast to `dtype` (the specs say so, and the
    manifest then): those are read through memory, never copied file to file."""

    def __init__(self, source, dtype: torch.dtype):
        self.inner, self.dtype = source, dtype
        self.cast = {s.name for s in source.specs if s.dtype.is_floating_point and s.dtype != dtype}
        self.specs = [TensorSpec(s.name, s.shape, dtype) if s.name in self.cast else s for s in source.specs]
        self.copyable = source.copyable and not self.cast

    @classmethod
    def maybe(cls, source, dtype: torch.dtype | None):
        return source if dtype is None else cls(source, dtype)

    def __getattr__(self, attr):
        return getattr(self.inner, attr)

    def read(self, name: str, out=None):
        if name not in self.cast:
            return self.inner.read(name, out)
        t = self.inner.read(name)
        return t.to(self.dtype) if out is None else out.copy_(t)

    def locate(self, name: str):
        return None if name in self.cast else self.inner.locate(name)


class _Renamed:
    """The source as the output names its tensors ({output name: source name}): a tied output
    layer is dropped or becomes a second name of the embedding (see `arch.output_names`)."""

    def __init__(self, source, names: dict[str, str]):
        self.inner, self.names = source, names
        by_name = {s.name: s for s in source.specs}
        self.specs = [TensorSpec(out, by_name[src].shape, by_name[src].dtype) for out, src in names.items()]
        self.dropped = sorted(set(by_name) - set(names.values()))

    def __getattr__(self, attr):  # format, config, fs, root, url, meta_files, step, copyable, ...
        return getattr(self.inner, attr)

    def read(self, name: str, out=None):
        return self.inner.read(self.names[name], out)

    def locate(self, name: str):
        return self.inner.locate(self.names[name])


def _check_tied(source: _Renamed, arch: Architecture) -> None:
    """A tied model's output layer must be its embedding where the source holds both: an output
    that drops it (hf, tp) would publish a policy other than the one trained, and one that keeps
    both names (dcp) would hold two matrices for what the config says is one."""
    names = {s.name for s in source.inner.specs}
    if not (arch.tied and LM_HEAD in names and EMBED in names):
        return
    head, embed = source.inner.read(LM_HEAD), source.inner.read(EMBED)
    if not torch.equal(head, embed):
        raise ReshardError(
            f"{source.url}: tie_word_embeddings is true but {LM_HEAD!r} differs from {EMBED!r} (max difference "
            f"{(head.float() - embed.float()).abs().max().item():.3g}); a tied model holds one matrix, so these "
            "weights are not the model config.json describes: set tie_word_embeddings to false if they are meant to differ"
        )


def _write(source, fs, root: str, fmt, arch: Architecture, header: dict, max_shard_bytes: int,
           extra: dict | None) -> tuple[dict, bool]:
    """Stream `source` into a new output at `root`, then commit its manifest (`header`, the
    caller's `extra` keys and the files written). On any error the files written are removed."""
    specs = ordered(source.specs)
    step, version = header["step"], header["version"]
    meta = checkpoint_meta(step, fmt.degree, version, source.carried.get("kind"), extra=source.carried)
    save_id = hashlib.sha256(f"{fmt}|{step}|{version}|{[(s.name, s.shape) for s in specs]}".encode()).hexdigest()[:32]
    pipe = HashPipe()
    sink = make_sink(fmt, fs, root, specs, arch, max_shard_bytes=max_shard_bytes, meta=meta, save_id=save_id, pipe=pipe)
    try:
        sink.copy_meta(source.fs, source.meta_files, META_PREFIX[fmt.kind])
        _stream(source, sink, sink.order(specs), pipe)
        sink.finish()
        manifest = {
            **{k: v for k, v in (extra or {}).items() if k not in _RESERVED}, **header,
            **sink.manifest_fields, "files": dict(sorted(sink.files.items())),
        }
        if put_if_absent(fs, f"{root}/{MANIFEST}", encode(manifest)):
            _remove_strays(fs, root, manifest["files"])
            return manifest, True
        winner = read_manifest(fs, root)  # a concurrent run committed the same output first
        return winner, False
    except BaseException:
        sink.abort()
        if read_manifest(fs, root) is None:
            _remove(fs, root, sink.committed_paths())
        raise
    finally:
        pipe.close()


def _remove_strays(fs, root: str, files: dict) -> None:
    """Weight files at the top of `root` that the committed output does not list: left there by an
    uncommitted write of another layout (a killed run, a reused folder), they would be read in its
    place (an index of old shards comes before `model.safetensors` for some readers)."""
    try:
        names = list_names(fs, root)
    except OSError:
        return
    strays = [n for n in names if n not in files and (n.endswith(".safetensors") or n.endswith(".safetensors.index.json"))]
    _remove(fs, root, [f"{root}/{n}" for n in strays])


def _remove(fs, root: str, paths: list[str]) -> None:
    """Delete what a failed run wrote, then the folders it leaves empty."""
    for path in paths:
        if fs.exists(path):
            fs.rm_file(path)
    for folder in sorted({p.rsplit("/", 1)[0] for p in paths} | {root}, key=len, reverse=True):
        try:
            if fs.isdir(folder) and not fs.ls(folder):
                fs.rmdir(folder)
        except OSError:
            pass
