"""The steps of one run, as its orchestrator takes them. The local runner (`rlhf run`) and the tasks
of the Airflow DAGs call these functions, and only these, so both paths do the same thing.

    prepare(cfg, run_url)                        the prepare task: inputs checked, run directory
                                                 created, prompts staged, policy v0 published
    publish_phase(run, phase, step, checkpoint)  a reshard task: the checkpoint closing a phase ->
                                                 policy v<step>, verified against its manifest
    check_replay_gate / poll_replay_gate         a replay-gate sensor and its trigger; the one
                                                 condition is `replay_gate_ready`
    advance(run)                                 the local runner's tick: publish every finished
                                                 phase, open every replay gate that is ready
    stop_after_trainer(run, by=...)              the teardown after the trainer: the stop marker
    finalize(run)                                the finalize task: final policy verified, held-out
                                                 evaluation, L1 compacted into L3, summary.json

Every step is idempotent: a retried task, or a runner that looks again, finds what an earlier call
did and does not do it twice. What only Airflow has (XCom, Asset events, task states, the clear
count of a DAG run) stays in `plugins/`; marker names live on `RunDir`.
"""

from __future__ import annotations

import json
import logging
import os
import time

from .config import ConfigError, RunConfig
from .rundir import RunDir, new_run_id, run_url_for

log = logging.getLogger("rlhf.orchestration")
DEFAULT_RUNS_ROOT = "runs"


# prepare ------------------------------------------------------------------------------------------
def _builtin(spec: str, field: str, seed: int) -> str | None:
    if not spec.startswith("builtin:"):
        return None
    task = spec.split(":", 1)[1]
    from .example import ensure_example
    from .builtin_tasks import TASKS

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
    from .data import data_sources, load_prompts
    from .models import ships_required_code
    from .scoring import check_sources
    from .rewards import check_reward_spec
    from .tracking import require

    check_reward_spec(cfg.reward.fn, cfg.reward.batched)  # read, not imported: see its docstring
    for backend in cfg.tracking.backends:  # a missing tracker library fails here, not in the trainer
        require(backend)
    src = resolve_sources(cfg)
    load_prompts(src["train"], "data.train", limit=1)
    load_prompts(src["eval"], "data.eval", limit=1)
    try:  # the training prompts' sources: one column read, not the sampler's failure once the run has started
        check_sources(cfg.reward, data_sources(src["train"], "data.train"))
    except ConfigError as e:
        raise ConfigError(f"data.train: {e}") from None
    try:  # held-out evaluations score with the rule reward whatever reward.kind the training uses
        check_sources(cfg.reward.model_copy(update={"kind": "rule"}), data_sources(src["eval"], "data.eval"))
    except ConfigError as e:
        raise ConfigError(f"data.eval: {e} (the held-out evaluation scores with the rule reward)") from None
    model_config = _model_folder("model.path", src["model"])
    if ships_required_code(model_config) and not cfg.model.trust_remote_code:
        raise ConfigError(f"model.path: {src['model']!r} is a {model_config.get('model_type')!r} model defined by code "
                          "in its folder (auto_map); set model.trust_remote_code: true if you trust that code")
    check_context(cfg, model_config, src["model"])
    if cfg.reward.kind == "model":
        labels = _model_folder("reward.model", cfg.reward.model)
        n = len(labels.get("id2label") or {}) or int(labels.get("num_labels") or 2)  # transformers' default: 2
        if cfg.reward.model_label >= n:
            raise ConfigError(f"reward.model_label: {cfg.reward.model_label} but the reward model has {n} label(s); "
                              f"use 0..{n - 1}")
    return src


def _model_folder(field: str, url: str) -> dict:
    """The config.json of the Hugging Face model folder at `url`, checked for weights and a tokenizer
    (a policy's as safetensors, which resharding reads; a reward model's in either format)."""
    from .locations import reaching
    from .storage import list_names, url_to_fs

    with reaching(field, url):
        fs, path = url_to_fs(url)
        if not fs.exists(path.rstrip("/") + "/config.json"):
            raise ConfigError(f"{field}: {url!r} is not a Hugging Face model folder (no config.json)")
        model_config = json.loads(fs.cat_file(path.rstrip("/") + "/config.json"))
        check_model_files(url, list_names(fs, path.rstrip("/")), field, torch_weights=field != "model.path")
    return model_config


