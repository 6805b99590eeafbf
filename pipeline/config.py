"""Run configuration: typed, validated up front, frozen into the run directory.

One loader (`load_config`) serves the CLI, the local runner and the Airflow DAGs. Unknown keys,
wrong types and bad values fail with a one-line `ConfigError` that names the field, the value and
the fix, before any model or dataset is loaded.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any, Literal

from pydantic import (AliasChoices, BaseModel, ConfigDict, Field, JsonValue, ValidationError, ValidationInfo, field_validator,
                      model_validator)

from .config_yaml import ConfigError, apply_overrides, dump_yaml, one_line, read_config_file
from .locations import validate_input_url, validate_run_id
from .tracking_config import TrackingConfig

class _Section(BaseModel):
    # field docstrings become the JSON schema's descriptions (the trigger form shows them)
    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True,
                              allow_inf_nan=False)

    @field_validator("*")
    @classmethod
    def _int64(cls, v: Any) -> Any:
        if _beyond_int64(v):  # torch, numpy and Arrow take 64-bit integers; YAML cannot write longer ones
            raise ValueError("an integer beyond 64 bits; use a value between -2**63 and 2**63 - 1")
        return v


def _beyond_int64(v: Any) -> bool:
    if isinstance(v, int):
        return not -2**63 <= v < 2**63
    if isinstance(v, dict):
        return any(_beyond_int64(x) for x in v.values())
    return isinstance(v, list) and any(_beyond_int64(x) for x in v)


class ModelConfig(_Section):
    path: str = "builtin:sort"
    """A Hugging Face model folder (local path or fsspec URL), or `builtin:<task>` for the tiny model."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Compute and serving dtype: the sampler loads the policy in it, the trainer computes in it while its master weights and optimizer state stay float32 (bfloat16 on GPUs; float32 on CPU, where bf16 decoding is slower: see trainer.dtype)."""
    @field_validator("path")
    @classmethod
    def _path(cls, v: str) -> str:
        return validate_input_url(v)

    trust_remote_code: bool = False
    """Run the Python code a model folder ships (an architecture transformers does not know, named by `auto_map` in its config.json) when the trainer, the sampler (hf and vllm) and evaluation load its tokenizer and model; off by default: turn it on only for folders you trust."""


class DataConfig(_Section):
    train: str = "builtin:sort"
    """Training prompts: Parquet file/URL in verl's columns, a folder of such files (shards, read in name order), or `builtin:<task>`."""
    eval: str = "builtin:sort"
    """Held-out prompts, same format; `builtin:<task>` uses the task's held-out split."""
    @field_validator("train", "eval")
    @classmethod
    def _urls(cls, v: str) -> str:
        return validate_input_url(v)

    max_prompt_tokens: int = Field(128, gt=0)
    """Longest rendered prompt, in tokens of the policy's tokenizer; the sampler checks every training and held-out prompt at start (see overlong_prompts)."""
    overlong_prompts: Literal["filter", "fail"] = "filter"
    """Prompts over max_prompt_tokens: `filter` drops them and logs the count (verl's filter_overlong_prompts; held-out ones are left out of the evaluation, counted in its `overlong_left_out`); `fail` stops the sampler naming the first one."""
    eval_size: int = Field(256, gt=0)
    """Held-out prompts used for evaluation (the first N)."""


class RewardConfig(_Section):
    kind: Literal["rule", "model"] = "rule"
    """What scores the sampler's completions: `rule` (reward.fn) or `model` (the reward model at reward.model)."""
    fn: str = "auto"
    """Rule reward: `auto` (the built-in scorer of each row's data_source), a built-in (`sort`, `digit`, `repeat`, `gsm8k`, `math`) or `path/to/file.py:function` (verl's signature, called by keyword); held-out evaluation always uses it."""
    batched: bool | None = None
    """The function takes lists (data_sources=, solution_strs=, ground_truths=, extra_infos=) and returns one value per sample; None: told by its signature (a parameter named solution_strs)."""
    timeout_s: float | None = Field(10.0, gt=0)
    """Time limit of a rule reward per sample (per call when batched); it runs in a worker process that is killed past it. None: run in the sampler process, without a limit."""
    on_error: Literal["fail", "zero"] = "fail"
    """A rule reward that raises, returns a bad value or times out: `fail` stops the sampler naming the sample; `zero` scores it 0. Both count it (reward/errors, reward/timeouts)."""
    model: str | None = None
    """Reward model (kind=model): a Hugging Face sequence-classification folder, local path or fsspec URL."""
    @field_validator("model")
    @classmethod
    def _model_url(cls, v: str | None) -> str | None:
        return v if v is None else validate_input_url(v, builtin=False)

    device: str = Field("cpu", pattern=r"^(cpu|cuda(:\d+)?|mps|xpu(:\d+)?)$")
    """Device of the reward model in the sampler process: cpu, cuda or cuda:N."""
    model_label: int = Field(0, ge=0)
    """The reward model's logit used as the score (0 for a one-label reward model)."""
    model_sigmoid: bool = False
    """Squash the reward model's logit into (0, 1) with a sigmoid."""
    batch_size: int = Field(16, gt=0)
    """Sequences per reward-model forward pass."""

    @model_validator(mode="after")
    def _model(self) -> "RewardConfig":
        if self.kind == "model" and not self.model:
            raise ValueError("reward.kind=model needs reward.model: a Hugging Face sequence-classification folder")
        return self


