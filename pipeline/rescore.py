"""Re-score a run's archived rollouts with another reward, into a new dataset; the run is not touched.

The reward is given as in a config's `reward:` section: `spec` is what `reward.fn` takes (`auto`, a
built-in such as `sort` or `gsm8k`, `path/to/file.py:function`), or `model:PATH` for a reward
model (reward.kind=model, reward.model=PATH); `overrides` set the section's other keys
(`timeout_s=5`, `on_error=zero`, `device=cuda`, ...). Unset keys keep the run's values. Every
archived row is scored through the same scorer the sampler uses (time limits, error policy), with
its prompt, ground truth and extra info from the run's staged prompts.

The output has the archive's columns, with `reward` and `reward_extra` from the new reward,
`reward_original` holding the old one, and `token_rewards` emptied (they belonged to the old reward).
Rows stream through, BATCH at a time: read, scored, written (memory does not grow with the archive).
"""

from __future__ import annotations

import json
from typing import Iterable, Iterator

import pyarrow as pa

from .config import ConfigError, RewardConfig, parse_config
from .export import archive_batches, archive_dataset, check_output, open_run, prompts_by_id, write_batches

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
    from .scoring import RewardScorer

    run = open_run(run_url)
    fs, path = check_output(out, run, force)
    cfg = reward_config(run.config().reward, spec, overrides)
    if cfg.kind == "rule":
        load_reward_fn(cfg.fn)  # a bad spec fails before the archive is read
    dataset = archive_dataset(run)
    ids = archived_prompt_ids(dataset)
    prompts = prompts_by_id(run, ids)
    _check_prompts(ids, prompts, run.url)
    sums = {"rows": 0, "original": 0.0, "new": 0.0}
    with RewardScorer(cfg) as scorer:
        rows = write_batches(_rescored(archive_batches(dataset, batch_size=BATCH), scorer, prompts, sums), fs, path)
    return {"out": fs.unstrip_protocol(path), "rows": rows, "reward": cfg.fn if cfg.kind == "rule" else
            f"model:{cfg.model}", "mean_reward_original": sums["original"] / sums["rows"],
            "mean_reward": sums["new"] / sums["rows"]}


def archived_prompt_ids(dataset) -> set[str]:
    """The prompt ids of the archive (only the `prompt_id` column is read)."""
    ids: set[str] = set()
    for batch in archive_batches(dataset, ["prompt_id"]):
        ids.update(batch.column("prompt_id").to_pylist())
    return ids


def _check_prompts(ids: set[str], prompts: dict, where: str) -> None:
    """Every archived prompt id is a staged prompt."""
    missing = ids - prompts.keys()
    if missing:
        first = min(missing)
        raise ConfigError(f"{where}: {len(missing)} archived prompt ids (e.g. {first}) are not in the run's "
                          "data/train.parquet; their ground truth is unknown")


def _rescored(batches: Iterable[pa.RecordBatch], scorer, prompts: dict, sums: dict) -> Iterator[pa.RecordBatch]:
    """Each batch scored as one reward batch, with its rewards replaced; `sums` adds up the rows
    and both rewards."""
    from .scoring import RewardSample

    for batch in batches:
        samples = []
        for pid, text in zip(batch.column("prompt_id").to_pylist(), batch.column("response_text").to_pylist()):
            p = prompts[pid]
            samples.append(RewardSample(pid, p.data_source, p.messages, text, p.ground_truth, p.extra_info))
        rewards, extras = [], []
        for s in scorer.score_batch(samples).scores:
            rewards.append(s.reward)
            extras.append(json.dumps(s.extra) if s.extra else None)
        sums["rows"] += batch.num_rows
        sums["original"] = sum(batch.column("reward").to_pylist(), sums["original"])
        sums["new"] = sum(rewards, sums["new"])
        yield _replace_rewards(batch, rewards, extras)


def _replace_rewards(table: pa.Table | pa.RecordBatch, rewards: list[float], extras: list[str | None]):
    out = table.append_column("reward_original", table.column("reward"))
    for name, values, kind in (("reward", rewards, pa.float32()), ("reward_extra", extras, pa.string()),
                               ("token_rewards", [None] * table.num_rows, pa.list_(pa.float32()))):
        out = out.set_column(out.schema.get_field_index(name), name, pa.array(values, kind))
    return out
