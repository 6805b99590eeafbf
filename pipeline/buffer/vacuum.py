"""Vacuum (garbage collection) and verification of a buffer directory.

Files on storage fall into three kinds: live (named by the state), quarantined (kept for
inspection) and everything else — shards of writers killed before their commit, inputs of
compactions, evicted shards, temporary files of interrupted writes. `vacuum` deletes the last kind,
but only once older than `orphan_grace_s` (by removal time when the log removed them, else by
modification time): a writer may be between writing a data file and committing it, and a reader
may still be reading a shard that was just compacted away.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from ..config_yaml import ConfigError
from ..storage import delete, join, list_files
from .logfiles import LOG_DIR, POINTER, CorruptLog, UnsupportedLogFormat, checkpoint_name, entry_name
from .schema import SchemaError
from .shards import CorruptShard, group_layout, read_shard
from .state import BufferState

if TYPE_CHECKING:
    from .buffer import ReplayBuffer

DATA_DIRS = ("l1", "l2", "l3")


MIN_LOG_RETENTION_S = 3600.0
"""Log entries younger than this are never deleted: a committer that has been idle catches up
before it commits only after `log.STALE_VIEW_S`, and one whose next number was deleted would
write it where no reader looks."""


def vacuum(buf: "ReplayBuffer", grace_s: float | None = None, log_retention_s: float | None = None,
           now: float | None = None) -> dict:
    """Delete unreferenced data files and log entries covered by a checkpoint. Returns counts."""
    cfg = buf.config
    grace = cfg.orphan_grace_s if grace_s is None else grace_s
    log_retention = cfg.log_retention_s if log_retention_s is None else log_retention_s
    if log_retention < MIN_LOG_RETENTION_S:
        raise ConfigError(f"log retention {log_retention:g} s: log entries are kept at least "
                         f"{MIN_LOG_RETENTION_S:g} s (a process idle for less may still commit after them)")
    now = time.time() if now is None else now
    st = buf.refresh()
    keep = set(st.shards) | set(st.quarantined)
    out = {"orphans_deleted": 0, "orphans_kept_young": 0, "log_entries_deleted": 0, "checkpoints_deleted": 0,
           "bytes_freed": 0}
    for d in DATA_DIRS:
        for f in list_files(buf.fs, join(buf.root, d), include_hidden=True):
            rel = f"{d}/{f.rel}"
            if rel in keep:
                continue
            since = st.tombstones.get(rel, f.mtime)
            if now - since < grace:
                out["orphans_kept_young"] += 1
                continue
            delete(buf.fs, join(buf.root, rel))
            out["orphans_deleted"] += 1
            out["bytes_freed"] += f.size
    ptr = buf.log.last_checkpoint()
    try:  # entries are deleted only below a checkpoint that can stand in for them
        if ptr:
            buf.log.read_checkpoint(ptr)
    except (FileNotFoundError, CorruptLog, UnsupportedLogFormat):
        ptr = 0
    ckpts = buf.log.checkpoint_versions()
    for f in list_files(buf.fs, join(buf.root, LOG_DIR), include_hidden=True):
        name = f.rel
        old = now - f.mtime >= log_retention
        if name.startswith("."):  # temporary file of an interrupted create-only write
            if now - f.mtime >= grace:
                delete(buf.fs, join(buf.log.dir, name))
                out["orphans_deleted"] += 1
            continue
        if not old or name == POINTER or not name[:20].isdigit():
            continue
        v = int(name[:20])
        if name == entry_name(v) and v < ptr:
            delete(buf.fs, join(buf.log.dir, name))
            out["log_entries_deleted"] += 1
        elif name == checkpoint_name(v) and v < ptr and v not in ckpts[-2:]:
            delete(buf.fs, join(buf.log.dir, name))
            out["checkpoints_deleted"] += 1
    return out


def verify(buf: "ReplayBuffer") -> dict:
    """Check the log's continuity and every live shard against the log and the rollout schema.
    Read-only: reports, never repairs. `ok` is False on any problem."""
    problems: list[str] = []
    try:
        st = buf.refresh()
    except (ValueError, RuntimeError, SchemaError) as e:
        return {"ok": False, "problems": [f"commit log unreadable: {e}"], "checked_shards": 0}
    versions = buf.log.entry_versions()
    if versions:
        missing = sorted(set(range(versions[0], versions[-1] + 1)) - set(versions))
        if missing:
            problems.append(f"{buf.log.dir}: commit log has gaps at versions {missing[:10]}")
        if versions[-1] != st.version:
            problems.append(f"{buf.log.dir}: last entry {versions[-1]} but the replayed state is at {st.version}")
    ptr = buf.log.read_pointer_file()
    if ptr is None:
        problems.append(f"{buf.log.dir}/{POINTER}: unreadable; it should hold {{\"v\": <newest checkpoint>}}")
    elif ptr > st.version:
        problems.append(f"{buf.log.dir}/{POINTER}: names checkpoint {ptr}, past the last entry {st.version}")
    ckpt_problems, replayed = _check_checkpoints(buf, versions)
    problems += ckpt_problems
    bad_entries = {p: why for s in (replayed, st) for p, why in s.quarantined.items() if p.startswith(LOG_DIR)}
    problems += [f"{join(buf.root, p)}: {why}" for p, why in bad_entries.items()]
    checked = 0
    for info in list(st.shards.values()):
        path = join(buf.root, info.path)
        try:
            table = read_shard(buf.fs, buf.root, info.path)
        except FileNotFoundError:
            problems.append(f"{path}: committed in version {info.version} but missing on storage")
            continue
        except (CorruptShard, SchemaError) as e:
            problems.append(str(e))
            continue
        checked += 1
        if table.num_rows != info.rows:
            problems.append(f"{path}: {table.num_rows} rows, the commit log says {info.rows}")
            continue
        _, gsizes = group_layout(table)
        if len(gsizes) != info.groups or (info.gsizes and gsizes != info.gsizes):
            problems.append(f"{path}: {len(gsizes)} groups of sizes {gsizes[:8]}, the commit log says "
                            f"{info.groups} of sizes {info.gsizes[:8]}")
    orphans = 0
    for d in DATA_DIRS:
        orphans += sum(1 for f in list_files(buf.fs, join(buf.root, d), include_hidden=True)
                       if f"{d}/{f.rel}" not in st.shards and f"{d}/{f.rel}" not in st.quarantined)
    return {"ok": not problems, "problems": problems, "checked_shards": checked, "version": st.version,
            "quarantined": dict(st.quarantined), "unreferenced_files": orphans}


def _check_checkpoints(buf: "ReplayBuffer", versions: list[int]) -> tuple[list[str], BufferState]:
    """Every checkpoint must be usable and hold the state that the entries before it give, where
    vacuum has kept them: the retained log is replayed from its first entry (or from its oldest usable
    checkpoint once vacuum deleted the first entries). Returns the problems and the replayed state."""
    log, present = buf.log, set(versions)
    problems: list[str] = []
    replayed = BufferState()
    replaying = 1 in present  # a replayed state to compare checkpoints with: from the log's start
    for c in log.checkpoint_versions():
        try:
            ckpt = log.read_checkpoint(c)
        except FileNotFoundError:  # deleted by a concurrent vacuum
            continue
        except (CorruptLog, UnsupportedLogFormat) as e:
            problems.append(str(e))
            continue
        try:
            while replaying and replayed.version < c and replayed.version + 1 in present:
                entry = log.read_entry(replayed.version + 1)
                if entry is None:  # deleted by a concurrent vacuum
                    break
                replayed.apply(entry)
        except UnsupportedLogFormat as e:
            problems.append(str(e))
        if not replaying or replayed.version != c:  # entries missing: go on from the checkpoint
            replayed, replaying = ckpt, True
            continue
        a, b = replayed.to_json(), ckpt.to_json()
        ta, tb = a.pop("tombstones"), b.pop("tombstones")  # a checkpoint drops tombstones past retention
        differ = [k for k in a if a[k] != b[k]]
        if any(ta.get(p) != t for p, t in tb.items()):
            differ.append("tombstones")
        if differ:
            problems.append(f"{join(log.dir, checkpoint_name(c))}: checkpoint differs from the state its entries "
                            f"give (in {', '.join(differ)}); delete it so readers replay the entries instead")
    return problems, replayed
