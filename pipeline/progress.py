"""Progress a person reads: one line per look at a run, the same in every place that shows it.

    step 120/400 · reward 0.56 · held-out 0.61 · 1.9k tok/s · staleness 1.2 · ETA 1m10s · phase 1/2

`progress_line(run)` builds it from the run directory (the trainer's metrics stream, eval.json,
the phase and replay-gate markers). `rlhf run` prints it (`follow`), `rlhf airflow demo` prints it
for the DAG run it follows, and the trainer's Airflow task logs it every `trainer.log_every` steps
(`TrainerWatch`, which also tells a stalled trainer: no new step for `trainer.stall_timeout_s`;
both `rlhf run` and the trainer's Airflow task stop such a run).
"""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from dataclasses import dataclass, field

from .metrics import StreamReader
from .processes import RunFailed
from .rundir import RunDir

log = logging.getLogger("rlhf.progress")
WINDOW = 20  # recent trainer steps averaged for reward, throughput, staleness and the ETA


def _mean(values: list) -> float | None:
    nums = [float(v) for v in values if isinstance(v, (int, float))]
    return sum(nums) / len(nums) if nums else None


def format_duration(seconds: float) -> str:
    """70 -> '1m10s', 5 -> '5s', 3700 -> '1h01m'."""
    s = max(int(round(seconds)), 0)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def format_rate(per_s: float) -> str:
    """1900 -> '1.9k', 250 -> '250', 2.5e6 -> '2.5M'."""
    if per_s >= 1e6:
        return f"{per_s / 1e6:.1f}M"
    if per_s >= 1e3:
        return f"{per_s / 1e3:.1f}k"
    return f"{per_s:.0f}"


def _last_steps(records: list[dict]) -> list[dict]:
    """The last WINDOW step records, read from the end (a long run's stream holds many)."""
    out = []
    for r in reversed(records):
        if isinstance(r.get("step"), (int, float)):
            out.append(r)
            if len(out) == WINDOW:
                break
    return out[::-1]


def snapshot(run: RunDir, records: list[dict] | None = None, cfg=None) -> dict:
    """What the progress line says, as a dict (also the demo's and the task log's source); `cfg`:
    the run's config, when the caller has read it."""
    cfg = cfg or run.config()
    records = run.read_metrics("trainer") if records is None else records
    recent = _last_steps(records)
    snap: dict = {"steps": cfg.trainer.steps, "step": int(recent[-1]["step"]) if recent else 0,
                  "reward": _mean([r.get("reward/mean") for r in recent]),
                  "tok_s": _mean([r.get("perf/tokens_per_s") for r in recent]),
                  "staleness": _mean([r.get("staleness/mean") for r in recent]), "eta_s": None}
    if len(recent) >= 2 and isinstance(recent[0].get("time"), (int, float)):
        dt, ds = recent[-1]["time"] - recent[0]["time"], recent[-1]["step"] - recent[0]["step"]
        if dt > 0 and ds > 0:
            snap["eta_s"] = max(snap["steps"] - snap["step"], 0) * dt / ds
    evals = run.read_json("eval.json") or {}
    scored = [(int(v), e["score"]) for v, e in evals.items()
              if isinstance(e, dict) and isinstance(e.get("score"), (int, float))]
    snap["heldout"] = max(scored)[1] if scored else None
    names = set(run.markers())
    n_phases, n_gates = int(cfg.trainer.phases or 1), int(cfg.trainer.replay_epochs or 0)
    done = sum(run.phase_done_marker(k) in names for k in range(n_phases))
    snap["phase"] = (min(done + 1, n_phases), n_phases)
    snap["gates_open"] = [e for e in range(n_gates) if run.replay_gate_marker(e) in names]
    snap["gates"] = n_gates
    snap["done"] = run.TRAINER_DONE_MARKER in names
    return snap


def format_progress(snap: dict) -> str:
    """The one line: `step 120/400 · reward 0.56 · ... · phase 1/2 · replay gate 0 open`."""
    if not snap.get("step"):
        parts = [f"waiting for the first trainer step (of {snap.get('steps', '?')})"]
    else:
        parts = [f"step {snap['step']}/{snap['steps']}"]
        if snap.get("reward") is not None:
            parts.append(f"reward {snap['reward']:.2f}")
    if snap.get("heldout") is not None:
        parts.append(f"held-out {snap['heldout']:.2f}")
    if snap.get("step"):
        if snap.get("tok_s") is not None:
            parts.append(f"{format_rate(snap['tok_s'])} tok/s")
        if snap.get("staleness") is not None:
            parts.append(f"staleness {snap['staleness']:.1f}")
        if snap.get("done") or snap["step"] >= snap["steps"]:
            parts.append("trainer done")
        elif snap.get("eta_s") is not None:
            parts.append(f"ETA {format_duration(snap['eta_s'])}")
    k, n = snap.get("phase") or (1, 1)
    parts.append(f"phase {k}/{n}")
    if snap.get("gates"):
        opened = snap.get("gates_open") or []
        parts.append(f"replay gate {opened[-1]} open" if opened else f"replay gates 0/{snap['gates']} open")
    return " · ".join(parts)


