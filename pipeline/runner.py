"""Prepare a run, run sampler and trainer as two OS processes (the local runner), finalize.

The local runner does what the Airflow DAG does, through the same functions: `prepare` (the
prepare task), two subprocesses `rlhf sampler` / `rlhf trainer` (the two long-running tasks),
`finalize` (the finalize task).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time

from .config import ConfigError, RunConfig
from .data import load_prompts, stage
from .example import ensure_example
from .policy import PolicyStore
from .rewards import load_reward_fn
from .runs import RunDir, new_run_id, run_url_for
from .signals import StopSignal, default_stop_signals
from .storage import url_to_fs
from .summary import build_summary

log = logging.getLogger("rlhf.runner")
DEFAULT_RUNS_ROOT = "runs"


def _builtin(spec: str, field: str, seed: int) -> str | None:
    if not spec.startswith("builtin:"):
        return None
    task = spec.split(":", 1)[1]
    from .tasks import TASKS

    if task not in TASKS:
        raise ConfigError(f"{field}: unknown built-in {spec!r}; use one of " + ", ".join(f"builtin:{t}" for t in TASKS))
    return ensure_example(task, seed)


def resolve_sources(cfg: RunConfig) -> dict:
    """Concrete URLs of model, train and eval data (building the built-in example if named)."""
    out = {}
    ex = _builtin(cfg.model.path, "model.path", cfg.seed)
    out["model"] = os.path.join(ex, "model") if ex else cfg.model.path
    ex = _builtin(cfg.data.train, "data.train", cfg.seed)
    out["train"] = os.path.join(ex, "data", "train.parquet") if ex else cfg.data.train
    ex = _builtin(cfg.data.eval, "data.eval", cfg.seed)
    out["eval"] = os.path.join(ex, "data", "test.parquet") if ex else cfg.data.eval
    return out


def validate_inputs(cfg: RunConfig) -> dict:
    """Everything that can be checked without loading a model: reward, datasets, model folder."""
    load_reward_fn(cfg.reward.fn)
    src = resolve_sources(cfg)
    load_prompts(src["train"], "data.train", limit=1)
    load_prompts(src["eval"], "data.eval", limit=1)
    fs, path = url_to_fs(src["model"])
    if not fs.exists(path.rstrip("/") + "/config.json"):
        raise ConfigError(f"model.path: {src['model']!r} is not a Hugging Face model folder (no config.json)")
    return src


def prepare(cfg: RunConfig, run_url: str | None = None, runs_root: str = DEFAULT_RUNS_ROOT) -> RunDir:
    """Validate, create the run directory, stage prompts, publish policy v0. Idempotent on retry.
    Where the run goes is checked first ('..', a folder that is not a run's), before any input loads."""
    if run_url is None:
        run_url = run_url_for(runs_root, cfg.run_id or new_run_id())
    run = RunDir(run_url)
    run.check_creatable()
    src = validate_inputs(cfg)
    run.create(cfg)
    if not run.fs.exists(run.path("data", "train.parquet")):
        stage(src["train"], run.fs, run.path("data", "train.parquet"), "data.train")
    if not run.fs.exists(run.path("data", "eval.parquet")):
        stage(src["eval"], run.fs, run.path("data", "eval.parquet"), "data.eval", limit=cfg.data.eval_size)
    store = PolicyStore(run)
    if not store.exists(0):
        from .models import localize

        store.publish_folder(0, localize(src["model"]), {"step": 0, "source": src["model"]})
    run.write_json("prepare.json", {"sources": src, "time": time.time()})
    return run


def evaluate_policy(run: RunDir, version: int, threads: int = 2) -> dict:
    """Held-out score of a published policy version (greedy, the task's reward)."""
    from .evaluate import evaluate
    from .models import set_threads
    from .sampler.backend import make_backend

    cfg = run.config()
    set_threads(threads)
    policy_dir = PolicyStore(run).local_dir(version)
    backend = make_backend("hf", policy_dir, dtype=cfg.model.dtype, threads=threads, seed=cfg.seed)
    try:
        prompts = load_prompts(run.child_url("data", "eval.parquet"), "data.eval")
        return evaluate(backend, backend.tokenizer, prompts, load_reward_fn(cfg.reward.fn),
                        cfg.eval.max_new_tokens or cfg.sampler.max_new_tokens, cfg.eval.batch_size)
    finally:
        backend.close()


def finalize(run: RunDir, threads: int = 2) -> dict:
    """Evaluate the first and the latest policy, write summary.json. Idempotent."""
    store = PolicyStore(run)
    latest = store.latest() or 0
    evals = run.read_json("eval.json", {}) or {}
    for v in (0, latest):
        if str(v) not in evals:
            evals[str(v)] = evaluate_policy(run, v, threads)
            run.write_json("eval.json", evals)
    summary = build_summary(run, eval_before=evals["0"], eval_after=evals[str(latest)], policy_version=latest)
    run.write_json("summary.json", summary)
    return summary


def _child(cmd: str, run: RunDir, threads: int, nproc: int = 1) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
               TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"] \
        if nproc > 1 else [sys.executable]
    # A session of its own: a terminal's Ctrl-C or hangup reaches the runner only, which stops the
    # children through the stop marker (and SIGTERM to their group if they overstay).
    return subprocess.Popen([*launcher, "-m", "pipeline", cmd, "--run-dir", run.url], env=env,
                            start_new_session=True, preexec_fn=default_stop_signals)


def run_local(cfg: RunConfig, run_url: str | None = None, progress: bool = True) -> dict:
    """prepare -> sampler + trainer subprocesses -> finalize.

    Ctrl-C, SIGTERM and SIGHUP stop runner, sampler and trainer cleanly: the runner writes the
    stop marker, the sampler commits its queued shards, the trainer stops at its next wait
    (`pipeline.signals`).
    Started with SIGINT ignored (`rlhf run ... &` in a script) or SIGHUP ignored (nohup), the
    runner keeps ignoring it, as whoever started it that way intends; SIGTERM still stops it. The
    sampler and trainer get the default dispositions back instead of inheriting the ignore.
    """
    from .progress import follow
    from .trainer.phases import advance

    t_start = time.time()
    run = prepare(cfg, run_url)
    log.info("run directory: %s", run.url)
    procs: dict[str, subprocess.Popen] = {}
    try:
        procs["sampler"] = _child("sampler", run, cfg.sampler.threads)
        procs["trainer"] = _child("trainer", run, cfg.trainer.threads, cfg.trainer.nproc_per_node)
        follow(run, procs, show_bar=progress, on_tick=lambda: advance(run))
        rc = procs["trainer"].wait()
        if rc == 0:
            advance(run)  # the last phase's checkpoint becomes the final policy version
        run.request_stop("trainer finished" if rc == 0 else f"trainer exited with {rc}")
        src = procs["sampler"].wait(timeout=120)
        if rc != 0 or src != 0:
            raise RuntimeError(f"trainer exited with {rc}, sampler with {src}; see the output above and {run.url}/metrics")
    except BaseException as e:
        # Ctrl-C or a failure: ask both processes to stop at their next poll, then make sure.
        run.request_stop(f"interrupted by {e.signum.name}" if isinstance(e, StopSignal) else
                         "interrupted" if isinstance(e, KeyboardInterrupt) else f"runner failed: {e}")
        deadline = time.time() + 15
        for p in procs.values():
            _terminate(p, grace_s=max(0.0, deadline - time.time()))
        raise
    summary = finalize(run)
    summary["total_s"] = round(time.time() - t_start, 2)
    run.write_json("summary.json", summary)
    return summary


def _terminate(p: subprocess.Popen, grace_s: float = 10.0) -> None:
    """Wait up to `grace_s` for a clean exit (stop marker), then SIGTERM, then SIGKILL the group."""
    for sig in (None, signal.SIGTERM, signal.SIGKILL):
        try:
            if sig is not None:
                os.killpg(p.pid, sig)
            p.wait(timeout=grace_s if sig is None else 10.0)
            return
        except subprocess.TimeoutExpired:
            continue
        except ProcessLookupError:
            return