# vllm.LLM arguments the vllm backend sets itself: `sampler.vllm` may not give them
VLLM_RESERVED_OPTIONS = ("model", "tokenizer", "dtype", "seed", "logprobs_mode", "generation_config", "trust_remote_code")


class SamplerConfig(_Section):
    backend: Literal["hf", "vllm"] = "hf"
    """Generation engine: `hf` (the transformers model's forward in a decoding loop of its own, `pipeline/sampler/decode.py`) or `vllm`."""
    group_size: int = Field(8, ge=2)
    """Completions per prompt (the GRPO group)."""
    prompts_per_batch: int = Field(16, gt=0)
    """Prompts whose groups a batch hands to the buffer (one rollout shard per batch); with `oversample`, a batch generates more and keeps these."""
    oversample: float = Field(1.0, ge=1.0, le=4.0)
    """A batch generates the groups of ceil(prompts_per_batch x oversample) prompts and hands over the prompts_per_batch groups whose rewards vary most (standard deviation); the others go to the archive, L3, untrained (`sampler/groups_dropped`). A group that scores alike teaches GRPO nothing (DAPO's dynamic sampling drops those), and the ranking prefers prompts the policy solves only sometimes. Worth it where the sampler would otherwise wait for the trainer (configs/tiny-grpo-long.yaml: 1.25, with what it measured). 1.0: every group generated is trained on."""
    max_new_tokens: int = Field(16, gt=0)
    """Longest completion, in tokens; generation stops there or at the end-of-sequence token."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature: the sampler draws from softmax(logits / temperature), and the trainer computes its log-probs the same way."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling: draw from the smallest set of tokens whose probability adds up to top_p (1: all tokens; below 1 with the hf backend only)."""
    max_staleness: int = Field(2, ge=0)
    """The sampler waits rather than produce data more than this many versions behind the trainer (counted at the step that trains a batch's last group)."""
    fixed_lag: bool = False
    """Generate each batch with the oldest policy version the staleness bound admits for it (the first the trainer publishes at or after its step minus `max_staleness`) rather than the newest: the data, and so the run, do not depend on how fast storage or the sampler is (a reproducible run; every version is then published, none replaced by a newer one). For one replica: several land their batches in an order timing decides, so they take the newest version. When the sampler is the bottleneck the newest version is fresher at no cost."""
    replicas: int = Field(1, ge=1, le=64)
    """Sampler processes (Airflow: mapped tasks), each its own buffer writer; they claim prompt draws, so none is drawn twice and a slow or lost one holds back no other."""
    threads: int = Field(1, gt=0)
    """torch intra-op threads of the sampler process."""
    poll_s: float = Field(0.2, gt=0, le=60)
    """Seconds between a waiting sampler's looks for a new policy version or a stop marker; the trainer waiting for rollouts polls at this pace too (then more slowly after a while)."""
    max_batch_tokens: int = Field(32768, gt=0)
    """Token budget of one engine call, sum of (prompt + max_new_tokens) * n; bigger calls are split, halved on OOM."""
    vllm: dict[str, JsonValue] = Field(default_factory=dict)
    """Extra engine arguments for the vllm backend (tensor_parallel_size, gpu_memory_utilization, ...)."""

    @property
    def prompts_drawn(self) -> int:
        """Prompts a batch generates (`oversample`)."""
        return math.ceil(self.prompts_per_batch * self.oversample - 1e-9)

    @field_validator("vllm")
    @classmethod
    def _vllm_options(cls, v: dict) -> dict:
        from .config_checks import check_vllm_options

        return check_vllm_options(v, VLLM_RESERVED_OPTIONS)

    @model_validator(mode="after")
    def _vllm_top_p(self) -> "SamplerConfig":
        if self.backend == "vllm" and self.top_p < 1.0:
            raise ValueError(f"sampler.top_p={self.top_p} with sampler.backend=vllm: vLLM returns nucleus-renormalised "
                             "log-probs that do not match the trainer's log_softmax(logits / temperature); use "
                             "sampler.top_p=1.0 or sampler.backend=hf")
        return self


