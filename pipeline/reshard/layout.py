"""Names shared by every reader and writer: formats, tensor descriptions, dtypes, file names.

A format string is what users type after `--to`: `hf`, `tp:N` or `dcp:N` (N >= 1). The file
names of a trainer checkpoint (`dcp:N`) are defined here and nowhere else; those of a Hugging Face
folder (`model.safetensors`, its index) in `pipeline.weights`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

MANIFEST = "manifest.json"
META = "meta.json"  # trainer checkpoint marker: complete only once it exists
DCP_DIR = "dcp"
HF_META_DIR = "hf"
MODEL_PREFIX = "model."  # DCP key prefix of model parameters in a trainer checkpoint
MANIFEST_VERSION = 2  # 2: files carry xxh3_128 checksums (1: sha256)

# safetensors dtype codes (https://github.com/huggingface/safetensors, format spec)
ST_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
ST_CODES: dict[torch.dtype, str] = {v: k for k, v in ST_DTYPES.items()}

_FORMAT_RE = re.compile(r"^(hf|tp:(\d+)|dcp:(\d+))$")


class ReshardError(ValueError):
    """A checkpoint or request that cannot be resharded; the message names what and how to fix it."""


@dataclass(frozen=True)
class Format:
    kind: str  # "hf" | "tp" | "dcp"
    degree: int = 1  # TP size or DCP world size; 1 for hf

    def __str__(self) -> str:
        return "hf" if self.kind == "hf" else f"{self.kind}:{self.degree}"


def parse_format(text: str) -> Format:
    m = _FORMAT_RE.match(str(text).strip())
    if not m:
        raise ReshardError(f"--to: unknown format {text!r}; use 'hf', 'tp:N' or 'dcp:N' with N >= 1")
    if m.group(1) == "hf":
        return Format("hf")
    kind, n = ("tp", m.group(2)) if m.group(2) else ("dcp", m.group(3))
    if int(n) < 1 or int(n) > 4096:
        raise ReshardError(f"--to: {text!r} has degree {n}; use an integer between 1 and 4096")
    return Format(kind, int(n))


@dataclass(frozen=True)
class TensorSpec:
    """One model parameter in Hugging Face naming, as the whole (unsharded) tensor."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def natural_key(name: str) -> tuple:
    """Order parameters as people read them: layers.2 before layers.10. Every writer uses this
    order, so two outputs of the same weights are identical whatever format they came from."""
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name))


def ordered(specs) -> list[TensorSpec]:
    return sorted(specs, key=lambda s: natural_key(s.name))


def hf_shard_name(i: int, n: int) -> str:
    return f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def tp_rank_name(rank: int, size: int) -> str:
    return f"model-tp-rank-{rank:05d}-of-{size:05d}.safetensors"


def dcp_rank_name(rank: int) -> str:
    return f"__{rank}_0.distcp"  # the name torch.distributed.checkpoint gives rank `rank`'s file


def is_weight_file(name: str) -> bool:
    """Files that hold weights (or point to them) and are never copied as model metadata."""
    return (
        name.endswith((".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".distcp", ".msgpack", ".h5"))
        or name.endswith(".index.json") or name in (MANIFEST, META, ".metadata")
    )
