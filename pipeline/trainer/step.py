"""One optimizer step (or `update_epochs` of them) on one batch of whole groups.

    advantages on the whole batch (every rank holds it)
    -> [rows whose advantage is 0 leave it when nothing else is in the loss: no KL, entropy, critic]
    -> this rank's groups
    -> micro-batches packed by token budget (same count on every rank: FSDP collectives)
    -> [no-grad pass: proximal log-probs, values -> GAE / V-trace advantages and targets]
    -> for each update epoch: forward/backward per micro-batch (losses divided by the whole
       batch's denominator, so the accumulated gradient equals one big batch), clip, step.

Returns the statistics of the first update epoch (what the corrections did to this batch) and
one new replay priority per group: the mean |advantage| over its response tokens. With `rows`
other than "all" (replay, `trainer.replay_rows`) only some rows of each group are trained on,
chosen by their advantages within the whole group (`kept_rows`).
A replay update takes `replay_config(tc)`: the decoupled objective.

Metrics: is/weight_mean, is/weight_max (untruncated pi_prox / mu), is/clip_frac (share truncated
at C); actor/logprob_gap = mean |log pi - log mu| on rows the sampler generated with the trainer's
current version (pure sampler/trainer numerics); actor/behavior_shift = the same over all rows
(numerics plus policy drift since the data was generated); trainer/padding_ratio;
trainer/skipped_rows (rows left out for a zero advantage); trainer/shared_prompts (1: this step's
prompts passed once per micro-batch, see `prefix`); actor/entropy over the rows trained.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import TrainerConfig
from .advantages import ADVANTAGES, gae, token_rewards, vtrace
from .algorithms import get_algorithm
from .batch import TrainBatch, forward, pack_micro_batches, padding_ratio, shard_groups
from .critic import ActorCritic
from .distributed import World, full_tensor
from .losses import KL_ESTIMATORS, aggregate_sum, denominator, policy_loss, value_loss
from .precision import FULL, Precision
from .prefix import pack_shared, shared_padding_ratio, worth_sharing

_SUMS = ("tokens", "clip_sum", "ratio_sum", "is_sum", "is_clipped", "pg_sum", "kl_sum", "ent_sum", "vf_sum",
         "gap_sum", "gap_tokens", "shift_sum", "pad_real", "pad_total", "samples", "value_sum", "target_sum")
_MAXES = ("ratio_max", "is_max")


@dataclass
class StepResult:
    loss: float
    stats: dict                 # metric name -> float
    priorities: torch.Tensor    # [G] new priority per group of the batch (order of batch.group_ids)
    rows: torch.Tensor | None = None  # the batch's rows trained on (long [b]); None: all of them


def kept_rows(batch: TrainBatch, seq_adv: torch.Tensor, rows: str) -> torch.Tensor:
    """Indices of the rows of `batch` an update with `trainer.replay_rows=rows` trains on:
    "positive", those whose advantage `seq_adv` (computed over the whole group) is above 0 and that
    ended on their own (not `truncated` at max_new_tokens: a cut-off answer is unfinished, and
    replaying it teaches the policy not to stop); "best", those of them with the highest reward
    among them in their group."""
    keep = (seq_adv > 0) & ~batch.truncated
    if rows == "best":
        gi = batch.group_index
        r = torch.where(keep, batch.rewards.float(), torch.tensor(-torch.inf))
        best = torch.full((int(gi.max()) + 1,), -torch.inf).scatter_reduce(0, gi, r, reduce="amax")
        keep &= r >= best[gi]
    elif rows != "positive":
        raise ValueError(f"trainer.replay_rows: unknown value {rows!r}; use all, positive or best")
    return torch.nonzero(keep).flatten()


def group_advantages(batch: TrainBatch, algo, tc: TrainerConfig) -> torch.Tensor:
    """The sequence advantage [B] of each row of `batch` under `algo`'s group estimator."""
    return ADVANTAGES[algo.advantage](batch.rewards, batch.group_index, std_normalize=tc.std_normalize,
                                      response_tokens=batch.mask.sum(-1))


def replayable(batch: TrainBatch, tc: TrainerConfig) -> torch.Tensor | None:
    """Rows (bool [B]) of the groups of a fresh batch that a replay can train on: with
    `trainer.replay_rows` positive or best, those of the groups that have a row `kept_rows`
    keeps; None: all of them (replay_rows all). The trainer promotes only these to L2, so every
    group drawn for a replay has rows to train on."""
    algo = get_algorithm(tc.algorithm)
    if tc.replay_rows == "all" or algo.advantage is None:
        return None
    adv = group_advantages(batch, algo, tc)
    rows = kept_rows(batch, adv, tc.replay_rows)
    return torch.isin(batch.group_index, batch.group_index[rows])


