"""Held-out evaluation: mean correctness reward of greedy completions."""

from __future__ import annotations

from .data import PromptRow
from .models import render_prompt
from .rewards import RewardFn, score
from .sampler.backend import GenParams, SamplerBackend


def evaluate(backend: SamplerBackend, tokenizer, prompts: list[PromptRow], reward_fn: RewardFn,
             max_new_tokens: int, batch_size: int = 64) -> dict:
    """Greedy-decode every held-out prompt and average the reward (and its extra entries)."""
    totals: dict[str, float] = {}
    n = 0
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start:start + batch_size]
        ids = [tokenizer(render_prompt(tokenizer, p.messages), add_special_tokens=False)["input_ids"] for p in chunk]
        outs = backend.generate(ids, 1, GenParams(max_new_tokens=max_new_tokens, greedy=True))
        for p, group in zip(chunk, outs):
            s = score(reward_fn, p.data_source, group[0].text, p.ground_truth, p.extra_info)
            totals["score"] = totals.get("score", 0.0) + s.reward
            for k, v in s.extra.items():
                totals[k] = totals.get(k, 0.0) + v
            n += 1
    return {k: v / max(n, 1) for k, v in totals.items()} | {"n": n}
