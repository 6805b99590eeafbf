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

from importlib import import_module

# Loaded on first use (PEP 562): importing `pipeline.reshard.cli` to list the commands of `rlhf`
# then costs no torch import.
_EXPORTS = {"save_dcp": "checkpoint", "publish": "engine", "reshard": "engine", "Format": "layout",
            "ReshardError": "layout", "parse_format": "layout", "Verification": "manifest", "verify": "manifest"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
