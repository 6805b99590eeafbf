"""A run's archive read back: SFT and DPO datasets, the raw rollouts, and re-scored rollouts.

The rows come from L3 (the buffer's cold archive: every rollout of a finished run, see
pipeline.buffer.archive), the prompts from the run's staged `data/train.parquet` (by prompt id),
the usage counts from the lineage ledger (pipeline.lineage). Layouts are the ones TRL's trainers
read (`datasets.load_dataset("parquet", data_files=PATH)`):

- `sft`: `prompt`, `completion`: the best completion of each group (highest reward, at least
  `min_reward` when given). Chat prompts give TRL's conversational form (lists of messages, the
  completion one assistant message); plain-text prompts give strings.
- `dpo`: `prompt`, `chosen`, `rejected`: per group its highest- and lowest-reward completions,
  only when the chosen reward is strictly greater.
- `parquet`: the archived rows as they are, plus `fresh_uses` and `replay_uses` from the ledger.

`version` keeps only the groups that made that policy version (those the ledger lists for
updates up to the one that produced it). Output goes to a new file (`.jsonl`: JSON lines, anything
else: Parquet), outside the run directory, never over an existing one unless `force`.
"""

from __future__ import annotations

import io
import json
import math
import os

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from .config import ConfigError
from .rundir import RunDir, url_is_under, validate_run_url
from .storage import is_local, put_atomic, url_to_fs

FORMATS = ("sft", "dpo", "parquet")


def open_run(url: str) -> RunDir:
    run = RunDir(validate_run_url(url))
    if not run.fs.exists(run.path("config.yaml")):
        raise ConfigError(f"{url}: not a run directory (no config.yaml); pass the folder `rlhf run` or prepare made")
    return run


def check_output(out: str, run: RunDir, force: bool):
    """(fs, path) of a new output file: no '..', not inside the run, not over a file unless `force`."""
    validate_run_url(out, "--out")
    if out.endswith("/"):
        raise ConfigError(f"--out: {out!r} names a folder; give a file (.jsonl for JSON lines, else Parquet)")
    fs, path = url_to_fs(out)
    inside = url_is_under(out, run.url)
    if not inside and is_local(fs) and is_local(run.fs):  # through a symbolic link, too
        real_run = os.path.realpath(run.root)
        inside = os.path.realpath(path).startswith(real_run.rstrip("/") + "/")
    if inside:
        raise ConfigError(f"--out: {out!r} is inside the run directory {run.url}; write datasets elsewhere")
    if fs.exists(path):
        if not force or fs.isdir(path):
            raise ConfigError(f"--out: {out!r} exists; pass --force to replace it (a folder is never replaced)")
    return fs, path


def write_table(table: pa.Table, fs, path: str) -> None:
    """Publish `table` at `path` atomically: JSON lines for `.jsonl`, else zstd Parquet."""
    if path.lower().endswith(".jsonl"):
        data = "".join(json.dumps(r, default=str) + "\n" for r in table.to_pylist()).encode()
    else:
        buf = io.BytesIO()
        pq.write_table(table, buf, compression="zstd")
        data = buf.getvalue()
    parent = path.rsplit("/", 1)[0]
    if parent:
        fs.makedirs(parent, exist_ok=True)
    put_atomic(fs, path, data)


def archive_table(run: RunDir) -> pa.Table:
    """Every archived rollout (L3) of the run, without the partition columns."""
    from .buffer import ReplayBuffer

    table = ReplayBuffer(run.buffer_url, run.config().buffer).archive_dataset().to_table()
    table = table.drop_columns([c for c in ("run", "policy") if c in table.column_names])
    if table.num_rows == 0:
        raise ConfigError(f"{run.url}: the archive (L3) is empty; finalize the run first, or archive what the "
                          f"trainer consumed with `rlhf buffer compact {run.url}` (--all for everything)")
    return table


def prompts_by_id(run: RunDir) -> dict:
    from .data import load_prompts

    return {p.prompt_id: p for p in load_prompts(run.child_url("data", "train.parquet"), "data.train")}


def select_version(table: pa.Table, run: RunDir, version: int | None) -> pa.Table:
    """The rows of the groups that made policy `version` (all rows when None)."""
    if version is None:
        return table
    from .lineage import check_version, groups_of_version, read_ledger

    ledger = read_ledger(run)
    check_version(ledger, version, run.url)
    groups = pa.array([g["group_id"] for g in groups_of_version(ledger, version)], pa.string())
    return table.filter(pc.is_in(table["group_id"], value_set=groups))


