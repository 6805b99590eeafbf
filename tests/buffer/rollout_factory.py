"""Synthetic rollout shards for buffer tests and the buffer benchmark."""

from __future__ import annotations

from datetime import datetime, timezone

import numpy as np
import pyarrow as pa

from pipeline.buffer.schema import ROLLOUT_SCHEMA, content_hash


def make_groups(prefix: str, n_groups: int, group_size: int = 4, policy_version: int = 0,
                rewards: list[list[float]] | None = None, seed: int = 0, response_len: int = 8) -> pa.Table:
    """`n_groups` whole groups with ids `<prefix>-g<i>` and sample ids `<prefix>-g<i>-<j>`."""
    rng = np.random.default_rng(seed)
    now = datetime.now(timezone.utc)
    cols: dict[str, list] = {f.name: [] for f in ROLLOUT_SCHEMA}
    for i in range(n_groups):
        gid = f"{prefix}-g{i}"
        prompt = [int(x) for x in rng.integers(0, 100, 6)]
        for j in range(group_size):
            resp = [int(x) for x in rng.integers(0, 100, response_len)]
            r = rewards[i][j] if rewards is not None else float(rng.random())
            cols["sample_id"].append(f"{gid}-{j}")
            cols["prompt_id"].append(f"{prefix}-p{i}")
            cols["group_id"].append(gid)
            cols["data_source"].append("test")
            cols["prompt_token_ids"].append(prompt)
            cols["response_token_ids"].append(resp)
            cols["response_text"].append(" ".join(map(str, resp)))
            cols["behavior_logprobs"].append([-1.0] * response_len)
            cols["reward"].append(r)
            cols["token_rewards"].append(None)
            cols["reward_extra"].append(None)
            cols["finish_reason"].append("length")
            cols["policy_version"].append(policy_version)
            cols["sampler_id"].append(prefix)
            cols["created_at"].append(now)
            cols["content_hash"].append(content_hash(prompt, resp))
            cols["tier"].append("l1")
            cols["replay_count"].append(0)
            cols["priority"].append(1.0)
    return pa.table(cols, schema=ROLLOUT_SCHEMA)