def replay_config(tc: TrainerConfig) -> TrainerConfig:
    """The config of a replay update: `tc` with the decoupled objective, whatever
    `trainer.decoupled` says for fresh steps. A replayed row was generated several versions ago.
    Clipped against that behaviour policy, a token the policy has since made more than `clip_eps`
    likelier gets no gradient (12% of the replayed tokens of bench/reuse.py's seed 0); decoupled,
    the trust region is around the current policy and every token of a kept row has a gradient,
    weighted by the truncated min(pi / mu, is_clip). On bench/reuse.py (seeds 0-9) the replay-on run
    then needs a median 0.59x the generated tokens of the replay-off run to the target, against
    0.78x with replay clipped to the behaviour policy; its held-out score averaged over the
    evaluations is higher on 8 of the 10 seeds."""
    return tc if tc.decoupled else tc.model_copy(update={"decoupled": True})


def _plan(batch: TrainBatch, tc: TrainerConfig, world: World, share: bool) -> tuple[list[tuple[TrainBatch, float]], list, float]:
    """This rank's micro-batches with a loss scale (0 for padding micro-batches), their row indices
    in `batch`, and the padding ratio. `share`: whole groups per micro-batch (`prefix.pack_shared`)."""
    rows = shard_groups(batch, world.rank, world.size)
    if share:
        mbs = pack_shared(batch, rows, tc.micro_batch_tokens) if rows.numel() else []
        pad = shared_padding_ratio(batch, mbs) if mbs else 0.0
    else:
        mbs = [rows[mb] for mb in pack_micro_batches(batch.lengths[rows], tc.micro_batch_tokens)] if rows.numel() else []
        pad = padding_ratio(batch.lengths, mbs) if mbs else 0.0
    plan = [(batch.select(mb).to(world.device), 1.0) for mb in mbs]
    n = world.max_int(len(plan))
    filler_rows = rows[:1] if rows.numel() else torch.tensor([0])
    plan += [(batch.select(filler_rows).to(world.device), 0.0)] * (n - len(plan))
    # (forward/backward with zero loss keeps the ranks in step)
    return plan, mbs + [filler_rows] * (n - len(mbs)), pad


def _shares(batch: TrainBatch, tc: TrainerConfig, algo) -> bool:
    """Shared prompts for this batch: where they save work; not for the critic (values at every
    column) nor with gradient checkpointing (no attention cache)."""
    return (tc.share_prompts and not algo.critic and not tc.gradient_checkpointing
            and worth_sharing(batch, tc.micro_batch_tokens))


def _whiten(advs: list[torch.Tensor], plan, world: World, eps: float = 1e-6) -> list[torch.Tensor]:
    """Token advantages -> zero mean, unit variance over every response token of the batch (all ranks)."""
    acc = torch.zeros(3, dtype=torch.float64, device=world.comm_device)
    for a, (mb, scale) in zip(advs, plan):
        if scale:
            m = mb.mask > 0
            acc += torch.stack([a[m].sum(), (a[m] ** 2).sum(), m.sum()]).double().to(acc.device)
    world.sum_(acc)
    n = max(float(acc[2]), 1.0)
    mean = float(acc[0]) / n
    std = max(float(acc[1]) / n - mean ** 2, 0.0) ** 0.5
    return [(a - mean) / (std + eps) * mb.mask for a, (mb, _) in zip(advs, plan)]


def _critic_advantages(actor: ActorCritic, plan, prox, hidden, tc: TrainerConfig, world: World):
    """Values (no grad) -> per micro-batch (token advantages, value targets), with V-trace or GAE."""
    advs, targets, values = [], [], []
    with torch.no_grad():
        for (mb, _), p, h in zip(plan, prox, hidden):
            v = actor.critic(h) * mb.mask
            r = token_rewards(mb.rewards.cpu(), mb.mask.cpu())
            if tc.critic_targets == "vtrace":
                log_rho = (p - mb.behavior_logprobs) * mb.mask
                a, t = vtrace(v.cpu(), r.cpu(), mb.mask.cpu(), log_rho.cpu(), tc.gamma, tc.gae_lambda,
                              tc.vtrace_rho_bar, tc.vtrace_c_bar)
            else:
                a, t = gae(v.cpu(), r.cpu(), mb.mask.cpu(), tc.gamma, tc.gae_lambda)
            advs.append(a.to(v.device))
            targets.append(t.to(v.device))
            values.append(v)
    return _whiten(advs, plan, world), targets, values


