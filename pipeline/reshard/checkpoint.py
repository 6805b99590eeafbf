"""The trainer checkpoint layout (`dcp:W`): the only code that writes it, and the readers of its meta.

    <checkpoint>/
      dcp/        torch.distributed.checkpoint output; model entries are "model.<hf name>", other
                  keys (optimizer, counters) belong to whoever saved them
      hf/         config.json, generation_config.json, tokenizer files (no weights)
      meta.json   {"format": "dcp", "policy_version": K, "step": N, "world_size": W[, "kind"]},
                  written last: a checkpoint exists only once it is there

Writers: `save_dcp` (the trainer saves every checkpoint through it) and the resharder's `dcp:N`
output, which writes `dcp/` tensor by tensor (`dcp_io`) and takes `meta.json`'s content and
bytes from `checkpoint_meta` / `encode_meta`. Readers: `read_meta` (the resharder's source and the
trainer's list of checkpoints), `dcp_reader` and `dcp_load` (DCP's own loader, through which the
trainer resumes, with no plain unpickling) and `load_model_weights`; the resharder reads `dcp/`
with its own reader (`dcp_io`).
"""

from __future__ import annotations

import functools
import io
import json
import warnings

import torch
import torch.distributed as dist

from ..storage import is_local, list_names, put_atomic, read_bytes, url_to_fs
from .layout import DCP_DIR, HF_META_DIR, META, MODEL_PREFIX, ReshardError, is_weight_file

# one process without a process group is a supported mode of DCP, not a mistake
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


# meta.json entries of a trainer checkpoint that a `dcp:N` copy of it keeps: its retention class,
# and the buffer log version a resume from it takes later replays back to (trainer.checkpoint)
CARRIED = ("kind", "buffer_version")


def checkpoint_meta(step: int | None, world_size: int, policy_version: int | None, kind: str | None = None,
                    extra: dict | None = None) -> dict:
    """The content of meta.json. `kind` ("periodic" | "phase") is the trainer's retention class;
    `extra`: the caller's own entries."""
    meta = {**(extra or {}), "step": step, "world_size": world_size, "policy_version": policy_version, "format": "dcp"}
    if kind is not None:
        meta["kind"] = kind
    return meta


def encode_meta(meta: dict) -> bytes:
    return json.dumps(meta, indent=1, sort_keys=True).encode()


def read_meta(fs, root: str) -> dict | None:
    """The meta.json of the checkpoint folder `root`; None while it is incomplete (no meta.json)."""
    try:
        data = read_bytes(fs, f"{root}/{META}")
    except FileNotFoundError:
        return None
    try:
        return json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ReshardError(f"{root}/{META}: invalid JSON in checkpoint meta.json ({e})") from None


def dcp_module():
    """torch.distributed.checkpoint, imported on first use: it loads torch.distributed.tensor
    (~1 s), which a process that only reads or publishes Hugging Face folders never needs."""
    import torch.distributed.checkpoint as dcp

    return dcp


def dcp_writer(url: str):
    """DCP's storage writer for the `dcp/` folder at `url`, on local disk or any fsspec URL."""
    dcp = dcp_module()
    fs, path = url_to_fs(url)
    if is_local(fs):
        return dcp.FileSystemWriter(path, thread_count=1)
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter  # not exported by the package

    return FsspecWriter(url, thread_count=1)


def dcp_reader(url: str):
    """DCP's storage reader for the `dcp/` folder at `url`, but `.metadata` is read through
    `dcp_io.read_metadata`'s restricted unpickler: DCP's own reader unpickles it with plain
    pickle, so a crafted file in the run directory would run code in the trainer that resumes."""
    dcp = dcp_module()
    fs, path = url_to_fs(url)
    if is_local(fs):
        base, arg = dcp.FileSystemReader, path
    else:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        base, arg = FsspecReader, url
    return _safe(base)(arg, fs=fs, folder=path)


@functools.cache
def _safe(base: type) -> type:
    """`base` (a DCP file reader) with `read_metadata` replaced by the restricted one."""

    class Reader(base):
        def __init__(self, arg, *, fs, folder: str):
            super().__init__(arg)
            self._where = (fs, folder)

        def read_metadata(self, *args, **kwargs):
            from torch.distributed.checkpoint.metadata import StorageMeta

            from .dcp_io import METADATA, read_metadata

            fs, folder = self._where
            md = read_metadata(fs, f"{folder}/{METADATA}")
            if getattr(md, "storage_meta", None) is None:
                md.storage_meta = StorageMeta()
            md.storage_meta.load_id = self.load_id  # as DCP's own read_metadata does
            return md

    Reader.__name__ = Reader.__qualname__ = f"Safe{base.__name__}"
    return Reader


