"""The demo run with its run directory on local disk and on an S3 endpoint: prints ONE JSON line.

    .venv/bin/python bench/storage.py [--steps 400] [--repeats 2] [--smoke] [--config configs/tiny-grpo.yaml]

Runs `rlhf run CONFIG` one run after the other on the same machine, with `--run-dir
file:///<tmp>/local-i` and with `--run-dir s3://<bucket>/<prefix>` on moto's S3 server on 127.0.0.1
(the endpoint the tests use, `tests/buffer/s3_endpoint.py`: a process of its own that serves one
request at a time, on the same cores as the run; the runs reach it through FSSPEC_S3_ENDPOINT_URL
and dummy AWS_* credentials). Everything of the run goes there: buffer shards and commit log,
policy versions, metrics, markers. Each arm runs `--repeats` times (default 2; 1 with `--smoke`)
in palindromic order: local, s3, s3, local (`order`), after the engine's libraries were imported
once (so that neither arm pays alone for reading them from disk): this machine's speed drifts over
minutes, and a steady drift then weighs on both arms alike.

- `local_wall_s` / `s3_wall_s`: the loop's wall time, the mean over the arm's runs (each in
  `*_wall_runs_s`): summary.json `wall_s`, from the first engine process's start (after its
  imports and `prepare`) to the end of the last sampler batch or trainer step; `ratio_wall` =
  s3 / local.
- `local_total_s` / `s3_total_s`: the whole command (prepare, loop, finalize with its two held-out
  evaluations and compaction), means likewise; `ratio_total` likewise.
- `*_sampler_busy_s`, `*_trainer_busy_s`, `*_overlap_ratio` (wall / max(sampler busy, trainer
  busy)): of the arm's first run; `*_eval_after`: held-out score of each run's final policy (the
  storage should not change what is learnt; one value when the runs agree).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "buffer"))
FIRST = ("sampler_busy_s", "trainer_busy_s", "overlap_ratio")  # of each arm's first run
IMPORTS = "import torch, transformers, pyarrow.parquet, s3fs, pipeline.trainer.loop, pipeline.sampler.loop"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="configs/tiny-grpo.yaml")
    p.add_argument("--steps", type=int, default=None, help="trainer steps (default: the config's)")
    p.add_argument("--repeats", type=int, default=2, help="runs per arm, in palindromic order (local, s3, s3, local)")
    p.add_argument("--smoke", action="store_true", help="40 steps, one run per arm (~2 min in all)")
    return p.parse_args(argv)


def rlhf_run(config: str, run_dir: str, sets: list[str]) -> dict:
    rlhf = Path(sys.executable).with_name("rlhf")
    argv = [str(rlhf)] if rlhf.exists() else [sys.executable, "-m", "pipeline"]
    argv += ["run", config, "--run-dir", run_dir, "--no-progress"]
    for s in sets:
        argv += ["--set", s]
    t0 = time.time()
    proc = subprocess.run(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    if proc.returncode != 0:
        raise RuntimeError(f"rlhf run --run-dir {run_dir} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    out = json.loads(proc.stdout[proc.stdout.index("{"):])
    out["command_s"] = round(time.time() - t0, 2)
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    from peer import arm_order, mean  # the palindromic order and the means of bench/peer.py
    from s3_endpoint import moto_s3

    steps = 40 if args.smoke and args.steps is None else args.steps
    repeats = 1 if args.smoke else args.repeats
    sets = [f"trainer.steps={steps}"] if steps else []
    config = str(ROOT / args.config)
    from pipeline.config import load_config
    from pipeline.orchestration import resolve_sources

    resolve_sources(load_config(config, sets))  # the built-in model and prompts, before either clock
    subprocess.run([sys.executable, "-c", IMPORTS], cwd=ROOT, check=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        order = arm_order(["local", "s3"], repeats)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    runs: dict[str, list[dict]] = {"local": [], "s3": []}
    with tempfile.TemporaryDirectory(prefix="rlhf-storage-") as tmp, moto_s3("rlhf-bench") as bucket:
        for arm in order:
            url = (Path(tmp, f"local-{len(runs['local'])}").as_uri() if arm == "local"
                   else f"s3://{bucket}/runs/{uuid.uuid4().hex[:12]}")
            runs[arm].append(rlhf_run(config, url, sets))
    line = {"config": args.config, "steps": runs["local"][0].get("steps"), "order": order}
    for arm, res in runs.items():
        line[f"{arm}_wall_s"] = mean([r.get("wall_s") for r in res])
        line[f"{arm}_wall_runs_s"] = [r.get("wall_s") for r in res]
        line[f"{arm}_total_s"] = mean([r.get("total_s") for r in res])
        line[f"{arm}_total_runs_s"] = [r.get("total_s") for r in res]
        line.update({f"{arm}_{k}": res[0].get(k) for k in FIRST})
        evals = sorted({r.get("eval_after") for r in res}, key=str)
        line[f"{arm}_eval_after"] = evals[0] if len(evals) == 1 else [r.get("eval_after") for r in res]
    for key in ("wall", "total"):
        lo, hi = line[f"local_{key}_s"], line[f"s3_{key}_s"]
        line[f"ratio_{key}"] = round(hi / lo, 3) if lo and hi is not None else None
    line["load_avg_1m"] = round(os.getloadavg()[0], 2)
    print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