def check_context(cfg: RunConfig, model_config: dict, url: str) -> None:
    """A prompt of data.max_prompt_tokens and the longest answer fit the model's positions."""
    text = model_config.get("text_config") or model_config
    limit, scaling = text.get("max_position_embeddings"), text.get("rope_scaling") or {}
    if not isinstance(limit, int):
        return
    if isinstance(scaling.get("factor"), (int, float)) and scaling["factor"] > 1:  # YaRN and the like: more positions
        limit = int(limit * scaling["factor"])
    for field, new in (("sampler.max_new_tokens", cfg.sampler.max_new_tokens), ("eval.max_new_tokens", cfg.eval.max_new_tokens)):
        if new is not None and cfg.data.max_prompt_tokens + new > limit:
            raise ConfigError(f"{field}={new} and data.max_prompt_tokens={cfg.data.max_prompt_tokens}: a prompt and its "
                              f"answer could take {cfg.data.max_prompt_tokens + new} tokens, past the model's "
                              f"{limit} positions (max_position_embeddings in {url}); lower one of them")


def check_model_files(url: str, names: list[str], field: str = "model.path", torch_weights: bool = False) -> None:
    """A model folder holds its weights as safetensors (or, with `torch_weights`, PyTorch's
    pytorch_model.bin), and a tokenizer."""
    weights = {"model.safetensors", "model.safetensors.index.json"}
    if not (weights | ({"pytorch_model.bin", "pytorch_model.bin.index.json"} if torch_weights else set())) & set(names):
        raise ConfigError(f"{field}: {url!r} has no model.safetensors (nor model.safetensors.index.json); save "
                          "the model with save_pretrained(..., safe_serialization=True) to convert .bin weights")
    if not any(n.startswith(("tokenizer", "vocab")) or n.endswith((".tiktoken", "spiece.model")) for n in names):
        raise ConfigError(f"{field}: {url!r} has no tokenizer files (tokenizer.json, tokenizer_config.json, "
                          "vocab...); save the tokenizer into the model folder (tokenizer.save_pretrained)")


def prepare(cfg: RunConfig, run_url: str | None = None, runs_root: str = DEFAULT_RUNS_ROOT) -> RunDir:
    """Validate, create the run directory, stage prompts, publish policy v0. Idempotent on retry.
    Where the run goes is checked first ('..', a folder that is not a run's), before any input loads."""
    from .data import stage
    from .policy import PolicyStore

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
        from .model_cache import localize

        store.publish_folder(0, localize(src["model"]), {"step": 0, "source": src["model"]})
    now = time.time()  # `created` stays the first preparation's: it names this run's local policy copies
    created = (run.read_json("prepare.json") or {}).get("created") or now
    run.write_json("prepare.json", {"sources": src, "time": now, "created": created})
    return run


# phases ---------------------------------------------------------------------------------------------
def publish_phase(run: RunDir, phase: int, step: int, checkpoint: str) -> dict:
    """The end of phase `phase`: reshard its checkpoint (trainer layout) into policy v<step> (sampler
    layout, committed atomically by its manifest), then verify every file against the manifest.
    Idempotent: a retry finds the version committed and verifies it again.
    Returns {"phase", "version", "published_now", "files", "bytes"}."""
    from .policy import PolicyStore

    # raises when the checkpoint is unusable, or a file of the version is missing or its checksum differs
    done = PolicyStore(run).publish_checkpoint(int(step), checkpoint)
    log.info("phase %s: policy v%d %s from %s and verified", phase, done.version,
             "published" if done.published_now else "already published", checkpoint)
    return {"phase": int(phase), "version": done.version, "published_now": done.published_now,
            "files": done.files, "bytes": done.bytes}


# replay gates ---------------------------------------------------------------------------------------
def replay_gate_min_groups(cfg: RunConfig) -> int:
    """Eligible L2 groups a replay epoch needs: one optimizer step's worth (`trainer.groups_per_step`)."""
    return int(cfg.trainer.groups_per_step)


def replay_gate_ready(eligible: int, min_groups: int) -> bool:
    """THE replay-gate condition: L2 holds at least `min_groups` groups eligible for replay. The
    trainer defers a due epoch on the same condition, so it never waits on a gate this keeps closed."""
    return int(eligible) >= int(min_groups)


def eligible_replay_groups(run: RunDir) -> int:
    """L2 groups that may be replayed now (the gate's measure); 0 before the buffer exists."""
    from .buffer import ReplayBuffer

    try:
        return int(ReplayBuffer(run.buffer_url, run.config().buffer).eligible_replay_groups())
    except FileNotFoundError:
        return 0


