"""Process groups: is one alive, stop it, and tell its leader apart from a later process.

Every long-lived process this project starts (the local runner's sampler and trainer, the
operator's engine process, the embedded deployment's components and their supervisor) runs in
its own session, so stopping it means stopping its group: torchrun workers, vLLM engine processes
and executor workers go with it. This is the one place that does it.

Nothing here reaps a child: a `Popen` that owns the group leader keeps its exit status (reaping
behind its back would make its `wait()` report 0 for a killed process). Zombies are not counted as
alive, so waiting on a group whose leader exited but was not reaped yet ends at once.

A process id says little once the machine or the container restarted (the same pid and hostname
come back for a stranger), so `process_identity` also records the kernel's boot id and the
process's start time, and `identity_mismatch` says why a live process is not the one recorded.
Where /proc is missing (not Linux) nothing is verifiable: `identity_mismatch` never confirms.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path
from typing import Any, Iterable, Mapping


class RunFailed(RuntimeError):
    """A local run's sampler or trainer failed or stopped short; the message says what and where
    to look (`rlhf run` prints it as one line: their own output is above it)."""

PROC = Path("/proc")


def group_alive(pgid: int) -> bool:
    """True while the process group `pgid` has a member that is not a zombie."""
    if pgid <= 0:  # 0 and negative numbers name no group of a child (killpg(0) is our own)
        return False
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    if not PROC.is_dir():
        return True
    for stat in PROC.glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        # fields[0] is field 3 of /proc/<pid>/stat (the state), fields[2] field 5 (the group)
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def _signal_group(pgid: int, sig: int) -> bool:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    return True


def stop_groups(pgids: Iterable[int], grace_s: float = 30.0) -> list[int]:
    """SIGTERM every group at once, wait up to `grace_s` for all to go, then SIGKILL what is left.
    Returns the groups that existed."""
    existed = [pgid for pgid in pgids if pgid and pgid > 0 and _signal_group(pgid, signal.SIGTERM)]
    deadline = time.monotonic() + grace_s
    left = existed
    while left:
        left = [pgid for pgid in left if group_alive(pgid)]
        if not left or time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    for pgid in left:
        _signal_group(pgid, signal.SIGKILL)
    return existed


def stop_group(pgid: int, grace_s: float = 30.0) -> bool:
    """SIGTERM the group, wait up to `grace_s` for it to go, then SIGKILL. True if it existed."""
    return bool(stop_groups([pgid], grace_s))


def boot_id() -> str | None:
    """The kernel's id of the current boot; it changes when the machine restarts."""
    try:
        return (PROC / "sys" / "kernel" / "random" / "boot_id").read_text().strip() or None
    except OSError:
        return None


def process_start_ticks(pid: int) -> int | None:
    """Start time of process `pid` in clock ticks since boot (field 22 of /proc/<pid>/stat)."""
    try:
        stat = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    # Field 2 (the command name, in parentheses) may hold spaces and ')': split after the last one.
    fields = stat.rsplit(")", 1)[-1].split()
    try:
        return int(fields[22 - 3])  # fields[0] is field 3 (the state)
    except (IndexError, ValueError):
        return None


def process_identity(pid: int) -> dict:
    """What tells the process `pid` apart from a later one that got the same pid."""
    return {"host": socket.gethostname(), "boot_id": boot_id(), "start_ticks": process_start_ticks(pid)}


def identity_mismatch(record: Mapping[str, Any]) -> str | None:
    """Why the live process with the recorded `pgid` is not the recorded group leader (None: it
    is). `record` holds `pgid` and what `process_identity` returned when the group started."""
    pgid = record.get("pgid")
    if not pgid:
        return "no process group recorded"
    live = process_identity(int(pgid))
    for key in ("host", "boot_id", "start_ticks"):
        if record.get(key) is None:
            return f"the record has no {key}, so process {pgid} cannot be identified"
        if live[key] is None:
            return (f"process {pgid} is gone (its group, if any is left, cannot be identified)"
                    if key == "start_ticks" else f"{key} of this machine is unknown")
        if live[key] != record[key]:
            return f"{key} differs: recorded {record[key]!r}, live process {pgid} has {live[key]!r}"
    return None