class TrainerConfig(_Section):
    algorithm: Literal["grpo", "dr_grpo", "rloo", "reinforce_pp", "ppo"] = "grpo"
    """Registered algorithm (pipeline.trainer.algorithms): grpo, dr_grpo, rloo, reinforce_pp, or ppo (critic + GAE/V-trace)."""
    steps: int = Field(50, gt=0)
    """Optimizer steps on fresh data."""
    groups_per_step: int = Field(16, gt=0)
    """Prompt groups consumed per optimizer step."""
    lr: float = Field(1e-3, gt=0)
    """Learning rate of the policy (AdamW)."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW's decoupled weight decay of the policy, on every parameter (norms and biases too)."""
    max_grad_norm: float = Field(1.0, gt=0)
    """Clip the policy's gradient to this global L2 norm before each optimizer step."""
    warmup_steps: int = Field(0, ge=0)
    """Linear learning-rate warmup over this many optimizer updates (0: constant rate)."""
    clip_eps: float = Field(0.2, gt=0)
    """PPO ratio clip range (against the proximal policy when `decoupled`, else the behaviour policy)."""
    update_epochs: int = Field(1, gt=0)
    """Optimizer updates per batch; the proximal policy is the one before the first of them."""
    replay_lr_scale: float = Field(0.5, gt=0, le=1)
    """Learning-rate factor of replay updates. Adam's step size does not depend on the loss scale, so a replayed batch moves the policy as far as a fresh one; below 1 its updates are smaller. On the demo task 0.5 learnt more per generated token than 1 (`bench/reuse.py`, seeds 0-4, replay-on/off generated tokens to the target: median 0.485 against 0.511; lower on seeds 0, 2 and 3, within 0.005 on 1 and 4)."""
    replay_rows: Literal["all", "positive", "best"] = "positive"
    """Rows of a replayed group that its update trains on, by the advantages of the whole group: `positive`, the completions that beat their group (advantage > 0) and ended on their own, as in self-imitation learning: a replay reinforces what worked and never pushes down stale tokens the policy has moved since, at about half a fresh update's cost; `best`, the best of those in each group; `all`. `positive` and `best` never replay an answer cut off at `sampler.max_new_tokens` (finish_reason `length`): it is unfinished, and replayed it teaches the policy not to stop (configs/tiny-grpo-long.yaml with a replay epoch after every step: 46-55% of the answers cut off over the first 90 steps, against 26% falling to 4% without replay). With ppo (a critic, token advantages) only `all`. Which rows pay depends on the task: on the demo task (`bench/reuse.py`, seeds 0-4, replay-on/off generated tokens to the target) `positive` needed a median 0.485, `all` 0.717 (seed 2 never reached the target); on configs/tiny-grpo-long.yaml, with a replay epoch after every fresh step, the held-out score at steps 90 / 150 was 0.350 / 0.406 without replay, 0.364 / 0.406 with `all`, 0.334 / 0.376 with `positive` and 0.294 / 0.341 with `best` (seed 0), and 0.265 / 0.293 without, 0.299 / 0.325 with `all`, 0.281 / 0.292 with `positive` (seed 1). Measure yours: `bench/reuse.py --config CONFIG --set trainer.replay_rows=all`."""
    kl_coef: float = Field(0.0, ge=0)
    """Weight of the KL penalty to the frozen initial policy (0 disables the reference model)."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """Per-token KL estimator in the loss: k3 = exp(ref - logp) - (ref - logp) - 1 (>= 0; the default of TRL and verl) has the expected gradient of KL(ref || pi); k2 = 0.5 (logp - ref)^2 that of KL(pi || ref), the reverse KL the penalty is usually meant to be (arXiv 2506.09477); k1 = logp - ref has an expected gradient of 0 on the policy's own samples: the penalty then only adds noise."""
    entropy_coef: float = Field(0.0, ge=0)
    """Entropy bonus weight (0: off)."""
    std_normalize: bool = True
    """grpo only: divide group-centred rewards by the group's standard deviation; off gives Dr. GRPO's advantages (refused with another algorithm, which would ignore it)."""
    loss_agg: Literal["token-mean", "seq-mean-token-mean"] = "token-mean"
    """Loss aggregation: over all response tokens of the batch, or per sequence then over sequences."""
    decoupled: bool = False
    """Decoupled PPO: clip against the proximal policy, correct behaviour->proximal by truncated IS; off: clip the ratio to the behaviour policy (a trust region around the sampler's policy). The proximal clip binds only with update_epochs > 1. This chooses the objective of fresh steps; replay updates always use the decoupled one (their behaviour policy is several versions old: `pipeline.trainer.step.replay_config`)."""
    is_level: Literal["token", "sequence", "none"] = "token"
    """Truncated importance sampling of behaviour -> proximal policy: per token, per sequence (product), or off."""
    is_clip: float = Field(1.0, gt=0)
    """Truncation C of the importance weights: w = min(pi_prox / mu, C); 1 never up-weights stale tokens (V-trace's rho-bar)."""
    vf_coef: float = Field(0.5, ge=0)
    """Weight of the critic's value loss (ppo)."""
    critic_lr: float | None = Field(None, gt=0)
    """Learning rate of the value head (None: trainer.lr)."""
    gamma: float = Field(1.0, ge=0, le=1)
    """Discount of the token-level return (ppo)."""
    gae_lambda: float = Field(0.95, ge=0, le=1)
    """GAE / V-trace lambda (ppo)."""
    critic_targets: Literal["gae", "vtrace"] = "vtrace"
    """Critic targets and advantages for stale data: V-trace (off-policy corrected) or plain GAE."""
    vtrace_rho_bar: float = Field(1.0, gt=0)
    """V-trace truncation of the TD-error weights rho."""
    vtrace_c_bar: float = Field(1.0, gt=0)
    """V-trace truncation of the trace coefficients c."""
    micro_batch_tokens: int = Field(8192, gt=0)
    """Dynamic batching: padded tokens per micro-batch; gradients are accumulated over micro-batches."""
    share_prompts: bool = True
    """Each distinct prompt of a micro-batch passes through the model once, not once per completion: a prompt pass keeps its attention cache and the group's responses attend to it (same log-probs and gradient up to float rounding; micro-batches hold whole groups). Used on the batches where it computes fewer positions than one pass over every row (short answers: the demo's batches take half the work; long, uneven answers to short prompts: one pass); not with the critic (ppo) or gradient_checkpointing. Off: one pass over every row's prompt and response. Metric: trainer/shared_prompts (1 on the steps that used it)."""
    phases: int = Field(1, gt=0)
    """The fresh steps are split into this many equal phases; each ends with a checkpoint and a phase marker."""
    replay_epochs: int = Field(0, ge=0)
    """Replay passes over L2, spread evenly over the fresh steps; each waits for its replay gate marker."""
    replay_yield: bool = False
    """A replay epoch gives way to fresh data: it ends before any update once the next fresh step's groups have arrived or are due before the update would end (`pipeline.trainer.feed.ReplayPace`), and after the last fresh step, which has none to wait for; an update under way when they come anyway (with update_epochs 1: a later epoch would follow an optimizer step already taken) stops, unapplied and uncounted, before its next micro-batch, so replay fills only time the trainer would spend waiting for the sampler: free when the sampler is the bottleneck, none when the trainer is. Which updates run then depends on timing; off, every epoch makes all its draws."""
    checkpoint_every: int = Field(0, ge=0)
    """Extra checkpoints every N fresh steps (0: only at phase ends and as checkpoint_every_s says)."""
    checkpoint_every_s: float = Field(1800.0, ge=0)
    """An extra checkpoint once this many seconds have passed since the trainer started or saved its last one (0: off): a killed run redoes at most about this much training when it resumes."""
    keep_checkpoints: int = Field(2, gt=0)
    """Periodic checkpoints kept (the newest K); phase-end checkpoints are always kept."""
    nproc_per_node: int = Field(1, gt=0)
    """Trainer processes per node (torchrun + FSDP2 when the world is > 1)."""
    nnodes: int = Field(1, ge=1, le=1024)
    """Trainer nodes (Airflow: mapped trainer tasks) meeting in a torchrun c10d rendezvous; FSDP2 spans all their ranks."""
    rendezvous: str | None = None
    """host:port of the trainer's rendezvous when nnodes > 1 (an IPv6 address in brackets); empty: node 0 picks a port and publishes its address in the run directory."""

    @field_validator("rendezvous")
    @classmethod
    def _rendezvous(cls, v: str | None) -> str | None:
        from .config_checks import check_endpoint

        return check_endpoint(v) if v else None
    sync_every: int = Field(1, gt=0)
    """Publish a new policy version for the sampler every N steps."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass (less memory, ~30% more compute)."""
    keep_policy_versions: int = Field(3, ge=1)
    """Policy versions kept: the newest K; v0, phase-end versions (the last is the final one) and any version a sampler is loading stay as well, older ones are deleted after each publication."""
    threads: int = Field(1, gt=0)
    """torch intra-op threads of the trainer process."""
    dtype: Literal["float32", "bfloat16", "float16"] | None = None
    """The trainer's compute dtype, when it should differ from `model.dtype` (which the sampler serves in and the trainer publishes in); master weights and optimizer state stay float32. On a CPU with bf16 instructions (AMX, or AVX-512 BF16: about 30% faster there), `bfloat16` here with a float32 sampler takes 0.29 s per step of the generation-heavy config instead of 0.36 s: the matmuls gain, while decoding one token at a time does not (see pipeline.trainer.precision)."""
    borrow_threads: int = Field(0, ge=0)
    """When the samplers share this machine's CPU cores with a one-process trainer (the laptop path): threads the trainer adds for the rest of a fresh step once every sampler is held by the staleness bound (they compute nothing until this step's policy is published), given back when the step ends. 0: never. It changes when steps end, and so, without `sampler.fixed_lag`, which policy version makes each batch (timing decides that there anyway); the updates stay the same where the kernels' sums do not depend on the thread count (the built-in tiny models on CPU: the same weights bit for bit after steps at 1 and at 2 threads)."""
    log_every: int = Field(5, gt=0)
    """Steps between progress log lines."""
    wait_timeout_s: float = Field(600.0, gt=0)
    """Fail if no fresh rollouts arrive (or a replay gate stays closed) for this long."""
    stall_timeout_s: float = Field(1800.0, ge=0)
    """Stop a run whose trainer records no new step for this long: `rlhf run` stops its engines (the same command resumes), the Airflow trainer task fails (its retries take over) and sends a stall alert; 0 = never."""

    @model_validator(mode="after")
    def _rules(self, info: ValidationInfo) -> "TrainerConfig":
        from .config_checks import check_trainer

        if self.algorithm == "ppo" and "replay_rows" not in self.model_fields_set:
            self.replay_rows = "all"  # the default for group algorithms; ppo has no group advantages
        check_trainer(self, frozen=bool((info.context or {}).get("frozen")))
        return self


