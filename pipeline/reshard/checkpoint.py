"""The trainer's checkpoint writer, so the layout reshard reads has exactly one producer.

    checkpoints/step_<N>/
      dcp/        torch.distributed.checkpoint output; model entries are "model.<hf name>"
      hf/         config.json, generation_config.json, tokenizer files (no weights)
      meta.json   {"step": N, "world_size": W, "policy_version": K, "format": "dcp"}, written last

`save_dcp` works in a single process (plain tensors) and inside an initialised process group where
the model entries are FSDP2 DTensors: every rank calls it; DCP writes each rank's shards, and rank 0
then copies the metadata files and commits meta.json.
"""

from __future__ import annotations

import json
import warnings

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from ..storage import is_local, list_names, put_atomic, url_to_fs
from .layout import DCP_DIR, HF_META_DIR, META, ReshardError, is_weight_file


def _writer(url: str):
    fs, path = url_to_fs(url)
    if is_local(fs):
        return dcp.FileSystemWriter(path, thread_count=1)
    from torch.distributed.checkpoint import FsspecWriter

    return FsspecWriter(url, thread_count=1)


def save_dcp(state_dict: dict, dst_url: str, hf_meta_dir: str, step: int, world_size: int,
             policy_version: int | None) -> None:
    """Save `state_dict` ({"model": {hf name: tensor or DTensor}, optional "optim", ...}) as a
    complete checkpoint at `dst_url`; it counts as complete once meta.json exists."""
    if not isinstance(state_dict.get("model"), dict) or not state_dict["model"]:
        raise ReshardError("save_dcp: state_dict['model'] must be a non-empty {parameter name: tensor} dict")
    distributed = dist.is_available() and dist.is_initialized()
    if distributed and dist.get_world_size() != world_size:
        raise ReshardError(f"save_dcp: world_size={world_size} but the process group has {dist.get_world_size()} ranks")
    fs, root = url_to_fs(dst_url)
    src_fs, src_root = url_to_fs(hf_meta_dir)
    meta_names = [n for n in list_names(src_fs, src_root) if not is_weight_file(n) and src_fs.isfile(f"{src_root}/{n}")]
    if "config.json" not in meta_names:
        raise ReshardError(f"save_dcp: hf_meta_dir {hf_meta_dir!r} has no config.json; pass the model's HF folder")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process.*")
        dcp.save(state_dict, storage_writer=_writer(f"{dst_url.rstrip('/')}/{DCP_DIR}"))
    if not distributed or dist.get_rank() == 0:
        for name in meta_names:
            put_atomic(fs, f"{root}/{HF_META_DIR}/{name}", src_fs.cat_file(f"{src_root}/{name}"))
        meta = {"step": step, "world_size": world_size, "policy_version": policy_version, "format": "dcp"}
        put_atomic(fs, f"{root}/{META}", json.dumps(meta, indent=1, sort_keys=True).encode())
    if distributed:
        dist.barrier()  # no rank returns before the checkpoint is complete
