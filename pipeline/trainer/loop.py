"""The persistent trainer: consume fresh groups from L1, take GRPO steps, publish policy versions.

Policy version k = the weights after k optimizer steps (v0 = the initial model). Every rollout
carries the version that generated it; staleness = trainer version - rollout version.
"""

from __future__ import annotations

import logging
import time

import pyarrow as pa
import torch

from ..buffer import ReplayBuffer
from ..models import load_model, load_tokenizer, set_threads
from ..policy import PolicyStore
from ..runs import RunDir
from .advantages import ADVANTAGES
from ..config import TrainerConfig
from .batch import TrainBatch, collate, token_logprobs
from .losses import LOSSES, aggregate, kl_k3

log = logging.getLogger("rlhf.trainer")


class TrainerStopped(Exception):
    """The stop marker appeared while waiting for data."""


def wait_for_groups(buffer: ReplayBuffer, run: RunDir, cursor: dict | None, groups: int,
                    poll_s: float, timeout_s: float) -> tuple[pa.Table, dict | None, float]:
    """Read exactly `groups` fresh groups (blocking). Returns (table, new cursor, seconds waited)."""
    parts: list[pa.Table] = []
    have = 0
    t0 = time.time()
    while have < groups:
        table, cursor = buffer.read_fresh(cursor, groups - have)
        if table.num_rows:
            parts.append(table)
            have += len(set(table.column("group_id").to_pylist()))
            continue
        if run.stop_requested():
            raise TrainerStopped()
        if time.time() - t0 > timeout_s:
            raise TimeoutError(
                f"no fresh rollouts for {timeout_s:.0f}s (have {have}/{groups} groups); is the sampler running? "
                "raise trainer.wait_timeout_s for slow samplers"
            )
        time.sleep(poll_s)
    return pa.concat_tables(parts), cursor, time.time() - t0


def train_step(model, ref, opt, batch: TrainBatch, tc: TrainerConfig, temperature: float):
    """One optimizer step on one batch of whole groups. Returns (token log-probs before the
    update [B, T], loss, stats)."""
    adv = ADVANTAGES[tc.algorithm](batch.rewards, batch.group_index, std_normalize=tc.std_normalize)
    logprobs = token_logprobs(model, batch, temperature)
    loss, stats = LOSSES[tc.algorithm](logprobs, batch.behavior_logprobs, adv, batch.mask,
                                       clip_eps=tc.clip_eps, agg=tc.loss_agg)
    if ref is not None:
        with torch.no_grad():
            ref_lp = token_logprobs(ref, batch, temperature)
        kl = aggregate(kl_k3(logprobs, ref_lp), batch.mask, tc.loss_agg)
        loss = loss + tc.kl_coef * kl
        stats["actor/kl"] = kl.item()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    stats["actor/grad_norm"] = float(torch.nn.utils.clip_grad_norm_(model.parameters(), tc.max_grad_norm))
    opt.step()
    return logprobs.detach(), loss.detach(), stats


def run_trainer(run_url: str) -> dict:
    run = RunDir(run_url)
    cfg = run.config()
    tc = cfg.trainer
    metrics = run.metrics("trainer")
    metrics.log({"event": "start"})
    set_threads(tc.threads)
    torch.manual_seed(cfg.seed)
    store = PolicyStore(run)
    base_dir = store.local_dir(0)
    tokenizer = load_tokenizer(base_dir)
    model = load_model(base_dir, cfg.model.dtype).train()
    ref = load_model(base_dir, cfg.model.dtype).eval().requires_grad_(False) if tc.kl_coef > 0 else None
    opt = torch.optim.AdamW(model.parameters(), lr=tc.lr, weight_decay=tc.weight_decay)
    buffer = ReplayBuffer(run.buffer_url, cfg.buffer)
    temperature = cfg.sampler.temperature
    cursor = None
    step = 0
    log.info("trainer: %d steps of %d groups, algorithm %s", tc.steps, tc.groups_per_step, tc.algorithm)
    try:
        while step < tc.steps:
            table, cursor, waited = wait_for_groups(buffer, run, cursor, tc.groups_per_step,
                                                    cfg.sampler.poll_s, tc.wait_timeout_s)
            t0 = time.time()
            batch = collate(table, tokenizer.pad_token_id)
            logprobs, loss, stats = train_step(model, ref, opt, batch, tc, temperature)
            step += 1

            with torch.no_grad():
                m = batch.mask.bool()
                same = (batch.policy_version == step - 1).unsqueeze(-1).expand_as(m) & m
                gap = (logprobs - batch.behavior_logprobs).abs()[same].mean().item() if same.any() else None
                staleness = (step - 1) - batch.policy_version
            published = False
            if step % tc.sync_every == 0 or step == tc.steps:
                published = store.publish_model(step, model, tokenizer, {"step": step})
            t1 = time.time()
            record = {
                "step": step, "reward/mean": batch.rewards.mean().item(),
                "reward/std": batch.rewards.std().item(), "actor/loss": loss.item(),
                "actor/entropy_proxy": -logprobs[m].mean().item(),
                "staleness/mean": staleness.float().mean().item(), "staleness/max": int(staleness.max()),
                "trainer/samples": table.num_rows, "trainer/tokens": batch.num_tokens,
                "trainer/response_tokens": batch.response_tokens, "perf/tokens_per_s": batch.num_tokens / (t1 - t0),
                "timing_s/step": t1 - t0, "timing_s/wait": waited, "timing/start": t0, "timing/end": t1,
                "trainer/policy_version": step if published else None, **stats,
            }
            if gap is not None:
                record["actor/logprob_gap"] = gap
            metrics.log(record)
            if step % tc.log_every == 0 or step == tc.steps:
                log.info("step %d/%d reward %.3f loss %.4f staleness %.2f tok/s %.0f", step, tc.steps,
                         record["reward/mean"], record["actor/loss"], record["staleness/mean"],
                         record["perf/tokens_per_s"])
    except TrainerStopped:
        log.info("trainer: stop requested at step %d", step)
    finally:
        metrics.flush()
    if step >= tc.steps:
        run.set_marker("trainer_done", {"step": step})
    return {"step": step}