class BufferConfig(_Section):
    shard_compression: Literal["zstd", "snappy", "none"] = "zstd"
    """Parquet compression of the rollout shards of L1 and L2 (the L3 archive is always zstd)."""
    writer_queue: int = Field(8, gt=0)
    """Shards queued in the asynchronous writer before `write` blocks."""
    fsync: bool = False
    """fsync data files and log entries on local disk: commits survive a machine crash, at a disk flush each; off, files torn by a crash are quarantined."""
    checkpoint_interval: int = Field(50, gt=0)
    """Commit-log entries between state checkpoints; opening reads one checkpoint plus at most this many entries."""
    max_replays_per_group: int = Field(2, ge=0, validation_alias=AliasChoices("max_replays_per_group", "num_epochs_per_sample"))
    """Times an L2 group may be replayed after its fresh use; 0 disables replay. `num_epochs_per_sample`, its deprecated old name, is still accepted."""
    l2_min_reward_std: float = Field(0.0, ge=0)
    """Promote only groups whose reward standard deviation is above this (0: any non-zero spread)."""
    l2_min_reward_mean: float | None = None
    """Promote only groups whose mean reward is at least this (None: no lower bound)."""
    l2_max_reward_mean: float | None = None
    """Promote only groups whose mean reward is at most this (None: no upper bound)."""
    l2_dedup: bool = True
    """Drop a group whose completions (by content hash) are already in L2."""
    priority_alpha: float = Field(0.6, ge=0)
    """Prioritization exponent: 0 samples uniformly, 1 proportionally to priority."""
    priority_beta0: float = Field(0.4, ge=0, le=1)
    """Initial importance-sampling exponent, annealed linearly to 1."""
    priority_beta_steps: int = Field(1000, ge=0)
    """Trainer steps over which beta reaches 1 (0: always 1)."""
    priority_eps: float = Field(1e-3, gt=0)
    """Added to every priority so that no eligible group has zero probability."""
    l1_max_rows: int = Field(1_000_000, gt=0)
    """L1 bound on rows not yet consumed: they are never dropped, the sampler waits for the trainer instead. Consumed shards stay in L1 until compaction archives them into L3 (the run's finalize, or `rlhf buffer compact`)."""
    l2_max_groups: int = Field(50_000, gt=0)
    """L2 bound: groups that used up their replays go first, then the oldest shards (FIFO)."""
    l3_max_rows: int | None = Field(None, gt=0)
    """L3 bound (None: unbounded): the oldest archive files are dropped first."""
    l3_retention_s: float | None = Field(None, gt=0)
    """Drop L3 archive files committed longer ago than this (None: keep forever)."""
    compact_target_rows: int = Field(100_000, gt=0)
    """Rows per L3 file written by compaction."""
    samples_per_insert: float | None = Field(None, gt=0)
    """Rate limiter: groups the trainer consumes (fresh + replays) per group inserted (None: no ratio bound)."""
    rate_error_groups: int = Field(256, ge=0)
    """Rate limiter slack: how far inserts may run ahead of samples_per_insert, in groups."""
    max_fresh_backlog: int | None = Field(None, gt=0)
    """Rate limiter: the sampler waits while more than this many L1 groups are unconsumed (None: only l1_max_rows). A sampler held a minute by a bound of the rate limiter logs which, with its numbers."""
    orphan_grace_s: float = Field(3600.0, ge=0)
    """vacuum deletes unreferenced files only when older than this (a writer may be about to commit them)."""
    log_retention_s: float = Field(7 * 86400.0, ge=3600)
    """vacuum deletes log entries covered by a checkpoint once older than this (at least an hour: a process idle for ten minutes catches up before it commits, and one whose next entry was deleted would commit where no reader looks)."""


