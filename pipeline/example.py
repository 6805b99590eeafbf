"""The embedded default: a tiny tokenizer, model and prompt datasets, built offline from a seed.

`build_example(dir, task, seed)` writes

    DIR/model/                 Qwen2 causal LM in HF format (safetensors, untied embeddings),
                               briefly warm-started with supervised steps so RL has signal
    DIR/data/train.parquet     verl columns: data_source, prompt, ability, reward_model, extra_info
    DIR/data/test.parquet      held-out split

The build is deterministic for a given (task, seed, size) and cached under RLHF_CACHE.

`build_tiny_arch(dir, family)` (cached: `ensure_tiny_arch`) writes a random-init model of another
architecture family (`ARCH_FAMILIES`: Qwen2 tied and untied, Qwen3, Llama 3, Mistral, Gemma 2/3,
Phi-3) with the same tokenizer, for tests and for trying a family end to end.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
import uuid

from .model_cache import cache_dir
from .builtin_tasks import TASKS, corpus, make_rows, prompts_of

# torch, transformers and the tokenizer builder load inside the builders: a run whose example is
# already cached (`ensure_example`) starts without them.

EXAMPLE_VERSION = 2  # 2: the test split holds no train prompt and none twice
# Supervised warm-start steps per task: enough that sampled answers earn partial credit,
# far from enough to solve the task (RL does the rest).
# `repeat` answers are 40-64 tokens long: more steps before sampled answers earn partial credit (~0.25).
WARM_STEPS = {"sort": 25, "digit": 0, "repeat": 200}
SPLITS = {"train": 4000, "test": 256}


def split_rows(task: str, seed: int) -> dict[str, list[dict]]:
    """The example's prompts: the held-out split has none of the train split's, and none twice."""
    train = make_rows(task, SPLITS["train"], seed, "train")
    return {"train": train, "test": make_rows(task, SPLITS["test"], seed, "test", exclude=prompts_of(train))}


def example_dir(task: str, seed: int = 0, size: str = "tiny") -> str:
    return str(cache_dir() / "examples" / f"{task}-{size}-seed{seed}-v{EXAMPLE_VERSION}")


def warm_start(model, tokenizer, rows: list[dict], steps: int, seed: int, batch: int = 64, lr: float = 3e-3) -> list[float]:
    """Supervised steps on (prompt, answer<eos>) pairs; loss on answer tokens only."""
    if steps <= 0:
        return []
    import torch

    from .models import render_prompt

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
    if os.path.lexists(out_dir) and not (os.path.isdir(out_dir) and (
            not os.listdir(out_dir) or os.path.isfile(os.path.join(out_dir, "example.json")))):
        from .config_yaml import ConfigError

        # it replaces the folder: only an empty one or an example it built before
        raise ConfigError(f"{out_dir} exists and is not an example folder (no example.json); choose a new or "
                          "empty folder")
    from .data import write_rows
    from .devices import set_threads
    from .tiny_model import build_tiny_model, build_tokenizer

    set_threads(threads)
    t0 = time.time()
    tmp = f"{out_dir.rstrip('/')}.tmp-{uuid.uuid4().hex[:8]}"
    os.makedirs(os.path.join(tmp, "data"), exist_ok=True)
    rows = split_rows(task, seed)
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


def build_tiny_reward_model(out_dir: str, tokenizer_dir: str, target: str = "7", seed: int = 0) -> str:
    """A one-layer Qwen2 sequence classifier (one label) whose score grows with the share of the
    `target` token in the text, built by hand, offline: attention is uniform (zero queries and
    keys, identity values), so the last position holds the mean of the normalised token
    embeddings, and the score head points at the target's embedding (about 0 for text without
    it, near 1 for text made of it). Writes model and tokenizer to `out_dir`."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForSequenceClassification

    tok = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    ids = tok(target, add_special_tokens=False)["input_ids"]
    if len(ids) != 1:
        raise ValueError(f"target {target!r} is {len(ids)} tokens for this tokenizer; choose a single token")
    hidden = 64
    cfg = Qwen2Config(
        vocab_size=len(tok), hidden_size=hidden, intermediate_size=hidden, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256, num_labels=1,
        pad_token_id=tok.pad_token_id, bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id,
        tie_word_embeddings=False, use_sliding_window=False,
    )
    torch.manual_seed(seed)
    model = Qwen2ForSequenceClassification(cfg).eval()
    with torch.no_grad():
        attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
        for lin in (attn.q_proj, attn.k_proj):
            lin.weight.zero_()
            lin.bias.zero_()
        attn.v_proj.weight.copy_(torch.eye(hidden))
        attn.v_proj.bias.zero_()
        attn.o_proj.weight.copy_(torch.eye(hidden))
        mlp.down_proj.weight.zero_()
        emb = model.model.embed_tokens.weight
        emb.normal_(std=0.02)  # small next to the normalised mean the attention adds
        direction = emb[ids[0]] / emb[ids[0]].norm()
        model.score.weight.copy_(direction[None] / hidden ** 0.5)  # the final norm gives length sqrt(hidden)
    model.save_pretrained(out_dir, safe_serialization=True)
    tok.save_pretrained(out_dir)
    return out_dir


