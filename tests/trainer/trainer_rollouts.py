"""Rollout tables and pre-written buffers for trainer tests (deterministic, no sampler)."""

from __future__ import annotations

import datetime as dt
import random

from pipeline.buffer.schema import content_hash, to_table


def rollout_table(tok, rewards, versions=None, group_size: int = 4):
    """One row per reward; groups of `group_size`; short answers of repeated 7s."""
    rows = []
    prompt = tok("say 7: ", add_special_tokens=False)["input_ids"]
    for i, r in enumerate(rewards):
        resp = tok("7" * (i % 3 + 1), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        rows.append({
            "sample_id": f"s{i}", "prompt_id": "p0", "group_id": f"g{i // group_size}", "data_source": "builtin/digit",
            "prompt_token_ids": prompt, "response_token_ids": resp, "response_text": "7",
            "behavior_logprobs": [-1.0] * len(resp), "reward": r, "token_rewards": None, "reward_extra": None,
            "finish_reason": "stop", "policy_version": (versions or [0] * len(rewards))[i], "sampler_id": "s",
            "created_at": dt.datetime.now(dt.timezone.utc), "content_hash": content_hash(prompt, resp),
            "tier": "l1", "replay_count": 0, "priority": 1.0,
        })
    return to_table(rows)


def synthetic_shard(tok, prompts: list[list[int]], shard: int, groups: int, group_size: int, seed: int,
                    max_len: int = 8, constant_reward: float | None = None):
    """`groups` groups of random answers over the digit tokens, with rewards that favour answers
    rich in the digit 7 (so training on them has a direction), behaviour log-probs of a uniform
    sampler over 10 digits, policy version 0. `constant_reward`: every row earns it (no variance)."""
    rng = random.Random(seed * 1000 + shard)
    digits = [tok(str(d), add_special_tokens=False)["input_ids"][0] for d in range(10)]
    rows = []
    now = dt.datetime.now(dt.timezone.utc)
    for g in range(groups):
        prompt = prompts[(shard * groups + g) % len(prompts)]
        gid = f"sh{shard}-g{g}"
        for j in range(group_size):
            n = rng.randint(1, max_len)
            resp = [rng.choice(digits) for _ in range(n)]
            reward = sum(t == digits[7] for t in resp) / n if constant_reward is None else constant_reward
            rows.append({
                "sample_id": f"{gid}-{j}", "prompt_id": f"p{g}", "group_id": gid, "data_source": "builtin/digit",
                "prompt_token_ids": prompt, "response_token_ids": resp, "response_text": "",
                "behavior_logprobs": [-2.302585] * n, "reward": reward, "token_rewards": None, "reward_extra": None,
                "finish_reason": "stop", "policy_version": 0, "sampler_id": "test", "created_at": now,
                "content_hash": content_hash(prompt, resp), "tier": "l1", "replay_count": 0, "priority": 1.0,
            })
    return to_table(rows)
