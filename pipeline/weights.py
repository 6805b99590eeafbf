"""Hugging Face model folders from in-memory models: the one writer (`write_hf_folder`) and reader
(`load_state_dict`) of config.json, generation_config.json, tokenizer files and safetensors weights.

Everything that turns a model, its config or its tokenizer into files goes through
`write_hf_folder`: the trainer's in-phase policy publications (their weights, beside policy v0's
other files; rendered metadata only where no v0 is published) and `PolicyStore.publish_model`.
Trained versions and checkpoints copy v0's config and tokenizer files rather than render them:
saving them again would rewrite them (other keys, dropped files). Published policy versions
are Hugging Face folders too; `pipeline.reshard` writes those from a folder written here or from a
checkpoint (page-aligned safetensors, checksummed, committed by a manifest) and reads folders back
tensor by tensor without this module.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid

import torch
from safetensors.torch import load_file, save_file

HF_SINGLE = "model.safetensors"
HF_INDEX = "model.safetensors.index.json"


def safetensors_files(folder: str) -> list[str]:
    index = os.path.join(folder, HF_INDEX)
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(folder, x) for x in files]
    single = os.path.join(folder, HF_SINGLE)
    if os.path.exists(single):
        return [single]
    raise FileNotFoundError(f"{folder}: no {HF_SINGLE} or {HF_INDEX}")


def load_state_dict(folder: str) -> dict[str, torch.Tensor]:
    """All tensors of a local HF folder (safetensors only: no pickle)."""
    sd: dict[str, torch.Tensor] = {}
    for path in safetensors_files(folder):
        sd.update(load_file(path))
    return sd


def write_hf_folder(folder: str, *, config=None, tokenizer=None, generation_config=None,
                    weights: dict[str, torch.Tensor] | None = None, meta_from: str | None = None) -> list[str]:
    """Write a Hugging Face model folder on local disk: `config` (a transformers config), the
    generation config and the tokenizer when given, and with `weights` ({name: tensor}) one
    `model.safetensors`; a model defined by code in its folder gets that code too. With
    `meta_from`, a folder this function wrote without weights, its files stand for config,
    generation config and tokenizer (copied, not rendered again). Returns the names of the files
    written.

    The folder appears whole or not at all: it is written beside `folder` and renamed into place,
    so `folder` must not exist or be empty. Tensors that share memory (tied embeddings) are each
    written under their own name, as a trainer checkpoint holds them."""
    if config is None and meta_from is None:
        raise ValueError("write_hf_folder needs a config, or meta_from: a folder holding one")
    parent = os.path.dirname(os.path.abspath(folder))
    os.makedirs(parent, exist_ok=True)
    # a name `storage.is_temporary` knows (what a killed writer leaves is no one's data), made with
    # the permissions of the umask: the folder keeps them when it is renamed
    tmp = os.path.join(parent, f".{os.path.basename(folder)}.tmp-{uuid.uuid4().hex}")
    os.mkdir(tmp)
    try:
        if meta_from is not None:
            shutil.copytree(meta_from, tmp, dirs_exist_ok=True)
        else:
            config.save_pretrained(tmp)
            _copy_shipped_code(config, tmp)
            if generation_config is not None:
                generation_config.save_pretrained(tmp)
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
        if weights is not None:
            save_file(_own_memory(weights), os.path.join(tmp, HF_SINGLE), metadata={"format": "pt"})
        names = sorted(os.listdir(tmp))
        os.rename(tmp, folder)  # replaces an empty folder; refuses a non-empty one
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return names


def _copy_shipped_code(config, folder: str) -> None:
    """A model defined by code in its folder (`auto_map`, loaded with trust_remote_code) loads only
    beside that code: copy the folder's Python files from where the config was loaded. (transformers
    copies the configuration's own file, not the modelling one.)"""
    src = getattr(config, "_name_or_path", "") or ""
    if not getattr(config, "auto_map", None) or not os.path.isdir(src):
        return
    for name in sorted(os.listdir(src)):
        if name.endswith(".py") and not os.path.exists(os.path.join(folder, name)):
            shutil.copyfile(os.path.join(src, name), os.path.join(folder, name))


def _own_memory(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous CPU tensors, none sharing memory with another (safetensors refuses aliases)."""
    out, seen = {}, set()
    for name, t in weights.items():
        t = t.detach().contiguous().cpu()
        storage = t.untyped_storage().data_ptr() if t.numel() else None
        if storage in seen:
            t = t.clone()
        elif storage is not None:
            seen.add(storage)
        out[name] = t
    return out
