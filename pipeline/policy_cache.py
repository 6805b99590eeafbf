"""Node-local copies of a remote run's policy versions (`PolicyStore` on object stores).

A reader loads a version of a remote run from a local folder: `cache/policies/<run>/v<K>/` with
the files of the version's manifest and that manifest, renamed into place whole, so a copy that
has `manifest.json` is complete and was committed in the run directory. Two ways in:

- a download (`PolicyStore.local_dir`): the files that did not change since the newest copy
  below (a tokenizer, a config) are linked from it, the others fetched;
- a seed: the publisher of a version on the same node writes the copy itself (the folder it
  uploads from), placed right after its commit, so a sampler beside it loads the version without
  a request. Seeds carry a `.seeded`
  file; while one is recent (`FRESH_SEED_S`), readers learn of new versions from this folder and
  look at the run's `latest.json` at most every `REMOTE_POLL_S` (a publisher elsewhere, or
  restarted elsewhere, is still seen).

The folder of a run is named after the run's id, a hash of its URL and the time it was first
prepared (`prepare.json`'s `created`), so a new run at the same URL never reads the copies of the
one before, and a resumed run keeps its own. Copies are
bounded (v0 and the newest `LOCAL_COPIES`, or `sampler.max_staleness` + 1); a copy a reader holds
(`pinned`) is not pruned. The folders of other runs that nothing has touched for IDLE_RUN_S go
when a run's copies are first opened on the node (`sweep_idle_runs`): finished runs leave theirs.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import tempfile
import time
import uuid
from pathlib import Path
from typing import Callable, Iterator

VERSION_RE = re.compile(r"^v(\d{6,})$")
LOCAL_COPIES = 3
"""Local copies of a remote run's versions kept besides v0, at least: the newest ones. A run keeps
`sampler.max_staleness` + 1 where that is more: a fixed-lag sampler restarted beside the trainer
runs the version `max_staleness` behind the newest (see PolicyStore._copies)."""
IDLE_RUN_S = 3 * 86400.0
"""A run's folder of copies that nothing has written into for this long is removed by the next run
that opens its own on the node (a run resumed later downloads what it needs again)."""
SHARED = "shared"
"""Manifest key of the files a version shares with others (stored once in the run directory)."""
SEEDED = ".seeded"
FRESH_SEED_S = 60.0
"""A seed younger than this means the run's publisher is on this node."""
REMOTE_POLL_S = 1.0
"""While a fresh seed is there, the run's `latest.json` is read at most this often."""


def version_dirname(version: int) -> str:
    return f"v{version:06d}"


def sweep_idle_runs(parent: Path, mine: Path, idle_s: float = IDLE_RUN_S) -> list[str]:
    """Remove the folders of `parent` (one per run) other than `mine` whose newest entry, or
    themselves, were last modified over `idle_s` ago. Returns the names removed."""
    removed, now = [], time.time()
    try:
        runs = [p for p in parent.iterdir() if p.is_dir() and p != mine]
    except FileNotFoundError:
        return removed
    for run in runs:
        try:
            newest = max([run.stat().st_mtime, *(c.stat().st_mtime for c in run.iterdir())])
        except FileNotFoundError:  # removed meanwhile
            continue
        if now - newest > idle_s:
            shutil.rmtree(run, ignore_errors=True)
            removed.append(run.name)
    return removed