@dataclass
class _Tally:
    """Sums and maxima of the first update epoch, and the per-group priority accumulators."""
    sums: dict
    maxes: dict
    prio: torch.Tensor  # [2, G]: sum of |advantage| over response tokens, response tokens

    @classmethod
    def new(cls, groups: int) -> "_Tally":
        return cls(dict.fromkeys(_SUMS, 0.0), dict.fromkeys(_MAXES, 0.0), torch.zeros(2, groups, dtype=torch.float64))


@dataclass
class _Loss:
    total: torch.Tensor
    logprobs: torch.Tensor
    prox: torch.Tensor
    adv: torch.Tensor
    s: dict                          # policy_loss statistics
    pg: torch.Tensor
    ent: torch.Tensor
    kl: torch.Tensor | None = None
    vf: torch.Tensor | None = None
    values: torch.Tensor | None = None


def _advantages(actor: ActorCritic, algo, plan, tc: TrainerConfig, temperature: float, world: World, share: bool):
    """(proximal log-probs per micro-batch (None: the current policy's, detached), token
    advantages and value targets per micro-batch (critic only))."""
    prox: list[torch.Tensor | None] = [None] * len(plan)
    tok_adv = targets = None
    if algo.critic or tc.update_epochs > 1:
        with torch.no_grad():
            pre = [forward(actor.policy, mb, temperature, hidden=algo.critic, share=share) for mb, _ in plan]
        prox = [f.logprobs for f in pre]
        if algo.critic:
            tok_adv, targets, _ = _critic_advantages(actor, plan, prox, [f.hidden for f in pre], tc, world)
    return prox, tok_adv, targets


def _micro_batch_loss(actor: ActorCritic, ref, mb: TrainBatch, prox, adv, target, algo, tc: TrainerConfig,
                      temperature: float, share: bool) -> _Loss:
    """Policy loss (+ KL to the reference, - entropy bonus, + value loss) of one micro-batch, summed
    over its tokens as `tc.loss_agg` says (not yet divided by the batch's denominator)."""
    f = forward(actor.policy, mb, temperature, entropy=True, hidden=algo.critic, share=share)
    p = prox if prox is not None else f.logprobs.detach()
    per_tok, s = policy_loss(f.logprobs, p, mb.behavior_logprobs, adv, mb.mask, clip_eps=tc.clip_eps,
                             decoupled=tc.decoupled, is_level=tc.is_level, is_clip=tc.is_clip)
    w = mb.sample_weight.unsqueeze(-1)
    pg = aggregate_sum(per_tok * w, mb.mask, tc.loss_agg)
    ent = aggregate_sum(f.entropy, mb.mask, tc.loss_agg)
    out = _Loss(total=pg, logprobs=f.logprobs, prox=p, adv=adv, s=s, pg=pg, ent=ent)
    if ref is not None:
        with torch.no_grad():
            ref_lp = forward(ref, mb, temperature, share=share).logprobs
        out.kl = aggregate_sum(KL_ESTIMATORS[tc.kl_estimator](f.logprobs, ref_lp), mb.mask, tc.loss_agg)
        out.total = out.total + tc.kl_coef * out.kl
    if tc.entropy_coef > 0:
        out.total = out.total - tc.entropy_coef * ent
    if algo.critic:
        out.values = actor.critic(f.hidden) * mb.mask
        out.vf = aggregate_sum(value_loss(out.values, target) * w, mb.mask, tc.loss_agg)
        out.total = out.total + tc.vf_coef * out.vf
    return out


