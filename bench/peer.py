"""This project against TRL's GRPOTrainer, side by side on one machine: one JSON line per regime.

    make peer                                   # builds .venv-peer (requirements/peer.txt), runs both regimes
    .venv/bin/python bench/peer.py [--regimes demo,generation-heavy] [--smoke] [--steps N]
        [--eval-every K] [--eval-size N] [--target X] [--peer-python .venv-peer/bin/python] [--peer-bf16]
        [--repeats R] [--seed S]

Each regime runs the arms one after the other, each with both cores (ours: sampler and trainer,
one thread each; TRL: one process, two threads), `--repeats` times each (default 2; 1 with
`--smoke`) in palindromic order: ours, TRL, TRL, ours (`order` in the line). The speed of this
machine drifts by 20-30% over minutes, and an arm that ran in a fast spell alone moved the ratio
as much as any change to the code (0.43 and 0.63 in two runs of the same commit); in a palindrome
a drift that is steady over the bench weighs on both arms alike. Seeded runs of an arm follow the
same curve; each is evaluated. The arms run on the same inputs:

- the model folder and Parquet prompts `rlhf init-example --task <task>` builds (built before the
  clocks start), prompts rendered with the tokenizer's chat template by both;
- the same reward function (`pipeline.builtin_tasks`), batch shape (16 prompts x 8 completions
  per step, one optimizer step per batch), generation length, sampling temperature 1 (no top-k),
  learning rate (5e-4, constant), no KL term, token-mean loss, group-normalised advantages,
  gradient clipping: `trl_settings` passes them from the regime's config to the TRL script, and
  refuses a config with a setting TRL's arm has no counterpart for. The policy ratio is clipped at
  0.2 in both, but it binds only in ours: TRL with one iteration per batch clips the ratio to its
  own detached log-probs (always 1), ours to the sampler's behaviour policy, up to
  `sampler.max_staleness` versions old (the algorithms as each really runs);
- the groups a step trains on: 16 prompts' in both. Where the config sets `sampler.oversample`
  (the generation-heavy one: 1.25), ours picks them among the groups of more prompts (20), the
  ones whose rewards vary most (`pipeline/sampler/groups.py`; its sampler would otherwise wait for
  the trainer); TRL's GRPOTrainer has no such option and trains on every group it generates. The
  completions ours generates and does not hand over count in its generated tokens (tokens to the
  target, tokens per second). `ours_oversample` in the line;
- each arm in its fastest precision on this CPU. The generation-heavy config trains in bf16
  (`trainer.dtype`) and samples in float32. TRL's one model trains and generates in one dtype:
  float32 by default, `--peer-bf16` for `bf16=True` (autocast, float32 master weights, eager
  attention like our bf16 trainer). On the generation-heavy regime its bf16 gained nothing here:
  0.72, 0.93 and 1.08 s per step against 0.83, 0.81 and 0.92 s in float32 (pairs of 24- to
  40-step runs, one after the other);
- the same held-out evaluation, run after both arms with the same code (`pipeline.evaluate`,
  greedy, the run's `data/eval.parquet`) on the policies after 0, K, 2K, ... steps: ours reads them
  from `<run>/policy/v<K>` (retention widened so that they all stay), TRL's arm saves them every K
  steps (the saving time is recorded and taken off its clock). Evaluation is on neither clock.

Before the clocks start, each arm's libraries are imported once in its own environment (the page
cache then holds both; otherwise the arm that runs first pays alone for reading them from disk).
Clocks start when the arm's command starts (`rlhf run CONFIG` for ours: prepare, process start,
model loads; the TRL script: imports, model load, dataset) and read the end of step K: for ours the
trainer's `time/end` of step K in `metrics/trainer.jsonl`, for TRL the step's end in its log.
Printed per regime:

- `*_time_to_target_s`: the clock at the first evaluated step whose held-out score >= `target`,
  the mean over the arm's runs (null unless every run reached it; each run's in
  `*_time_to_target_runs_s`); `ratio_time_to_target` = ours / trl (< 1: ours is faster; 0.5:
  twice as fast).
- `*_tokens_to_target`: completion tokens generated until then (ours: by the sampler, which runs
  ahead of the trainer by up to `sampler.max_staleness` versions; TRL: by its own generation).
- `*_gen_tokens_per_s`: completion tokens generated per second of the running loop (from the first
  batch's start to the last step's end; TRL: less the saving time).
- `*_start_s`: the clock at the end of step 1 (start-up plus one step).
- `*_curves`: per run, [step, clock_s, held-out score] per evaluated step. Steps and tokens to
  the target are one value when the runs agree, else one per run; tokens/s and start are means.
- `dtypes`: the compute dtype of our trainer and sampler and of TRL's arm.
- generation-heavy only, a third arm: ours again with L2 replay on (`REPLAY`), printed as
  `ours_replay_*` with `replay_tokens_ratio` and `replay_time_ratio` (replay / no replay: < 1 is
  fewer generated tokens, resp. less time, to the target) and `ours_replay_reuse_rate`.
- from each arm's first run: `ours_wall_s`, `ours_overlap_ratio`, the busy times, the replay
  arm's reuse rate and `ours_replay_updates` (replay updates it applied), `*_trainer_wait_s`
  (the time our trainer waited for fresh groups after its first step: all that replay which
  gives way to fresh data can fill), `*_cpu_s`: CPU seconds the arm's processes used (ours: with
  finalize's evaluations), and the 1-minute load average after each arm: on a shared machine,
  what the other work took.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

REGIMES = {
    # config, steps, eval every, target held-out score (reached by both arms in a full run here)
    "demo": {"config": "configs/tiny-grpo.yaml", "steps": 160, "eval_every": 10, "target": 0.60},
    "generation-heavy": {"config": "configs/tiny-grpo-long.yaml", "steps": 300, "eval_every": 30, "target": 0.40,
                         "replay_arm": True},
}
# The replay arm's settings besides one replay epoch per fresh step (see replay_overrides): the
# default replay (positive rows at half the learning rate, up to 2 replays per group) that gives way
# to fresh data, so it runs only while the trainer would wait for the sampler.
REPLAY = ("trainer.replay_yield=true",)
SMOKE = {"demo": {"steps": 20, "eval_every": 10}, "generation-heavy": {"steps": 10, "eval_every": 5}}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--regimes", default="demo,generation-heavy")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps per arm (default: per regime)")
    p.add_argument("--eval-every", type=int, default=None)
    p.add_argument("--eval-size", type=int, default=256, help="held-out prompts")
    p.add_argument("--target", type=float, default=None, help="held-out score to reach (default: per regime)")
    p.add_argument("--smoke", action="store_true", help="a few steps per arm, 64 held-out prompts (~3 min)")
    p.add_argument("--peer-python", default=str(ROOT / ".venv-peer" / "bin" / "python"))
    p.add_argument("--threads", type=int, default=2,
                   help="TRL's torch threads (its one process); ours runs the config's sampler and trainer threads (1 + 1)")
    p.add_argument("--peer-bf16", action="store_true", help="TRL's arm in bf16 mixed precision (default: float32)")
    p.add_argument("--repeats", type=int, default=2,
                   help="runs per arm, in palindromic order (ours, trl, trl, ours): times to the target are their means")
    p.add_argument("--seed", type=int, default=None, help="the run's seed: built-in model, prompts, sampling (default: the config's)")
    p.add_argument("--work-dir", default=None, help="where runs go (default: a temporary folder, removed)")
    return p.parse_args(argv)


def regime_settings(name: str, args) -> dict:
    s = dict(REGIMES[name])
    if args.smoke:
        s.update(SMOKE[name])
        args.eval_size = min(args.eval_size, 64)
        args.repeats = 1
    for key in ("steps", "eval_every", "target"):
        if getattr(args, key) is not None:
            s[key] = getattr(args, key)
    from pipeline.config import load_config

    if args.seed is not None:
        s["seed"] = args.seed
    s["cfg"] = load_config(str(ROOT / s["config"]), overrides(s, args.eval_size))
    trl_settings(s["cfg"])  # a setting TRL's arm cannot run ends the bench before any arm runs
    try:
        arm_order(["ours"], args.repeats)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    return s


def overrides(s: dict, eval_size: int) -> list[str]:
    return [f"trainer.steps={s['steps']}", f"trainer.keep_policy_versions={s['steps'] + 1}",
            f"data.eval_size={eval_size}", *([f"seed={s['seed']}"] if "seed" in s else [])]


# the arms -----------------------------------------------------------------------------------------
# What each arm's processes import first. Read once by `warm_up` before the clocks start: the arm
# that ran first otherwise paid alone for reading its libraries from disk into the page cache
# (a cold start of 16-22 s instead of 7.5 s was seen on a machine with little of it cached).
OURS_IMPORTS = "import torch, transformers, pyarrow.parquet, pipeline.trainer.loop, pipeline.sampler.loop"
TRL_IMPORTS = "import torch, transformers, datasets, pyarrow.parquet, trl; from trl import GRPOTrainer"


def warm_up(peer_python: str) -> None:
    """Import both arms' libraries once, each in its own environment, off the clocks."""
    for python, code in ((sys.executable, OURS_IMPORTS), (peer_python, TRL_IMPORTS)):
        subprocess.run([python, "-c", code], cwd=ROOT, check=True, stdout=subprocess.DEVNULL,
                       env=dict(os.environ, OMP_NUM_THREADS="1", TRANSFORMERS_VERBOSITY="error"))


