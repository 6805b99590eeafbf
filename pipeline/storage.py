"""Shared storage on any fsspec URL, with the two write primitives the whole project relies on.

- `put_atomic`: readers see the old object or the new one, never a partial one (local: write a
  temporary file in the same folder, then rename; object stores: a single PUT is atomic).
- `put_if_absent`: create-only; exactly one of several concurrent writers of the same path wins
  (local/NFS: hard-link of a complete temporary file; S3: `If-None-Match: *`; GCS: generation
  match 0; memory: a process-local lock); a writer whose create was applied but whose reply was
  lost finds its own bytes there and wins too.
"""

from __future__ import annotations

import errno
import os
import re
import tempfile
import threading
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, Iterator

import fsspec
from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFileSystem

if TYPE_CHECKING:
    import pyarrow as pa

_memory_lock = threading.Lock()
_TMP_NAME = re.compile(r"^\..+\.tmp-[0-9a-f]{32}$")


S3_CLIENT_DEFAULTS = {"request_checksum_calculation": "when_required",
                      "response_checksum_validation": "when_required", "parameter_validation": False}
"""botocore settings for S3 clients, under any the user's fsspec configuration (`s3.config_kwargs`)
or the call gives. Every file of a run carries its own check (log entries their seal, policy files
their manifest checksums, shards their byte sizes and Parquet's own structure), so the CRC32 that
botocore would otherwise compute for every upload and download, and its validation of the request
parameters s3fs builds, only cost CPU: with them, a small PUT or GET costs about a third more CPU
in the client (and a local test endpoint's, which must decode the checksum trailer). Stores that
require a checksum for an operation still get one (`when_required`), and S3-compatible stores that
reject the checksum headers work."""


def url_to_fs(url: str, **storage_options: Any) -> tuple[fsspec.AbstractFileSystem, str]:
    """Resolve a URL or plain path to (filesystem, path-in-filesystem)."""
    if url.split("://", 1)[0] in ("s3", "s3a"):
        configured = fsspec.config.conf.get("s3", {}).get("config_kwargs", {})
        storage_options["config_kwargs"] = {**S3_CLIENT_DEFAULTS, **configured,
                                            **storage_options.get("config_kwargs", {})}
    fs, path = fsspec.core.url_to_fs(url, **storage_options)
    return fs, path.rstrip("/") if path not in ("/", "") else path


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
    return isinstance(fs, LocalFileSystem)


def join(base: str, *parts: str) -> str:
    out = base.rstrip("/")
    for p in parts:
        out = f"{out}/{p.strip('/')}"
    return out


def to_url(fs: fsspec.AbstractFileSystem, path: str) -> str:
    """The URL another process can pass to `url_to_fs` to reach the same object."""
    return fs.unstrip_protocol(path)


def _local_tmp(path: str) -> str:
    d, name = os.path.split(path)
    return os.path.join(d, f".{name}.tmp-{uuid.uuid4().hex}")


def is_temporary(name: str) -> bool:
    """A base name `_local_tmp` makes: a killed writer leaves one behind, and it is no one's data."""
    return bool(_TMP_NAME.match(name))


def write_local(path: str, data: bytes, fsync: bool, mode: str = "wb") -> None:
    """Write a local file, creating its folder on demand (checked only when the open fails)."""
    try:
        f = open(path, mode)
    except FileNotFoundError:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        f = open(path, mode)
    with f:
        f.write(data)
        if fsync:
            f.flush()
            os.fsync(f.fileno())


def put_atomic(fs: fsspec.AbstractFileSystem, path: str, data: bytes, fsync: bool = True) -> None:
    """Publish `data` at `path` so that readers never observe a partial object. `fsync=False`
    keeps the atomicity against killed processes but not against a machine crash (local disk)."""
    if is_local(fs):
        tmp = _local_tmp(path)
        write_local(tmp, data, fsync)
        os.replace(tmp, path)
        return
    fs.pipe_file(path, data)


