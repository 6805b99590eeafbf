"""Retention of a run's policy versions: `PolicyStore.retain`, applied by their publisher (the
trainer) every few publications and at its end."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Iterable

from .policy_cache import VERSION_RE, version_dirname
from .storage import delete_files, list_files

if TYPE_CHECKING:
    from .policy import PolicyStore

log = logging.getLogger("rlhf.policy")


def retain(store: "PolicyStore", keep: int, protected: Iterable[int] = ()) -> list[int]:
    """Delete the versions older than the newest `keep` committed ones, except `protected` and
    those under a lease. Returns the versions deleted.

    One listing of `policy/` finds every version's files. Each doomed version goes in two steps:
    its manifest first (the uncommit: from then on no reader starts on it), then, once the
    leases have been read, its files; each step is one bulk deletion on object stores. A loader
    writes its lease before it reads the manifest (`lease_latest`), so a loader that found the
    manifest has a lease this read sees. Folders without a manifest (a killed publication, or
    files kept for a lease) are removed by a later call. Only the publisher of the versions
    that are not `protected` may call this, after its publication returned: a version being
    published is either newer than the newest `keep` or protected."""
    if keep < 1:
        raise ValueError(f"keep={keep}: at least the newest version must stay")
    files: dict[int, list[str]] = {}
    for entry in list_files(store.fs, store.run.path("policy"), include_hidden=True):
        m = VERSION_RE.match(entry.rel.split("/", 1)[0])
        if m and "/" in entry.rel:
            files.setdefault(int(m.group(1)), []).append(entry.rel)
    kept = [v for v in sorted(files, reverse=True) if f"{version_dirname(v)}/manifest.json" in files[v]][:keep]
    if len(kept) < keep:
        return []
    protected = set(protected)
    doomed = [v for v in sorted(files) if v < kept[-1] and v not in protected]
    if not doomed:
        return []
    delete_files(store.fs, [store.run.path("policy", version_dirname(v), "manifest.json") for v in doomed
                            if f"{version_dirname(v)}/manifest.json" in files[v]])
    leased = store.leased()
    deleted = [v for v in doomed if v not in leased]
    delete_files(store.fs, [store.run.path("policy", rel) for v in deleted for rel in files[v]],
                 folders=[store.run.path("policy", version_dirname(v)) for v in deleted])
    if deleted:
        log.info("policy retention: deleted %s", ", ".join(f"v{v}" for v in deleted))
    return deleted