class LocalCopies:
    def __init__(self, root: Path, keep: int = LOCAL_COPIES):
        self.root = root
        self.keep = keep  # the newest copies that pruning leaves

    def folder(self, version: int) -> Path:
        return self.root / version_dirname(version)

    def get(self, version: int) -> str | None:
        """The complete copy of `version`, if there is one."""
        folder = self.folder(version)
        return str(folder) if (folder / "manifest.json").exists() else None

    def _versions(self) -> list[int]:
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return []
        return sorted(int(m.group(1)) for m in map(VERSION_RE.match, names) if m)

    def newest(self) -> tuple[int | None, bool]:
        """(the newest complete copy, whether a fresh seed is there: the publisher is on this node)."""
        for v in reversed(self._versions()):
            folder = self.folder(v)
            if (folder / "manifest.json").exists():
                try:
                    fresh = time.time() - (folder / SEEDED).stat().st_mtime < FRESH_SEED_S
                except FileNotFoundError:
                    fresh = False
                return v, fresh
        return None, False

    def _newest_below(self, below: int) -> tuple[str | None, dict]:
        for v in reversed(self._versions()):
            if v < below:
                folder = self.folder(v)
                try:
                    return str(folder), all_files(json.loads((folder / "manifest.json").read_text()))
                except (FileNotFoundError, ValueError):
                    continue
        return None, {}

    def download(self, version: int, manifest: dict, fetch: Callable[[str, str], None]) -> str:
        """The copy of `version`, made from `manifest` with `fetch(name, local path)` for each file
        that is not the same in the newest copy below."""
        dst = self.folder(version)
        if self.get(version) is None:
            self.root.mkdir(parents=True, exist_ok=True)
            tmp = tempfile.mkdtemp(prefix=".dl-", dir=self.root)
            try:
                prev, prev_files = self._newest_below(version)
                for name, entry in all_files(manifest).items():
                    target = os.path.join(tmp, name)
                    os.makedirs(os.path.dirname(target), exist_ok=True)
                    # same size and checksum as in that copy: unchanged (unless the copy was pruned meanwhile)
                    if not (prev_files.get(name) == entry and _link_or_copy(os.path.join(prev, name), target)):
                        fetch(name, target)
                self._place(tmp, manifest, dst)
            except OSError:
                shutil.rmtree(tmp, ignore_errors=True)
                if self.get(version) is None:  # not a concurrent download that got there first
                    raise
            self.prune(keep={0, version})
        return str(dst)

    def staging(self) -> str:
        """A new folder beside the copies, on the same file system, for a publisher's seed."""
        self.root.mkdir(parents=True, exist_ok=True)
        return tempfile.mkdtemp(prefix=".seed-", dir=self.root)

    def place_seed(self, version: int, folder: str, manifest: dict) -> bool:
        """Make `folder` (in a `staging()` folder) the copy of `version`, which its publisher has
        just committed with `manifest`. False if there was one already or it could not be placed."""
        if self.get(version) is not None:
            return False
        try:
            Path(folder, SEEDED).touch()
            self._place(folder, manifest, self.folder(version))
        except OSError:
            return False
        self.prune(keep={0, version})
        return True

    @staticmethod
    def _place(folder: str, manifest: dict, dst: Path) -> None:
        with open(os.path.join(folder, "manifest.json"), "w") as f:
            json.dump(manifest, f)
        os.rename(folder, dst)

    def prune(self, keep: set[int]) -> None:
        """Delete the copies except `keep` and the newest `self.keep`; a held copy is skipped."""
        copies = self._versions()
        keep = keep | set(copies[-self.keep:])
        for v in copies:
            if v in keep:
                continue
            path = self.folder(v)
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                trash = self.root / f".trash-{uuid.uuid4().hex}"
                os.rename(path, trash)  # readers see it gone at once, not half deleted
                shutil.rmtree(trash, ignore_errors=True)
            except (BlockingIOError, FileNotFoundError):
                pass
            finally:
                os.close(fd)

    @staticmethod
    @contextlib.contextmanager
    def pinned(folder: str) -> Iterator[bool]:
        """Hold a copy against pruning (a shared lock); False if it was pruned meanwhile."""
        try:
            fd = os.open(folder, os.O_RDONLY)
        except FileNotFoundError:
            yield False
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            try:
                same = os.stat(folder).st_ino == os.fstat(fd).st_ino and os.path.exists(f"{folder}/manifest.json")
            except FileNotFoundError:
                same = False
            yield same
        finally:
            os.close(fd)


def all_files(manifest: dict) -> dict:
    """Every file of a version's folder: its own (`files`) and those it shares with other
    versions (`shared`, stored once in the run directory's `policy/files/`)."""
    return {**manifest.get("files", {}), **manifest.get(SHARED, {})}


def _link_or_copy(src: str, dst: str) -> bool:
    try:
        os.link(src, dst)
    except OSError:
        try:
            shutil.copyfile(src, dst)
        except OSError:
            return False
    return True