# Tiny random models of the architectures the pipeline serves and reshards, each in the layout of a
# real checkpoint of its family (tied embeddings where Qwen2.5-0.5B, Llama-3.2-1B and Gemma tie them,
# Gemma's extra norms and soft-capping, Qwen3's q/k norms, Phi-3's fused qkv_proj and gate_up_proj),
# with the built-in task's tokenizer: the built-in tiny model's widths (head_dim 32: vLLM's CPU attention
# has no kernel for head_dim 16), 0.3-0.4 M parameters, built offline in well under a second.
ARCH_FAMILIES = {
    # name: (transformers config class, tied embeddings, config fields of the family)
    "qwen2": ("Qwen2Config", False, {"use_sliding_window": False}),
    "qwen2-tied": ("Qwen2Config", True, {"use_sliding_window": False}),
    "qwen3": ("Qwen3Config", False, {"head_dim": 32, "use_sliding_window": False}),
    "llama3": ("LlamaConfig", True, {"head_dim": 32, "rope_parameters": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 128}}),
    "mistral": ("MistralConfig", False, {"head_dim": 32, "sliding_window": None}),
    "gemma2": ("Gemma2Config", True, {"head_dim": 32, "query_pre_attn_scalar": 32, "sliding_window": 32,
                                      "layer_types": ["sliding_attention", "full_attention"]}),
    "gemma3": ("Gemma3TextConfig", True, {"head_dim": 32, "query_pre_attn_scalar": 32, "sliding_window": 32,
                                          "layer_types": ["sliding_attention", "full_attention"]}),
    "phi3": ("Phi3Config", False, {"original_max_position_embeddings": 256}),
}
LLAMA3_EOT = "<|eot_id|>"


def build_tiny_arch(out_dir: str, family: str, seed: int = 0, task: str = "sort") -> str:
    """Write a random-init causal LM of `family` (see ARCH_FAMILIES) with the built-in `task`'s
    tokenizer to `out_dir`: safetensors weights, config, tokenizer with its chat template and a
    generation_config.json listing every EOS id. The Llama 3 model is built like Meta's: an
    end-of-turn token beside the tokenizer's EOS (both in the generation config) and no pad
    token (the pipeline pads with EOS then). Deterministic for (family, seed, task)."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, GenerationConfig

    from .tiny_model import build_tokenizer

    if family not in ARCH_FAMILIES:
        raise ValueError(f"unknown architecture family {family!r}; choose one of {', '.join(ARCH_FAMILIES)}")
    config_class, tied, fields = ARCH_FAMILIES[family]
    tok = build_tokenizer(corpus(task, seed))
    eos = [tok.eos_token_id]
    pad = tok.pad_token_id
    if family == "llama3":
        tok.add_special_tokens({"additional_special_tokens": [LLAMA3_EOT]})
        eos.append(tok.convert_tokens_to_ids(LLAMA3_EOT))
        tok.pad_token = None
        pad = None
    cfg = getattr(transformers, config_class)(
        vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=tied, bos_token_id=eos[0],
        eos_token_id=eos if len(eos) > 1 else eos[0], pad_token_id=pad, **fields,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    model.generation_config = GenerationConfig(bos_token_id=eos[0], eos_token_id=eos, pad_token_id=pad,
                                               do_sample=True, top_k=0, top_p=1.0, temperature=1.0)
    model.save_pretrained(out_dir, safe_serialization=True)
    tok.save_pretrained(out_dir)
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


def ensure_tiny_arch(family: str, seed: int = 0, task: str = "sort") -> str:
    """The cached tiny model of `family` (see `build_tiny_arch`), built on first use."""
    import transformers

    d = cache_dir() / "archs" / f"{family}-{task}-seed{seed}-tf{transformers.__version__}"
    if not (d / "config.json").exists():
        tmp = f"{d}.tmp-{uuid.uuid4().hex[:8]}"
        build_tiny_arch(tmp, family, seed, task)
        try:
            os.rename(tmp, d)
        except OSError:  # a twin build won the race; keep its folder
            shutil.rmtree(tmp, ignore_errors=True)
            if not (d / "config.json").exists():
                raise
    return str(d)
