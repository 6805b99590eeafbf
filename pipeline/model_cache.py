"""The local model cache: remote model folders are copied here once, built-in examples are built here.

`RLHF_CACHE` names the folder (default `~/.cache/rlhf-pipeline`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from .storage import is_local, url_to_fs

CACHE_ENV = "RLHF_CACHE"
ABANDONED_S = 24 * 3600  # a partial copy this old belongs to a process that died


def cache_dir() -> Path:
    root = os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "rlhf-pipeline")
    p = Path(root)
    p.mkdir(parents=True, exist_ok=True)
    return p


def localize(url: str) -> str:
    """A local folder with the contents of `url` (copied once into the cache if remote).

    The copy is made in a folder of its own and renamed into place when complete, so processes of
    one node that localize the same model at once (sampler replicas, a reward model) never read a
    folder another one is still writing; the first rename wins and the others drop their copy. The
    copy is named by the URL and the remote files' sizes and versions: new content at the same URL
    is copied again (the old copy stays for runs that use it)."""
    fs, path = url_to_fs(url)
    if is_local(fs):
        if not os.path.isdir(path):
            raise FileNotFoundError(f"model folder {url!r} does not exist")
        return path
    key = hashlib.sha256(f"{url.rstrip('/')}\n{_fingerprint(fs, path)}".encode()).hexdigest()[:16]
    dst = cache_dir() / "remote" / key
    if (dst / ".complete").exists():
        return str(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    _sweep_abandoned(dst.parent, key)
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=dst.parent))
    os.chmod(tmp, 0o755)  # mkdtemp's 0700 would keep the cache from processes of other users
    try:
        fs.get(path.rstrip("/") + "/", str(tmp) + "/", recursive=True)
        (tmp / ".complete").write_text(url)
        if dst.exists() and not (dst / ".complete").exists():
            shutil.rmtree(dst, ignore_errors=True)  # copied in place by an older version and cut off
        try:
            os.rename(tmp, dst)
        except OSError:
            if not (dst / ".complete").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(dst)


# what object stores and filesystems report of a file's content, first found first
_VERSION_FIELDS = ("ETag", "etag", "md5Hash", "LastModified", "last_modified", "updated", "mtime", "created")


def _fingerprint(fs, path: str) -> str:
    """The folder's files with their sizes and versions (ETag, modification time...): a model
    uploaded again to the same URL is another cache entry, not the old copy (one listing)."""
    root = path.rstrip("/")
    files = fs.find(root, detail=True)
    return json.dumps(sorted((name[len(root):], info.get("size"),
                              str(next((info[f] for f in _VERSION_FIELDS if info.get(f) is not None), "")))
                             for name, info in files.items()))


def _sweep_abandoned(parent: Path, key: str) -> None:
    for p in parent.glob(f".{key}-*"):
        try:
            if time.time() - p.stat().st_mtime > ABANDONED_S:
                shutil.rmtree(p, ignore_errors=True)
        except OSError:
            pass
