"""Policy versions in the sampler's layout: `policy/v<K>/` committed by its `manifest.json`.

`PolicyStore` is the one writer and the one reader of this format. A version is a Hugging Face
folder that `pipeline.reshard` writes into `policy/v<K>/` from any layout it reads (a trainer
checkpoint, a Hugging Face folder, tp:N) and commits with its create-only manifest; a version exists
only once that manifest exists, so a sampler never loads a partial folder. `policy/latest.json`
points to the newest version; it is a hint updated after the commit, and the manifest stays the
source of truth. The publications: v0 in `prepare` (`publish_folder`), the trainer's in-phase
versions (`publish_model`, in-memory weights) and each phase's checkpoint (`publish_checkpoint`,
which also verifies every file against the manifest and casts the weights to the serving dtype,
`model.dtype`; the DAG's reshard task and the local runner call it). v0 is the user's model folder as
it is; every later version, like each trainer checkpoint, carries v0's files but weights (`base_meta`).

Retention (`retain`): the trainer deletes old versions every few publications, in a constant number
of requests however many go; a loader takes the newest version through `lease_latest`, which
records a lease in `policy/leases/<holder>.json` (kept until the holder's next load or `release`),
and no version is deleted while a lease on it is held. On object stores a reader gets a version through
a local copy (`local_dir`; `pipeline.policy_cache`): downloaded once, or seeded by the trainer's
publication on the same node, in which case a sampler beside it learns of the version, and loads
it, without a request. The trainer's in-phase versions on object stores are such copies first
and go up to the run directory every `RECORD_EVERY_S`, or each one while a reader on another node
holds a lease (`pipeline.policy_upload`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass
from typing import Iterable, Iterator

from .config import ConfigError
from .model_cache import cache_dir
from .policy_cache import (IDLE_RUN_S, LOCAL_COPIES, REMOTE_POLL_S, SHARED, VERSION_RE, LocalCopies, all_files,
                           sweep_idle_runs, version_dirname)
from .rundir import RunDir
from .storage import delete, file_exists, is_local, list_names, put_atomic, read_bytes

log = logging.getLogger("rlhf.policy")
LEASES = "leases"
LEASE_TTL_S = 3600.0
"""A lease older than this is ignored (its holder died while loading): it pins a version for at most this long."""
LEASE_ATTEMPTS = 5


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
        self._local: LocalCopies | None = None
        self._polled = float("-inf")  # when latest.json was last read while a local publisher seeds
        self._new_above: int | None = None  # publisher: no version folder above this was there at its start
        self._hinted: int | None = None  # publisher: the version its last latest.json named
        self._uploads = None  # publisher on an object store: pipeline.policy_upload.Uploads
        self._leased: set[str] = set()  # holders whose lease this store wrote and did not remove
        self._meta: tuple[tuple, tempfile.TemporaryDirectory] | None = None  # see _rendered_meta
        self._base: tempfile.TemporaryDirectory | None = None  # see base_meta

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
    def publish_folder(self, version: int, source_url: str, meta: dict | None = None, dtype=None) -> bool:
        """Publish a complete model as `version` through `pipeline.reshard` (the one publication
        path): a Hugging Face folder, or any layout it reads (a trainer checkpoint, tp:N), on local
        disk or any fsspec URL; `meta` adds keys to the manifest; `dtype` (a torch dtype) casts the
        floating-point weights. Idempotent: returns False if the version was already committed (a
        retried task)."""
        return not self.exists(version) and self._publish(version, source_url, meta, dtype)

    def _publish(self, version: int, source_url: str, meta: dict | None, dtype=None) -> bool:
        """Publish `version`, which the caller has just seen uncommitted, and move `latest.json`;
        whether this call committed it."""
        from .reshard import publish

        committed = publish(source_url, self.url(version), "hf", policy_version=version, extra=meta,
                            known_new=True, dtype=dtype)[1]
        if committed:
            self._move_hint(version)
        return committed

    def _move_hint(self, version: int) -> None:
        """Point `latest.json` at `version`, just committed, unless it names a newer one."""
        # The hint this store wrote last is newer than any other's unless it is below `version`
        # (not latest(): that would see this version past the hint and list them all).
        hint = self._hinted if self._hinted is not None and version > self._hinted else self._hint()
        if hint is None or version >= hint:
            put_atomic(self.fs, self.run.path("policy", "latest.json"), json.dumps({"version": version}).encode())
            self._hinted = version

    def flush(self) -> None:
        """Upload the versions `publish_model(defer=True)` left on this node only whose copies it
        still keeps, and point `latest.json` at the newest (its publisher calls this once it has
        published nothing for REMOTE_POLL_S, and at its end)."""
        if self._uploads is not None:
            self._uploads.flush()

    def publish_model(self, version: int, model, tokenizer, meta: dict | None = None,
                      weights: dict | None = None, defer: bool = False) -> bool:
        """Publish in-memory weights (the trainer's in-phase path): `weights` ({hf name: tensor},
        e.g. gathered from FSDP2 shards) or else the model's own state dict, with its config,
        generation config and `tokenizer`. Idempotent like `publish_folder`: the first call of a
        store lists the version folders once; a later version above them all is new without a
        request. On object stores see `pipeline.policy_upload`: the version is this node's copy
        first and, with `defer`, goes up to the run directory only when a reader can need it
        (the caller then calls `flush` when idle and at its end)."""
        if self._new_above is None:
            self._new_above = max(self._folders(), default=-1)
        if version <= self._new_above and self.exists(version):
            return False
        from .weights import write_hf_folder

        rendered = self.base_meta() or self._rendered_meta(model, tokenizer)
        with tempfile.TemporaryDirectory(prefix="policy-") as tmp:
            folder = os.path.join(tmp, "model")
            write_hf_folder(folder, weights=model.state_dict() if weights is None else weights, meta_from=rendered)
            if is_local(self.fs):
                return self._publish(version, folder, meta)
            if self._uploads is None:
                from .policy_upload import Uploads

                self._uploads = Uploads(self)
            return self._uploads.publish(version, folder, meta, tmp, defer)

    def base_meta(self) -> str | None:
        """A local folder with v0's files but its weights (the user's config, generation config,
        tokenizer, shipped code...: what a trained version carries byte for byte, where rendering
        them again would rewrite keys and drop files); None while v0 is not committed. Fetched once."""
        if self._base is None:
            manifest = self.manifest(0)
            if manifest is None:
                return None
            from .reshard.layout import is_weight_file

            tmp = tempfile.TemporaryDirectory(prefix="policy-base-")
            for name in sorted(all_files(manifest)):
                if "/" not in name and not is_weight_file(name):
                    self._fetch(0, manifest, name, os.path.join(tmp.name, name))
            self._base = tmp
        return self._base.name

    def _rendered_meta(self, model, tokenizer) -> str:
        """Without v0 (a bare store): a folder with `model`'s config, generation config and `tokenizer`,
        rendered once for the objects this store publishes with (they do not change while a trainer
        trains; rendering them was most of a small model's publication, on the trainer's thread)."""
        from .weights import write_hf_folder

        key = (model.config, getattr(model, "generation_config", None), tokenizer)
        if self._meta is None or any(a is not b for a, b in zip(self._meta[0], key)):
            tmp = tempfile.TemporaryDirectory(prefix="policy-meta-")
            write_hf_folder(os.path.join(tmp.name, "meta"), config=key[0], generation_config=key[1], tokenizer=key[2])
            if self._meta is not None:
                self._meta[1].cleanup()
            self._meta = (key, tmp)
        return os.path.join(self._meta[1].name, "meta")

    def publish_checkpoint(self, version: int, checkpoint_url: str) -> PolicyPublication:
        """Publish the trainer checkpoint at `checkpoint_url` as `version` and verify every file of
        the version against its manifest: a phase's publication. Its float32 master weights are
        cast to the serving dtype (`model.dtype`), as the in-phase versions are. Idempotent (a
        retried task verifies what the first attempt committed); raises ReshardError when the
        checkpoint is unusable or the version does not verify."""
        published = self.publish_folder(version, checkpoint_url, dtype=self._serving_dtype())
        report = self.verify(version)
        return PolicyPublication(version, published, report.files, report.bytes)

    def _serving_dtype(self):
        """The torch dtype of the run's `model.dtype`; None for a store without a run config."""
        import torch

        try:
            return getattr(torch, self.run.config().model.dtype)
        except ConfigError:
            return None

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
        shows the version with the next publication. On object stores a newer local copy (seeded
        by a publisher on this node) answers first (`_here_or_poll`)."""
        local, ask = self._here_or_poll(version)
        if local is not None or not ask:
            return local
        hint = self._hint()
        return hint if hint is not None and hint > version else None

    def committed(self, version: int) -> bool:
        """Whether `version` is committed, for a loader's poll (`sampler.fixed_lag`), knowing that
        in-phase versions are published in order: one request (its manifest). On object stores
        this node's copies answer first (a copy of it or of a newer version; `_here_or_poll`)."""
        local, ask = self._here_or_poll(version - 1)
        if local is not None or not ask:
            return local is not None
        return self.exists(version)

    def _here_or_poll(self, newer_than: int) -> tuple[int | None, bool]:
        """For a loader's poll: (this node's newest copy if newer than `newer_than`, else None;
        whether to read the run directory now). On local disk: (None, True). On object stores the
        run directory is read at most every REMOTE_POLL_S while a publisher on this node seeds
        copies (a publisher elsewhere, or restarted elsewhere, is still seen), else at every poll."""
        if is_local(self.fs):
            return None, True
        local, fresh = self._copies().newest()
        if local is not None and local > newer_than:
            return local, False
        if fresh and time.monotonic() - self._polled < REMOTE_POLL_S:
            return None, False
        self._polled = time.monotonic()
        return None, True

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
    def lease_latest(self, holder: str, version: int | None = None, exact: bool = False) -> Iterator[PolicyLease]:
        """The newest version (or `version`, e.g. the one `latest.json` just named; with `exact`, that
        one or FileNotFoundError), which `retain` does not delete while `holder`'s lease names it:
        load it inside. The lease stays after the block (the holder runs the version it loaded)
        until the holder's next lease overwrites it, `release` removes it, or it is older than
        LEASE_TTL_S: one request per load.

        The lease is written before the manifest is read. `retain` removes a manifest before it
        reads the leases, so either it sees this lease and keeps the files, or the manifest was
        already gone when read here, and the newest version is taken again. A version with a
        local copy on this node needs no lease (nothing is read from the run directory): the
        holder's lease is removed instead, once."""
        lease = self._lease(holder)
        for attempt in range(LEASE_ATTEMPTS):
            if version is None or (attempt and not exact):
                version = self.latest()
            if version is None:
                raise FileNotFoundError(f"{self.run.url}: no policy version is published")
            have = None if is_local(self.fs) else self._copies().get(version)
            if have is not None:
                with self._pinned(have) as pinned:
                    if pinned:
                        if holder in self._leased:
                            self.release(holder)
                        yield PolicyLease(version, have)
                        return
                continue
            put_atomic(self.fs, lease, json.dumps({"version": version, "time": time.time()}).encode(), fsync=False)
            self._leased.add(holder)
            try:
                folder = self.local_dir(version)
            except FileNotFoundError:
                if exact:
                    raise
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
        self._leased.discard(holder)

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
        those under a lease; returns those deleted (`pipeline.policy_retention`)."""
        from .policy_retention import retain

        return retain(self, keep, protected)

    # local copies -----------------------------------------------------------------------------
    def _copies(self) -> LocalCopies:
        """This node's copies of the run's versions (see pipeline.policy_cache)."""
        if self._local is None:
            try:  # when the run was first prepared: a new run at this URL gets new copies, a resumed one its own
                born = str(json.loads(read_bytes(self.fs, self.run.path("prepare.json"))).get("created", ""))
            except (FileNotFoundError, ValueError, AttributeError):
                born = ""
            key = hashlib.sha256(f"{self.run.url}|{born}".encode()).hexdigest()[:8]
            try:  # a fixed-lag sampler restarted on another node asks for the version max_staleness behind
                keep = max(LOCAL_COPIES, self.run.config().sampler.max_staleness + 1)
            except ConfigError:
                keep = LOCAL_COPIES
            root = cache_dir() / "policies" / f"{self.run.run_id}-{key}"
            gone = sweep_idle_runs(root.parent, root)
            if gone:
                log.info("policy copies of runs idle for %.0f days removed: %s", IDLE_RUN_S / 86400, ", ".join(gone))
            self._local = LocalCopies(root, keep)
        return self._local

    def local_dir(self, version: int) -> str:
        """A local folder with the committed files of `version` (the folder itself on local disk;
        on object stores this node's copy, downloaded once or seeded by its publisher)."""
        if is_local(self.fs):
            if not self.exists(version):
                raise FileNotFoundError(f"policy version {version} is not published in {self.run.url}")
            return self._dir(version)
        copies = self._copies()
        have = copies.get(version)  # only ever made from a committed manifest
        if have is not None:
            return have
        manifest = self.manifest(version)
        if manifest is None:
            raise FileNotFoundError(f"policy version {version} is not published in {self.run.url}")
        return copies.download(version, manifest, lambda name, target: self._fetch(version, manifest, name, target))

    def _fetch(self, version: int, manifest: dict, name: str, target: str) -> None:
        """Copy file `name` of the committed `version` (its `manifest`) from the run directory to `target`."""
        shared = manifest.get(SHARED, {})
        where = self.run.path("policy", shared[name]["path"]) if name in shared else f"{self._dir(version)}/{name}"
        self.fs.get_file(where, target)

    @contextlib.contextmanager
    def _pinned(self, folder: str) -> Iterator[bool]:
        """Hold a local copy against pruning; False if it was pruned meanwhile."""
        if is_local(self.fs):
            yield True
            return
        with LocalCopies.pinned(folder) as pinned:
            yield pinned
