"""Policy versions in the sampler's layout: `policy/v<K>/` committed by its `manifest.json`.

`PolicyStore` is the one writer and the one reader of this format. A version is a Hugging Face
folder that `pipeline.reshard` writes into `policy/v<K>/` from any layout it reads (a trainer
checkpoint, a Hugging Face folder, tp:N) and commits with its create-only manifest; a version exists
only once that manifest exists, so a sampler never loads a partial folder. `policy/latest.json`
points to the newest version; it is a hint updated after the commit, and the manifest stays the
source of truth. The publications: v0 in `prepare` (`publish_folder`), the trainer's in-phase
versions (`publish_model`, in-memory weights) and each phase's checkpoint (`publish_checkpoint`,
which also verifies every file against the manifest; the DAG's reshard task and the local runner
call it).

Retention (`retain`): the trainer deletes old versions every few publications, in a constant number
of requests however many go; a loader takes the newest version through `lease_latest`, which
records a lease in `policy/leases/<holder>.json` (kept until the holder's next load or `release`),
and no version is deleted while a lease on it is held. On object stores a reader gets a version through
a local copy (`local_dir`, in the cache); the copies of a run are bounded too (`LOCAL_COPIES`).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

from .model_cache import cache_dir
from .rundir import RunDir
from .storage import delete, delete_files, file_exists, is_local, list_files, list_names, put_atomic, read_bytes

log = logging.getLogger("rlhf.policy")
VERSION_RE = re.compile(r"^v(\d{6,})$")
LEASES = "leases"
LEASE_TTL_S = 3600.0
"""A lease older than this is ignored (its holder died while loading): it pins a version for at most this long."""
LEASE_ATTEMPTS = 5
LOCAL_COPIES = 2
"""Local copies of a remote run's versions kept in the cache besides v0: the newest ones."""


def version_dirname(version: int) -> str:
    return f"v{version:06d}"


@dataclass(frozen=True)
class PolicyPublication:
    version: int
    published_now: bool
    """False when the version was already committed (a retried task); it was verified either way."""
    files: int
    bytes: int


@dataclass(frozen=True)
class PolicyLease:
    version: int
    path: str
    """A local folder with the version's files, valid while the lease is held."""


