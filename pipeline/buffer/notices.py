"""Commit notices between the processes of one node that share a commit log on object storage.

A reader waiting for the next entry of a remote log (the trainer's read of fresh groups) would
otherwise probe the store every poll: a request that finds nothing most of the time. The local
runner's sampler and trainer share a node; every process that commits to a remote log also writes
a notice on local disk (`<cache>/log-notices/<log>/<process>.json`: the writer names it committed
as, its last version). A poll then skips the store when every writer whose entries it read lately
has a notice here and none names a version past the reader's; it still probes at least every
REMOTE_POLL_S, for a writer on another node it has not met yet. A writer met in the log without a
notice here (a sampler on another node) makes every poll probe again. The log stays the record: a
notice only says when to look, and a missed one delays a reader by at most REMOTE_POLL_S.
"""

from __future__ import annotations

import hashlib
import json
import os
import time

REMOTE_POLL_S = 1.0
"""A polling reader probes the store at least this often, whatever the notices say."""
FRESH_S = 30.0
"""Notices and writers met in the log older than this are not counted."""


class CommitNotices:
    def __init__(self, log_url: str, process_id: str, root: str | None = None):
        if root is None:
            from ..model_cache import cache_dir

            root = str(cache_dir())
        self.dir = os.path.join(root, "log-notices", hashlib.sha256(log_url.encode()).hexdigest()[:16])
        self.path = os.path.join(self.dir, f"{process_id}.json")
        self._writers: set[str] = set()  # names this process committed as
        self._met: dict[str, float] = {}  # writers of the entries read, and when
        self._probed = float("-inf")

    def committed(self, version: int, writer: str) -> None:
        """After a commit of this process: its notice names `version` (an OSError only costs probes)."""
        self._writers.add(writer)
        tmp = f"{self.path}.{os.getpid()}.tmp"
        try:
            os.makedirs(self.dir, exist_ok=True)
            with open(tmp, "w") as f:
                json.dump({"v": version, "writers": sorted(self._writers)}, f)
            os.replace(tmp, self.path)
        except OSError:
            pass

    def met(self, writer: str) -> None:
        """An entry of `writer` was read."""
        self._met[writer] = time.monotonic()

    def worth_probing(self, known: int) -> bool:
        """Whether a poll should read the store, this reader having applied the log up to `known`."""
        now = time.monotonic()
        if now - self._probed >= REMOTE_POLL_S or not self._nothing_new(known, now):
            self._probed = now
            return True
        return False

    def _nothing_new(self, known: int, now: float) -> bool:
        try:
            names = os.listdir(self.dir)
        except OSError:
            return False
        writers, newest = set(), -1
        for name in names:
            path = os.path.join(self.dir, name)
            try:
                if not name.endswith(".json") or time.time() - os.stat(path).st_mtime > FRESH_S:
                    continue
                with open(path) as f:
                    doc = json.load(f)
                writers.update(doc["writers"])
                newest = max(newest, int(doc["v"]))
            except (OSError, ValueError, KeyError, TypeError):
                return False
        recent = {w for w, t in self._met.items() if now - t < FRESH_S}
        return bool(writers) and recent <= writers and newest <= known