def with_usage(table: pa.Table, run: RunDir) -> pa.Table:
    """`table` plus `fresh_uses`, `replay_uses`: how often the trainer used each row's group."""
    from .lineage import read_ledger

    uses: dict[str, list[int]] = {}
    for gid, kind in zip(*read_ledger(run).select(["group_id", "kind"]).to_pydict().values()):
        uses.setdefault(gid, [0, 0])[kind != "fresh"] += 1
    ids = table["group_id"].to_pylist()
    table = table.append_column("fresh_uses", pa.array([uses.get(g, [0, 0])[0] for g in ids], pa.int32()))
    return table.append_column("replay_uses", pa.array([uses.get(g, [0, 0])[1] for g in ids], pa.int32()))


def _groups(table: pa.Table) -> list[list[dict]]:
    """Rows by group, each group's rows by sample id (a stable order for ties). Rows whose reward
    is not a finite number (NaN from a reward model) are left out: no order ranks them."""
    cols = ["group_id", "prompt_id", "sample_id", "response_text", "reward", "policy_version", "data_source"]
    out: dict[str, list[dict]] = {}
    for r in table.select(cols).to_pylist():
        if r["reward"] is None or not math.isfinite(r["reward"]):
            continue
        out.setdefault(r["group_id"], []).append(r)
    return [sorted(rows, key=lambda r: r["sample_id"]) for _, rows in sorted(out.items())]


def _conversational(prompts: dict, rows: list[list[dict]]) -> bool:
    kinds = {isinstance(prompts[g[0]["prompt_id"]].messages, list) for g in rows}
    if len(kinds) > 1:
        raise ConfigError("the run's prompts mix chat messages and plain strings; TRL reads one form per dataset")
    return kinds == {True}


def _answer(text: str, chat: bool):
    return [{"role": "assistant", "content": text}] if chat else text


def sft_rows(groups: list[list[dict]], prompts: dict, min_reward: float | None = None) -> list[dict]:
    chat = _conversational(prompts, groups)
    out = []
    for rows in groups:
        best = max(rows, key=lambda r: r["reward"])  # the first of equal rewards, by sample id
        if min_reward is not None and best["reward"] < min_reward:
            continue
        out.append({"prompt": prompts[best["prompt_id"]].messages, "completion": _answer(best["response_text"], chat),
                    "reward": best["reward"], **{k: best[k] for k in ("group_id", "prompt_id", "sample_id",
                                                                      "policy_version", "data_source")}})
    return out


def dpo_rows(groups: list[list[dict]], prompts: dict) -> list[dict]:
    chat = _conversational(prompts, groups)
    out = []
    for rows in groups:
        chosen, rejected = max(rows, key=lambda r: r["reward"]), min(rows, key=lambda r: r["reward"])
        if not chosen["reward"] > rejected["reward"]:
            continue  # no preference in this group
        out.append({"prompt": prompts[chosen["prompt_id"]].messages, "chosen": _answer(chosen["response_text"], chat),
                    "rejected": _answer(rejected["response_text"], chat), "chosen_reward": chosen["reward"],
                    "rejected_reward": rejected["reward"], "group_id": chosen["group_id"],
                    "prompt_id": chosen["prompt_id"], "policy_version": chosen["policy_version"]})
    return out


def export(run_url: str, fmt: str, out: str, *, force: bool = False, version: int | None = None,
           min_reward: float | None = None) -> dict:
    """Write the dataset `fmt` (sft | dpo | parquet) of the run at `run_url` to `out`; returns counts."""
    if fmt not in FORMATS:
        raise ConfigError(f"--format {fmt!r}: choose one of {', '.join(FORMATS)}")
    if min_reward is not None and fmt != "sft":
        raise ConfigError(f"--min-reward applies to --format sft (the best completion of each group), not {fmt}")
    run = open_run(run_url)
    fs, path = check_output(out, run, force)
    table = select_version(archive_table(run), run, version)
    if fmt == "parquet":
        if table.num_rows == 0:
            raise ConfigError(f"{run.url}: no archived rows{'' if version is None else f' of the groups that made version {version}'}")
        result = with_usage(table, run)
    else:
        prompts = prompts_by_id(run)
        groups = [g for g in _groups(table) if g[0]["prompt_id"] in prompts]
        rows = sft_rows(groups, prompts, min_reward) if fmt == "sft" else dpo_rows(groups, prompts)
        if not rows:
            raise ConfigError(f"{run.url}: no {fmt} rows (no group has "
                              f"{'two completions with different rewards' if fmt == 'dpo' else 'a completion'}"
                              f"{'' if min_reward is None or fmt == 'dpo' else f' with reward >= {min_reward}'})")
        result = pa.Table.from_pylist(rows)
    write_table(result, fs, path)
    return {"out": fs.unstrip_protocol(path), "format": fmt, "rows": result.num_rows,
            "archived_rows": table.num_rows, "groups": len(set(table["group_id"].to_pylist()))}
