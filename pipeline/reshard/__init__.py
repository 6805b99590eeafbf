"""Checkpoint resharding between the trainer's layout and the sampler's.

    reshard(src_url, dst_url, to="hf" | "tp:N" | "dcp:N", *, policy_version=None) -> manifest
    verify(dst_url) -> Verification (ok, problems); verify_policy(run_url, version) raises if bad
    publish_checkpoint(run_url, checkpoint_url, version) -> bool   (into policy/v<K>/ of a run)
    save_dcp(state_dict, dst_url, hf_meta_dir, step, world_size, policy_version)   (trainer side)

Every output is committed by a create-only `manifest.json` written last (see `manifest`); the
layouts are described in `sinks` (hf, tp:N) and `dcp_io` (dcp:N). Any source layout converts to any
target layout, on any fsspec URL, streaming one tensor at a time.
"""

from .checkpoint import save_dcp
from .engine import publish, publish_checkpoint, reshard, verify_policy
from .layout import Format, ReshardError, parse_format
from .manifest import Verification, verify

__all__ = [
    "Format", "ReshardError", "Verification", "parse_format", "publish", "publish_checkpoint", "reshard", "save_dcp",
    "verify", "verify_policy",
]
