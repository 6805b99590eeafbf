"""In-phase policy versions on object stores (`PolicyStore.publish_model`): serialized once, on
this node first, uploaded when a reader can need them.

A version is published by `pipeline.reshard` into a staging folder beside this node's copies
(`pipeline.policy_cache`), which then becomes this node's copy of it (its seed): a sampler beside
the trainer loads it from there without a request. The version goes up to the run directory, its
weight files (concurrently) and then its create-only manifest, the commit there; the files it
shares with other versions (config, tokenizer, generation config) are stored once per content in
`policy/files/` and named in the manifest's `shared` entry.

When it goes up: at once when it is the first publication in RECORD_EVERY_S, when a reader on
another node holds a lease (`policy/leases/`, which a reader writes when it loads a version from
the run directory and keeps until its next load; looked at most every REMOTE_POLL_S), or when it
cannot be seeded. Otherwise (a publisher that `defer`s: the trainer's background thread, which
calls `flush` when it has been idle for REMOTE_POLL_S and at its end) it waits, and `flush` uploads
the versions still waiting whose copies this node keeps (the newest `sampler.max_staleness` + 1,
LOCAL_COPIES at least: a fixed-lag sampler restarted on another node, which the trainer waits for,
asks for one of those).
So readers elsewhere (which learn of versions from `latest.json`) see the newest version within
about REMOTE_POLL_S while one holds a lease (one that loaded its version from its own node's copy
holds none: within RECORD_EVERY_S), and with none the store gets a version every RECORD_EVERY_S
however fast the trainer steps, instead of one per step (the run directory stays the record: the
phase-end versions, the checkpoints and the newest in-phase versions are there). Each upload is a
few requests and the weights' bytes from the trainer's process: at one a second, the demo config's
400 steps on S3 made 58 uploads, 107 MB and some 170 of the run's 2234 requests.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from typing import TYPE_CHECKING

from .policy_cache import REMOTE_POLL_S, SHARED
from .storage import file_exists, put_atomic, put_if_absent

if TYPE_CHECKING:
    from .policy import PolicyStore

log = logging.getLogger("rlhf.policy")
RECORD_EVERY_S = 10.0
"""With no reader on another node, an in-phase version goes up at most this often."""
SHARED_DIR = "files"
"""The folder (under policy/) of the files in-phase versions share on object stores (manifest key SHARED)."""


class Uploads:
    """The object-store side of one `PolicyStore`'s in-phase publications."""

    def __init__(self, store: "PolicyStore"):
        self.store = store
        self.stored: set[str] = set()  # shared files known to be in policy/files/
        self.waiting: list[int] = []  # versions seeded here, not uploaded (while their copies last)
        self.uploaded_at = float("-inf")
        self._elsewhere = (False, float("-inf"))  # (a reader elsewhere holds a lease, when looked)

    def publish(self, version: int, folder: str, meta: dict | None, tmp: str, defer: bool) -> bool:
        """Publish the Hugging Face `folder` as `version`; False if it was already committed (on
        this node by an earlier attempt, or in the run directory by another publisher)."""
        from .reshard import publish
        from .reshard.layout import is_weight_file

        copies = self.store._copies()
        if copies.get(version) is not None:  # this node has it: committed, or seeded by a process before
            if file_exists(self.store.fs, f"{self.store._dir(version)}/manifest.json"):
                return False
            # a trainer killed while the version waited here (its list of those died with it), now
            # resumed and redoing the step: it goes up as the ones it defers do
            self.waiting.append(version)
            if not defer or self._due_now():
                self.flush()
            return True
        try:
            staging = copies.staging()
        except OSError as e:  # no copy here: the samplers on this node download the version
            log.warning("policy v%d: no local copy (%s)", version, e)
            staging = None
        out = os.path.join(staging or tmp, "out")
        try:
            written = publish(folder, out, "hf", policy_version=version, extra=meta, known_new=True)[0]
            own = {n: e for n, e in written["files"].items() if is_weight_file(n)}
            shared = self._share(out, {n: e for n, e in written["files"].items() if n not in own})
            manifest = {**written, "files": own, **({SHARED: shared} if shared else {})}
            upload = staging is None or not defer or self._due_now()
            if upload and not self._upload(version, out, manifest):
                return False
            seeded = staging is not None and copies.place_seed(version, out, manifest)
            if not (upload or seeded):  # not placed here after all: it goes up now
                if not self._upload(version, out, manifest):
                    return False
                upload = True
            if upload:
                self.store._move_hint(version)
            else:
                self.waiting = [v for v in self.waiting if copies.get(v) is not None] + [version]
            return True
        finally:
            if staging is not None:
                shutil.rmtree(staging, ignore_errors=True)

    def flush(self) -> None:
        """Upload the versions that wait and still have their copy here (the newest copies at
        most: what a fixed-lag sampler restarted on another node can ask for), oldest first,
        and point `latest.json` at the newest."""
        waiting, self.waiting = self.waiting, []
        newest = None
        for version in waiting:
            path = self.store._copies().get(version)
            if path is None:
                continue
            with self.store._pinned(path) as pinned:
                if pinned:
                    with open(os.path.join(path, "manifest.json")) as f:
                        manifest = json.load(f)
                    if self._upload(version, path, manifest):
                        newest = version
        if newest is not None:
            self.store._move_hint(newest)

    def _due_now(self) -> bool:
        now = time.monotonic()
        if now - self.uploaded_at >= RECORD_EVERY_S:
            return True
        seen, at = self._elsewhere
        if now - at >= REMOTE_POLL_S:
            seen = bool(self.store.leased())
            self._elsewhere = (seen, now)
        return seen

    def _upload(self, version: int, folder: str, manifest: dict) -> bool:
        """Put the version's own files, then commit it with its manifest; False if it was there."""
        from .reshard.manifest import encode

        dst, own = self.store._dir(version), manifest["files"]
        self.store.fs.put([os.path.join(folder, n) for n in own], [f"{dst}/{n}" for n in own])
        self.uploaded_at = time.monotonic()
        return put_if_absent(self.store.fs, f"{dst}/manifest.json", encode(manifest))

    def _share(self, folder: str, entries: dict) -> dict:
        """Store each file of `entries` ({name: manifest entry}, the files of `folder` that are not
        weights) once per content in `policy/files/` (uploaded the first time this store meets
        it); their `shared` manifest entries."""
        from .reshard.files import CHECKSUM

        out, run = {}, self.store.run
        for name, entry in sorted(entries.items()):
            rel = f"{SHARED_DIR}/{entry[CHECKSUM]}-{name}"
            if rel not in self.stored and not file_exists(self.store.fs, run.path("policy", rel)):
                with open(os.path.join(folder, name), "rb") as f:
                    put_atomic(self.store.fs, run.path("policy", rel), f.read())
            self.stored.add(rel)
            out[name] = {**entry, "path": rel}
        return out