def child_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run_ours(s: dict, run_dir: Path, extra: tuple[str, ...] = ()) -> dict:
    """`rlhf run CONFIG` (and `extra` overrides) with its clock; returns step end times, sampler token times."""
    from pipeline.rundir import RunDir

    rlhf = Path(sys.executable).with_name("rlhf")
    argv = [str(rlhf)] if rlhf.exists() else [sys.executable, "-m", "pipeline"]
    argv += ["run", str(ROOT / s["config"]), "--run-dir", run_dir.as_uri(), "--no-progress"]
    for o in [*overrides(s, s["cfg"].data.eval_size), *extra]:
        argv += ["--set", o]
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    t0, cpu0 = time.time(), child_cpu_s()
    proc = subprocess.run(argv, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    cpu = child_cpu_s() - cpu0  # the whole command, with finalize's two evaluations
    if proc.returncode != 0:
        raise RuntimeError(f"rlhf run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    run = RunDir(run_dir.as_uri())
    records = run.read_metrics("trainer")
    steps = {r["step"]: r for r in records if "step" in r}
    batches = [r for n in run.metric_streams() if n.startswith("sampler") for r in run.read_metrics(n)
               if "sampler/gen_tokens" in r]
    summary = json.loads(Path(run_dir, "summary.json").read_text())
    return {"t0": t0, "steps": steps, "batches": batches, "summary": summary, "run": run, "cpu_s": cpu,
            "load": os.getloadavg()[0], **trainer_idle(records)}


def trainer_idle(records: list[dict]) -> dict:
    """What replay that gives way to fresh data could fill, from the trainer's metric records: its
    waits for fresh groups after its first step (before it, nothing is in L2), and the replay
    updates it applied."""
    fresh = [r for r in records if "timing_s/wait" in r and not r.get("replay/is_replay")]
    return {"trainer_wait_s": round(sum(r["timing_s/wait"] for r in fresh if r.get("step", 0) > 1), 2),
            "replay_updates": sum(1 for r in records if r.get("replay/is_replay"))}


def trl_settings(cfg) -> list[str]:
    """The TRL script's arguments for the config's sampling and optimisation settings, so that both
    arms run the same ones; SystemExit for a setting TRL's arm has no counterpart for."""
    tc, sc = cfg.trainer, cfg.sampler
    unlike = {"trainer.algorithm": (tc.algorithm, "grpo"), "trainer.loss_agg": (tc.loss_agg, "token-mean"),
              "trainer.std_normalize": (tc.std_normalize, True), "trainer.update_epochs": (tc.update_epochs, 1),
              "trainer.kl_estimator": (tc.kl_estimator if tc.kl_coef else "k3", "k3"),
              "trainer.entropy_coef": (tc.entropy_coef, 0.0),
              "trainer.warmup_steps": (tc.warmup_steps, 0),  # HF's warmup starts at 0, ours at lr / warmup
              "trainer.weight_decay": (tc.weight_decay, 0.0),  # HF's decay skips biases and norms, ours does not
              # TRL clips its ratio to its own detached log-probs; ours without `decoupled` clips to the
              # behaviour policy, the nearest it has (the docstring); decoupled PPO has no TRL counterpart
              "trainer.decoupled": (tc.decoupled, False)}
    for key, (have, trl) in unlike.items():
        if have != trl:
            raise SystemExit(f"{key}={have!r}: TRL's arm runs only {trl!r}")
    return ["--temperature", repr(sc.temperature), "--top-p", repr(sc.top_p), "--clip-eps", repr(tc.clip_eps),
            "--beta", repr(tc.kl_coef), "--max-grad-norm", repr(tc.max_grad_norm)]


def run_trl(s: dict, model: str, train: str, out: Path, peer_python: str, threads: int, bf16: bool = False) -> dict:
    cfg = s["cfg"]
    argv = [peer_python, str(ROOT / "bench" / "peer_trl.py"), "--model", model, "--train", train,
            "--reward", cfg.reward.fn, "--out", str(out), "--steps", str(s["steps"]),
            "--save-every", str(s["eval_every"]), "--max-new-tokens", str(cfg.sampler.max_new_tokens),
            "--lr", str(cfg.trainer.lr), "--prompts-per-step", str(cfg.trainer.groups_per_step),
            "--group-size", str(cfg.sampler.group_size), "--threads", str(threads), "--seed", str(cfg.seed),
            *trl_settings(cfg)]
    if bf16:
        argv.append("--bf16")
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", WANDB_DISABLED="true")
    t0, cpu0 = time.time(), child_cpu_s()
    proc = subprocess.run(argv, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    cpu = child_cpu_s() - cpu0
    if proc.returncode != 0:
        raise RuntimeError(f"TRL arm failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    steps = {}
    for line in (out / "steps.jsonl").read_text().splitlines():
        r = json.loads(line)
        steps[r["step"]] = r
    return {"t0": t0, "steps": steps, "cpu_s": cpu, "load": os.getloadavg()[0]}


# held-out evaluation, the same code for both arms -----------------------------------------------------
class Evaluator:
    def __init__(self, cfg, eval_parquet: str, threads: int):
        from pipeline.data import load_prompts
        from pipeline.scoring import RewardScorer

        self.cfg, self.threads = cfg, threads
        self.prompts = load_prompts(eval_parquet, "data.eval")
        self.scorer = RewardScorer(cfg.reward.model_copy(update={"kind": "rule"}))

    def score(self, folder: str) -> float:
        from pipeline.evaluate import evaluate
        from pipeline.sampler.backend import make_backend

        backend = make_backend("hf", folder, dtype=self.cfg.model.dtype, threads=self.threads, seed=self.cfg.seed)
        try:
            out = evaluate(backend, backend.tokenizer, self.prompts, self.scorer,
                           self.cfg.eval.max_new_tokens or self.cfg.sampler.max_new_tokens, self.cfg.eval.batch_size)
        finally:
            backend.close()
        return round(out["score"], 4)

    def close(self):
        self.scorer.close()


def eval_steps(s: dict) -> list[int]:
    k, n = s["eval_every"], s["steps"]
    return sorted(set(range(0, n + 1, k)) | {n})


def ours_curve(ours: dict, s: dict, ev: Evaluator) -> list[list]:
    from pipeline.policy import PolicyStore

    store, curve = PolicyStore(ours["run"]), []
    for k in eval_steps(s):
        clock = 0.0 if k == 0 else ours["steps"][k]["time/end"] - ours["t0"]
        curve.append([k, round(clock, 2), ev.score(store.local_dir(k))])
    return curve


def trl_curve(trl: dict, s: dict, out: Path, ev: Evaluator) -> list[list]:
    curve = []
    for k in eval_steps(s):
        r = trl["steps"].get(k)
        clock = 0.0 if k == 0 else r["time/end"] - trl["t0"] - r["excluded_s"]
        curve.append([k, round(clock, 2), ev.score(str(out / f"v{k}"))])
    return curve


# figures ----------------------------------------------------------------------------------------------
def first_reaching(curve: list[list], target: float):
    return next(((k, t) for k, t, score in curve if score >= target), (None, None))


def ours_figures(ours: dict, curve: list[list], target: float) -> dict:
    step, t = first_reaching(curve, target)
    end = ours["steps"][max(ours["steps"])]["time/end"]
    batches = [b for b in ours["batches"] if b["time/end"] <= end]
    start = min((b["time/start"] for b in batches), default=end)
    tokens = sum(b["sampler/gen_tokens"] for b in batches)
    at = None if step is None else ours["t0"] + t
    return {"time_to_target_s": t, "step_to_target": step,
            "tokens_to_target": None if at is None else sum(b["sampler/gen_tokens"] for b in batches
                                                             if b["time/end"] <= at),
            "gen_tokens_per_s": round(tokens / max(end - start, 1e-9), 1),
            "start_s": round(ours["steps"][1]["time/end"] - ours["t0"], 2)}


def trl_figures(trl: dict, curve: list[list], target: float) -> dict:
    step, t = first_reaching(curve, target)
    last, first = trl["steps"][max(trl["steps"])], trl["steps"][min(trl["steps"])]
    loop = last["time/end"] - first["time/start"] - (last["excluded_s"] - first["excluded_s"])
    return {"time_to_target_s": t, "step_to_target": step,
            "tokens_to_target": None if step is None else (trl["steps"][step]["gen_tokens"] if step else 0),
            "gen_tokens_per_s": round(last["gen_tokens"] / max(loop, 1e-9), 1),
            "start_s": round(first["time/end"] - trl["t0"] - first["excluded_s"], 2)}


def arm_order(arms: list[str], repeats: int) -> list[str]:
    """The arms forwards, then backwards, and so on: a palindrome, so that a machine whose speed
    drifts over the bench (20-30% over minutes here) weighs on every arm alike. Only an even
    `repeats` makes one (or 1, a single pass): ValueError for 3, 5, ..."""
    if repeats < 1 or (repeats > 1 and repeats % 2):
        raise ValueError(f"--repeats {repeats}: 1 or an even number (the arms run in a palindrome)")
    return [a for r in range(repeats) for a in (arms if r % 2 == 0 else arms[::-1])]


def mean(values: list):
    return round(sum(values) / len(values), 2) if values and None not in values else None


def run_regime(name: str, args, work: Path) -> dict:
    from pipeline.orchestration import resolve_sources

    s = regime_settings(name, args)
    src = resolve_sources(s["cfg"])  # builds the task's model and prompts (rlhf init-example), off the clocks
    arms = ["ours", *(["replay"] if s.get("replay_arm") else []), "trl"]
    runs: dict[str, list[tuple[dict, Path]]] = {a: [] for a in arms}
    warm_up(args.peer_python)
    t_bench = time.time()
    order = arm_order(arms, args.repeats)
    for arm in order:
        out = work / f"{name}-{arm}-{len(runs[arm])}"
        shutil.rmtree(out, ignore_errors=True)
        if arm == "trl":
            r = run_trl(s, src["model"], src["train"], out, args.peer_python, args.threads, args.peer_bf16)
        else:
            r = run_ours(s, out, replay_overrides(s) if arm == "replay" else ())
        runs[arm].append((r, out))
    ev = Evaluator(s["cfg"], str(runs["ours"][0][1] / "data" / "eval.parquet"), args.threads)
    try:
        curves = {a: [trl_curve(r, s, out, ev) if a == "trl" else ours_curve(r, s, ev) for r, out in runs[a]]
                  for a in arms}
    finally:
        ev.close()
    figs = {a: [(trl_figures if a == "trl" else ours_figures)(r, c, s["target"]) for (r, _), c in zip(runs[a], curves[a])]
            for a in arms}
    o, t = merged(figs["ours"]), merged(figs["trl"])
    ours, trl = runs["ours"][0][0], runs["trl"][0][0]
    summ = ours["summary"]
    return {"regime": name, "seed": s["cfg"].seed, "target": s["target"], "steps": s["steps"], "eval_every": s["eval_every"],
            "eval_prompts": len(ev.prompts), "max_new_tokens": s["cfg"].sampler.max_new_tokens,
            "dtypes": {"ours_trainer": s["cfg"].trainer.dtype or s["cfg"].model.dtype, "ours_sampler": s["cfg"].model.dtype,
                       "trl": "bfloat16" if args.peer_bf16 else "float32"},
            "order": order, "ours_oversample": s["cfg"].sampler.oversample,
            "trl_time_to_target_s": t["time_to_target_s"], "ours_time_to_target_s": o["time_to_target_s"],
            "ratio_time_to_target": ratio(o["time_to_target_s"], t["time_to_target_s"]),
            "trl_time_to_target_runs_s": t["runs_s"], "ours_time_to_target_runs_s": o["runs_s"],
            "trl_gen_tokens_per_s": t["gen_tokens_per_s"], "ours_gen_tokens_per_s": o["gen_tokens_per_s"],
            "ours_tokens_to_target": o["tokens_to_target"], "trl_tokens_to_target": t["tokens_to_target"],
            "ours_step_to_target": o["step_to_target"], "trl_step_to_target": t["step_to_target"],
            "ours_start_s": o["start_s"], "trl_start_s": t["start_s"],
            "ours_wall_s": summ.get("wall_s"), "ours_overlap_ratio": summ.get("overlap_ratio"),
            "ours_sampler_busy_s": summ.get("sampler_busy_s"), "ours_trainer_busy_s": summ.get("trainer_busy_s"),
            "ours_trainer_wait_s": ours["trainer_wait_s"],
            "ours_cpu_s": round(ours["cpu_s"], 1), "trl_cpu_s": round(trl["cpu_s"], 1),
            "load_avg_after_ours": round(ours["load"], 2), "load_avg_after_trl": round(trl["load"], 2),
            "ours_curves": curves["ours"], "trl_curves": curves["trl"],
            **(replay_figures(runs["replay"], curves["replay"], figs["replay"], o, s) if "replay" in runs else {}),
            "bench_s": round(time.time() - t_bench, 1),
}


def merged(figs: list[dict]) -> dict:
    """An arm's runs as one: the mean time to the target (null unless every run reached it), its
    mean tokens per second and start, the step and tokens of each run (one value when they agree:
    seeded runs follow the same curve)."""
    def one(key):
        values = [f[key] for f in figs]
        return values[0] if len(set(values)) == 1 else values

    return {"time_to_target_s": mean([f["time_to_target_s"] for f in figs]),
            "runs_s": [f["time_to_target_s"] for f in figs],
            "gen_tokens_per_s": mean([f["gen_tokens_per_s"] for f in figs]),
            "start_s": mean([f["start_s"] for f in figs]),
            "step_to_target": one("step_to_target"), "tokens_to_target": one("tokens_to_target")}


def replay_overrides(s: dict) -> tuple[str, ...]:
    """The replay arm: the regime's config with L2 replay on, one replay epoch after every fresh step."""
    return (f"trainer.replay_epochs={s['steps']}", *REPLAY)


def ratio(a, b):
    return round(a / b, 3) if a and b else None


def replay_figures(runs: list, curves: list, figs: list[dict], ours: dict, s: dict) -> dict:
    """The replay arm beside ours without replay: `replay_tokens_ratio` < 1 is fewer generated
    tokens to the target, `replay_time_ratio` <= 1 equal or better wall time."""
    r = merged(figs)
    summ = runs[0][0]["summary"]
    tokens = [mean(t) if isinstance(t, list) else t for t in (r["tokens_to_target"], ours["tokens_to_target"])]
    return {"replay_settings": list(replay_overrides(s)),
            "ours_replay_time_to_target_s": r["time_to_target_s"], "ours_replay_time_to_target_runs_s": r["runs_s"],
            "ours_replay_tokens_to_target": r["tokens_to_target"], "ours_replay_step_to_target": r["step_to_target"],
            "replay_tokens_ratio": ratio(*tokens),  # of the runs' means where they differ
            "replay_time_ratio": ratio(r["time_to_target_s"], ours["time_to_target_s"]),
            "ours_replay_wall_s": summ.get("wall_s"), "ours_replay_trainer_busy_s": summ.get("trainer_busy_s"),
            "ours_replay_sampler_busy_s": summ.get("sampler_busy_s"),
            "ours_replay_reuse_rate": round(summ["samples_trained"] / max(summ["samples_generated"], 1), 3),
            "ours_replay_updates": runs[0][0]["replay_updates"],
            "ours_replay_trainer_wait_s": runs[0][0]["trainer_wait_s"],
            "ours_replay_curves": curves}


def main(argv=None) -> int:
    args = parse_args(argv)
    if not Path(args.peer_python).exists():
        print(f"peer: {args.peer_python} not found; `make peer` builds .venv-peer from requirements/peer.txt",
              file=sys.stderr)
        return 2
    names = [n.strip() for n in args.regimes.split(",") if n.strip()]
    unknown = [n for n in names if n not in REGIMES]
    if unknown:
        print(f"peer: unknown regime(s) {unknown}; choose from {', '.join(REGIMES)}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="rlhf-peer-") as tmp:
        work = Path(args.work_dir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        for name in names:
            print(json.dumps(run_regime(name, args, work)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
