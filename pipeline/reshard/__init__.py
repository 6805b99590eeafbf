"""Checkpoint resharding between the trainer's layout and the sampler's.

    reshard(src_url, dst_url, to="hf" | "tp:N" | "dcp:N", *, policy_version=None) -> manifest
    publish(...) -> (manifest, committed now)       the same, saying whether this call committed it
    verify(dst_url) -> Verification (ok, problems)
    save_dcp(state_dict, dst_url, hf_meta_dir, step, world_size, policy_version)   (the trainer's writer)

Every output goes into the folder it is given and is committed there by a create-only
`manifest.json` written last (see `manifest`); the layouts are described in `sinks` (hf, tp:N),
`checkpoint` and `dcp_io` (dcp:N, the trainer's layout). Any source layout converts to any target
layout, on any fsspec URL, streaming one tensor at a time. This package knows nothing of runs or
policy versions: `pipeline.policy` publishes versions through it.
"""

from .checkpoint import save_dcp
from .engine import publish, reshard
from .layout import Format, ReshardError, parse_format
from .manifest import Verification, verify

__all__ = ["Format", "ReshardError", "Verification", "parse_format", "publish", "reshard", "save_dcp", "verify"]