class PolicyStore:
    def __init__(self, run: RunDir):
        self.run = run
        self.fs = run.fs

    def _dir(self, version: int) -> str:
        return self.run.path("policy", version_dirname(version))

    def manifest(self, version: int) -> dict | None:
        try:
            return json.loads(read_bytes(self.fs, self._dir(version) + "/manifest.json"))
        except FileNotFoundError:
            return None

    def exists(self, version: int) -> bool:
        return file_exists(self.fs, self._dir(version) + "/manifest.json")

    def url(self, version: int) -> str:
        """The URL of `version`'s folder (committed or not)."""
        return self.run.child_url("policy", version_dirname(version))

    # publishing -------------------------------------------------------------------------------
    def publish_folder(self, version: int, source_url: str, meta: dict | None = None) -> bool:
        """Publish a complete model as `version` through `pipeline.reshard` (the one publication
        path): a Hugging Face folder, or any layout it reads (a trainer checkpoint, tp:N), on local
        disk or any fsspec URL; `meta` adds keys to the manifest. Idempotent: returns False if the
        version was already committed (a retried task)."""
        return not self.exists(version) and self._publish(version, source_url, meta)

    def _publish(self, version: int, source_url: str, meta: dict | None) -> bool:
        """Publish `version`, which the caller has just seen uncommitted."""
        from .reshard import publish

        _, committed = publish(source_url, self.url(version), "hf", policy_version=version, extra=meta, known_new=True)
        if committed:
            hint = self._hint()  # not latest(): that would see this version past the hint and list them all
            if hint is None or version >= hint:
                put_atomic(self.fs, self.run.path("policy", "latest.json"), json.dumps({"version": version}).encode())
        return committed

    def publish_model(self, version: int, model, tokenizer, meta: dict | None = None,
                      weights: dict | None = None) -> bool:
        """Publish in-memory weights (the trainer's in-phase path): `weights` ({hf name: tensor},
        e.g. gathered from FSDP2 shards) or else the model's own state dict, with its config,
        generation config and `tokenizer`. Idempotent like `publish_folder`."""
        if self.exists(version):
            return False
        from .weights import write_hf_folder

        with tempfile.TemporaryDirectory(prefix="policy-") as tmp:
            folder = os.path.join(tmp, "model")
            write_hf_folder(folder, config=model.config, tokenizer=tokenizer,
                            generation_config=getattr(model, "generation_config", None),
                            weights=model.state_dict() if weights is None else weights)
            return self._publish(version, folder, meta)  # checked above

    def publish_checkpoint(self, version: int, checkpoint_url: str) -> PolicyPublication:
        """Publish the trainer checkpoint at `checkpoint_url` as `version` and verify every file of
        the version against its manifest: a phase's publication. Idempotent (a retried task
        verifies what the first attempt committed); raises ReshardError when the checkpoint is
        unusable or the version does not verify."""
        published = self.publish_folder(version, checkpoint_url)
        report = self.verify(version)
        return PolicyPublication(version, published, report.files, report.bytes)

    def verify(self, version: int):
        """Check every file of `version` against its manifest; returns the `Verification` and raises
        ReshardError when a file is missing or differs, or the version is not committed."""
        from .reshard import verify

        report = verify(self.url(version))
        report.raise_if_bad()
        return report

    def _hint(self) -> int | None:
        try:
            return int(json.loads(read_bytes(self.fs, self.run.path("policy", "latest.json")))["version"])
        except FileNotFoundError:
            return None

    def published_after(self, version: int) -> int | None:
        """The version `latest.json` names if newer than `version` (else None): one read, for a
        loader's poll. A hint that lags (its publisher stopped between the manifest and the hint)
        shows the version with the next publication."""
        hint = self._hint()
        return hint if hint is not None and hint > version else None

    def latest(self) -> int | None:
        hint = self._hint()
        if hint is not None and self.exists(hint) and not self.exists(hint + 1):
            return int(hint)
        versions = self.versions()
        return versions[-1] if versions else None

    def _folders(self) -> list[int]:
        """Every `v<K>` folder, committed or not."""
        return sorted(int(m.group(1)) for m in map(VERSION_RE.match, list_names(self.fs, self.run.path("policy"))) if m)

    def versions(self) -> list[int]:
        return [v for v in self._folders() if self.exists(v)]

    # loading ----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def lease_latest(self, holder: str, version: int | None = None) -> Iterator[PolicyLease]:
        """The newest version (or `version`, e.g. the one `latest.json` just named), which `retain`
        does not delete while `holder`'s lease names it: load it inside. The lease stays after the
        block (the holder runs the version it loaded) until the holder's next lease overwrites it,
        `release` removes it, or it is older than LEASE_TTL_S: one request per load.

        The lease is written before the manifest is read. `retain` removes a manifest before it
        reads the leases, so either it sees this lease and keeps the files, or the manifest was
        already gone when read here, and the newest version is taken again."""
        lease = self._lease(holder)
        for attempt in range(LEASE_ATTEMPTS):
            if attempt or version is None:
                version = self.latest()
            if version is None:
                raise FileNotFoundError(f"{self.run.url}: no policy version is published")
            put_atomic(self.fs, lease, json.dumps({"version": version, "time": time.time()}).encode(), fsync=False)
            try:
                folder = self.local_dir(version)
            except FileNotFoundError:
                log.info("policy v%d was deleted before it could be loaded; taking the newest again", version)
                continue
            with self._pinned(folder) as pinned:
                if pinned:
                    yield PolicyLease(version, folder)
                    return
        raise FileNotFoundError(f"{self.run.url}: no policy version stayed published long enough to be "
                                f"leased ({LEASE_ATTEMPTS} attempts)")

    def release(self, holder: str) -> None:
        """Remove `holder`'s lease (it no longer runs a version of this run)."""
        delete(self.fs, self._lease(holder))

    def _lease(self, holder: str) -> str:
        return self.run.path("policy", LEASES, f"{holder}.json")

    def leased(self) -> set[int]:
        """Versions under a lease younger than LEASE_TTL_S."""
        out = set()
        folder = self.run.path("policy", LEASES)
        for name in list_names(self.fs, folder):
            try:
                lease = json.loads(read_bytes(self.fs, f"{folder}/{name}"))
                version, taken = int(lease["version"]), float(lease["time"])
            except (FileNotFoundError, ValueError, KeyError, TypeError):
                continue  # released meanwhile, or not a lease
            if time.time() - taken < LEASE_TTL_S:
                out.add(version)
        return out

    # retention --------------------------------------------------------------------------------
    def retain(self, keep: int, protected: Iterable[int] = ()) -> list[int]:
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
        for entry in list_files(self.fs, self.run.path("policy"), include_hidden=True):
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
        delete_files(self.fs, [self._dir(v) + "/manifest.json" for v in doomed
                               if f"{version_dirname(v)}/manifest.json" in files[v]])
        leased = self.leased()
        deleted = [v for v in doomed if v not in leased]
        delete_files(self.fs, [self.run.path("policy", rel) for v in deleted for rel in files[v]],
                     folders=[self._dir(v) for v in deleted])
        if deleted:
            log.info("policy retention: deleted %s", ", ".join(f"v{v}" for v in deleted))
        return deleted

    # local copies -----------------------------------------------------------------------------
    def _cache(self) -> Path:
        return cache_dir() / "policies" / f"{self.run.run_id}-{hashlib.sha256(self.run.url.encode()).hexdigest()[:8]}"

    def local_dir(self, version: int) -> str:
        """A local folder with the committed files of `version` (the folder itself on local disk;
        on object stores a copy in the cache, which keeps v0 and the newest LOCAL_COPIES)."""
        manifest = self.manifest(version)
        if manifest is None:
            raise FileNotFoundError(f"policy version {version} is not published in {self.run.url}")
        if is_local(self.fs):
            return self._dir(version)
        dst = self._cache() / version_dirname(version)
        if not (dst / "manifest.json").exists():
            dst.parent.mkdir(parents=True, exist_ok=True)
            tmp = tempfile.mkdtemp(prefix=".dl-", dir=dst.parent)
            try:
                prev, prev_files = _newest_copy(dst.parent, below=version)
                for name, entry in manifest["files"].items():
                    target = os.path.join(tmp, name)
                    os.makedirs(os.path.dirname(target), exist_ok=True)
                    # same size and checksum as in that copy: unchanged (unless the copy was pruned meanwhile)
                    if not (prev_files.get(name) == entry and _link_or_copy(os.path.join(prev, name), target)):
                        self.fs.get_file(f"{self._dir(version)}/{name}", target)
                with open(os.path.join(tmp, "manifest.json"), "w") as f:
                    json.dump(manifest, f)
                os.rename(tmp, dst)
            except OSError:
                shutil.rmtree(tmp, ignore_errors=True)
                if not (dst / "manifest.json").exists():  # not a concurrent download that got there first
                    raise
            _prune_copies(dst.parent, keep={0, version})
        return str(dst)

    @contextlib.contextmanager
    def _pinned(self, folder: str) -> Iterator[bool]:
        """Hold a cached copy against pruning (a shared lock); False if it was pruned meanwhile."""
        if is_local(self.fs):
            yield True
            return
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


