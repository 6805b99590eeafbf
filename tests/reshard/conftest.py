"""A tiny Qwen2 model (fp32) and its trainer checkpoint, built once per test run."""

import os
import shutil

import pytest
import torch

from pipeline.devices import set_threads

from pipeline.tiny_model import build_tiny_model, build_tokenizer

TEXTS = [f"sort {i} {i * 7 % 10} {i * 3 % 10} -> digits" for i in range(200)]


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """(model, folder with config/tokenizer only, full HF folder)."""
    set_threads(1)
    root = tmp_path_factory.mktemp("tiny")
    tok = build_tokenizer(TEXTS, vocab_size=300)
    model = build_tiny_model(len(tok), tok.eos_token_id, tok.pad_token_id, seed=0).eval()
    full = root / "hf_full"
    model.save_pretrained(full)
    tok.save_pretrained(full)
    meta = root / "hf_meta"
    meta.mkdir()
    for name in os.listdir(full):
        if not name.endswith(".safetensors"):
            shutil.copy(full / name, meta / name)
    return model, str(meta), str(full)


@pytest.fixture(scope="session")
def trainer_ckpt(tiny, tmp_path_factory):
    """A trainer checkpoint written by the trainer's own writer (single process)."""
    from pipeline.reshard import save_dcp

    model, meta, _ = tiny
    dst = tmp_path_factory.mktemp("run") / "checkpoints" / "step_4"
    state = {"model": model.state_dict(), "optim": {"step": torch.tensor(4.0)}, "cursor": 17}
    save_dcp(state, str(dst), meta, step=4, world_size=1, policy_version=4)
    return str(dst)

