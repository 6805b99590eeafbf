"""The buffer's commit log: numbered, create-only JSON entries plus periodic checkpoints.

This is the Delta Lake pattern. Data files are immutable and invisible until an entry of the log
names them; entry N is created with a create-only write (`storage.put_if_absent`: hard link on
local/NFS, `If-None-Match: *` on S3, generation match 0 on GCS), so exactly one of several
concurrent committers gets each number and the log is a total order every process agrees on.

    _log/00000000000000000042.json        entry 42: {"v", "txn", "time", "writer", "actions"}
    _log/00000000000000000050.ckpt.json   the state after entry 50 (every `checkpoint_interval`)
    _log/_last_checkpoint                  {"v": 50}: where opening starts (may lag; never ahead)
    _log/_tip                              {"v": 57}: where contending writers of a remote log start
                                           (a hint: may lag or even go back; never trusted)

Opening reads the pointer, one checkpoint and the few entries after it, so it costs O(1) files
whatever the history length. Keeping up reads only entries past the last version seen, probing
N+1, N+2, ... until one is missing: no listing of the whole log.

Entries only ever appear in order: a committer creates N+1 only after seeing N exist. So the log is
always a contiguous run of numbers, which is what lets readers stop at the first missing one.
"""

from __future__ import annotations

import json
import logging
import random
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from fsspec.implementations.memory import MemoryFileSystem

from ..storage import is_local, join, list_names, put_atomic, put_if_absent, read_bytes
from .state import BufferState

log = logging.getLogger(__name__)

LOG_DIR = "_log"
POINTER = "_last_checkpoint"
TIP = "_tip"
LOG_FORMAT = 1
_REMOTE_PROBE = 8  # most entries read in parallel when catching up on remote storage
_CONTENDED_APPENDS = 16  # appends that use and update the tip hint after the last lost race
_BACKOFF_MAX = 8  # after a lost race on remote storage, wait up to this many round trips (times misses)
_BLIND_TRIES = 4  # lost add-only races before catching up with the log instead of trying the next number


class CommitConflict(RuntimeError):
    """A commit whose precondition no longer holds after another process committed first."""


def entry_name(version: int) -> str:
    return f"{version:020d}.json"


def checkpoint_name(version: int) -> str:
    return f"{version:020d}.ckpt.json"


