"""The manifest every output carries, written last and create-only: it is the commit point.

Keys (a superset of what `pipeline.policy.PolicyStore` reads):
    format            "hf" | "tp:N" | "dcp:N"
    version           policy version (int) or null
    step              trainer step the weights come from, or null
    source_format     format of the source
    architecture      e.g. "Qwen2ForCausalLM"
    files             {relative path: {"bytes", "xxh3_128"}} for every file of the output
    tensors           per-parameter layout (file, or TP split), see `sinks`
    manifest_version  2 (1: the checksum of each file was "sha256"; such manifests still verify)
No timestamps: re-running the same reshard produces the same bytes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from ..storage import read_bytes, url_to_fs
from .files import CHECKSUMS, file_checksum
from .layout import MANIFEST, ReshardError


def read_manifest(fs, root: str) -> dict | None:
    try:
        return json.loads(read_bytes(fs, f"{root}/{MANIFEST}"))
    except FileNotFoundError:
        return None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ReshardError(f"{root}/{MANIFEST}: invalid JSON ({e}); delete the folder and re-run the reshard") from None


def encode(manifest: dict) -> bytes:
    return json.dumps(manifest, indent=1, sort_keys=True).encode()


@dataclass
class Verification:
    url: str
    files: int = 0
    bytes: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def raise_if_bad(self) -> None:
        if self.problems:
            more = f" (and {len(self.problems) - 3} more)" if len(self.problems) > 3 else ""
            raise ReshardError(f"{self.url} does not verify: {'; '.join(self.problems[:3])}{more}")


def verify(url: str) -> Verification:
    """Check every file listed in the manifest: present, same size, same checksum (with the
    algorithm its entry names: "xxh3_128", or "sha256" in manifests of version 1)."""
    fs, root = url_to_fs(url)
    out = Verification(url)
    manifest = read_manifest(fs, root)
    if manifest is None:
        out.problems.append(f"no {MANIFEST} (the output was never committed)")
        return out
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        out.problems.append(f"{MANIFEST} lists no files")
        return out
    for rel, want in sorted(files.items()):
        if rel.startswith("/") or ".." in rel.split("/"):
            out.problems.append(f"{rel!r} points outside the folder")
            continue
        if not isinstance(want, dict):
            out.problems.append(f"{rel}: its manifest entry is not an object")
            continue
        path = f"{root}/{rel}"
        try:
            size = fs.size(path)
        except FileNotFoundError:
            out.problems.append(f"{rel} is missing")
            continue
        if size != want.get("bytes"):
            out.problems.append(f"{rel} has {size} bytes, manifest says {want.get('bytes')}")
            continue
        algorithm = next((a for a in CHECKSUMS if a in want), None)
        if algorithm is None:
            out.problems.append(f"{rel} has no checksum in the manifest (one of {', '.join(CHECKSUMS)})")
            continue
        n, digest = file_checksum(fs, path, algorithm)
        if digest != want[algorithm]:
            out.problems.append(
                f"{rel} {algorithm} {digest[:12]}... differs from the manifest's {str(want[algorithm])[:12]}..."
            )
            continue
        out.files += 1
        out.bytes += n
    return out