@contextmanager
def staged_file(fs: fsspec.AbstractFileSystem, path: str) -> Iterator[str]:
    """A local file to write an output too large for `put_atomic`'s bytes into, published at `path`
    when the block succeeds and removed either way: on local disk a `_local_tmp` beside it, fsynced
    and renamed over `path`; on an object store a temporary file uploaded (one PUT or a multipart
    upload, visible only once complete)."""
    local = is_local(fs)
    if local:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        tmp = _local_tmp(path)
    else:
        fd, tmp = tempfile.mkstemp(prefix="rlhf-staged-")
        os.close(fd)
    try:
        yield tmp
        if local:
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        else:
            parent = path.rsplit("/", 1)[0]
            if parent:
                fs.makedirs(parent, exist_ok=True)
            fs.put_file(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def put_if_absent(fs: fsspec.AbstractFileSystem, path: str, data: bytes, fsync: bool = True,
                  own_check: bool = True) -> bool:
    """Create `path` with `data` only if it does not exist. Returns False if it already existed.
    `fsync=False` keeps exclusivity and atomicity against killed processes, not against a
    machine crash (local disk).

    A create retried after its reply was lost (a connection reset after the store applied it,
    which botocore retries; an NFS link whose reply was lost) meets its own write: with
    `own_check`, that is a success, told from another writer's by the object's bytes (one GET
    after a 412: callers' payloads are unique per attempt, a claim's time, a metrics chunk's
    records; where two writers' bytes are equal, so is what either would have made) or, locally,
    by the link count. Callers that recover from a lost reply their own way (the buffer log's
    transaction ids; adds that may be repeated) or whose content is the same for every writer
    pass `own_check=False`: a lost race then costs no read."""
    if is_local(fs):
        tmp = _local_tmp(path)
        write_local(tmp, data, fsync)
        try:
            os.link(tmp, path)  # atomic and exclusive, also on NFS
            return True
        except FileExistsError:
            return own_check and os.stat(tmp).st_nlink == 2  # the link is ours (NFS: a retried link)
        finally:
            os.unlink(tmp)
    if isinstance(fs, MemoryFileSystem):
        with _memory_lock:
            if fs.exists(path):
                return False
            fs.pipe_file(path, data)
            return True
    if _protocol(fs) in ("s3", "s3a", "gs", "gcs"):
        # s3fs sends `If-None-Match: *`, gcsfs `ifGenerationMatch=0` (marked experimental by
        # gcsfs); both stores answer 412 when the object exists, which both libraries raise as
        # FileExistsError. The other checks cover older releases that raise a generic error.
        try:
            fs.pipe_file(path, data, mode="create")
            return True
        except (FileExistsError, OSError, ValueError) as e:
            if isinstance(e, FileExistsError) or _is_precondition_failure(e):
                return own_check and _holds(fs, path, data)  # 412: another writer's, or our own lost reply's
            raise
    raise NotImplementedError(
        f"create-only writes are not implemented for protocol {_protocol(fs)!r}; "
        "use a local/NFS path, s3://, gs:// or memory://"
    )


# the client libraries of object stores whose errors are not all OSErrors (botocore's
# EndpointConnectionError, when the endpoint cannot be reached, is not)
_STORE_CLIENTS = ("botocore", "aiobotocore", "s3fs", "gcsfs", "google.", "aiohttp", "adlfs", "azure.")
# what a disk, a network filesystem or an object store (as s3fs translates its answers: 503
# SlowDown is EBUSY, 403 EACCES) fails with; not ENOENT, which the project's own code raises for
# states of a run, nor an errno-less OSError such as a TimeoutError of its own
_STORAGE_ERRNOS = {errno.EIO, errno.EBUSY, errno.ETIMEDOUT, errno.ECONNRESET, errno.ECONNREFUSED, errno.ECONNABORTED,
                   errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ENETDOWN, errno.EPIPE, errno.ENOSPC, errno.EDQUOT,
                   errno.EROFS, errno.ESTALE, errno.EACCES, errno.EPERM}


def is_storage_error(e: BaseException) -> bool:
    """Whether `e` is storage failing: an object store client's error, or an OSError whose errno
    is one storage fails with."""
    if any(type(e).__module__.startswith(m) for m in _STORE_CLIENTS):
        return True
    return isinstance(e, OSError) and e.errno in _STORAGE_ERRNOS


def _holds(fs, path: str, data: bytes) -> bool:
    """Whether the object at `path` holds `data` (False if it is gone)."""
    try:
        return read_bytes(fs, path) == data
    except FileNotFoundError:
        return False


def _is_precondition_failure(e: BaseException) -> bool:
    text = f"{type(e).__name__} {e} {getattr(e, 'code', '')}"
    return "PreconditionFailed" in text or "412" in text or "conditionNotMet" in text


def read_bytes(fs: fsspec.AbstractFileSystem, path: str) -> bytes:
    """The whole object. On S3 a single GET: s3fs otherwise sends a HEAD first (and, for a missing
    key, a LIST to tell a folder from a file), which triples the cost of polling for a log entry
    that does not exist yet."""
    if _protocol(fs) in ("s3", "s3a"):
        return fs.cat_file(path, max_concurrency=1)
    return fs.cat_file(path)


def parquet_from_bytes(data: bytes) -> pa.Table:
    """A whole Parquet file held in memory, as a pyarrow Table, decoded on this thread. On
    pyarrow's thread pool, a pool thread could drop the last reference to `data` (a Python
    object); when that happens while the interpreter exits, the thread is killed as it waits for
    the GIL and the process aborts ("terminate called without an active exception") after its
    work is done: 11 of 200 processes that read a small Parquet file from bytes a few times, with
    pyarrow 26, and 0 of 200 decoding on their own thread. The files read this way (shards,
    ledgers, datasets) are small, and the pool saves little on them: the same time for shards of
    6 and 44 kB, 7-10 ms against 10-11 ms for one of 1 MB, on 2 cores."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    return pq.read_table(pa.BufferReader(data), use_threads=False)


def file_exists(fs: fsspec.AbstractFileSystem, path: str) -> bool:
    """Whether a file (not a folder) exists. On S3 a single HEAD: s3fs's `exists` follows a HEAD
    that finds nothing with a LIST (is it a folder?), two requests per poll of a marker that is
    not there yet."""
    if _protocol(fs) in ("s3", "s3a"):
        bucket, key, _ = fs.split_path(path)
        try:
            fs.call_s3("head_object", Bucket=bucket, Key=key)
            return True
        except FileNotFoundError:
            return False
    return fs.isfile(path)


def _protocol(fs: fsspec.AbstractFileSystem) -> str:
    return fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]


def list_names(fs: fsspec.AbstractFileSystem, path: str) -> list[str]:
    """Base names in a folder (empty if it does not exist), skipping temporary files."""
    try:
        fs.invalidate_cache(path)
        entries = fs.ls(path, detail=False)
    except FileNotFoundError:
        return []
    names = [e.rstrip("/").rsplit("/", 1)[-1] for e in entries]
    return sorted(n for n in names if not n.startswith("."))


@dataclass(frozen=True)
class FileEntry:
    """A file found by `list_files`: path relative to the listed folder, size, modification time."""

    rel: str
    size: int
    mtime: float  # seconds since the epoch; 0.0 when the store does not say


def _mtime(info: dict) -> float:
    for key in ("mtime", "LastModified", "updated", "created", "last_modified"):
        v = info.get(key)
        if v is None:
            continue
        if isinstance(v, datetime):
            return v.timestamp()
        if isinstance(v, (int, float)):
            return float(v)
        try:
            return datetime.fromisoformat(str(v).replace("Z", "+00:00")).timestamp()
        except ValueError:
            continue
    return 0.0


def list_files(fs: fsspec.AbstractFileSystem, path: str, include_hidden: bool = False) -> list[FileEntry]:
    """Every file under `path` (recursive), for garbage collection and verification. Temporary
    files (names starting with '.') are included only with `include_hidden`."""
    try:
        fs.invalidate_cache(path)
        found = fs.find(path, detail=True, withdirs=False)
    except FileNotFoundError:
        return []
    base = path.rstrip("/") + "/"
    out = []
    for full, info in found.items():
        full = full.rstrip("/")
        rel = full[len(base):] if full.startswith(base) else full.rsplit("/", 1)[-1]
        if info.get("type") == "directory":
            continue
        if not include_hidden and any(part.startswith(".") for part in rel.split("/")):
            continue
        out.append(FileEntry(rel, int(info.get("size") or 0), _mtime(info)))
    return sorted(out, key=lambda e: e.rel)


def delete(fs: fsspec.AbstractFileSystem, path: str) -> None:
    """Remove one file; a file already gone (another gc got there first) is not an error."""
    try:
        fs.rm_file(path)
    except FileNotFoundError:
        pass


_OBJECT_STORES = ("s3", "s3a", "gs", "gcs", "az", "abfs", "abfss")


def delete_files(fs: fsspec.AbstractFileSystem, paths: list[str], folders: list[str] = ()) -> None:
    """Remove `paths` and the `folders` they are in (files already gone are not an error). On
    object stores, where folders are only key prefixes, one bulk request per 1000 files; elsewhere
    file by file, then each folder with whatever else it holds."""
    if _protocol(fs) in _OBJECT_STORES:
        if paths:
            fs.rm(list(paths))
        return
    for path in paths:
        if not any(path.startswith(folder.rstrip("/") + "/") for folder in folders):
            delete(fs, path)
    for folder in folders:
        try:
            fs.rm(folder, recursive=True)
        except FileNotFoundError:
            pass
