"""Commit notices between the processes of one node that share a commit log on object storage.

A reader waiting for the next entry of a remote log (the trainer's read of fresh groups) would
otherwise probe the store every poll: a request that finds nothing most of the time, and two more
(the entry, then the miss past it) when there is something. The local runner's sampler and
trainer share a node; every process that commits to a remote log also writes a notice on local
disk, `<cache>/log-notices/<log>/<process>.json`: the writer names it committed as, its last
version and its newest entries, as committed, and its process id (the notice of a process that is
gone does not count: it may have written to an earlier log at the same URL). A poll then:

- skips the store when every writer whose entries it read lately has a notice here and none names
  a version past the reader's;
- else reads up to the newest version noticed here, taking the entries the notices hold from them
  (checked like any entry read from the store) and the others from the store, and stops there
  instead of probing past it.

It still probes the store, to the first missing entry, at least every REMOTE_POLL_S (for a writer
on another node it has not met yet). A writer met in the log without a notice here (a sampler on
another node) makes every poll probe to the end again. The log stays the record: a notice is
written only after its entry was committed, and a missed one delays a reader by at most
REMOTE_POLL_S.
"""

from __future__ import annotations

import hashlib
import json
import os
import time

REMOTE_POLL_S = 1.0
"""A polling reader probes the store to the end of the log at least this often."""
FRESH_S = 30.0
"""Notices and writers met in the log older than this are not counted."""
KEPT_ENTRIES = 8
"""The newest entries a process's notice holds (those of at most KEPT_ENTRY_BYTES: a compaction's
entry, which names every shard it replaces, is read from the store)."""
KEPT_ENTRY_BYTES = 16384
STALE_S = 86400.0
"""Notices and shard copies of any log or buffer older than this are deleted by the next process
that starts writing them on this node."""


class CommitNotices:
    def __init__(self, log_url: str, process_id: str, root: str | None = None):
        if root is None:
            from ..model_cache import cache_dir

            root = str(cache_dir())
        self.dir = os.path.join(root, "log-notices", hashlib.sha256(log_url.encode()).hexdigest()[:16])
        self.path = os.path.join(self.dir, f"{process_id}.json")
        self._writers: set[str] = set()  # names this process committed as
        self._mine: dict[str, str] = {}  # its newest entries: version -> the committed text
        self._met: dict[str, float] = {}  # writers of the entries read, and when
        self._probed = float("-inf")
        self._read: dict[str, tuple[tuple, dict]] = {}  # notice path -> (its stat, its document)
        self._entries: dict[int, bytes] = {}  # the entries the notices held at the last poll

    def committed(self, version: int, writer: str, data: bytes) -> None:
        """After a commit of this process: its notice names `version`, written as `data` (an OSError
        only costs requests)."""
        if not self._writers:
            _prune(os.path.dirname(self.dir), STALE_S)
        self._writers.add(writer)
        if len(data) <= KEPT_ENTRY_BYTES:
            self._mine[str(version)] = data.decode()
        for old in sorted(self._mine, key=int)[:-KEPT_ENTRIES]:
            del self._mine[old]
        tmp = f"{self.path}.{os.getpid()}.tmp"
        try:
            os.makedirs(self.dir, exist_ok=True)
            with open(tmp, "w") as f:
                json.dump({"v": version, "pid": os.getpid(), "writers": sorted(self._writers), "entries": self._mine}, f)
            os.replace(tmp, self.path)
        except OSError:
            pass

    def met(self, writer: str) -> None:
        """An entry of `writer` was read."""
        self._met[writer] = time.monotonic()

    def entry(self, version: int) -> bytes | None:
        """Entry `version` as a notice held it at the last poll, if one did."""
        return self._entries.get(version)

    def poll(self, known: int) -> tuple[bool, int | None]:
        """For a poll of a reader that has applied the log up to `known`: whether to read the store,
        and the last version to read (None: up to the first missing entry)."""
        now = time.monotonic()
        newest = self._newest(now)
        if now - self._probed >= REMOTE_POLL_S or newest is None:
            self._probed = now
            return True, None
        return newest > known, newest

    def _newest(self, now: float) -> int | None:
        """The newest version noticed here when every writer met lately has a notice, else None."""
        try:
            names = [n for n in os.listdir(self.dir) if n.endswith(".json")]
        except OSError:
            return None
        writers, newest, entries = set(), -1, {}
        for name in names:
            path = os.path.join(self.dir, name)
            try:
                st = os.stat(path)
                if time.time() - st.st_mtime > FRESH_S:
                    continue
                key = (st.st_mtime_ns, st.st_size, st.st_ino)
                if self._read.get(path, (None,))[0] != key:
                    with open(path) as f:
                        self._read[path] = (key, json.load(f))
                doc = self._read[path][1]
                if not _alive(int(doc["pid"])):  # a killed writer, or one of an earlier log at this URL
                    continue
                writers.update(doc["writers"])
                newest = max(newest, int(doc["v"]))
                entries.update((int(v), text.encode()) for v, text in doc.get("entries", {}).items())
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                return None
        self._entries = entries
        recent = {w for w, t in self._met.items() if now - t < FRESH_S}
        return newest if writers and recent <= writers else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


SHARD_COPY_S = 300.0
"""Local copies of shards older than this are deleted (by the writers of any buffer on this node,
as they add new ones)."""


class ShardCopies:
    """Copies on local disk of the L1 shards this node's writers put on a remote buffer
    (`<cache>/shard-copies/<buffer>/`): a reader on the same node (the trainer beside the sampler)
    takes a committed shard from here instead of downloading it. A copy is written before its
    shard is committed, under the shard's own unique name, with the same bytes; a reader takes
    it only for a shard the log names, of the size the log records."""

    def __init__(self, buffer_url: str, root: str | None = None):
        if root is None:
            from ..model_cache import cache_dir

            root = str(cache_dir())
        self.dir = os.path.join(root, "shard-copies", hashlib.sha256(buffer_url.encode()).hexdigest()[:16])
        self._kept = 0

    def _path(self, rel: str) -> str:
        return os.path.join(self.dir, rel.replace("/", "__"))

    def keep(self, rel: str, data: bytes) -> None:
        """Keep a copy of shard `rel`, about to be committed (an OSError only costs a download)."""
        path = self._path(rel)
        try:
            os.makedirs(self.dir, exist_ok=True)
            with open(f"{path}.{os.getpid()}.tmp", "wb") as f:
                f.write(data)
            os.replace(f"{path}.{os.getpid()}.tmp", path)
            self._kept += 1
            if self._kept % 50 == 1:
                _prune(os.path.dirname(self.dir), SHARD_COPY_S)
        except OSError:
            pass

    def get(self, rel: str, size: int) -> bytes | None:
        """The copy of committed shard `rel`, if this node has one of `size` bytes."""
        try:
            with open(self._path(rel), "rb") as f:
                data = f.read()
        except OSError:
            return None
        return data if len(data) == size else None


def _prune(root: str, older_than_s: float) -> None:
    """Delete the files in the folders of `root` not modified for `older_than_s`, and the folders
    left empty (another process's pruning at the same time only makes some fail)."""
    now = time.time()
    try:
        folders = os.listdir(root)
    except OSError:
        return
    for folder in folders:
        path = os.path.join(root, folder)
        try:
            for name in os.listdir(path):
                if now - os.stat(os.path.join(path, name)).st_mtime > older_than_s:
                    os.unlink(os.path.join(path, name))
            if not os.listdir(path):
                os.rmdir(path)
        except OSError:
            continue
