"""The embedded default: a tiny tokenizer, model and prompt datasets, built offline from a seed.

`build_example(dir, task, seed)` writes

    DIR/model/                 Qwen2 causal LM in HF format (safetensors, untied embeddings),
                               briefly warm-started with supervised steps so RL has signal
    DIR/data/train.parquet     verl columns: data_source, prompt, ability, reward_model, extra_info
    DIR/data/test.parquet      held-out split

The build is deterministic for a given (task, seed, size) and cached under RLHF_CACHE.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
import uuid

import torch

from .data import write_rows
from .models import build_tiny_model, build_tokenizer, cache_dir, render_prompt, set_threads
from .tasks import TASKS, corpus, make_rows

EXAMPLE_VERSION = 1
# Supervised warm-start steps per task: enough that sampled answers earn partial credit,
# far from enough to solve the task (RL does the rest).
WARM_STEPS = {"sort": 25, "digit": 0}
SPLITS = {"train": 4000, "test": 256}


def example_dir(task: str, seed: int = 0, size: str = "tiny") -> str:
    return str(cache_dir() / "examples" / f"{task}-{size}-seed{seed}-v{EXAMPLE_VERSION}")


def warm_start(model, tokenizer, rows: list[dict], steps: int, seed: int, batch: int = 64, lr: float = 3e-3) -> list[float]:
    """Supervised steps on (prompt, answer<eos>) pairs; loss on answer tokens only."""
    if steps <= 0:
        return []
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    losses = []
    eos = tokenizer.eos_token_id
    for _ in range(steps):
        chunk = rng.sample(rows, batch)
        seqs, labels = [], []
        for r in chunk:
            p = tokenizer(render_prompt(tokenizer, r["prompt"]), add_special_tokens=False)["input_ids"]
            a = tokenizer(r["reward_model"]["ground_truth"], add_special_tokens=False)["input_ids"] + [eos]
            seqs.append(p + a)
            labels.append([-100] * len(p) + a)
        width = max(map(len, seqs))
        ids = torch.full((batch, width), tokenizer.pad_token_id)
        lab = torch.full((batch, width), -100)
        mask = torch.zeros((batch, width), dtype=torch.long)
        for i, (s, l) in enumerate(zip(seqs, labels)):
            ids[i, : len(s)] = torch.tensor(s)
            lab[i, : len(l)] = torch.tensor(l)
            mask[i, : len(s)] = 1
        loss = model(input_ids=ids, attention_mask=mask, labels=lab).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    model.eval()
    return losses


def build_example(out_dir: str, task: str = "sort", seed: int = 0, size: str = "tiny",
                  warm_steps: int | None = None, threads: int = 2) -> str:
    if task not in TASKS:
        raise ValueError(f"unknown built-in task {task!r}; choose one of {', '.join(TASKS)}")
    set_threads(threads)
    t0 = time.time()
    tmp = f"{out_dir.rstrip('/')}.tmp-{uuid.uuid4().hex[:8]}"
    os.makedirs(os.path.join(tmp, "data"), exist_ok=True)
    rows = {split: make_rows(task, n, seed, split) for split, n in SPLITS.items()}
    for split, r in rows.items():
        write_rows(r, os.path.join(tmp, "data", f"{split}.parquet"))
    tok = build_tokenizer(corpus(task, seed))
    model = build_tiny_model(len(tok), tok.eos_token_id, tok.pad_token_id, seed, size)
    steps = WARM_STEPS[task] if warm_steps is None else warm_steps
    losses = warm_start(model, tok, rows["train"], steps, seed)
    model.save_pretrained(os.path.join(tmp, "model"), safe_serialization=True)
    tok.save_pretrained(os.path.join(tmp, "model"))
    info = {"task": task, "seed": seed, "size": size, "warm_steps": steps,
            "warm_loss_last": losses[-1] if losses else None,
            "parameters": sum(p.numel() for p in model.parameters()), "build_s": round(time.time() - t0, 2)}
    with open(os.path.join(tmp, "example.json"), "w") as f:
        json.dump(info, f, indent=1)
    if os.path.exists(out_dir):
        shutil.rmtree(out_dir)
    os.rename(tmp, out_dir)
    return out_dir


def ensure_example(task: str, seed: int = 0, size: str = "tiny") -> str:
    """The cached example folder for (task, seed, size), built on first use."""
    d = example_dir(task, seed, size)
    if not os.path.exists(os.path.join(d, "example.json")):
        try:
            build_example(d, task, seed, size)
        except OSError:
            if not os.path.exists(os.path.join(d, "example.json")):  # lost a race to a twin build
                raise
    return d