class CommitLog:
    """One process's view of the log: the replayed state and the means to append to it."""

    def __init__(self, fs, root: str, checkpoint_interval: int = 50, writer: str = "",
                 tombstone_retention_s: float = 3600.0, fsync: bool = True):
        self.fs = fs
        self.fsync = fsync
        # gc needs a removed file's removal time only until the grace period has passed: after
        # that its modification time (never later than its removal) is just as safe to go by
        self.tombstone_retention_s = tombstone_retention_s
        self.root = root
        self.dir = join(root, LOG_DIR)
        self.checkpoint_interval = checkpoint_interval
        self.writer = writer
        self.state = BufferState()
        self.files_read = 0  # entries + checkpoints read; opening cost is visible in tests/bench
        self._last_pointer_check = 0.0
        self._opened = False
        self._tip = 0  # highest version this process knows to exist (its own blind appends included)
        # object stores: every request is a round trip, so contending writers share a tip hint
        self._remote = not is_local(fs) and not isinstance(fs, MemoryFileSystem)
        self._contended = 0  # appends left to start from the hint (and to update it) after a lost race

    # reading ----------------------------------------------------------------------------------
    def open(self) -> None:
        """Load the latest checkpoint (if any) and the entries after it."""
        ptr = self._read_pointer()
        if ptr:
            self._load_checkpoint(ptr)
        self._opened = True
        self.refresh()

    def _read_pointer(self) -> int:
        try:
            return int(json.loads(read_bytes(self.fs, join(self.dir, POINTER)))["v"])
        except FileNotFoundError:
            return 0

    def _load_checkpoint(self, version: int) -> bool:
        try:
            raw = read_bytes(self.fs, join(self.dir, checkpoint_name(version)))
        except FileNotFoundError:
            log.warning("buffer log %s: checkpoint %d named by %s is missing; replaying entries",
                        self.dir, version, POINTER)
            return False
        self.files_read += 1
        doc = json.loads(raw)
        self._check_format(doc, checkpoint_name(version))
        self.state = BufferState.from_json(doc["state"])
        return True

    def _check_format(self, doc: dict, name: str) -> None:
        fmt = int(doc.get("format", 1))
        if fmt > LOG_FORMAT:
            raise RuntimeError(
                f"buffer log {join(self.dir, name)}: log format v{fmt}, this installation reads up to "
                f"v{LOG_FORMAT}; upgrade rlhf-pipeline to read this buffer"
            )

    def _read_entry(self, version: int) -> dict | None:
        try:
            raw = read_bytes(self.fs, join(self.dir, entry_name(version)))
        except FileNotFoundError:
            return None
        self.files_read += 1
        try:
            doc = json.loads(raw)
        except ValueError as e:
            # Only a machine crash without fsync can leave a torn entry (a complete file is linked
            # into place, never written in place). Its number is taken for good, so it counts as an
            # empty commit; the shards it named become orphans. Recorded, and reported by verify.
            reason = f"torn commit-log entry ({e}); its shards are lost"
            log.error("buffer log %s/%s: %s", self.dir, entry_name(version), reason)
            return {"v": version, "actions": [{"op": "quarantine", "path": f"{LOG_DIR}/{entry_name(version)}",
                                              "reason": reason}]}
        self._check_format(doc, entry_name(version))
        return doc

    def refresh(self) -> list[tuple[int, dict]]:
        """Apply every entry committed after the state's version; returns them in order."""
        if not self._opened:
            self.open()
            return []
        applied = self._probe(self.state.version + 1)
        for v, doc in applied:
            self.state.apply(v, doc)
        if not applied:
            self._catch_up_after_retention()
        return applied

    def _probe(self, start: int) -> list[tuple[int, dict]]:
        """Entries start, start+1, ... up to the first missing one. Local storage reads them one
        by one. Remote storage reads the first two one by one, so an idle poll costs one request
        and a single new entry two, then reads 2, 4, ... up to _REMOTE_PROBE at once: catching up
        on many entries takes few round trips, and reading past the end of the log wastes at most
        half of the last batch."""
        out: list[tuple[int, dict]] = []
        v, width = start, 1
        while True:
            if width == 1:
                docs = [self._read_entry(v)]
            else:
                with ThreadPoolExecutor(width) as ex:
                    docs = list(ex.map(self._read_entry, range(v, v + width)))
            for d in docs:
                if d is None:
                    return out
                out.append((v, d))
                v += 1
            if self._remote and len(out) >= 2:
                width = min(2 * width, _REMOTE_PROBE)

    def _catch_up_after_retention(self) -> None:
        """A process far behind may find its next entry deleted by log retention: the pointer then
        names a checkpoint past it. Checked at most every few seconds (one small read)."""
        now = time.monotonic()
        if now - self._last_pointer_check < 5.0:
            return
        self._last_pointer_check = now
        ptr = self._read_pointer()
        if ptr > self.state.version + 1 and self._read_entry(self.state.version + 1) is None:
            log.warning("buffer log %s: entries after %d were removed by retention; reloading checkpoint %d",
                        self.dir, self.state.version, ptr)
            if self._load_checkpoint(ptr):
                self.refresh()

    # writing ----------------------------------------------------------------------------------
    def commit(self, actions: list[dict], precondition: Callable[[BufferState], None] | None = None) -> int:
        """Append one entry holding `actions`; returns its version.

        On a lost race the state is refreshed and `precondition` (which raises CommitConflict when
        the actions no longer make sense, e.g. removing a shard another compactor removed) is
        re-checked before trying the next number.
        """
        if not self._opened:
            self.open()
        if precondition is None and all(a["op"] == "add" for a in actions):
            return self._append(actions)
        txn = uuid.uuid4().hex
        while True:
            if precondition is not None:
                precondition(self.state)
            v = self.state.version + 1
            doc = {"format": LOG_FORMAT, "v": v, "txn": txn, "time": time.time(), "writer": self.writer,
                   "actions": actions}
            if put_if_absent(self.fs, join(self.dir, entry_name(v)), json.dumps(doc).encode(), self.fsync):
                self.state.apply(v, doc)
                self._maybe_checkpoint(v)
                return v
            for got_v, got in self.refresh():
                if got.get("txn") == txn:  # our PUT landed but its answer was lost and retried
                    return got_v

    def _append(self, actions: list[dict]) -> int:
        """Commit add-only actions without reading what others committed in between.

        Adds need no precondition, so after a lost race the next number is tried directly (one
        request) instead of reading the winner's entry first. The state then lags until the next
        refresh, which reads the entries in between, ours included. A duplicate add (a PUT whose
        answer was lost, retried under the next number) is harmless: adding a path twice is
        ignored by the state.

        On remote storage, a writer that lost a race publishes the number it gets in `_tip` for
        its next _CONTENDED_APPENDS appends, and starts each of them there instead of walking
        past every entry the others committed since its last one, one failed create-only PUT
        each. The hint may lag or go back (racing overwrites); it only saves requests, and the
        create-only PUT still decides. A writer that lost a race waits a random fraction of a
        round trip per race lost so far (at most _BACKOFF_MAX) before the next try: the losers
        of one number then do not all race again for the next. A process far behind skips ahead
        after a few misses (see `_known_end`) instead of probing number by number. The state is
        read only to write a checkpoint, from the newest checkpoint on."""
        v = max(self.state.version, self._tip) + 1
        if self._remote and self._contended:
            v = max(v, self._read_tip() + 1)
        misses = 0
        while True:
            doc = {"format": LOG_FORMAT, "v": v, "txn": uuid.uuid4().hex, "time": time.time(),
                   "writer": self.writer, "actions": actions}
            t0 = time.monotonic()
            if put_if_absent(self.fs, join(self.dir, entry_name(v)), json.dumps(doc).encode(), self.fsync):
                break
            misses += 1
            if self._remote:  # the losers of a number would all race for the next one: spread them
                time.sleep(random.uniform(0, min(misses, _BACKOFF_MAX) * (time.monotonic() - t0)))
            if self._remote and misses == 1 and not self._contended:
                v = max(v, self._read_tip()) + 1
            elif misses % _BLIND_TRIES == 0:
                v = max(v, self._known_end()) + 1
            else:
                v += 1
        self._tip = v
        if self._remote and (misses or self._contended):
            self._contended = _CONTENDED_APPENDS if misses else self._contended - 1
            put_atomic(self.fs, join(self.dir, TIP), json.dumps({"v": v}).encode(), fsync=False)
        if v == self.state.version + 1:
            self.state.apply(v, doc)
        if self.checkpoint_interval and v % self.checkpoint_interval == 0:
            self._catch_up()
            self.write_checkpoint()
        return v

    def _known_end(self) -> int:
        """A version known to exist, for a writer that keeps losing races: a remote log's tip hint
        or newest checkpoint (two small reads: losing races to many contending writers is not
        being far behind, and reading their entries would not help), else the refreshed state."""
        if self._remote:
            return max(self._read_tip(), self._read_pointer())
        self.refresh()
        return self.state.version

    def _read_tip(self) -> int:
        try:
            return int(json.loads(read_bytes(self.fs, join(self.dir, TIP)))["v"])
        except (FileNotFoundError, ValueError, KeyError, TypeError):
            return 0

    def _catch_up(self) -> None:
        """Refresh; a state more than a checkpoint behind starts from the newest checkpoint rather
        than reading every entry since (an appending writer's state lags: it reads no entries)."""
        if self.checkpoint_interval and self.state.version + self.checkpoint_interval < max(self._tip, 1):
            ptr = self._read_pointer()
            if ptr > self.state.version:
                self._load_checkpoint(ptr)
        self.refresh()

    def _maybe_checkpoint(self, version: int) -> None:
        if self.checkpoint_interval and version % self.checkpoint_interval == 0:
            self.write_checkpoint()

    def write_checkpoint(self) -> int:
        """Serialise the current state; any process may do it (create-only, same content)."""
        v = self.state.version
        doc = {"format": LOG_FORMAT, "v": v, "time": time.time(),
               "state": self.state.to_json(self.tombstone_retention_s)}
        put_if_absent(self.fs, join(self.dir, checkpoint_name(v)), json.dumps(doc).encode(), self.fsync)
        if self._read_pointer() < v:  # a racing older pointer is harmless: opening just reads more
            put_atomic(self.fs, join(self.dir, POINTER), json.dumps({"v": v}).encode(), fsync=self.fsync)
        return v

    # maintenance ------------------------------------------------------------------------------
    def entry_versions(self) -> list[int]:
        """All entry numbers present (lists the folder: for verify and gc only)."""
        return sorted(int(n[:20]) for n in list_names(self.fs, self.dir)
                      if n.endswith(".json") and not n.endswith(".ckpt.json") and n[:20].isdigit())

    def checkpoint_versions(self) -> list[int]:
        return sorted(int(n[:20]) for n in list_names(self.fs, self.dir) if n.endswith(".ckpt.json"))
