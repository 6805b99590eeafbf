"""Re-score a run's archived rollouts with another reward, into a new dataset; the run is not touched.

The reward is given as in a config's `reward:` section: `spec` is what `reward.fn` takes (`auto`, a
built-in such as `sort` or `gsm8k`, `path/to/file.py:function`), or `model:PATH` for a reward
model (reward.kind=model, reward.model=PATH); `overrides` set the section's other keys
(`timeout_s=5`, `on_error=zero`, `device=cuda`, ...). Unset keys keep the run's values. Every
archived row is scored through the same scorer the sampler uses (time limits, error policy), with
its prompt, ground truth and extra info from the run's staged prompts.

The output has the archive's columns, with `reward` and `reward_extra` from the new reward,
`reward_original` holding the old one, and `token_rewards` emptied (they belonged to the old reward).
"""

from __future__ import annotations

import json

import pyarrow as pa

from .config import ConfigError, RewardConfig, parse_config
from .export import archive_table, check_output, open_run, prompts_by_id, write_table

BATCH = 256


def reward_config(base: RewardConfig, spec: str, overrides: list[str] | None = None) -> RewardConfig:
    """The run's reward section with `spec` and `overrides` applied, validated like a config."""
    data = base.model_dump(mode="json")
    if spec.startswith("model:"):
        data.update(kind="model", model=spec[len("model:"):])
    else:
        data.update(kind="rule", fn=spec)
    sets = [s if s.startswith("reward.") else f"reward.{s}" for s in overrides or []]
    return parse_config({"reward": data}, sets).reward


def rescore(run_url: str, spec: str, out: str, *, overrides: list[str] | None = None, force: bool = False) -> dict:
    """Score every archived rollout of the run with the reward `spec`; write the rows to `out`."""
    from .rewards import load_reward_fn
    from .scoring import RewardSample, RewardScorer

    run = open_run(run_url)
    fs, path = check_output(out, run, force)
    cfg = reward_config(run.config().reward, spec, overrides)
    if cfg.kind == "rule":
        load_reward_fn(cfg.fn)  # a bad spec fails before the archive is read
    table = archive_table(run)
    prompts = prompts_by_id(run)
    ids = table["prompt_id"].to_pylist()
    missing = sorted({p for p in ids if p not in prompts})
    if missing:
        raise ConfigError(f"{run.url}: {len(missing)} archived prompt ids (e.g. {missing[0]}) are not in the run's "
                          "data/train.parquet; their ground truth is unknown")
    texts = table["response_text"].to_pylist()
    rewards: list[float] = []
    extras: list[str | None] = []
    with RewardScorer(cfg) as scorer:
        for start in range(0, len(ids), BATCH):
            samples = []
            for pid, text in zip(ids[start:start + BATCH], texts[start:start + BATCH]):
                p = prompts[pid]
                samples.append(RewardSample(pid, p.data_source, p.messages, text, p.ground_truth, p.extra_info))
            for s in scorer.score_batch(samples).scores:
                rewards.append(s.reward)
                extras.append(json.dumps(s.extra) if s.extra else None)
    result = _replace_rewards(table, rewards, extras)
    write_table(result, fs, path)
    old = table["reward"].to_pylist()
    return {"out": fs.unstrip_protocol(path), "rows": result.num_rows, "reward": cfg.fn if cfg.kind == "rule" else
            f"model:{cfg.model}", "mean_reward_original": sum(old) / len(old), "mean_reward": sum(rewards) / len(rewards)}


def _replace_rewards(table: pa.Table, rewards: list[float], extras: list[str | None]) -> pa.Table:
    out = table.append_column("reward_original", table["reward"])
    for name, values, kind in (("reward", rewards, pa.float32()), ("reward_extra", extras, pa.string()),
                               ("token_rewards", [None] * table.num_rows, pa.list_(pa.float32()))):
        out = out.set_column(out.schema.get_field_index(name), name, pa.array(values, kind))
    return out