def check_replay_gate(run: RunDir, epoch: int, min_groups: int | None = None) -> dict:
    """Where replay gate `epoch` stands: {"epoch", "open", "ready", "eligible", "min_groups"}. An open
    gate is ready and reports the count it opened with. Reads only; `min_groups` defaults to
    `replay_gate_min_groups` of the run's config."""
    epoch = int(epoch)
    if min_groups is None:
        min_groups = replay_gate_min_groups(run.config())
    opened = run.marker(RunDir.replay_gate_marker(epoch))
    if opened is not None:
        return {"epoch": epoch, "open": True, "ready": True, "eligible": opened.get("eligible"),
                "min_groups": int(min_groups)}
    eligible = eligible_replay_groups(run)
    return {"epoch": epoch, "open": False, "ready": replay_gate_ready(eligible, min_groups),
            "eligible": eligible, "min_groups": int(min_groups)}


def open_replay_gate(run: RunDir, epoch: int, eligible: int | None) -> dict:
    """Open replay epoch `epoch` (the trainer waits for its marker) with the count that made it
    ready. Idempotent: a gate already open stays as it was opened. Returns {"epoch", "eligible"}."""
    epoch = int(epoch)
    gate = RunDir.replay_gate_marker(epoch)
    existing = run.marker(gate)
    if existing is not None:
        return {"epoch": epoch, "eligible": existing.get("eligible")}
    run.set_marker(gate, {"eligible": eligible, "epoch": epoch})
    log.info("replay epoch %d opened with %s eligible groups", epoch, eligible)
    return {"epoch": epoch, "eligible": eligible}


def poll_replay_gate(run: RunDir, epoch: int, min_groups: int | None = None) -> dict:
    """One look of a waiter: `check_replay_gate`, and open the gate if it is ready and still closed.
    Returns the check with "open" as it is now, and "opened_now"."""
    gate = check_replay_gate(run, epoch, min_groups)
    if gate["open"] or not gate["ready"]:
        return {**gate, "opened_now": False}
    opened = open_replay_gate(run, epoch, gate["eligible"])
    return {**gate, "open": True, "opened_now": True, "eligible": opened["eligible"]}


def replay_epoch_skipped(run: RunDir, epoch: int) -> bool:
    """True when the trainer finished without replay epoch `epoch` (its gate will never open)."""
    done = run.marker(RunDir.TRAINER_DONE_MARKER) or {}
    return int(epoch) in {int(e) for e in done.get("replay_epochs_skipped", [])}


# the local runner's tick ----------------------------------------------------------------------------
def advance(run: RunDir, cfg: RunConfig | None = None, settled: set[str] | None = None) -> list[str]:
    """Publish every finished phase that is not yet a policy version, and open every replay gate
    that is ready, in order (what the DAG's reshard tasks and gate sensors do). Returns what it did.
    A caller that ticks passes the run's `cfg` and a `settled` set, which remembers the phases
    published and the gates open so that later ticks do not look at them again."""
    from .policy import PolicyStore

    cfg = cfg or run.config()
    tc, settled = cfg.trainer, set() if settled is None else settled
    done: list[str] = []
    store = PolicyStore(run)
    for k in range(tc.phases):
        if f"phase {k}" in settled:
            continue
        m = run.marker(RunDir.phase_done_marker(k))
        if m is None:
            break
        if not store.exists(int(m["step"])):
            publish_phase(run, k, int(m["step"]), m["checkpoint"])
            done.append(f"published policy v{int(m['step'])} from phase {k}")
        settled.add(f"phase {k}")
    for e in range(tc.replay_epochs):
        if f"gate {e}" in settled:
            continue
        gate = poll_replay_gate(run, e, replay_gate_min_groups(cfg))
        if not gate["open"]:
            break
        if gate["opened_now"]:
            done.append(f"opened replay gate {e} ({gate['eligible']} eligible groups)")
        settled.add(f"gate {e}")
    for line in done:
        log.info("%s", line)
    return done


# the end of the trainer -----------------------------------------------------------------------------
def stop_after_trainer(run: RunDir, *, by: str, attempt: int | None = None,
                       unfinished: str = "trainer ended without finishing") -> dict:
    """The trainer's process or task is over, whatever its outcome: stop the sampler and the waiting
    sensors with the stop marker, unless the run is already stopped (for `attempt`). After a trainer
    that finished, the stop is final; otherwise (reason `unfinished`) it names `attempt`, so a later
    attempt of the run resumes it (see `RunDir.request_stop`). Returns the stop marker in effect."""
    if not run.stop_requested(attempt):
        done = run.has_marker(RunDir.TRAINER_DONE_MARKER)
        run.request_stop("trainer finished" if done else unfinished, by=by, attempt=None if done else attempt)
    return run.stop_marker(attempt) or {}


