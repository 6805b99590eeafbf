"""Policy versions in the sampler's layout: `policy/v<K>/` committed by its `manifest.json`.

A version exists only once its manifest exists (create-only), so a sampler never loads a partial
folder. `policy/latest.json` points to the newest version; it is a hint updated after the commit,
and the manifest stays the source of truth.
"""

from __future__ import annotations

import json
import os
import re
import tempfile

from .models import cache_dir
from .runs import RunDir
from .storage import is_local, list_names, put_atomic, read_bytes

VERSION_RE = re.compile(r"^v(\d{6,})$")


def version_dirname(version: int) -> str:
    return f"v{version:06d}"


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
        return self.fs.exists(self._dir(version) + "/manifest.json")

    def publish_folder(self, version: int, local_folder: str, meta: dict | None = None) -> bool:
        """Publish a complete model folder as `version` through `pipeline.reshard` (the one
        publication path): a Hugging Face folder, or any layout it reads (a trainer checkpoint,
        tp:N), on local disk or any fsspec URL. Idempotent: returns False if the version was
        already committed (a retried task)."""
        if self.exists(version):
            return False
        from .reshard import publish

        _, committed = publish(local_folder, self.run.child_url("policy", version_dirname(version)), "hf",
                               policy_version=version, extra=meta)
        if committed:
            latest = self.latest()
            if latest is None or version >= latest:
                put_atomic(self.fs, self.run.path("policy", "latest.json"), json.dumps({"version": version}).encode())
        return committed

    def publish_model(self, version: int, model, tokenizer, meta: dict | None = None) -> bool:
        """Publish in-memory weights (the trainer's in-phase sync path)."""
        with tempfile.TemporaryDirectory(prefix="policy-") as tmp:
            model.save_pretrained(tmp, safe_serialization=True)
            tokenizer.save_pretrained(tmp)
            return self.publish_folder(version, tmp, meta)

    def latest(self) -> int | None:
        try:
            hint = json.loads(read_bytes(self.fs, self.run.path("policy", "latest.json")))["version"]
        except FileNotFoundError:
            hint = None
        if hint is not None and self.exists(hint) and not self.exists(hint + 1):
            return int(hint)
        versions = self.versions()
        return versions[-1] if versions else None

    def versions(self) -> list[int]:
        out = []
        for name in list_names(self.fs, self.run.path("policy")):
            m = VERSION_RE.match(name)
            if m and self.exists(int(m.group(1))):
                out.append(int(m.group(1)))
        return sorted(out)

    def local_dir(self, version: int) -> str:
        """A local folder with the committed files of `version` (the folder itself on local disk)."""
        manifest = self.manifest(version)
        if manifest is None:
            raise FileNotFoundError(f"policy version {version} is not published in {self.run.url}")
        if is_local(self.fs):
            return self._dir(version)
        dst = cache_dir() / "policies" / self.run.run_id / version_dirname(version)
        if not (dst / "manifest.json").exists():
            tmp = tempfile.mkdtemp(prefix="dl-", dir=dst.parent if dst.parent.exists() else None)
            for name in manifest["files"]:
                self.fs.get_file(f"{self._dir(version)}/{name}", os.path.join(tmp, name))
            with open(os.path.join(tmp, "manifest.json"), "w") as f:
                json.dump(manifest, f)
            dst.parent.mkdir(parents=True, exist_ok=True)
            if not dst.exists():
                os.rename(tmp, dst)
        return str(dst)
