"""The buffer's commit log: numbered, create-only JSON entries plus periodic checkpoints.

This is the Delta Lake pattern. Data files are immutable and invisible until an entry of the log
names them; entry N is created with a create-only write (`storage.put_if_absent`: hard link on
local/NFS, `If-None-Match: *` on S3, generation match 0 on GCS), so exactly one of several
concurrent committers gets each number and the log is a total order every process agrees on. Its
files (logfiles.py): entry N {"sum", "format", "v", "txn", "time", "writer", "actions" (actions.py)};
a checkpoint every `checkpoint_interval` entries (a writer keeps its newest few); `_last_checkpoint`,
where opening starts (may lag, never ahead); `_tip`, where contending appenders start (a hint).

Opening reads the pointer, one checkpoint and the few entries after it, so it costs O(1) files
whatever the history length. Keeping up reads only entries past the last version seen, probing N+1,
N+2, ... until one is missing: no listing of the whole log. A process does not read back the entries
it appended itself (it keeps them until its state reaches them). A committer creates N+1 only after
seeing N exist, so the log is a contiguous run of numbers: readers stop at the first missing one.

A file changed after it was written fails its checksum (`"sum"`, logfiles.py). An entry that cannot
be used (torn by a machine crash, changed, copied under another number, missing a field) still takes
its number: it counts as an empty commit, recorded as a quarantine that verify reports. A checkpoint
that cannot be used is replayed from the entries, or is a `CorruptLog` error once vacuum has deleted
them. A newer format or action is an `UnsupportedLogFormat` error: skipping a newer writer's commits
would silently lose them.
"""

from __future__ import annotations

import json
import logging
import random
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence

from fsspec.implementations.memory import MemoryFileSystem

from ..storage import delete, is_local, join, list_names, put_atomic, put_if_absent, read_bytes
from .actions import ACTION_TYPES, Action, AddShard, LogEntry, MalformedEntry, Quarantine, UnknownAction
from .logfiles import (LOG_DIR, LOG_FORMAT, POINTER, TIP, CommitConflict, CorruptLog, UnsupportedLogFormat,
                       check_format, checkpoint_name, entry_name, is_int, seal, shards_still_live, unseal, unusable)
from .notices import CommitNotices
from .state import BufferState

log = logging.getLogger(__name__)

__all__ = ["CommitLog", "CommitConflict", "shards_still_live"]

_REMOTE_PROBE = 8  # most entries read in parallel when catching up on remote storage
_CONTENDED_APPENDS = 16  # appends that use and update the tip hint after one another appender wrote
_BACKOFF_MAX = 8  # after a lost race on remote storage, wait up to this many round trips (times misses)
_BLIND_TRIES = 4  # lost add-only races before catching up with the log instead of trying the next number
KEPT_CHECKPOINTS = 3  # state checkpoints each writer keeps: its newest few (a reader may still be reading one)
STALE_VIEW_S = 600.0  # unread this long, a committer catches up first (vacuum.MIN_LOG_RETENTION_S)