def dcp_load(state: dict, url: str) -> None:
    """`torch.distributed.checkpoint.load` of `state` from the `dcp/` folder at `url`, with no
    plain unpickling: `.metadata` as in `dcp_reader`, and each non-tensor entry (counters, the
    scheduler's state: DCP stores them as `torch.save` bytes and loads them with
    weights_only=False) checked to load with weights_only=True first."""
    dcp = dcp_module()
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    refused: list[str] = []

    class Planner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value):
            try:
                torch.load(io.BytesIO(value.getvalue()), weights_only=True)
            except Exception as e:  # noqa: BLE001 - whatever a crafted entry makes the safe loader raise
                refused.append(f"{url}: entry {read_item.dest_index.fqn!r} holds more than plain values and "
                               f"tensors; refusing to unpickle it ({type(e).__name__})")
                raise ReshardError(refused[-1]) from None
            value.seek(0)
            super().load_bytes(read_item, value)

    try:
        dcp.load(state, storage_reader=dcp_reader(url), planner=Planner())
    except BaseException:  # DCP's CheckpointException, which wraps what a rank raised, is a BaseException
        if refused:
            raise ReshardError(refused[0]) from None
        raise


def _metadata_names(hf_meta_dir: str) -> list[str]:
    fs, root = url_to_fs(hf_meta_dir)
    names = [n for n in list_names(fs, root) if not is_weight_file(n) and fs.isfile(f"{root}/{n}")]
    if "config.json" not in names:
        raise ReshardError(f"save_dcp: hf_meta_dir {hf_meta_dir!r} has no config.json; pass the model's HF folder")
    return names


def save_dcp(state_dict: dict, dst_url: str, hf_meta_dir: str, step: int, world_size: int,
             policy_version: int | None, kind: str | None = None, extra: dict | None = None) -> dict:
    """Save `state_dict` ({"model": {hf name: tensor or DTensor}, other entries as the caller
    likes}) as a complete checkpoint at `dst_url`, with the metadata files of the Hugging Face
    folder `hf_meta_dir` (its weights are not copied). Returns its meta.json.

    Works in one process (plain tensors) and in an initialised process group (FSDP2 DTensors):
    every rank calls it; DCP writes each rank's shards, then rank 0 copies the metadata files and
    commits meta.json. A complete checkpoint at `dst_url` is kept as it is (a step redone after a
    resume saves the same state); a folder without meta.json is the remains of a killed save and
    is replaced."""
    if not isinstance(state_dict.get("model"), dict) or not state_dict["model"]:
        raise ReshardError("save_dcp: state_dict['model'] must be a non-empty {parameter name: tensor} dict")
    distributed = dist.is_available() and dist.is_initialized()
    if distributed and dist.get_world_size() != world_size:
        raise ReshardError(f"save_dcp: world_size={world_size} but the process group has {dist.get_world_size()} ranks")
    main = not distributed or dist.get_rank() == 0
    fs, root = url_to_fs(dst_url)
    src_fs, src_root = url_to_fs(hf_meta_dir)
    names = _metadata_names(hf_meta_dir)
    meta = read_meta(fs, root)
    if meta is None:
        if main and fs.exists(root):
            fs.rm(root, recursive=True)
        if distributed:
            dist.barrier()  # no rank writes before the remains are gone
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process.*")
            dcp_module().save(state_dict, storage_writer=dcp_writer(f"{dst_url.rstrip('/')}/{DCP_DIR}"))
        meta = checkpoint_meta(step, world_size, policy_version, kind, extra)
        if main:
            for name in names:
                put_atomic(fs, f"{root}/{HF_META_DIR}/{name}", src_fs.cat_file(f"{src_root}/{name}"))
            put_atomic(fs, f"{root}/{META}", encode_meta(meta))  # the commit point
    if distributed:
        dist.barrier()  # no rank returns before the checkpoint is complete
    return meta


def load_model_weights(checkpoint_url: str) -> dict[str, torch.Tensor]:
    """The model's full weights {hf name: tensor} from a checkpoint (one process, any saved world size)."""
    dcp_url = f"{checkpoint_url.rstrip('/')}/{DCP_DIR}"
    md = dcp_reader(dcp_url).read_metadata()
    template = {}
    for key, item in md.state_dict_metadata.items():
        if key.startswith(MODEL_PREFIX) and hasattr(item, "size"):
            template[key[len(MODEL_PREFIX):]] = torch.empty(tuple(item.size), dtype=item.properties.dtype)
    if not template:
        raise ReshardError(f"{checkpoint_url}: no '{MODEL_PREFIX}*' entries; not a trainer checkpoint")
    state = {"model": template}
    dcp_load(state, dcp_url)
    return state["model"]