def _newest_copy(parent: Path, below: int) -> tuple[str | None, dict]:
    """The newest complete cached copy of a version below `below` and its manifest's files: a
    download takes the files that did not change from there (a tokenizer, a config) instead of
    fetching them again."""
    copies = sorted((int(m.group(1)) for m in (VERSION_RE.match(p.name) for p in parent.iterdir()) if m), reverse=True)
    for v in copies:
        if v < below:
            folder = parent / version_dirname(v)
            try:
                return str(folder), json.loads((folder / "manifest.json").read_text()).get("files", {})
            except (FileNotFoundError, ValueError):
                continue
    return None, {}


def _link_or_copy(src: str, dst: str) -> bool:
    try:
        os.link(src, dst)
    except OSError:
        try:
            shutil.copyfile(src, dst)
        except OSError:
            return False
    return True


def _prune_copies(parent: Path, keep: set[int]) -> None:
    """Delete the cached copies of a run except `keep` and the newest LOCAL_COPIES; a copy a
    reader holds (`_pinned`) is skipped."""
    copies = sorted(int(m.group(1)) for m in (VERSION_RE.match(p.name) for p in parent.iterdir()) if m)
    keep = keep | set(copies[-LOCAL_COPIES:])
    for v in copies:
        if v in keep:
            continue
        path = parent / version_dirname(v)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            trash = parent / f".trash-{uuid.uuid4().hex}"
            os.rename(path, trash)  # readers see it gone at once, not half deleted
            shutil.rmtree(trash, ignore_errors=True)
        except (BlockingIOError, FileNotFoundError):
            pass
        finally:
            os.close(fd)