class CommitLog:
    """One process's view of the log: the replayed state and the means to append to it."""

    def __init__(self, fs, root: str, checkpoint_interval: int = 50, writer: str = "",
                 tombstone_retention_s: float = 3600.0, fsync: bool = True):
        self.fs, self.fsync, self.root, self.dir = fs, fsync, root, join(root, LOG_DIR)
        # vacuum needs a removed file's removal time only for its grace period: then its mtime will do
        self.tombstone_retention_s = tombstone_retention_s
        self.checkpoint_interval, self.writer = checkpoint_interval, writer
        self.state = BufferState()
        self.files_read = 0  # entries + checkpoints read; opening cost is visible in tests/bench
        self.pointer_check_interval_s = 5.0  # how often a reader that sees no new entry checks retention
        self._last_pointer_check, self._opened = 0.0, False
        self._written: list[int] = []  # the checkpoints this process wrote, newest last
        self._seen = time.monotonic()  # when this view was last brought up to date (read)
        self._tip = 0  # highest version this process knows to exist (its own blind appends included)
        self._own: dict[int, LogEntry] = {}  # entries this process appended past its state: not read back
        # object stores: every request is a round trip, so contending writers share a tip hint
        self.remote = not is_local(fs) and not isinstance(fs, MemoryFileSystem)  # an object store
        self._notices = CommitNotices(self.dir, uuid.uuid4().hex[:12]) if self.remote else None
        self._contended = 0  # appends left to start from the hint (and to update it): see `_append`
        self._id, self._tip_by = uuid.uuid4().hex[:12], ""  # who writes our tips; who wrote the last read

    # reading ----------------------------------------------------------------------------------
    @property
    def is_open(self) -> bool:
        """Whether the state was loaded (`open`, or the first `refresh`)."""
        return self._opened

    def open(self) -> None:
        """Load the latest checkpoint (if any) and the entries after it."""
        ptr = self.last_checkpoint()
        if ptr:
            self._load_checkpoint(ptr)
        self._opened = True
        self.refresh()
        if self.state.version < ptr:  # the checkpoint was unusable and its entries are gone, unless a
            newer = self.last_checkpoint()  # vacuum replaced both meanwhile: then the pointer names a newer one
            if newer <= ptr or not self._load_checkpoint(newer):
                raise self._history_lost(ptr)
            self.refresh()

    def read_pointer_file(self) -> int | None:
        """The version `_last_checkpoint` names: 0 when there is none, None when it is unreadable."""
        try:
            raw = read_bytes(self.fs, join(self.dir, POINTER))
        except FileNotFoundError:
            return 0
        try:
            v = json.loads(raw)["v"]
        except (ValueError, KeyError, TypeError):
            return None
        return v if is_int(v) and v >= 0 else None

    def last_checkpoint(self) -> int:
        """Where opening starts: the version `_last_checkpoint` names (0: none), or the newest
        checkpoint listed when the pointer is unreadable."""
        v = self.read_pointer_file()
        if v is None:  # torn by a machine crash without fsync: a lost hint, the listing has the rest
            v = max(self.checkpoint_versions(), default=0)
            log.error("buffer log %s/%s: unreadable; starting from the newest checkpoint, %d", self.dir, POINTER, v)
        return v

    def read_checkpoint(self, version: int) -> BufferState:
        """The state checkpoint `version` holds. Raises FileNotFoundError, CorruptLog (torn,
        changed, misplaced or malformed) or UnsupportedLogFormat."""
        path = join(self.dir, checkpoint_name(version))
        raw = read_bytes(self.fs, path)
        self.files_read += 1
        try:
            doc = unseal(raw)
            check_format(doc, path)
            state = BufferState.from_json(doc["state"])
        except (ValueError, KeyError, TypeError, AttributeError, IndexError) as e:
            raise CorruptLog(f"buffer log {path}: {unusable('checkpoint', e)}") from None
        if not (is_int(doc.get("v")) and is_int(state.version) and doc["v"] == state.version == version):
            raise CorruptLog(f"buffer log {path}: misplaced checkpoint (it holds the state at version "
                             f"{str(state.version)[:40]}, copied or moved here)")
        return state

    def _load_checkpoint(self, version: int) -> bool:
        try:
            self.state = self.read_checkpoint(version)
            return True
        except FileNotFoundError:
            log.warning("buffer log %s: checkpoint %d named by %s is missing; replaying entries",
                        self.dir, version, POINTER)
        except CorruptLog as e:
            log.error("%s; replaying entries instead", e)
        return False

    def _history_lost(self, ptr: int) -> CorruptLog:
        return CorruptLog(
            f"buffer log {join(self.dir, checkpoint_name(ptr))} (named by {POINTER}): missing or unusable, "
            f"and entry {self.state.version + 1} before it is gone (deleted by vacuum), so the state past "
            f"version {self.state.version} cannot be rebuilt; restore the checkpoint from a backup"
        )

    def read_entry(self, version: int, raw: bytes | None = None) -> LogEntry | None:
        """Entry `version` (read from `raw` when given: a commit notice's copy), or None when there
        is none. An unusable entry reads as a quarantine of itself; a newer format or action raises
        UnsupportedLogFormat."""
        name = entry_name(version)
        path = join(self.dir, name)
        try:
            raw = read_bytes(self.fs, path) if raw is None else raw
        except FileNotFoundError:
            return None
        self.files_read += 1
        try:
            doc = unseal(raw)
            check_format(doc, path)
            if not is_int(doc.get("v")) or doc["v"] != version:
                raise ValueError(f"misplaced: it is entry {str(doc.get('v'))[:40]}, copied or moved here")
            try:
                return LogEntry.from_json(doc)
            except MalformedEntry as e:
                raise ValueError(f"malformed: {e}") from None
        except UnknownAction as e:
            raise UnsupportedLogFormat(f"buffer log {path}: unknown action {e.op!r}, written by a newer "
                                       "rlhf-pipeline; upgrade rlhf-pipeline to read this buffer") from None
        except ValueError as e:
            # Only a machine crash without fsync can leave a torn entry (a complete file is linked
            # into place, never written in place); the other kinds are damage or a writer's bug. Its
            # number is taken for good, so it counts as an empty commit; the shards it named become
            # orphans. Every reader skips it the same way: recorded, and reported by verify.
            reason = f"{unusable('commit-log entry', e)}; its actions are lost"
            log.error("buffer log %s/%s: %s", self.dir, name, reason)
            return LogEntry(version, 0.0, (Quarantine(f"{LOG_DIR}/{name}", reason),))

    def refresh(self, poll: bool = False) -> list[LogEntry]:
        """Apply every entry committed after the state's version; returns them in order. `poll`: a
        reader waiting for new entries, which on a remote log goes by the commit notices here."""
        if not self._opened:
            self.open()
            return []
        wanted, end = self._notices.poll(self.state.version) if poll and self._notices is not None else (True, None)
        if not wanted:
            return []
        self._seen = time.monotonic()
        applied = self.read_entries(self.state.version + 1, end)
        for entry in applied:
            self.state.apply(entry)
            if self._notices is not None:
                self._notices.met(entry.writer)
        if self._own:  # those a checkpoint or a parallel read got past
            self._own = {v: e for v, e in self._own.items() if v > self.state.version}
        if not applied:
            self._catch_up_after_retention()
        return applied

    def read_entries(self, start: int, end: int | None = None) -> list[LogEntry]:
        """Entries start, start+1, ... up to the first missing one (or `end`, the newest noticed).
        Local storage reads them one by one. Remote storage reads the first two one by one (and
        those after one of its own), then 2, 4, ... up to _REMOTE_PROBE at once: catching up takes
        few round trips, and reading past the end wastes at most half of the last batch. An entry
        a commit notice holds is read from it."""
        out: list[LogEntry] = []
        v, width, read = start, 1, 0  # read: entries read in a row since one of its own (not read back)
        noticed = self._notices.entry if self._notices is not None else lambda k: None
        while end is None or v <= end:
            if v in self._own:
                entries, width, read = [self._own.pop(v)], 1, 0
            elif width == 1:
                entries, read = [self.read_entry(v, noticed(v))], read + 1
            else:
                last = v + width if end is None else min(v + width, end + 1)
                with ThreadPoolExecutor(width) as ex:
                    entries = list(ex.map(lambda k: self._own.get(k) or self.read_entry(k, noticed(k)), range(v, last)))
            for e in entries:
                if e is None:
                    return out
                out.append(e)
                v += 1
            if self.remote and read >= 2:
                width = min(2 * width, _REMOTE_PROBE)
        return out

    def _catch_up_after_retention(self) -> None:
        """A process far behind may find its next entry deleted by log retention: the pointer then
        names a checkpoint past it. Checked at most every few seconds (one small read)."""
        now = time.monotonic()
        if now - self._last_pointer_check < self.pointer_check_interval_s:
            return
        self._last_pointer_check = now
        ptr = self.last_checkpoint()
        if ptr > self.state.version + 1 and self.read_entry(self.state.version + 1) is None:
            log.warning("buffer log %s: entries after %d were removed by retention; reloading checkpoint %d",
                        self.dir, self.state.version, ptr)
            if not self._load_checkpoint(ptr):
                raise self._history_lost(ptr)
            self.refresh()

    # writing ----------------------------------------------------------------------------------
    def commit(self, actions: Sequence[Action], precondition: Callable[[BufferState], None] | None = None,
               writer: str | None = None) -> int:
        """Append one entry holding `actions`; returns its version. `writer` (default: the log's)
        is recorded in the entry.

        On a lost race the state is refreshed and `precondition` (which raises CommitConflict when
        the actions no longer make sense, e.g. removing a shard another compactor removed) is
        re-checked before trying the next number.
        """
        actions = tuple(actions)
        bad = [a for a in actions if not isinstance(a, ACTION_TYPES)]
        if bad:
            raise TypeError(f"commit: {bad[0]!r} is not a log action; build one from pipeline.buffer.actions")
        if not self._opened:
            self.open()
        elif time.monotonic() - self._seen > STALE_VIEW_S:  # not read for a while: retention may have
            self._last_pointer_check = float("-inf")  # deleted the entries after this view
            self._catch_up()
        writer = self.writer if writer is None else writer
        if precondition is None and all(isinstance(a, AddShard) for a in actions):
            return self._append(actions, writer)
        txn = uuid.uuid4().hex
        while True:
            if precondition is not None:
                precondition(self.state)
            entry = LogEntry(self.state.version + 1, time.time(), actions, txn, writer)
            data = seal(entry.to_json())
            if put_if_absent(self.fs, join(self.dir, entry_name(entry.version)), data, self.fsync, own_check=False):
                self.state.apply(entry)
                if self._notices is not None:
                    self._notices.committed(entry.version, writer, data)
                if self.checkpoint_interval and entry.version % self.checkpoint_interval == 0:
                    self.write_checkpoint()
                return entry.version
            for got in self.refresh():
                if got.txn == txn:  # our PUT landed but its answer was lost and retried
                    return got.version

    def _append(self, actions: tuple[Action, ...], writer: str) -> int:
        """Commit add-only actions without reading what others committed in between.

        Adds need no precondition, so after a lost race the next number is tried directly (one
        request) instead of reading the winner's entry first. The state then lags until the next
        refresh, which reads the entries in between, ours included. A duplicate add (a PUT whose
        answer was lost, retried under the next number) is harmless: adding a path twice is
        ignored by the state.

        On remote storage, a writer that lost two races in one append reads `_tip`. Written by
        another appender, the tip tells it contends with appenders: for its next
        _CONTENDED_APPENDS appends (counted again from each tip another one wrote) it starts at
        the tip instead of walking past every entry the others committed since its last one, one
        failed create-only PUT each, and publishes the number it gets there. No tip yet: it
        publishes one, for others to find. Its own tip: the races were lost to committers that
        do not write it (the trainer's `commit`), and it tells nothing, so one appender costs no
        tip request. The hint may lag or go back (racing overwrites); it only saves requests,
        and the create-only PUT still decides. A writer that lost a race waits a random fraction
        of a round trip per race lost so far (at most _BACKOFF_MAX) before the next try: the
        losers of one number then do not all race again for the next. A process far behind skips
        ahead after a few misses (see `_known_end`) instead of probing number by number. The
        state is read only to write a checkpoint, from the newest checkpoint on."""
        v = max(self.state.version, self._tip) + 1
        publish = self.remote and self._contended > 0
        if publish:
            v = max(v, self._use_tip(self._contended - 1) + 1)
        misses = 0
        while True:
            entry = LogEntry(v, time.time(), actions, uuid.uuid4().hex, writer)
            t0, data = time.monotonic(), seal(entry.to_json())
            if put_if_absent(self.fs, join(self.dir, entry_name(v)), data, self.fsync, own_check=False):
                break
            misses += 1
            if self.remote:  # the losers of a number would all race for the next one: spread them
                time.sleep(random.uniform(0, min(misses, _BACKOFF_MAX) * (time.monotonic() - t0)))
            if self.remote and misses == 2 and not publish:
                v = max(v, self._use_tip(0)) + 1
                publish = self._tip_by != self._id
            elif misses % _BLIND_TRIES == 0:
                v = max(v, self._known_end()) + 1
            else:
                v += 1
        self._tip = v
        if self._notices is not None:
            self._notices.committed(v, writer, data)
        if publish:
            put_atomic(self.fs, join(self.dir, TIP), json.dumps({"v": v, "by": self._id}).encode(), fsync=False)
        if v == self.state.version + 1:
            self.state.apply(entry)
        else:
            self._own[v] = entry
        if self.checkpoint_interval and v % self.checkpoint_interval == 0:
            self._catch_up()
            self.write_checkpoint()
        return v

    def _known_end(self) -> int:
        """A version known to exist, for a writer that keeps losing races: a remote log's tip hint
        or newest checkpoint (two small reads: losing races to many contending writers is not
        being far behind, and reading their entries would not help), else the refreshed state."""
        if self.remote:
            return max(self._read_tip(), self.last_checkpoint())
        self.refresh()
        return self.state.version

    def _read_tip(self) -> int:
        """The tip hint's version (0: none); its writer goes to `_tip_by` ("": none, None: unknown)."""
        self._tip_by = ""
        try:
            doc = json.loads(read_bytes(self.fs, join(self.dir, TIP)))
            v = int(doc["v"])
        except (FileNotFoundError, ValueError, KeyError, TypeError):
            return 0
        self._tip_by = doc.get("by") if isinstance(doc, dict) else None
        return v

    def _use_tip(self, otherwise: int) -> int:
        """Read the tip; contended for _CONTENDED_APPENDS appends if another wrote it, else `otherwise`."""
        v = self._read_tip()
        self._contended = _CONTENDED_APPENDS if self._tip_by not in ("", self._id) else otherwise
        return v

    def _catch_up(self) -> None:
        """Refresh; a state more than a checkpoint behind starts from the newest checkpoint rather
        than reading every entry since (an appending writer's state lags: it reads no entries)."""
        if self.checkpoint_interval and self.state.version + self.checkpoint_interval < max(self._tip, 1):
            ptr = self.last_checkpoint()
            if ptr > self.state.version:
                self._load_checkpoint(ptr)
        self.refresh()

    def write_checkpoint(self) -> int:
        """Serialise the current state; any process may do it (create-only, same content)."""
        v = self.state.version
        doc = {"format": LOG_FORMAT, "v": v, "time": time.time(),
               "state": self.state.to_json(self.tombstone_retention_s)}
        put_if_absent(self.fs, join(self.dir, checkpoint_name(v)), seal(doc), self.fsync, own_check=False)
        if self.last_checkpoint() < v:  # a racing older pointer is harmless: opening just reads more
            put_atomic(self.fs, join(self.dir, POINTER), json.dumps({"v": v}).encode(), fsync=self.fsync)
        self._written.append(v)  # each holds the whole state: all kept, they took O(n^2) space; every writer
        for old in self._written[:-KEPT_CHECKPOINTS]:  # keeps its newest few (the pointer names one of them)
            delete(self.fs, join(self.dir, checkpoint_name(old)))
        del self._written[:-KEPT_CHECKPOINTS]
        return v

    # maintenance ------------------------------------------------------------------------------
    def entry_versions(self) -> list[int]:
        """All entry numbers present (lists the folder: for verify and vacuum only)."""
        return sorted(int(n[:20]) for n in list_names(self.fs, self.dir)
                      if n.endswith(".json") and not n.endswith(".ckpt.json") and n[:20].isdigit())

    def checkpoint_versions(self) -> list[int]:
        return sorted(int(n[:20]) for n in list_names(self.fs, self.dir) if n.endswith(".ckpt.json"))