# finalize -------------------------------------------------------------------------------------------
def evaluate_policy(run: RunDir, version: int, threads: int = 2) -> dict:
    """Held-out score of a published policy version (greedy, the task's reward), over the held-out
    prompts within data.max_prompt_tokens ("overlong_left_out": how many were not, if any)."""
    from .data import held_out_within_length
    from .evaluate import evaluate
    from .devices import set_threads
    from .policy import PolicyStore
    from .sampler.backend import make_backend
    from .scoring import RewardScorer

    cfg = run.config()
    set_threads(threads)
    policy_dir = PolicyStore(run).local_dir(version)
    backend = make_backend("hf", policy_dir, dtype=cfg.model.dtype, threads=threads, seed=cfg.seed,
                           trust_remote_code=cfg.model.trust_remote_code)
    # held-out correctness is the rule reward (`reward.fn`, by data_source with `auto`), also when
    # training scores with a reward model; with the run's timeouts and error policy
    scorer = RewardScorer(cfg.reward.model_copy(update={"kind": "rule"}))
    try:
        prompts, overlong = held_out_within_length(run.child_url("data", "eval.parquet"), backend.tokenizer, cfg.data)
        score = evaluate(backend, backend.tokenizer, prompts, scorer,
                         cfg.eval.max_new_tokens or cfg.sampler.max_new_tokens, cfg.eval.batch_size)
        return score | ({"overlong_left_out": overlong} if overlong else {})
    finally:
        backend.close()
        scorer.close()


def compact_buffer(run: RunDir) -> dict:
    """The run is over: archive all of L1 into L3 (large zstd Parquet files, partitioned by policy
    version) and merge small L3 files, so the rollouts stay as a dataset for analysis or SFT/DPO."""
    from .buffer import ReplayBuffer

    return ReplayBuffer(run.buffer_url, run.config().buffer).compact(everything=True)


def _check_over(run: RunDir) -> None:
    """finalize archives all of L1, the groups not trained on yet too: a run the trainer may still
    resume must not be finalized (it would wait for those groups for ever). Over means the trainer
    finished, or a stop that holds for good: one without an attempt, not a runner's own (`rlhf run`
    removes that one to resume)."""
    if run.has_marker(RunDir.TRAINER_DONE_MARKER):
        return
    stop = run.marker(RunDir.STOP_MARKER)
    if stop is not None and stop.get("attempt") is None and stop.get("by") != "runner":
        return
    raise ConfigError(f"{run.url}: the trainer has not finished and the run is not stopped for good, so finalize "
                      "would archive groups it still has to train on; resume the run (`rlhf run` with the same "
                      "--run-dir, or clear the DAG run), or end it where it is with a stop marker of your own "
                      "(markers/stop.json with a reason) first")


def finalize(run: RunDir, threads: int = 2) -> dict:
    """The last step: verify the latest policy against its manifest, evaluate the first and the
    latest policy (cached in eval.json: a retry does not evaluate again), compact L1 into L3, write
    summary.json (with "compaction" and "final_policy"). Idempotent. Returns the summary."""
    from .policy import PolicyStore
    from .summary import build_summary
    from .tracking import send_evaluations

    _check_over(run)
    store = PolicyStore(run)
    latest = store.latest() or 0
    report = store.verify(latest)  # the policy the run hands on: every file, every checksum
    evals = run.read_json("eval.json", {}) or {}
    for v in (0, latest):
        if str(v) not in evals:
            evals[str(v)] = evaluate_policy(run, v, threads)
            run.write_json("eval.json", evals)
    send_evaluations(run, evals, sorted({0, latest}))  # each at step v: version v is the policy after v steps
    compaction = compact_buffer(run)
    log.info("buffer compaction into L3: %s", compaction)
    summary = build_summary(run, eval_before=evals["0"], eval_after=evals[str(latest)], policy_version=latest)
    summary["compaction"] = compaction
    summary["final_policy"] = {"version": latest, "verified": report.ok, "files": report.files,
                               "bytes": report.bytes}
    run.write_json("summary.json", summary)
    return summary
