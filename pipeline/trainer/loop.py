"""The persistent trainer: fresh groups from L1, replay epochs over L2, checkpoints, phases.

Policy version k = the weights after k fresh optimizer steps (v0 = the initial model); the replay
updates run after fresh step k are part of version k (it is checkpointed and published after
them). Every rollout carries the version that generated it; staleness = trainer version - rollout
version.

    resume from the newest complete checkpoint (weights, optimizer, scheduler, RNG, L1 cursor),
    taking back the replays the buffer recorded after it
    for each fresh step:
        read groups_per_step groups from the cursor (read while the step before trained, feed.py)
        -> train_step -> rank 0: promote to L2 and record the cursor in the buffer
        replay epochs due now: wait for the gate, draw by priority, train with the importance
        weights, write new priorities back
        phase end: checkpoint + phase marker | every checkpoint_every: checkpoint
        otherwise every sync_every: publish the policy in-process, delete versions past the newest K
        (resumed at such a step: its version again, if the kill came before it was committed)

Run as one process or under torchrun (see distributed.py). Rank 0 alone writes metrics, markers,
buffer commits and policies.
"""

from __future__ import annotations

import logging
import os
import signal
import time

import pyarrow as pa
import torch

from ..buffer import ReplayBuffer
from ..devices import engine_loaded, set_threads
from ..lineage import LineageWriter, NullLineage
from ..metrics import NullMetrics
from ..models import load_model, load_tokenizer
from ..orchestration import replay_gate_min_groups, replay_gate_ready
from ..policy import PolicyStore
from ..rundir import RunDir
from ..tracking import Tracker, open_tracker, scalars
from .algorithms import get_algorithm
from .batch import collate
from .borrow import BorrowedThreads
from .checkpoint import TrainerState, latest_checkpoint, load_checkpoint, restore_replays, save_checkpoint
from .critic import ActorCritic, ValueHead
from .distributed import World, init_world, shard
from .feed import ConsumedMarks, FreshFeed, GaveWay, ReplayPace, TrainerStopped, agreed, wait_for_gate
from .phases import mark_closed_phases, phase_end_steps, replay_epoch_steps
from .publish import BackgroundPublisher, publish_policy, replaces
from .precision import DTYPES, Precision
from .step import replay_config, replayable, train_step

log = logging.getLogger("rlhf.trainer")
FAULT_ENV = "RLHF_TRAINER_KILL_AFTER_STEP"  # fault injection for the resume tests: SIGKILL after step N + its replays


def rollback_metrics(run: RunDir, step: int) -> None:
    """Drop metric records of steps after `step` (a resumed trainer redoes them)."""
    records = run.read_metrics("trainer")
    keep = [r for r in records if r.get("step", 0) <= step]
    if len(keep) != len(records):
        run.metrics("trainer").replace(keep)


def build_models(base: str, cfg, world: World, precision: Precision, critic: bool = False):
    """(actor, reference or None). The policy (and critic) are float32 master weights that compute
    in `precision.dtype`; the reference model, never updated, is loaded in that dtype directly."""
    tc = cfg.trainer
    policy = load_model(base, "float32", trust_remote_code=cfg.model.trust_remote_code).to(world.device).train()
    if tc.gradient_checkpointing:
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        policy.config.use_cache = False
    head = ValueHead(policy.config.hidden_size).to(world.device) if critic else None
    mp = precision.mp_policy()
    policy = shard(precision.wrap(policy), world, mp_policy=mp)
    head = shard(head, world, policy=False) if head is not None else None  # small: computes in fp32
    ref = None
    if tc.kl_coef > 0:
        ref = load_model(base, precision.name, trust_remote_code=cfg.model.trust_remote_code)
        ref = shard(ref.to(world.device).eval().requires_grad_(False), world)
    return ActorCritic(policy, head), ref


