"""The demo run with its run directory on local disk and on an S3 endpoint: prints ONE JSON line.

    .venv/bin/python bench/storage.py [--steps 400] [--smoke] [--config configs/tiny-grpo.yaml]

Runs `rlhf run CONFIG` twice, one after the other, on the same machine: first with `--run-dir
file:///<tmp>/local`, then with `--run-dir s3://<bucket>/<prefix>` on moto's S3 server on 127.0.0.1
(the endpoint the tests use, `tests/buffer/s3_endpoint.py`: a process of its own that serves one
request at a time; the runs reach it through FSSPEC_S3_ENDPOINT_URL and dummy AWS_* credentials).
Everything of the run goes there: buffer shards and commit log, policy versions, metrics, markers.

- `local_wall_s` / `s3_wall_s`: the loop's wall time (summary.json `wall_s`: process start to the
  last trainer step); `ratio_wall` = s3 / local.
- `local_total_s` / `s3_total_s`: the whole command (prepare, loop, finalize with its two held-out
  evaluations and compaction); `ratio_total` likewise.
- `*_overlap_ratio`: wall / max(sampler busy, trainer busy) of each run; `*_eval_after`: held-out
  score of each run's final policy (the storage should not change what is learnt).
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
KEYS = ("wall_s", "total_s", "sampler_busy_s", "trainer_busy_s", "overlap_ratio", "eval_after", "steps")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="configs/tiny-grpo.yaml")
    p.add_argument("--steps", type=int, default=None, help="trainer steps (default: the config's)")
    p.add_argument("--smoke", action="store_true", help="40 steps per run (~2 min in all)")
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
    from s3_endpoint import moto_s3

    steps = 40 if args.smoke and args.steps is None else args.steps
    sets = [f"trainer.steps={steps}"] if steps else []
    config = str(ROOT / args.config)
    from pipeline.config import load_config
    from pipeline.orchestration import resolve_sources

    resolve_sources(load_config(config, sets))  # the built-in model and prompts, before either clock
    with tempfile.TemporaryDirectory(prefix="rlhf-storage-") as tmp:
        local = rlhf_run(config, Path(tmp, "local").as_uri(), sets)
        with moto_s3("rlhf-bench") as bucket:
            s3 = rlhf_run(config, f"s3://{bucket}/runs/{uuid.uuid4().hex[:12]}", sets)
    line = {"config": args.config, "steps": local.get("steps")}
    for name, res in (("local", local), ("s3", s3)):
        line.update({f"{name}_{k}": res.get(k) for k in KEYS if k != "steps"})
    line["ratio_wall"] = round(s3["wall_s"] / local["wall_s"], 3) if local.get("wall_s") else None
    line["ratio_total"] = round(s3["total_s"] / local["total_s"], 3) if local.get("total_s") else None
    line["load_avg_1m"] = round(os.getloadavg()[0], 2)
    print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
