"""The dashboard's data: a run directory's metrics, markers and buffer log shaped for charts.

Everything here reads through the engine (`RunDir`, the buffer's commit log) and returns plain
JSON-ready values; the page (`page.py`, `static/dashboard.js`) only draws them.

- `table`: one metrics stream as columns (`x`, wall time `t`, one list per key), long streams
  averaged over consecutive buckets so that a chart never gets more than `MAX_POINTS` points;
- `staleness_histogram`: trained samples by staleness, over the whole run;
- `activity`: sampler and trainer busy fractions over wall time, and when both were busy;
- `events`: phase ends and replay-gate openings with their step and time (one axis for both);
- `BufferHistory`: rows per tier over time, replayed from the buffer's commit log (incrementally:
  each poll reads only the entries committed since the last one);
- `version_summary`: policy versions as a few numbers and ranges instead of a list of hundreds.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

MAX_POINTS = 500
TRAINER_KEYS = ("reward/mean", "reward/std", "actor/loss", "actor/kl", "actor/behavior_shift", "actor/logprob_gap", "actor/clip_frac",
                "is/weight_mean", "is/weight_max", "is/clip_frac", "actor/entropy", "perf/tokens_per_s",
                "staleness/mean", "staleness/max", "replay/fraction", "replay/is_replay")
SAMPLER_KEYS = ("reward/mean", "perf/gen_tokens_per_s", "sampler/policy_version", "timing_s/reload",
                "sampler/throttle_s")
ACTIVITY_BINS = 120


def _num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v


def table(records: list[dict], x_key: str, keys: tuple[str, ...], limit: int = MAX_POINTS) -> dict:
    """{"x": [...], "t": [...], key: [...]} of the records that have `x_key` and a time."""
    rows = [r for r in records if _num(r.get(x_key)) and _num(r.get("time"))]
    size = max(1, -(-len(rows) // limit))
    out: dict[str, list] = {"x": [], "t": []}
    present = [k for k in keys if any(_num(r.get(k)) for r in rows)]
    for k in present:
        out[k] = []
    for i in range(0, len(rows), size):
        chunk = rows[i:i + size]
        out["x"].append(chunk[-1][x_key])
        out["t"].append(round(chunk[-1]["time"], 3))
        for k in present:
            vals = [r[k] for r in chunk if _num(r.get(k))]
            out[k].append(sum(vals) / len(vals) if vals else None)
    return out


def staleness_histogram(records: list[dict]) -> dict[str, int]:
    hist: dict[int, int] = {}
    for r in records:
        for k, n in (r.get("staleness/hist") or {}).items():
            if str(k).lstrip("-").isdigit() and _num(n):
                hist[int(k)] = hist.get(int(k), 0) + int(n)
    return {str(k): hist[k] for k in sorted(hist)}


def _intervals(records: list[dict]) -> list[tuple[float, float]]:
    """Busy intervals (time/start, time/end) of one role, merged and sorted."""
    spans = sorted((r["time/start"], r["time/end"]) for r in records
                   if _num(r.get("time/start")) and _num(r.get("time/end")) and r["time/end"] >= r["time/start"])
    merged: list[list[float]] = []
    for s, e in spans:
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return [(s, e) for s, e in merged]


def _intersect(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if s < e:
            out.append((s, e))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def _binned(spans: list[tuple[float, float]], t0: float, width: float, bins: int) -> list[float]:
    busy = [0.0] * bins
    for s, e in spans:
        k = max(int((s - t0) // width), 0)
        while k < bins and t0 + k * width < e:
            lo, hi = max(s, t0 + k * width), min(e, t0 + (k + 1) * width)
            busy[k] += max(hi - lo, 0.0)
            k += 1
    return [round(min(b / width, 1.0), 4) for b in busy]


def activity(trainer: list[dict], samplers: list[list[dict]], bins: int = ACTIVITY_BINS) -> dict:
    """Busy fractions per wall-time bin of the trainer, the samplers (any replica busy) and both."""
    tr = _intervals(trainer)
    sa = _intervals([r for recs in samplers for r in recs])
    both = _intersect(tr, sa)
    if not tr and not sa:
        return {}
    t0 = min(x[0] for x in tr + sa)
    t1 = max(x[1] for x in tr + sa)
    width = max((t1 - t0) / bins, 1e-3)
    return {"t": [round(t0 + (k + 1) * width, 3) for k in range(bins)],
            "trainer": _binned(tr, t0, width, bins), "sampler": _binned(sa, t0, width, bins),
            "overlap": _binned(both, t0, width, bins),
            "trainer_busy_s": round(sum(e - s for s, e in tr), 2), "sampler_busy_s": round(sum(e - s for s, e in sa), 2),
            "overlap_s": round(sum(e - s for s, e in both), 2)}


def events(run, phases: list[dict], trainer: list[dict]) -> list[dict]:
    """Phase ends and replay-gate openings, each with a step and a wall time where known."""
    time_of_step = {r["step"]: r["time"] for r in trainer if _num(r.get("step")) and _num(r.get("time"))}
    out = []
    for p in phases:
        if not p.get("done"):
            continue
        if p["kind"] == "phase":
            out.append({"kind": "phase", "index": p["index"], "step": p.get("step"),
                        "t": time_of_step.get(p.get("step"))})
            continue
        marker = run.marker(run.replay_gate_marker(p["index"])) or {}
        t = marker.get("time")
        step = max((s for s, ts in time_of_step.items() if _num(t) and ts <= t), default=None)
        out.append({"kind": "replay_gate", "index": p["index"], "step": step, "t": t, "eligible": p.get("eligible")})
    return out


def ranges(numbers: list[int]) -> str:
    """[0, 398, 399, 400] -> 'v0, v398-v400'."""
    parts, nums = [], sorted(set(numbers))
    i = 0
    while i < len(nums):
        j = i
        while j + 1 < len(nums) and nums[j + 1] == nums[j] + 1:
            j += 1
        parts.append(f"v{nums[i]}" if i == j else f"v{nums[i]}-v{nums[j]}")
        i = j + 1
    return ", ".join(parts)


def version_summary(stored: list[int], latest: int | None, sync_every: int, samplers: list[list[dict]]) -> dict:
    loaded = {int(r["sampler/policy_version"]) for recs in samplers for r in recs if _num(r.get("sampler/policy_version"))}
    return {"latest": latest, "published": (latest // max(sync_every, 1) + 1) if latest is not None else 0,
            "stored": len(stored), "stored_ranges": ranges(stored),
            "sampler_loaded": len(loaded), "sampler_newest": max(loaded) if loaded else None}


class KeptPerRun:
    """State a dashboard poll builds on the last one's, kept for the `MAX_RUNS` runs (or buffers)
    viewed last: `of(key)` gives the key's, made on first use; each subclass keeps its own."""

    MAX_RUNS = 16

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        cls._cache: OrderedDict = OrderedDict()
        cls._lock = threading.Lock()

    @classmethod
    def of(cls, key: str):
        with cls._lock:
            kept = cls._cache.pop(key, None) or cls()
            cls._cache[key] = kept
            while len(cls._cache) > cls.MAX_RUNS:
                cls._cache.popitem(last=False)
            return kept


