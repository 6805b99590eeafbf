"""The persistent sampler: generate groups with the latest policy, score them, commit shards.

It runs until the stop marker appears or the trainer is done. Each iteration:
1. load the newest published policy version in place (no restart), under a lease that keeps
   retention from deleting it meanwhile;
2. wait while it is more than `max_staleness` versions ahead of the trainer (the rate limiter);
3. generate `group_size` completions for each of `prompts_per_batch` prompts, record the
   behaviour log-probs and the policy version, score them with the reward function;
4. hand the shard (whole groups) to the buffer's asynchronous writer.
"""

from __future__ import annotations

import json
import logging
import random
import time
import uuid
import zlib
from datetime import datetime, timezone

from ..buffer import ReplayBuffer
from ..buffer.schema import content_hash, to_table
from ..config import validate_name
from ..data import PromptRow, load_prompts
from ..models import load_tokenizer, render_prompt, set_threads
from ..policy import PolicyStore
from ..rewards import load_reward_fn, score
from ..runs import RunDir
from .backend import GenParams, make_backend

log = logging.getLogger("rlhf.sampler")


def batch_ahead(groups_committed: int, groups_per_step: int, policy_version: int) -> int:
    """How many versions the next batch would be ahead of the policy that generates it.

    The next batch is consumed at trainer step `groups_committed // groups_per_step`; generated
    with `policy_version`, its staleness at consumption is the difference. This is the one place
    the staleness bound is computed for the sampler."""
    return groups_committed // groups_per_step - policy_version


class PromptStream:
    """Deterministic shuffled passes over the prompts, resumable from a position."""

    def __init__(self, prompts: list[PromptRow], seed: int, position: int = 0):
        self.prompts, self.seed, self.position = prompts, seed, position

    def take(self, k: int) -> list[PromptRow]:
        out = []
        n = len(self.prompts)
        while len(out) < k:
            epoch, i = divmod(self.position, n)
            order = list(range(n))
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
            out.append(self.prompts[order[i]])
            self.position += 1
        return out


def run_sampler(run_url: str, sampler_id: str = "sampler-0") -> dict:
    validate_name(sampler_id, "--sampler-id", max_len=64)
    run = RunDir(run_url)
    cfg = run.config()
    sc = cfg.sampler
    set_threads(sc.threads)
    stream_name = sampler_id.lower()
    metrics = run.metrics(stream_name)
    metrics.log({"event": "start", "sampler_id": sampler_id})
    state_key = f"sampler_state_{stream_name}"
    state = run.marker(state_key) or {}

    prompts = load_prompts(run.child_url("data", "train.parquet"))
    reward_fn = load_reward_fn(cfg.reward.fn)
    store = PolicyStore(run)
    if store.latest() is None:
        raise RuntimeError(f"{run.url}: no policy published; run `rlhf prepare` first")
    with store.lease_latest(sampler_id) as lease:  # retention keeps the version until it is loaded
        version = lease.version
        tokenizer = load_tokenizer(lease.path)
        backend = make_backend(sc.backend, lease.path, dtype=cfg.model.dtype, threads=sc.threads,
                               seed=cfg.seed + zlib.crc32(sampler_id.encode()) % 1000, options=sc.vllm,
                               max_batch_tokens=sc.max_batch_tokens)
    buffer = ReplayBuffer(run.buffer_url, cfg.buffer)
    writer = buffer.writer(sampler_id)
    stream = PromptStream(prompts, cfg.seed, int(state.get("prompt_position", 0)))
    params = GenParams(max_new_tokens=sc.max_new_tokens, temperature=sc.temperature, top_p=sc.top_p)
    gps = cfg.trainer.groups_per_step
    batches = int(state.get("batches", 0))
    # Groups produced so far: the buffer's count, or, while our own last shards are still in the
    # asynchronous writer, the count at start plus what we handed over (whichever is larger).
    committed_at_start = buffer.committed_groups()
    handed_over = 0
    limiter = buffer.rate_limiter()
    waited = reload_s = 0.0  # since the last logged batch
    log.info("sampler %s: policy v%d, backend %s, %d prompts", sampler_id, version, sc.backend, len(prompts))

    try:
        while True:
            if run.stop_requested() or run.has_marker("trainer_done"):
                break
            latest = store.latest()
            if latest is not None and latest > version:
                with store.lease_latest(sampler_id) as lease:
                    if lease.version > version:
                        reload_s += backend.load_weights(lease.path)
                        version = lease.version
            produced = max(buffer.committed_groups(), committed_at_start + handed_over)
            if batch_ahead(produced, gps, version) > sc.max_staleness or \
                    limiter.blocked_by(sc.prompts_per_batch) is not None:
                # throttled: wait for a newer policy, or for the trainer to use what is buffered
                time.sleep(sc.poll_s)
                waited += sc.poll_s
                continue

            t0 = time.time()
            batch = stream.take(sc.prompts_per_batch)
            prompt_ids = [tokenizer(render_prompt(tokenizer, p.messages), add_special_tokens=False)["input_ids"]
                          for p in batch]
            groups = backend.generate(prompt_ids, sc.group_size, params)
            gen_s = time.time() - t0
            rows, rewards, tokens = [], [], 0
            now = datetime.now(timezone.utc)
            for p, ids, group in zip(batch, prompt_ids, groups):
                group_id = f"{p.prompt_id}-{uuid.uuid4().hex[:12]}"
                for c in group:
                    s = score(reward_fn, p.data_source, c.text, p.ground_truth, p.extra_info)
                    rewards.append(s.reward)
                    tokens += len(c.token_ids)
                    rows.append({
                        "sample_id": uuid.uuid4().hex, "prompt_id": p.prompt_id, "group_id": group_id,
                        "data_source": p.data_source, "prompt_token_ids": ids,
                        "response_token_ids": c.token_ids, "response_text": c.text,
                        "behavior_logprobs": c.logprobs, "reward": s.reward, "token_rewards": None,
                        "reward_extra": json.dumps(s.extra) if s.extra else None,
                        "finish_reason": c.finish_reason, "policy_version": version,
                        "sampler_id": sampler_id, "created_at": now,
                        "content_hash": content_hash(ids, c.token_ids),
                        "tier": "l1", "replay_count": 0, "priority": 1.0,
                    })
            writer.write(to_table(rows))
            handed_over += len(batch)
            t1 = time.time()
            batches += 1
            run.set_marker(state_key, {"prompt_position": stream.position, "batches": batches})
            record = {
                "sampler/batch": batches, "sampler/policy_version": version, "sampler/samples": len(rows),
                "sampler/gen_tokens": tokens, "reward/mean": sum(rewards) / len(rewards),
                "timing_s/generate": gen_s, "timing_s/batch": t1 - t0,
                "perf/gen_tokens_per_s": tokens / max(gen_s, 1e-9), "timing/start": t0, "timing/end": t1,
            }
            if reload_s:
                record["sampler/reload_s"] = reload_s
            record["sampler/throttle_s"] = waited
            waited = reload_s = 0.0
            if hasattr(backend, "stats"):
                record.update(backend.stats())
            metrics.log(record)
    finally:
        writer.close()
        metrics.flush()
        backend.close()
    return {"batches": batches, "policy_version": version}