def progress_line(run: RunDir, records: list[dict] | None = None, cfg=None) -> str:
    return format_progress(snapshot(run, records, cfg))


@dataclass
class TrainerWatch:
    """Watches the trainer's metrics from outside its process: a progress line every `every`
    steps, and a stall when no new step appeared for `stall_timeout_s` (0: never) since the
    watch started or the last new step. `clock` is monotonic seconds. It reads only the metrics
    that are new since its last look (`reader`)."""

    run: RunDir
    every: int = 5
    stall_timeout_s: float = 0.0
    clock: object = time.monotonic
    last_step: int | None = None
    last_change: float | None = None
    logged_step: int = -1
    cfg: object = None  # the run's config, when the caller has read it
    reader: StreamReader = field(init=False)
    records: list = field(init=False, default_factory=list)  # the stream as the last poll read it
    _max_step: int = field(init=False, default=0)  # over `records`, kept as they grow

    def __post_init__(self) -> None:
        self.reader = StreamReader(self.run, "trainer")

    def poll(self) -> tuple[str | None, str | None]:
        """(a progress line to log or None, the reason of a stall or None)."""
        now = self.clock()
        seen, records = len(self.records), self.reader.read()
        if len(records) < seen or (seen and records[seen - 1] is not self.records[seen - 1]):
            # the stream was replaced (a resumed trainer drops the steps it redoes): redone steps are progress
            seen, self._max_step, self.last_step = 0, 0, None
        self.records = records
        step = self._max_step = max([self._max_step, *(int(r["step"]) for r in records[seen:]
                                                        if isinstance(r.get("step"), (int, float)))])
        if self.last_step is None or step > self.last_step:
            self.last_step, self.last_change = step, now
        line = None
        if step > 0 and step // self.every > self.logged_step // self.every:
            line, self.logged_step = progress_line(self.run, records, self.cfg), step
        idle = now - (self.last_change if self.last_change is not None else now)
        if self.stall_timeout_s and idle >= self.stall_timeout_s and not self.run.has_marker(self.run.TRAINER_DONE_MARKER):
            return line, (f"no new trainer step for {format_duration(idle)} (trainer.stall_timeout_s="
                          f"{self.stall_timeout_s:g}); last step {step}")
        return line, None


def follow(run: RunDir, procs: dict[str, subprocess.Popen], show_bar: bool = True, poll_s: float = 1.0,
           on_tick=None, cfg=None) -> None:
    """Block until the trainer exits; fail fast if the sampler dies first, or if the trainer
    records no new step for `trainer.stall_timeout_s` (as the trainer's Airflow task does). `on_tick()`
    runs every poll (the local runner's orchestration: reshard finished phases, open replay gates).
    In a terminal the progress line is rewritten in place; elsewhere it is logged every
    `trainer.log_every` steps. `cfg`: the run's config, when the caller has read it."""
    tty = show_bar and sys.stderr.isatty()
    cfg = cfg or run.config()
    watch = TrainerWatch(run, every=cfg.trainer.log_every, cfg=cfg, stall_timeout_s=float(cfg.trainer.stall_timeout_s))
    shown = ""
    try:
        while procs["trainer"].poll() is None:
            if on_tick is not None:
                on_tick()
            s = procs["sampler"].poll()
            if s is not None and s != 0:
                raise RunFailed(f"sampler exited with {s} while the trainer was running")
            line, stalled = watch.poll()
            if stalled:
                raise RunFailed(f"the trainer stalled: {stalled}; the engines are stopped. The same command "
                                "resumes the run from its last checkpoint")
            if tty:
                line = progress_line(run, watch.records, cfg)
                if line != shown:
                    sys.stderr.write("\r" + line.ljust(len(shown)))
                    sys.stderr.flush()
                    shown = line
            elif line:
                log.info("%s", line)
            time.sleep(poll_s)
    finally:
        if tty and shown:
            sys.stderr.write("\n")
    if not tty:
        log.info("%s", progress_line(run, watch.reader.read(), cfg))