class BufferHistory(KeptPerRun):
    """Rows per tier after each commit of a buffer's log, kept per buffer URL between polls (the
    `MAX_RUNS` buffers viewed last; at most `MAX_KEPT` points each, thinned when it grows past)."""

    MAX_KEPT = 8 * MAX_POINTS

    def __init__(self) -> None:
        self.next_version: int | None = None
        self.shards: dict[str, tuple[str, int]] = {}
        self.rows = {"l1": 0, "l2": 0, "l3": 0}
        self.points: list[list] = []  # [time, l1, l2, l3]
        self.lock = threading.Lock()

    def update(self, log, max_entries: int = 20000) -> None:
        """Apply the entries of `log` (a `CommitLog`) committed since the last update."""
        with self.lock:
            self._update(log, max_entries)

    def _update(self, log, max_entries: int) -> None:
        if self.next_version is None:
            present = log.entry_versions()
            self.next_version = present[0] if present else 1
            if self.next_version > 1:  # the entries before it were vacuumed: start from a checkpoint
                self._seed(log)
        for _ in range(max_entries):
            entry = log.read_entry(self.next_version)
            if entry is None:
                break
            self.next_version += 1
            for action in entry.actions:
                op = getattr(action, "op", None)
                if op == "add":
                    self.shards[action.path] = (action.tier, action.rows)
                    self.rows[action.tier] += action.rows
                elif op in ("remove", "quarantine") and action.path in self.shards:
                    tier, rows = self.shards.pop(action.path)
                    self.rows[tier] -= rows
            if entry.time:
                self.points.append([round(entry.time, 3), self.rows["l1"], self.rows["l2"], self.rows["l3"]])
        if len(self.points) > self.MAX_KEPT:
            self.points = self.points[:-1:2] + self.points[-1:]

    def _seed(self, log) -> None:
        """The shards of the first state checkpoint from which the entries that are left follow."""
        usable = [c for c in log.checkpoint_versions() if c >= self.next_version - 1]
        if not usable:
            return
        try:
            state = log.read_checkpoint(min(usable))
        except Exception:  # noqa: BLE001 - a chart without its start, not an error page
            return
        self.shards = {path: (info.tier, info.rows) for path, info in state.shards.items()}
        for tier, rows in self.shards.values():
            self.rows[tier] += rows
        self.next_version = state.version + 1

    def series(self, limit: int = MAX_POINTS) -> dict:
        pts = self.points
        if len(pts) > limit:
            stride = len(pts) / limit
            pts = [pts[int(i * stride)] for i in range(limit - 1)] + [pts[-1]]
        return {"t": [p[0] for p in pts], "l1": [p[1] for p in pts], "l2": [p[2] for p in pts],
                "l3": [p[3] for p in pts]}
