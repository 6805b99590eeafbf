"""Reading and writing Hugging Face safetensors weights (single file or sharded with an index)."""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file


def safetensors_files(folder: str) -> list[str]:
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(folder, x) for x in files]
    single = os.path.join(folder, "model.safetensors")
    if os.path.exists(single):
        return [single]
    raise FileNotFoundError(f"{folder}: no model.safetensors or model.safetensors.index.json")


def load_state_dict(folder: str) -> dict[str, torch.Tensor]:
    """All tensors of a local HF folder (safetensors only: no pickle)."""
    sd: dict[str, torch.Tensor] = {}
    for path in safetensors_files(folder):
        sd.update(load_file(path))
    return sd
