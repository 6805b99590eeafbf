"""Held-out evaluation: mean correctness reward of greedy completions."""

from __future__ import annotations

from .data import PromptRow
from .models import prompt_token_ids
from .sampler.backend import GenParams, SamplerBackend
from .scoring import RewardSample, RewardScorer


def evaluate(backend: SamplerBackend, tokenizer, prompts: list[PromptRow], scorer: RewardScorer,
             max_new_tokens: int, batch_size: int = 64) -> dict:
    """Greedy-decode every held-out prompt and average the reward (and its extra entries). The
    scorer applies the run's reward timeouts and error policy, as in training."""
    totals: dict[str, float] = {}
    n = 0
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start:start + batch_size]
        ids = prompt_token_ids(tokenizer, [p.messages for p in chunk])
        outs = backend.generate(ids, 1, GenParams(max_new_tokens=max_new_tokens, greedy=True))
        scored = scorer.score_batch([RewardSample(p.prompt_id, p.data_source, p.messages, group[0].text,
                                                  p.ground_truth, p.extra_info) for p, group in zip(chunk, outs)])
        for s in scored.scores:
            totals["score"] = totals.get("score", 0.0) + s.reward
            for k, v in s.extra.items():
                totals[k] = totals.get(k, 0.0) + v
            n += 1
        if scored.errors or scored.timeouts:
            totals["reward_errors"] = totals.get("reward_errors", 0.0) + scored.errors + scored.timeouts
    out = {k: v / max(n, 1) for k, v in totals.items() if k != "reward_errors"} | {"n": n}
    if "reward_errors" in totals:
        out["reward_errors"] = int(totals["reward_errors"])
    return out