class Trainer:
    def __init__(self, run: RunDir, world: World):
        self.run, self.world = run, world
        self.cfg = cfg = run.config()
        self.tc = tc = cfg.trainer
        set_threads(tc.threads)
        torch.manual_seed(cfg.seed)
        self.algo = get_algorithm(tc.algorithm)
        self.store = PolicyStore(run)
        base = self.store.local_dir(0)
        self.tokenizer = load_tokenizer(base, trust_remote_code=cfg.model.trust_remote_code)
        self.precision = Precision.of(tc.dtype or cfg.model.dtype, world.device, sharded=world.distributed)
        self.actor, self.ref = build_models(base, cfg, world, self.precision, critic=self.algo.critic)
        policy, critic = self.actor.policy, self.actor.critic
        groups = [{"params": list(policy.parameters()), "lr": tc.lr}]
        if critic is not None:
            groups.append({"params": list(critic.parameters()), "lr": tc.critic_lr or tc.lr})
        self.opt = torch.optim.AdamW(groups, lr=tc.lr, weight_decay=tc.weight_decay)
        warm = tc.warmup_steps
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda n: min(1.0, (n + 1) / warm) if warm else 1.0)
        self.buffer = ReplayBuffer(run.buffer_url, cfg.buffer)
        self.marks = ConsumedMarks(self.buffer, cfg.buffer)
        borrow = bool(tc.borrow_threads) and world.size == 1
        if tc.borrow_threads and not borrow:
            log.warning("trainer.borrow_threads=%d ignored: %d trainer processes (it is for one process that "
                        "shares a machine's cores with the samplers)", tc.borrow_threads, world.size)
        # a borrowing trainer's read ahead polls steadily, so that it sees the next step's groups within a poll
        self.feed = FreshFeed(self.buffer, run, tc.groups_per_step, cfg.sampler.poll_s, tc.wait_timeout_s,
                              self.marks if world.is_main else None, steady=borrow)
        self.borrow = BorrowedThreads(tc.threads, tc.borrow_threads, cfg.sampler.max_staleness, tc.groups_per_step,
                                      self.feed, self.buffer, cfg.sampler.poll_s) if borrow else None
        self.pace = ReplayPace()
        self.state = TrainerState()
        self._saved_at = time.monotonic()  # trainer.checkpoint_every_s counts from the start and each checkpoint
        ck = latest_checkpoint(run)
        if ck is not None:
            self.state = load_checkpoint(ck, self.actor, self.opt, self.sched)
            log.info("trainer: resumed from %s (step %d)", ck.url, self.state.step)
        if world.is_main:  # also without a checkpoint: a trainer killed before its first one redoes every step
            rollback_metrics(run, self.state.step)
            restore_replays(self.buffer, ck)
            self._mark_resumable()  # compaction keeps what a restart redoes
        self.metrics = run.metrics("trainer") if world.is_main else NullMetrics()
        # the ledger and the trackers resume with the checkpoint: what came after it is redone
        self.lineage = LineageWriter(run, self.state.updates) if world.is_main else NullLineage()
        self.tracker = open_tracker(run, cfg, resumed_step=self.state.step) if world.is_main else Tracker()
        self.replayed_samples = 0
        self.fresh_samples = 0
        self.skipped_epochs: list[int] = []  # replay epochs that never had enough eligible groups

    # one fresh step ---------------------------------------------------------------------------
    def fresh_step(self) -> dict:
        tc, st, world = self.tc, self.state, self.world
        table, cursor, waited = agreed(world, lambda: self.feed.take(st.cursor_dict(), ahead=st.step + 1 < tc.steps))
        t0 = time.time()
        batch = collate(table, self.tokenizer.pad_token_id)
        version = st.step
        borrowed = {}
        if self.borrow is not None:
            self.borrow.start(st.step)
        try:
            res = train_step(self.actor, self.ref, self.opt, batch, tc, self.cfg.sampler.temperature, world=world,
                             scheduler=self.sched, version=version, precision=self.precision,
                             before_micro_batch=self.borrow)
        finally:
            if self.borrow is not None:
                borrowed = {"trainer/borrowed_threads_share": self.borrow.end()}
        st.step += 1
        st.updates += tc.update_epochs
        st.cursor = (int(cursor["seq"]), int(cursor["group"]))
        if world.is_main:
            if tc.replay_epochs:
                keep = replayable(batch, tc)  # groups with rows a replay trains on
                promote = table if keep is None else table.filter(pa.array(keep.numpy()))
                self.buffer.promote(promote, cursor=cursor)  # quality filter -> L2, and the cursor, in one commit
                self.marks.recorded()
            else:
                self.marks.consumed(cursor)
        self.fresh_samples += table.num_rows
        self.lineage.add(table, step=st.step, update=st.updates, version=st.step, kind="fresh", stats=res.stats)
        staleness = version - batch.policy_version
        hist: dict[str, int] = {}
        for s in staleness.tolist():
            hist[str(s)] = hist.get(str(s), 0) + 1
        t1 = time.time()
        self.pace.took("fresh", t1 - t0)
        return self._record(batch, res, t0, t1, waited, table.num_rows, {
            "staleness/mean": staleness.float().mean().item(), "staleness/max": int(staleness.max()),
            "staleness/hist": hist, "replay/is_replay": 0, **borrowed,
        })

    def _record(self, batch, res, t0, t1, waited, samples, extra: dict) -> dict:
        total = self.fresh_samples + self.replayed_samples
        rec = {
            "step": self.state.step, "updates": self.state.updates,
            "reward/mean": batch.rewards.mean().item(), "reward/std": batch.rewards.std().item() if len(batch.rewards) > 1 else 0.0,
            "actor/loss": res.loss, "trainer/samples": samples, "trainer/tokens": batch.num_tokens,
            "trainer/response_tokens": batch.response_tokens, "perf/tokens_per_s": batch.num_tokens / max(t1 - t0, 1e-9),
            "timing_s/step": t1 - t0, "timing_s/wait": waited, "time/start": t0, "time/end": t1,
            "replay/fraction": self.replayed_samples / total if total else 0.0,
            "actor/lr": self.opt.param_groups[0]["lr"], **res.stats, **extra,
        }
        self.metrics.log(rec)
        self.tracker.log(scalars(rec), rec["step"])
        return rec

    # replay -----------------------------------------------------------------------------------
    def fresh_due(self) -> bool:
        """Replay gives way (`trainer.replay_yield`): the next fresh step's groups are read, or the
        last fresh step is done (there is no fresh data to wait for). Every rank reads ahead on its
        own, so the ranks agree first: one rank that went on alone would leave the others waiting
        in a collective."""
        due = self.state.step >= self.tc.steps or self.feed.ready()
        return bool(self.world.max_int(int(due)))

    def _replay_gives_way(self) -> bool:
        """Before a yielding replay update: the next fresh step's groups are here, or are expected
        before the update would end (`ReplayPace`); every rank decides as the slowest would."""
        late = not self.pace.fits(self.feed.expected_in())
        return self.fresh_due() or bool(self.world.max_int(int(late)))

    def _give_way(self) -> None:
        """Before each replay micro-batch (`replay_yield`, one update epoch): fresh data stops it unapplied."""
        if self.fresh_due():
            raise GaveWay

    def replay_epoch(self, epoch: int) -> int:
        """One pass over L2: eligible // groups_per_step draws by priority. Returns updates taken."""
        tc, st, world = self.tc, self.state, self.world
        waited = agreed(world, lambda: wait_for_gate(self.run, epoch, self.cfg.sampler.poll_s, tc.wait_timeout_s))
        n = self.buffer.eligible_replay_groups() // tc.groups_per_step
        done = 0
        for i in range(n):
            if tc.replay_yield and self._replay_gives_way():
                log.info("replay epoch %d: gives way to fresh data (here, or due before an update would end) "
                         "after %d of %d updates", epoch, i, n)
                break
            t0 = time.time()
            rb = self.buffer.sample_replay(tc.groups_per_step, step=st.updates,
                                           rng_seed=self.cfg.seed * 1_000_003 + epoch * 10_007 + i)
            if len(rb) == 0:
                break
            batch = collate(rb.table, self.tokenizer.pad_token_id, rb.weights)
            try:
                res = train_step(self.actor, self.ref, self.opt, batch, replay_config(tc), self.cfg.sampler.temperature,
                                 world=world, scheduler=self.sched, version=None, precision=self.precision,
                                 lr_scale=tc.replay_lr_scale, rows=tc.replay_rows,
                                 before_micro_batch=self._give_way if tc.replay_yield and tc.update_epochs == 1 else None)
            except GaveWay:
                log.info("replay epoch %d: gives way to fresh data during update %d of %d", epoch, i + 1, n)
                break
            if res.rows is not None and res.rows.numel() == 0:
                # no row of these groups is one a replay trains on (trainer.replay_rows): no update;
                # their replays are counted and their priorities drop to 0, so they are drawn last
                if world.is_main:
                    self.buffer.update_priorities(rb.keys, [0.0] * len(rb.keys))
                world.barrier()
                continue
            st.updates += tc.update_epochs
            self.pace.took("replay", time.time() - t0)
            if world.is_main:
                index = {g: k for k, g in enumerate(batch.group_ids)}
                self.buffer.update_priorities(rb.keys, [float(res.priorities[index[k]]) for k in rb.keys])
            world.barrier()  # priorities and replay counts are committed before the next draw
            table, weights = rb.table, rb.weights
            if res.rows is not None:  # the rows trained on (trainer.replay_rows)
                batch, table, weights = batch.select(res.rows), table.take(res.rows.numpy()), weights[res.rows.numpy()]
            self.replayed_samples += table.num_rows
            self.lineage.add(table, step=st.step, update=st.updates, version=st.step, kind="replay",
                             stats=res.stats, weights=weights, replay_epoch=epoch)
            staleness = st.step - batch.policy_version
            self._record(batch, res, t0, time.time(), waited if i == 0 else 0.0, table.num_rows, {
                "staleness/mean": staleness.float().mean().item(), "staleness/max": int(staleness.max()),
                "replay/is_replay": 1, "replay/epoch": epoch, "replay/groups": len(rb.keys),
                "replay/weight_mean": float(weights.mean()),
                "replay/beta": rb.beta,
            })
            done += 1
        log.info("replay epoch %d: %d updates of %d groups", epoch, done, tc.groups_per_step)
        return done

    def due_replay_epochs(self, replay_at: list[int]) -> None:
        """Run the replay epochs due by now. An epoch whose gate condition does not hold (L2 holds
        less than one step of eligible groups, `orchestration.replay_gate_ready`) is deferred to a
        later step rather than waited for (only fresh steps add to L2, so waiting would never end);
        at the last step it is skipped."""
        tc, st = self.tc, self.state
        for e in range(st.replay_epochs_done, tc.replay_epochs):
            if replay_at[e] > st.step:
                break
            self.world.barrier()  # rank 0's promote is committed: every rank counts the same L2
            eligible = self.buffer.eligible_replay_groups()
            if not replay_gate_ready(eligible, replay_gate_min_groups(self.cfg)):
                if st.step < tc.steps:
                    break
                log.info("replay epoch %d skipped: %d eligible groups < trainer.groups_per_step", e, eligible)
                self.skipped_epochs.append(e)
            else:
                self.replay_epoch(e)
            st.replay_epochs_done = e + 1

    # the loop ---------------------------------------------------------------------------------
    def _checkpoint(self, kind: str):
        """Save a checkpoint; the ledger's rows up to it are written first, so a resume from it
        finds them (rows written past the newest checkpoint are rolled back on resume); so are the
        metrics records, which on object storage are buffered into parts; and the consumption mark.
        Its cursor is recorded after it as where a restart resumes (`ReplayBuffer.mark_resumable`)."""
        if self.world.is_main:
            self.marks.flush()
        self.lineage.flush()
        self.metrics.flush()
        ck = save_checkpoint(self.run, self.actor, self.opt, self.sched, self.state, self.tokenizer, self.world,
                             kind=kind, keep=self.tc.keep_checkpoints, buffer_version=self.buffer.state.version,
                             store=self.store)
        self._saved_at = time.monotonic()
        if self.world.is_main:  # a restart now redoes nothing before it: compaction may archive up to it
            self._mark_resumable()
        return ck

    def _checkpoint_due(self) -> bool:
        """A periodic checkpoint after this step: every `checkpoint_every` steps, or once
        `checkpoint_every_s` have passed since the last one (rank 0's clock decides for every rank)."""
        tc = self.tc
        if tc.checkpoint_every and self.state.step % tc.checkpoint_every == 0:
            return True
        if not tc.checkpoint_every_s:  # the same config on every rank: no collective
            return False
        late = time.monotonic() - self._saved_at >= tc.checkpoint_every_s
        return bool(self.world.max_int(int(late and self.world.is_main))) if self.world.distributed else late

    def _mark_resumable(self) -> None:
        """Rank 0 alone writes it: a storage error here costs a warning (a mark left behind only
        makes compaction keep more), not rank 0 failing while the others wait in a collective."""
        try:
            self.buffer.mark_resumable(self.state.cursor_dict())
        except Exception as e:  # noqa: BLE001
            log.warning("trainer: could not record the resume position (%s: %s); compaction keeps more of L1",
                        type(e).__name__, e)

    def _publish(self, publisher) -> None:
        """Publish the weights as version `step` (idempotent: a version already committed stays)."""
        serve = DTYPES[self.cfg.model.dtype]  # the sampler's dtype (the trainer may compute in another)
        publish_policy(self.run, self.state.step, self.actor, self.tokenizer, self.world, dtype=serve,
                       publisher=publisher)

    def run_loop(self) -> dict:
        tc, st, world, run = self.tc, self.state, self.world, self.run
        phase_ends = phase_end_steps(tc)
        replay_at = replay_epoch_steps(tc)
        kill_at = int(os.environ.get(FAULT_ENV, "0") or 0)
        self.metrics.log({"event": "start", "resumed_step": st.step, "world_size": world.size})
        log.info("trainer: %d steps of %d groups, algorithm %s, %d phase(s), %d replay epoch(s), world size %d",
                 tc.steps, tc.groups_per_step, tc.algorithm, tc.phases, tc.replay_epochs, world.size)
        ok = False
        publisher = BackgroundPublisher(self.store, tc, replace=replaces(self.cfg.sampler)) if world.is_main else None
        try:
            if st.step and world.is_main:
                mark_closed_phases(run, tc, st.step)
            if st.step and st.step not in phase_ends and st.step % tc.sync_every == 0:
                # resumed: a trainer killed between its checkpoint and that step's publication left
                # the version uncommitted, and a fixed-lag sampler waits for exactly that one
                self._publish(publisher)
            while st.step < tc.steps:
                rec = self.fresh_step()
                self.due_replay_epochs(replay_at)
                if kill_at and st.step == kill_at:
                    world.barrier()
                    os.kill(os.getpid(), signal.SIGKILL)
                if st.step in phase_ends:
                    ck = self._checkpoint("phase")
                    if world.is_main:
                        if st.step == tc.steps and publisher is not None:
                            # every in-phase version is up before the orchestrator publishes the
                            # final one: one landing after it would move latest.json back
                            publisher.close()
                            publisher = None
                        run.set_marker(RunDir.phase_done_marker(phase_ends[st.step]),
                                       {"step": st.step, "checkpoint": ck.url})
                elif self._checkpoint_due():
                    self._checkpoint("periodic")
                if st.step not in phase_ends and st.step % tc.sync_every == 0:
                    self._publish(publisher)
                if world.is_main and (st.step % tc.log_every == 0 or st.step == tc.steps):
                    log.info("step %d/%d reward %.3f loss %.4f staleness %.2f tok/s %.0f", st.step, tc.steps,
                             rec["reward/mean"], rec["actor/loss"], rec["staleness/mean"], rec["perf/tokens_per_s"])
            ok = True
        except TrainerStopped:
            ok = True
            log.info("trainer: stop requested at step %d", st.step)
        finally:
            try:
                self.feed.close()
                if ok and world.is_main:
                    self.marks.flush()
                if publisher is not None:
                    publisher.close()  # publishes what is queued; raises if a publication failed
            finally:
                self.metrics.flush()
                self.lineage.flush()
                self.tracker.close(ok)
        if st.step >= tc.steps and world.is_main:
            # orchestrators stop waiting on the gates of skipped epochs (they will never open)
            run.set_marker(RunDir.TRAINER_DONE_MARKER,
                           {"step": st.step, "replay_epochs_skipped": self.skipped_epochs})
        return {"step": st.step, "updates": st.updates}


def run_trainer(run_url: str) -> dict:
    world = init_world()
    try:
        trainer = Trainer(RunDir(run_url), world)
        engine_loaded()
        return trainer.run_loop()
    finally:
        world.close()
