"""The persistent sampler: generate groups with the latest policy, score them, commit shards.

It runs until the stop marker appears or the trainer is done. Each iteration:
1. load the newest published policy version in place (no restart), under a lease that keeps
   retention from deleting it meanwhile (looked for after each batch and while waiting); with
   `sampler.fixed_lag` (a replica alone), the version the schedule names for the next batch: the first
   published at or after its step minus `max_staleness`, so that timing never changes the data;
2. wait while it is more than `max_staleness` versions ahead of the trainer (the rate limiter);
3. claim the run's next prompt draw (`claims.py`: replicas never draw the same batch twice);
4. generate `group_size` completions for each of `prompts_drawn` prompts (seeded by the draw,
   so a restarted sampler does not repeat its predecessor's sampling noise), record the
   behaviour log-probs and the policy version, score the batch (`pipeline.scoring`: a rule
   reward in a worker process with per-sample time limits, or the reward model);
5. hand the shard (whole groups) to the buffer's asynchronous writer and release the draw. With
   other replicas, the writer commits it only if it still arrives within the staleness bound,
   counting exactly what every replica committed before it (the commit's precondition); if the
   others have pushed it past the bound meanwhile, it is dropped and counted
   (`sampler/dropped_stale`, and an `event: dropped_stale` record naming the draw).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import time
import zlib

from ..buffer import ReplayBuffer, bounds_consumer_progress
from ..locations import validate_name
from ..data import PromptRow, Prompts, every, held_out_within_length, read_prompts, within_length
from ..devices import engine_loaded, set_threads
from ..models import load_tokenizer, prompt_token_ids
from ..policy import PolicyStore
from ..rundir import RunDir
from ..scoring import BatchScores, RewardError, RewardSample, RewardScorer, check_sources
from ..trainer.phases import phase_end_steps
from .backend import GenParams, make_backend
from .claims import DrawClaims
from .groups import most_varied, shard_tables

log = logging.getLogger("rlhf.sampler")
# Fault injection for the replica tests: "sampler-2=1.5,..." makes those replicas that much slower per batch.
DELAY_ENV = "RLHF_SAMPLER_DELAY_S"
RECOUNT_S = 2.0  # a lone replica reads the buffer log at most this often (see Sampler._groups_ahead)
STOP_CHECK_S = 1.0
NAME_WAIT_S = 60.0  # a wait on a bound of the buffer's rate limiter this long is logged with the bound


def injected_delay(sampler_id: str) -> float:
    for item in os.environ.get(DELAY_ENV, "").split(","):
        name, _, seconds = item.partition("=")
        if name.strip() == sampler_id and seconds:
            return float(seconds)
    return 0.0


def batch_ahead(groups_committed: int, groups_per_step: int, policy_version: int, groups: int = 1) -> int:
    """How many versions the next batch, of `groups` groups, would be ahead of the policy that
    generates it.

    Its last group is consumed at trainer step `(groups_committed + groups - 1) // groups_per_step`
    (a batch of several steps' groups is trained over all of them); generated with
    `policy_version`, its staleness there is the difference. This is the one place the staleness
    bound is computed for the sampler."""
    return (groups_committed + max(groups, 1) - 1) // groups_per_step - policy_version


def scheduled_version(cfg, groups_committed: int) -> int:
    """`sampler.fixed_lag`: the version the next batch is generated with, the first the trainer
    publishes (v0, every `sync_every` steps, each phase's end) at or after the oldest the
    staleness bound admits for it."""
    tc = cfg.trainer
    oldest = max(0, batch_ahead(groups_committed, tc.groups_per_step, 0, cfg.sampler.prompts_per_batch)
                 - cfg.sampler.max_staleness)
    return min([-(-oldest // tc.sync_every) * tc.sync_every, *(p for p in phase_end_steps(tc) if p >= oldest)])


class PromptStream:
    """Deterministic shuffled passes over the prompts, readable from any position."""

    def __init__(self, prompts: "Prompts | list[PromptRow]", seed: int, position: int = 0):
        self.prompts, self.seed, self.position = prompts, seed, position
        self._order: tuple[int, list[int]] = (-1, [])  # (pass, its order): shuffled once per pass

    def _pass(self, epoch: int) -> list[int]:
        if self._order[0] != epoch:
            order = list(range(len(self.prompts)))
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
            self._order = (epoch, order)
        return self._order[1]

    def take(self, k: int) -> list[PromptRow]:
        out = []
        n = len(self.prompts)
        while len(out) < k:
            epoch, i = divmod(self.position, n)
            out.append(self.prompts[self._pass(epoch)[i]])
            self.position += 1
        return out


def _within_length(prompts: Prompts, tokenizer, data_cfg, sampler_id: str, metrics, run: RunDir) -> Prompts:
    """The training prompts within data.max_prompt_tokens, the others dropped or refused (data.overlong_prompts;
    `within_length` records it in the run); the held-out prompts are checked now, not at finalize."""
    said = every(15.0, lambda done, n: log.info("sampler %s: %d of %d training prompts checked", sampler_id, done, n))
    kept, overlong = within_length(prompts, tokenizer, data_cfg, run.child_url("data"), said)
    held_out = held_out_within_length(run.child_url("data", "eval.parquet"), tokenizer, data_cfg)[1]
    if overlong or held_out:
        log.warning("sampler %s: prompts over data.max_prompt_tokens=%d left out: %d for training, %d held-out",
                    sampler_id, data_cfg.max_prompt_tokens, overlong, held_out)
    metrics.log({"event": "prompts", "data/prompts": len(kept), "data/filtered_overlong": overlong})
    return kept


def _score(scorer: RewardScorer, batch: list[PromptRow], groups: list, metrics) -> tuple[BatchScores, float]:
    """One reward call for the whole batch (scores in group order) and its duration; a failure
    under reward.on_error=fail goes to the metrics stream before it stops the sampler."""
    t0 = time.time()
    try:
        scored = scorer.score_batch([RewardSample(p.prompt_id, p.data_source, p.messages, c.text, p.ground_truth,
                                                  p.extra_info) for p, group in zip(batch, groups) for c in group])
    except RewardError as e:
        metrics.log({"event": "reward_failed", "error": str(e)})
        raise
    return scored, time.time() - t0


class Sampler:
    """One sampler process's state: engine, policy version, prompt stream, writer, throttle."""

    def __init__(self, run_url: str, sampler_id: str):
        validate_name(sampler_id, "--sampler-id", max_len=64)
        self.run, self.sampler_id = RunDir(run_url), sampler_id
        self.cfg = cfg = self.run.config()
        sc = cfg.sampler
        set_threads(sc.threads)
        stream_name = sampler_id.lower()
        self.metrics = self.run.metrics(stream_name)
        self.metrics.log({"event": "start", "sampler_id": sampler_id})
        prompts = read_prompts(self.run.child_url("data", "train.parquet"))
        check_sources(cfg.reward, prompts.sources())
        self.store = PolicyStore(self.run)
        if self.store.latest() is None:
            raise RuntimeError(f"{self.run.url}: no policy published; run `rlhf prepare` first")
        with self.store.lease_latest(sampler_id) as lease:  # retention keeps the version until it is loaded
            self.version = lease.version
            self.tokenizer = load_tokenizer(lease.path, trust_remote_code=cfg.model.trust_remote_code)
            prompts = _within_length(prompts, self.tokenizer, cfg.data, sampler_id, self.metrics, self.run)
            self.backend = make_backend(sc.backend, lease.path, dtype=cfg.model.dtype, threads=sc.threads,
                                        seed=cfg.seed + zlib.crc32(sampler_id.encode()) % 1000, options=sc.vllm,
                                        max_batch_tokens=sc.max_batch_tokens,
                                        trust_remote_code=cfg.model.trust_remote_code)
        self.buffer = ReplayBuffer(self.run.buffer_url, cfg.buffer)
        self.writer = self.buffer.writer(sampler_id)
        self.stream = PromptStream(prompts, cfg.seed)
        self.claims = DrawClaims(self.run, sampler_id, sc.replicas)
        self.params = GenParams(max_new_tokens=sc.max_new_tokens, temperature=sc.temperature, top_p=sc.top_p)
        self._dropped_logged = 0  # of writer.dropped (the draws refused at commit)
        self.delay_s = injected_delay(sampler_id)
        self.limiter = self.buffer.rate_limiter()
        self.waited = self.reload_s = 0.0  # since the last logged batch
        self._named: str | None = None  # the rate limiter's bound logged as holding the sampler since then
        self._stop_checked = float("-inf")
        self._stale_at: int | None = None  # the policy version at which the staleness bound held it
        self._counted, self._counted_at = 0, -RECOUNT_S  # see _groups_ahead
        log.info("sampler %s: policy v%d, backend %s, %d prompts", sampler_id, self.version, sc.backend, len(prompts))
        if sc.fixed_lag and not self.claims.alone:
            log.warning("sampler %s: sampler.fixed_lag holds for one replica; with %d each loads the newest version",
                        sampler_id, sc.replicas)
        self.scorer = RewardScorer(cfg.reward, dtype=cfg.model.dtype)  # a rule reward's worker loads meanwhile

    @property
    def fixed_lag(self) -> bool:
        """`sampler.fixed_lag`, for a replica alone (the batches of several land in an order timing
        decides: they take the newest version)."""
        return self.cfg.sampler.fixed_lag and self.claims.alone

    def reload_if_newer(self) -> None:
        if self.fixed_lag:
            return  # throttled() loads the version the schedule names, when it is published
        newer = self.store.published_after(self.version)
        if newer is not None:
            with self.store.lease_latest(self.sampler_id, newer) as lease:
                if lease.version > self.version:
                    self.reload_s += self.backend.load_weights(lease.path)
                    self.version = lease.version

    def _position(self, draw: int | None = None) -> int:
        """The groups a batch would come after: every committed group, this replica's own groups
        still in the writer, and the draws other replicas hold below `draw` (the next draw it would
        claim, with `draw` None)."""
        return self._groups_ahead() + self.cfg.sampler.prompts_per_batch * self.claims.held_below(draw)

    def ahead(self, draw: int | None = None) -> int:
        """Versions past the staleness bound's reference that a batch would arrive at."""
        return batch_ahead(self._position(draw), self.cfg.trainer.groups_per_step, self.version,
                           self.cfg.sampler.prompts_per_batch)

    def _on_schedule(self, draw: int | None = None) -> bool:
        """`sampler.fixed_lag`: run the version the schedule names for the batch (loaded here once
        published); False while it is not published yet."""
        want = scheduled_version(self.cfg, self._position(draw))
        if want == self.version:
            return True
        # A phase's version comes from its reshard task, after the trainer has gone on; it is never
        # deleted. The trainer publishes its in-phase versions in order (`committed`).
        if want in phase_end_steps(self.cfg.trainer):
            if not self.store.exists(want):
                return False
        elif not self.store.committed(want):
            return False
        try:
            with self.store.lease_latest(self.sampler_id, want, exact=True) as lease:
                self.reload_s += self.backend.load_weights(lease.path)
        except FileNotFoundError as e:
            raise RuntimeError(f"sampler.fixed_lag: policy v{want}, scheduled for the next batch, is no longer "
                               f"published ({e}); raise trainer.keep_policy_versions") from e
        self.version = want
        return True

    def _admit(self, groups_before: int, shard) -> bool:
        """The writer's check at commit: the shard is within the staleness bound at the place it takes."""
        return batch_ahead(groups_before, self.cfg.trainer.groups_per_step,
                           shard.policy_versions[0], shard.num_groups) <= self.cfg.sampler.max_staleness

    def _log_dropped(self) -> int:
        """Record the draws the writer refused since the last call; returns how many it has recorded
        in all. The writer's commit thread appends to its list meanwhile: what one slice holds is
        what gets counted (a refusal appended after the slice is recorded by the next call)."""
        new = self.writer.dropped[self._dropped_logged:]
        for d in new:
            log.warning("sampler %s: draw %d would have arrived past sampler.max_staleness; dropped",
                        self.sampler_id, d)
            self.metrics.log({"event": "dropped_stale", "sampler/dropped_draw": d})
        self._dropped_logged += len(new)
        return self._dropped_logged

    def _groups_ahead(self) -> int:
        """Groups committed to L1 by every writer, and this replica's still in its writer.

        Alone, the only L1 writer of the run, a replica knows that number without reading the log:
        the count of the last reading plus the groups it has handed to its writer since. It reads
        the log again (on object storage a request per new entry and one more) at most every
        RECOUNT_S, which also keeps the `l1_max_rows` bound's view of the buffer that fresh. The
        bounds on the trainer's progress (`bounds_consumer_progress`) read it each time."""
        written = self.writer.groups_written
        if (self.claims.alone and not bounds_consumer_progress(self.cfg.buffer)
                and time.monotonic() - self._counted_at < RECOUNT_S):
            return self._counted + written
        while True:
            pending = self.writer.pending_groups()  # read first: a commit meanwhile is counted twice, not missed
            position = pending + self.buffer.committed_groups()
            if self.writer.pending_groups() == pending:
                break
            # A commit came in between (only commits change it while this thread reads: it alone
            # hands groups over). Counted twice, the position would be a batch ahead of the truth,
            # and alone a sampler past the bound waits for a newer version; on a fixed lag that
            # version is the one it already runs, and the run would stall.
        self._counted, self._counted_at = position - written, time.monotonic()
        return position

    def throttled(self, draw: int | None = None) -> bool:
        """Too far ahead of the trainer (staleness bound) or of the buffer's rate limiter, for the
        draw it holds or else the next one it would claim."""
        sc = self.cfg.sampler
        if self.fixed_lag and not self._on_schedule(draw):
            return True
        if self._stale_at == self.version and self.claims.alone:
            # Past the staleness bound at this version, alone: the groups ahead of its next batch only
            # grow, so only a newer policy lets it go on (no need to read the log until then).
            return True
        if self.ahead(draw) > sc.max_staleness:
            self._stale_at = self.version
            return True
        self._stale_at = None
        # ahead() has read the log (or, alone with no bound on the trainer's progress, did so lately)
        reason = self.limiter.blocked_by(sc.prompts_per_batch, refresh=False)
        if reason is not None and self.waited >= NAME_WAIT_S and self._named != reason.split(":")[0]:
            log.info("sampler %s: waiting %.0f s so far on the buffer's %s", self.sampler_id, self.waited, reason)
            self._named = reason.split(":")[0]
        return reason is not None

    def wait(self) -> None:
        """Wait for a newer policy, or for the trainer to use what is buffered."""
        time.sleep(self.cfg.sampler.poll_s)
        self.waited += self.cfg.sampler.poll_s
        self.reload_if_newer()

    def stopping(self) -> bool:
        """The stop or trainer-done marker is there: looked for at most every STOP_CHECK_S (two
        requests each time on object storage, and the loop asks between every two polls). A sampler
        that goes on a little after the trainer's end only makes a batch nobody trains on."""
        now = time.monotonic()
        if now - self._stop_checked < STOP_CHECK_S:
            return False
        self._stop_checked = now
        return self.run.stop_requested() or self.run.has_marker(RunDir.TRAINER_DONE_MARKER)

    def one_batch(self) -> dict | None:
        """Claim a draw, generate, score and hand over its whole groups; returns the batch's metrics
        record (None when the run stops while the claimed draw waits for the staleness bound)."""
        sc, tok = self.cfg.sampler, self.tokenizer
        draw = self.claims.next()
        # alone, the check before claiming counted everything ahead of this draw; with other replicas,
        # one may have claimed ahead of what we had seen
        while not self.claims.alone and self.throttled(draw):
            if self.stopping():
                self.claims.release(draw)
                return None
            self.wait()
        t0 = time.time()
        time.sleep(self.delay_s)
        self.stream.position = draw * sc.prompts_drawn
        batch = self.stream.take(sc.prompts_drawn)
        prompt_ids = prompt_token_ids(tok, [p.messages for p in batch])
        groups = self.backend.generate(prompt_ids, sc.group_size,
                                       dataclasses.replace(self.params, seed=self.backend.call_seed(draw + 1)))
        gen_s = time.time() - t0
        scored, reward_s = _score(self.scorer, batch, groups, self.metrics)
        rewards, tokens = [s.reward for s in scored.scores], sum(len(c.token_ids) for g in groups for c in g)
        kept, left = most_varied(batch, prompt_ids, groups, scored, sc.prompts_per_batch)
        rows, archive = shard_tables(kept, left, self.version, self.sampler_id)
        if not self.claims.alone:  # others commit too: the writer checks the bound where the shard lands
            self.writer.admit = self._admit  # (alone, the count before claiming covered all ahead of it)
        self.writer.write(rows, tag=draw, archive=archive)  # the groups not handed over go to the archive
        t1 = time.time()
        self.claims.release(draw, t1 - t0)
        record = {
            "sampler/batch": self.claims.batches, "sampler/draw": draw, "sampler/dropped_stale": self._log_dropped(),
            "sampler/policy_version": self.version, "sampler/samples": rows.num_rows,
            "sampler/groups_dropped": len(groups) - len(kept[2]),
            "sampler/gen_tokens": tokens, "reward/mean": sum(rewards) / len(rewards),
            "timing_s/generate": gen_s, "timing_s/reward": reward_s, "timing_s/batch": t1 - t0,
            **scored.metrics(),
            "perf/gen_tokens_per_s": tokens / max(gen_s, 1e-9), "time/start": t0, "time/end": t1,
        }
        if self.reload_s:
            record["timing_s/reload"] = self.reload_s
        record["sampler/throttle_s"] = self.waited
        self.waited, self.reload_s, self._named = 0.0, 0.0, None
        if hasattr(self.backend, "stats"):
            record.update(self.backend.stats())
        return record

    def run_until_stopped(self) -> dict:
        try:
            while not self.stopping():
                if self.throttled():
                    self.wait()  # which looks for a newer policy
                    continue
                record = self.one_batch()
                if record is not None:
                    self.metrics.log(record)
                self.reload_if_newer()
        finally:
            try:
                self.writer.close()
            finally:
                self._log_dropped()
            self.claims.flush()
            self.metrics.flush()
            self.backend.close()
            self.scorer.close()
            self.store.release(self.sampler_id)
        return {"batches": self.claims.batches, "policy_version": self.version}


def run_sampler(run_url: str, sampler_id: str = "sampler-0") -> dict:
    """The sampler process: runs until the stop marker or the trainer's done marker appears."""
    sampler = Sampler(run_url, sampler_id)
    engine_loaded()
    return sampler.run_until_stopped()