class EvalConfig(_Section):
    max_new_tokens: int | None = Field(None, gt=0)
    """Longest greedy answer of the held-out evaluation, in tokens (None: sampler.max_new_tokens)."""
    batch_size: int = Field(64, gt=0)
    """Held-out prompts per generation call of the evaluation."""


class DevicesConfig(_Section):
    sampler_share: float = Field(0.3, gt=0, lt=1)
    """Share of a machine's accelerators that sample; the rest train (about 3:7 is a common split). With one accelerator both share it and vLLM gets this share of its memory."""
    count: int | None = Field(None, ge=0)
    """Accelerators of a machine; empty = those the process sees (CUDA_VISIBLE_DEVICES or the CUDA device count); 0 = CPU only."""


class RunConfig(_Section):
    run_id: str | None = None
    """Run name used in paths; generated from the time when empty."""
    seed: int = Field(0, ge=0)
    """Seed of the built-in model and prompts, the prompt order, sampling and replay draws."""
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    reward: RewardConfig = RewardConfig()
    sampler: SamplerConfig = SamplerConfig()
    trainer: TrainerConfig = TrainerConfig()
    buffer: BufferConfig = BufferConfig()
    eval: EvalConfig = EvalConfig()
    devices: DevicesConfig = DevicesConfig()
    tracking: TrackingConfig = TrackingConfig()

    @field_validator("run_id")
    @classmethod
    def _run_id(cls, v: str | None) -> str | None:
        return None if v is None else validate_run_id(v)

    @model_validator(mode="after")
    def _cross(self) -> "RunConfig":
        from .config_checks import check_run

        check_run(self)
        return self

    def to_yaml(self) -> str:
        return dump_yaml(self.model_dump(mode="json"))


def parse_config(data: dict | None, overrides: list[str] | None = None, frozen: bool = False) -> RunConfig:
    """`frozen`: a run directory's config.yaml, which a run took as valid: the rules that only
    refuse settings that would be ignored (`pipeline.config_checks`) do not apply to it."""
    from .config_checks import format_error

    if not isinstance(data, (dict, type(None))):
        raise ConfigError(f"config: top level is a {type(data).__name__}; it must be a mapping of sections")
    data = apply_overrides(copy.deepcopy(data or {}), overrides)  # the caller's dict stays as it was
    try:
        return RunConfig.model_validate(data, context={"frozen": frozen})
    except ValidationError as err:
        raise ConfigError(one_line(format_error(err, RunConfig))) from None


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> RunConfig:
    """The one loader of run configs: YAML file (or None for defaults) plus `key=value` overrides."""
    return parse_config(read_config_file(path) if path is not None else {}, overrides)
