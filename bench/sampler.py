"""Sampler benchmark, hf vs vllm: prints ONE JSON line.

Measured side by side in the same process, on the built-in sort models `tiny` (~0.5 M parameters)
and `small` (~3.3 M), alternating the two backends call by call so that load from other processes
hits both alike. Each engine call generates `group` completions for batch/group prompts (a GRPO
batch), with one warm-up call per backend and batch size; a call is never split (the token budget
is set above the largest call).

- hf_tok_s / vllm_tok_s: generated tokens per second, keyed "<model>/b<sequences per call>",
  median over --reps calls; vllm_over_hf: their ratio.
- vllm_start_s: seconds to construct the engine (LLM load, KV cache allocation, warm-up).
- vllm_reload_ms / hf_reload_ms: in-place reload of a new policy version (median of 3).
- max_logprob_gap: after each reload, the mean absolute gap between vLLM's behaviour log-probs
  and log_softmax(logits / T) recomputed by the HF model holding the same weights; the largest
  over models. max_token_logprob_gap: the largest single-token gap seen.

Run it in the vLLM environment (`make test-vllm` creates it):

    .venv-vllm/bin/python bench/sampler.py [--models tiny,small] [--batches 16,64,256] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from pipeline.data import load_prompts  # noqa: E402
from pipeline.example import ensure_example  # noqa: E402
from pipeline.models import load_model, load_tokenizer, prompt_token_ids  # noqa: E402
from pipeline.sampler.backend import GenParams  # noqa: E402
from pipeline.sampler.hf import HFBackend  # noqa: E402
from pipeline.sampler.parity import measure_gap  # noqa: E402

UNSPLIT = 1 << 40


def new_version(src: str, dst: str, seed: int) -> str:
    """A policy version that differs from `src` like a few optimizer steps would."""
    model = load_model(src)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.01)
    model.save_pretrained(dst)
    load_tokenizer(src).save_pretrained(dst)
    return dst


def timed_tokens_per_s(backend, prompts, group, params) -> float:
    t0 = time.perf_counter()
    groups = backend.generate(prompts, group, params)
    elapsed = time.perf_counter() - t0
    return sum(len(c.token_ids) for g in groups for c in g) / elapsed


def bench_model(size: str, batches: list[int], group: int, params: GenParams, reps: int, threads: int,
                tmp: str, out: dict) -> None:
    from pipeline.sampler.vllm import VLLMBackend

    model_dir = os.path.join(ensure_example("sort", 0, size), "model")
    tok = load_tokenizer(model_dir)
    rows = load_prompts(os.path.join(os.path.dirname(model_dir), "data", "test.parquet"), "bench")
    ids = prompt_token_ids(tok, [r.messages for r in rows])
    hf = HFBackend(model_dir, threads=threads, seed=0, max_batch_tokens=UNSPLIT)
    t0 = time.perf_counter()
    vl = VLLMBackend(model_dir, threads=threads, seed=0, options={"max_model_len": 256}, max_batch_tokens=UNSPLIT)
    out["vllm_start_s"][size] = round(time.perf_counter() - t0, 3)
    out["parameters"][size] = sum(p.numel() for p in hf.model.parameters())
    try:
        for b in batches:
            prompts = (ids * (b // len(ids) + 1))[: max(1, b // group)]
            key = f"{size}/b{len(prompts) * group}"
            for be in (hf, vl):  # warm-up: first-call allocations are not throughput
                be.generate(prompts, group, params)
            hf_runs, vl_runs = [], []
            for _ in range(reps):
                hf_runs.append(timed_tokens_per_s(hf, prompts, group, params))
                vl_runs.append(timed_tokens_per_s(vl, prompts, group, params))
            out["hf_tok_s"][key] = round(statistics.median(hf_runs), 1)
            out["vllm_tok_s"][key] = round(statistics.median(vl_runs), 1)
            out["vllm_over_hf"][key] = round(out["vllm_tok_s"][key] / out["hf_tok_s"][key], 3)
            print(f"{key}: hf {out['hf_tok_s'][key]} tok/s, vllm {out['vllm_tok_s'][key]} tok/s", file=sys.stderr)
        vl_ms, hf_ms, gaps = [], [], []
        for k in range(1, 4):
            path = new_version(model_dir if k == 1 else path, os.path.join(tmp, f"{size}-v{k}"), seed=k)
            vl_ms.append(vl.load_weights(path) * 1000)
            hf_ms.append(hf.load_weights(path) * 1000)
            gaps.append(measure_gap(vl, hf.model, tok.pad_token_id, ids[:32], 4,
                                    GenParams(max_new_tokens=params.max_new_tokens, temperature=params.temperature)))
        out["vllm_reload_ms"][size] = round(statistics.median(vl_ms), 2)
        out["hf_reload_ms"][size] = round(statistics.median(hf_ms), 2)
        out["logprob_gap"][size] = max(g["mean_abs_gap"] for g in gaps)
        out["max_token_logprob_gap"] = max(out["max_token_logprob_gap"], *(g["max_abs_gap"] for g in gaps))
    finally:
        vl.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="tiny,small")
    ap.add_argument("--batches", default="16,64,256", help="sequences per engine call")
    ap.add_argument("--group", type=int, default=8, help="completions per prompt")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    params = GenParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature)
    out: dict = {"bench": "sampler", "device": "cpu", "threads": args.threads, "group": args.group,
                 "max_new_tokens": args.max_new_tokens, "parameters": {}, "hf_tok_s": {}, "vllm_tok_s": {},
                 "vllm_over_hf": {}, "vllm_start_s": {}, "vllm_reload_ms": {}, "hf_reload_ms": {},
                 "logprob_gap": {}, "max_token_logprob_gap": 0.0}
    batches = [int(b) for b in args.batches.split(",")]
    with tempfile.TemporaryDirectory(prefix="bench-sampler-") as tmp:
        for size in args.models.split(","):
            bench_model(size, batches, args.group, params, args.reps, args.threads, tmp, out)
    out["max_logprob_gap"] = max(out["logprob_gap"].values())
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
