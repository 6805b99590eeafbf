"""summary.json: what a run did, computed from the metrics streams of its processes."""

from __future__ import annotations

from .rundir import RunDir


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def overlap_seconds(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total time during which both interval sets are busy."""
    a, b = _union(a), _union(b)
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def _busy(records: list[dict]) -> list[tuple[float, float]]:
    """(start, end) wall-clock times of each step or batch (`timing/...` in streams of old runs)."""
    out = []
    for r in records:
        key = "time" if "time/start" in r else "timing" if "timing/start" in r else None
        if key:
            out.append((r[f"{key}/start"], r[f"{key}/end"]))
    return out


def attempts_wall(trainer_starts: list[float], other_starts: list[float],
                  busy: list[tuple[float, float]]) -> float:
    """Seconds from each attempt's first process start to its last step or batch, summed over the
    attempts: a run resumed later leaves out the time between them. An attempt begins where a
    trainer starts after every step and batch before it ended (a resumed trainer); another
    process's start (a sampler, a restarted replica) only opens the first."""
    events = sorted([(t, 0, t) for t in trainer_starts] + [(t, 1, t) for t in other_starts]
                    + [(s, 2, e) for s, e in busy])
    total, begin, end = 0.0, None, None
    for t, kind, e in events:
        if kind == 0 and end is not None and t > end:  # a resumed trainer: the attempt before is over
            total += end - begin
            begin, end = t, None
        if begin is None:
            begin = t
        if kind == 2:
            end = e if end is None else max(end, e)
    return total + (end - begin if end is not None else 0.0)


def overlap_ratio(wall_s: float, sampler_busy_s: float, trainer_busy_s: float) -> float | None:
    """wall / max(sampler busy, trainer busy): 1.0 when the loop takes only as long as its busier
    process (the other's work hidden under it); more when they waited on each other (2.0 for
    equal shares taken in turns); None without work."""
    busiest = max(sampler_busy_s, trainer_busy_s)
    return round(wall_s / busiest, 3) if busiest > 0 else None


def sampler_streams(run: RunDir) -> list[str]:
    return [n for n in run.metric_streams() if n.startswith("sampler")]


def _dropped_samples(sampler: list[dict]) -> int:
    """Samples generated in the draws a replica's writer refused (past sampler.max_staleness where
    they would have landed: `dropped_stale` events), counted in samples_generated too. Draw
    numbers are the run's (claimed once, `pipeline.sampler.claims`)."""
    made = {r["sampler/draw"]: r.get("sampler/samples", 0) for r in sampler if "sampler/draw" in r}
    return sum(made.get(r["sampler/dropped_draw"], 0) for r in sampler if r.get("event") == "dropped_stale")


def build_summary(run: RunDir, eval_before: dict, eval_after: dict, policy_version: int) -> dict:
    trainer = [r for r in run.read_metrics("trainer") if "step" in r]
    fresh = [r for r in trainer if not r.get("replay/is_replay")]  # replayed groups are older by design
    sampler = [r for s in sampler_streams(run) for r in run.read_metrics(s)]
    s_busy, t_busy = _busy(sampler), _busy(trainer)
    trainer_starts = [r["time"] for r in run.read_metrics("trainer") if r.get("event") == "start"]
    sampler_starts = [r["time"] for r in sampler if r.get("event") == "start"]
    wall = attempts_wall(trainer_starts, sampler_starts, s_busy + t_busy)
    gen = [r for r in sampler if "sampler/samples" in r]
    group = run.config().sampler.group_size if any(r.get("sampler/groups_dropped") for r in gen) else 0
    sampler_busy = sum(e - s for s, e in _union(s_busy))
    trainer_busy = sum(e - s for s, e in _union(t_busy))
    return {
        "run_id": run.run_id,
        "run_dir": run.url,
        "eval_before": round(eval_before["score"], 4),
        "eval_after": round(eval_after["score"], 4),
        "eval_before_detail": eval_before,
        "eval_after_detail": eval_after,
        "reward_first": round(fresh[0]["reward/mean"], 4) if fresh else None,
        "reward_last": round(fresh[-1]["reward/mean"], 4) if fresh else None,
        "steps": trainer[-1]["step"] if trainer else 0,
        # with sampler.oversample, the groups a batch generated but did not hand over count as generated
        "samples_generated": sum(r["sampler/samples"] + r.get("sampler/groups_dropped", 0) * group for r in gen),
        "groups_dropped": sum(r.get("sampler/groups_dropped", 0) for r in gen),
        "samples_dropped_stale": _dropped_samples(sampler),
        "samples_trained": sum(r["trainer/samples"] for r in trainer),
        "generated_tokens": sum(r["sampler/gen_tokens"] for r in gen),
        "trained_tokens": sum(r["trainer/response_tokens"] for r in trainer),
        "wall_s": round(wall, 2),
        "sampler_busy_s": round(sampler_busy, 2),
        "trainer_busy_s": round(trainer_busy, 2),
        "overlap_s": round(overlap_seconds(s_busy, t_busy), 2),
        "overlap_ratio": overlap_ratio(wall, sampler_busy, trainer_busy),
        "policy_versions": policy_version,
        "max_staleness_seen": max((r["staleness/max"] for r in fresh), default=0),  # bounded by sampler.max_staleness
    }