def _tally(t: _Tally, loss: _Loss, mb: TrainBatch, target, version: int | None) -> None:
    """Add one micro-batch of the first update epoch to the step's statistics and priorities."""
    m = mb.mask > 0
    for k in ("tokens", "clip_sum", "ratio_sum", "is_sum", "is_clipped"):
        t.sums[k] += loss.s[k]
    for k in _MAXES:
        t.maxes[k] = max(t.maxes[k], loss.s[k])
    t.sums["pg_sum"] += float(loss.pg.detach())
    t.sums["ent_sum"] += float(loss.ent.detach())
    t.sums["samples"] += float(mb.mask.shape[0])
    if loss.kl is not None:
        t.sums["kl_sum"] += float(loss.kl.detach())
    if loss.vf is not None:
        t.sums["vf_sum"] += float(loss.vf.detach())
        t.sums["value_sum"] += float(loss.values.detach()[m].sum())
        t.sums["target_sum"] += float(target[m].sum())
    t.sums["shift_sum"] += float((loss.prox - mb.behavior_logprobs).abs()[m].sum())
    if version is not None:
        same = m & (mb.policy_version == version).unsqueeze(-1)
        t.sums["gap_sum"] += float((loss.logprobs.detach() - mb.behavior_logprobs).abs()[same].sum())
        t.sums["gap_tokens"] += float(same.sum())
    adv = loss.adv
    a_tok = (adv if adv.dim() == 2 else adv.unsqueeze(-1).expand_as(mb.mask)).abs() * mb.mask
    gi = mb.group_index.cpu()
    t.prio[0].index_add_(0, gi, a_tok.sum(-1).double().cpu())
    t.prio[1].index_add_(0, gi, mb.mask.sum(-1).double().cpu())


def _reduce(t: _Tally, pad: float, world: World) -> tuple[dict, dict, torch.Tensor, float]:
    """Sum (and max) the tallies over ranks: (sums, maxes, priority accumulators, padding ratio)."""
    flat = torch.tensor([t.sums[k] for k in _SUMS], dtype=torch.float64, device=world.comm_device)
    world.sum_(flat)
    mx = world.max_(torch.tensor([t.maxes[k] for k in _MAXES], dtype=torch.float64, device=world.comm_device))
    prio = world.sum_(t.prio.to(world.comm_device)).cpu()
    pad_t = world.sum_(torch.tensor([pad], dtype=torch.float64, device=world.comm_device))
    return dict(zip(_SUMS, flat.tolist())), dict(zip(_MAXES, mx.tolist())), prio, float(pad_t[0]) / world.size


def _stats(sums: dict, maxes: dict, denom: float, ent_denom: float, grad_norm: float, pad: float, n_micro: int,
           with_ref: bool, with_critic: bool) -> dict:
    """`denom`: the whole batch's loss denominator; `ent_denom`: that of the rows trained (the entropy's)."""
    n = max(sums["tokens"], 1.0)
    stats = {
        "actor/pg_loss": sums["pg_sum"] / denom, "actor/entropy": sums["ent_sum"] / ent_denom,
        "actor/clip_frac": sums["clip_sum"] / n, "actor/ratio_mean": sums["ratio_sum"] / n,
        "actor/ratio_max": maxes["ratio_max"], "actor/grad_norm": grad_norm,
        "actor/behavior_shift": sums["shift_sum"] / n,
        "is/weight_mean": sums["is_sum"] / n, "is/weight_max": maxes["is_max"], "is/clip_frac": sums["is_clipped"] / n,
        "trainer/padding_ratio": pad, "trainer/micro_batches": n_micro,
    }
    if with_ref:
        stats["actor/kl"] = sums["kl_sum"] / denom
    if with_critic:
        stats.update({"critic/vf_loss": sums["vf_sum"] / denom, "critic/value_mean": sums["value_sum"] / n,
                      "critic/target_mean": sums["target_sum"] / n})
    if sums["gap_tokens"]:
        stats["actor/logprob_gap"] = sums["gap_sum"] / sums["gap_tokens"]
    return stats


def _scaled_step(precision: Precision, opt, params, max_norm: float, lr_scale: float):
    """precision.step with every parameter group's learning rate times lr_scale for this step."""
    if lr_scale == 1.0:
        return precision.step(opt, params, max_norm)
    lrs = [g["lr"] for g in opt.param_groups]
    for g in opt.param_groups:
        g["lr"] *= lr_scale
    try:
        return precision.step(opt, params, max_norm)
    finally:
        for g, lr in zip(opt.param_groups, lrs):
            g["lr"] = lr


