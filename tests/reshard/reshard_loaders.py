"""Independent ways to load each output layout back into a model: transformers for hf, torch's
own DCP loader for dcp:N, plain safetensors plus the manifest's ranges for tp:N. None of them goes
through the resharder's readers, so a round trip checks the writers against other code."""

import copy
import json
import os

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file


def logits(model, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=g)
    with torch.no_grad():
        return model(input_ids=ids).logits


def load_hf(folder: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=torch.float32).eval()


def state_from_dcp(folder: str, like: dict) -> dict:
    sd = {"model": {k: torch.zeros_like(v) for k, v in like.items()}}
    dcp.load(sd, checkpoint_id=os.path.join(folder, "dcp"))
    return sd["model"]


def state_from_tp(folder: str) -> dict:
    with open(os.path.join(folder, "manifest.json")) as f:
        manifest = json.load(f)
    ranks = [load_file(os.path.join(folder, name)) for name in manifest["rank_files"]]
    out = {}
    for name, t in manifest["tensors"].items():
        if t["dim"] is None:
            out[name] = ranks[0][name]
            continue
        # a rank's slice is one run along `dim` (`ranges`) or, for fused tensors, several (`segments`)
        per_rank = t["segments"] if "segments" in t else [[r] for r in t["ranges"]]
        parts, seen = [], set()
        for r, segments in enumerate(per_rank):
            at = 0
            for start, stop in segments:
                if (start, stop) not in seen:
                    seen.add((start, stop))
                    parts.append((start, ranks[r][name].narrow(t["dim"], at, stop - start)))
                at += stop - start
        out[name] = torch.cat([p for _, p in sorted(parts, key=lambda x: x[0])], dim=t["dim"])
    return out


def model_with(model, state: dict):
    m = copy.deepcopy(model)
    m.load_state_dict(state, strict=True)
    return m.eval()
