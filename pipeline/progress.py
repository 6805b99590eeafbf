"""Progress of a running sampler/trainer pair: a bar in a terminal, a log line every N steps elsewhere."""

from __future__ import annotations

import logging
import subprocess
import sys
import time

from .rundir import RunDir

log = logging.getLogger("rlhf.progress")


def follow(run: RunDir, procs: dict[str, subprocess.Popen], show_bar: bool = True, poll_s: float = 1.0,
           on_tick=None) -> None:
    """Block until the trainer exits; fail fast if the sampler dies first. `on_tick()` runs every
    poll (the local runner's orchestration: reshard finished phases, open replay gates)."""
    steps = run.config().trainer.steps
    tty = show_bar and sys.stderr.isatty()
    bar = None
    if tty:
        from tqdm import tqdm

        bar = tqdm(total=steps, unit="step", dynamic_ncols=True, desc="train")
    last = 0
    try:
        while procs["trainer"].poll() is None:
            if on_tick is not None:
                on_tick()
            s = procs["sampler"].poll()
            if s is not None and s != 0:
                raise RuntimeError(f"sampler exited with {s} while the trainer was running")
            recs = [r for r in run.read_metrics("trainer") if "step" in r]
            if recs and recs[-1]["step"] > last:
                r = recs[-1]
                info = {"reward": f"{r['reward/mean']:.3f}", "tok/s": f"{r['perf/tokens_per_s']:.0f}",
                        "stale": f"{r['staleness/mean']:.1f}"}
                if bar is not None:
                    bar.update(r["step"] - last)
                    bar.set_postfix(info)
                elif r["step"] // 10 > last // 10 or r["step"] == steps:
                    log.info("step %d/%d %s", r["step"], steps, " ".join(f"{k}={v}" for k, v in info.items()))
                last = r["step"]
            time.sleep(poll_s)
    finally:
        if bar is not None:
            bar.close()
