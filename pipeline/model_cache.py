"""The local model cache: remote model folders are copied here once, built-in examples are built here.

`RLHF_CACHE` names the folder (default `~/.cache/rlhf-pipeline`).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from .storage import is_local, url_to_fs

CACHE_ENV = "RLHF_CACHE"


def cache_dir() -> Path:
    root = os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "rlhf-pipeline")
    p = Path(root)
    p.mkdir(parents=True, exist_ok=True)
    return p


def localize(url: str) -> str:
    """A local folder with the contents of `url` (copied once into the cache if remote)."""
    fs, path = url_to_fs(url)
    if is_local(fs):
        if not os.path.isdir(path):
            raise FileNotFoundError(f"model folder {url!r} does not exist")
        return path
    key = hashlib.sha256(url.encode()).hexdigest()[:16]
    dst = cache_dir() / "remote" / key
    if not (dst / ".complete").exists():
        dst.mkdir(parents=True, exist_ok=True)
        fs.get(path.rstrip("/") + "/", str(dst) + "/", recursive=True)
        (dst / ".complete").write_text(url)
    return str(dst)