def _skip_zero_gradient_rows(batch: TrainBatch, seq_adv, tally: _Tally, world: World, zero_only: bool):
    """(batch, seq_adv, rows left out): with `zero_only` (the loss has no term but the policy
    gradient: no KL, no entropy bonus, no critic), rows whose advantage is exactly 0 (a group
    whose rewards are all equal) add nothing to the gradient, so they need no forward or backward
    pass; the loss keeps the whole batch's denominator, so the update is the one the whole batch
    makes. Their response tokens still count in their groups' priorities. One row stays when all
    are zero, so the optimizer steps as it would (momentum, weight decay)."""
    if not zero_only:
        return batch, seq_adv, 0
    live = seq_adv != 0
    if bool(live.all()):
        return batch, seq_adv, 0
    if not bool(live.any()):
        live[0] = True
    if world.rank == 0:  # _reduce sums the tallies over ranks
        gone = ~live
        tally.prio[1].index_add_(0, batch.group_index[gone], batch.mask[gone].sum(-1).double())
    keep = torch.nonzero(live).flatten()
    return batch.select(keep), seq_adv[keep], int((~live).sum())


def train_step(actor: ActorCritic, ref, opt, batch: TrainBatch, tc: TrainerConfig, temperature: float, *,
               world: World | None = None, scheduler=None, version: int | None = None,
               precision: Precision = FULL, lr_scale: float = 1.0, rows: str = "all",
               before_micro_batch=None) -> StepResult:
    """See the module docstring. `version`: the trainer's policy version before this step (for the
    sampler/trainer log-prob gap, measured on rows generated by that same version). `precision`:
    the compute dtype and loss scaling (see pipeline.trainer.precision); parameters stay fp32.
    `lr_scale`: factor on the learning rate of these updates only (replay). `rows`: which rows of
    each group to train on (`kept_rows`; every rank holds the whole batch and keeps the same).
    `before_micro_batch`: called before each micro-batch's forward pass (the trainer's thread count)."""
    world = world or World()
    algo = get_algorithm(tc.algorithm)
    seq_adv = None
    if algo.advantage is not None:
        seq_adv = group_advantages(batch, algo, tc)
    kept = None
    if rows != "all":
        if seq_adv is None:
            raise ValueError(f"trainer.replay_rows={rows} needs group advantages; algorithm {tc.algorithm} has none")
        kept = kept_rows(batch, seq_adv, rows)
        if kept.numel() == 0:  # no update; priority 0: these groups have nothing left to replay
            return StepResult(loss=0.0, stats={}, priorities=torch.zeros(len(batch.group_ids)), rows=kept)
        batch, seq_adv = batch.select(kept), seq_adv[kept]
    denom = denominator(batch.mask, tc.loss_agg)
    tally = _Tally.new(len(batch.group_ids))
    batch, seq_adv, skipped = _skip_zero_gradient_rows(batch, seq_adv, tally, world, zero_only=(
        seq_adv is not None and not algo.critic and ref is None and tc.entropy_coef == 0))
    share = _shares(batch, tc, algo)
    plan, plan_rows, pad = _plan(batch, tc, world, share)
    prox, tok_adv, targets = _advantages(actor, algo, plan, tc, temperature, world, share)
    grad_norm = 0.0
    params = [p for p in actor.parameters() if p.requires_grad]
    for epoch in range(tc.update_epochs):
        opt.zero_grad(set_to_none=True)
        for i, (mb, scale) in enumerate(plan):
            if before_micro_batch is not None:
                before_micro_batch()
            adv = tok_adv[i] if algo.critic else seq_adv[plan_rows[i]].to(world.device)
            target = targets[i] if algo.critic else None
            loss = _micro_batch_loss(actor, ref, mb, prox[i], adv, target, algo, tc, temperature, share)
            # / denom: the whole batch's denominator (accumulation == one big batch);
            # * world.size: FSDP averages gradients over ranks, the loss is a sum over them
            precision.backward(loss.total / denom * scale * world.size)
            if epoch == 0 and scale:
                _tally(tally, loss, mb, target, version)
        norm = _scaled_step(precision, opt, params, tc.max_grad_norm, lr_scale)
        grad_norm = grad_norm or float(full_tensor(norm))
        if scheduler is not None:
            scheduler.step()

    sums, maxes, prio, pad = _reduce(tally, pad, world)
    loss_sum = sums["pg_sum"] + tc.kl_coef * sums["kl_sum"] - tc.entropy_coef * sums["ent_sum"] + tc.vf_coef * sums["vf_sum"]
    stats = _stats(sums, maxes, denom, denominator(batch.mask, tc.loss_agg), grad_norm, pad, len(plan),
                   ref is not None, algo.critic)
    stats["trainer/skipped_rows"] = skipped
    stats["trainer/shared_prompts"] = int(share)
    priorities = (prio[0] / prio[1].clamp_min(1)).float()
    return StepResult(loss=loss_sum / denom, stats=stats, priorities=priorities, rows=kept)
