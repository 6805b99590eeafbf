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

Memory does not grow with the archive: rows are read file by file in batches of READ_BATCH rows
(`archive_batches`), `sft` and `dpo` read only the columns they use (LIGHT_COLUMNS) and keep two rows
per group, `parquet` (and pipeline.rescore) write each batch as it comes (`write_batches`).
"""

from __future__ import annotations

import json
import logging
import math
import os
from typing import Iterable, Iterator

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from .config import ConfigError
from .rundir import RunDir, url_is_under, validate_run_url
from .storage import is_local, staged_file, url_to_fs

log = logging.getLogger("rlhf.export")

FORMATS = ("sft", "dpo", "parquet")
LIGHT_COLUMNS = ("group_id", "prompt_id", "sample_id", "response_text", "reward", "policy_version", "data_source")
"""The columns `sft` and `dpo` read: never the token ids or log-probs."""
READ_BATCH = 1024
"""Rows per batch read from the archive (a few MB with long token lists)."""
ROW_GROUP_BYTES = 64 << 20
"""Arrow bytes gathered before a Parquet output row group is written."""
READ_BUFFER = 1 << 20
"""Bytes per read of an archive file. Whole column chunks are never loaded: an L3 file is one row
group of up to `buffer.compact_target_rows` rows, which pyarrow's dataset scanner (and ParquetFile's
default pre-buffering) would decode whole, several files ahead (measured: 1.3-2.1 GB peak for 200k
rollouts of 768 tokens, against 0.2 GB this way)."""


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


class _Sink:
    """Batches appended to a local file: JSON lines for `.jsonl`, else zstd Parquet, in row groups
    of about ROW_GROUP_BYTES."""

    def __init__(self, local: str, jsonl: bool, schema: pa.Schema | None = None):
        self.local, self.jsonl, self.schema, self.rows = local, jsonl, schema, 0
        self.pending: list[pa.RecordBatch] = []
        self.pending_bytes = 0
        self.file = open(local, "wb") if jsonl else None
        self.writer: pq.ParquetWriter | None = None

    def write(self, batch: pa.RecordBatch) -> None:
        self.schema = self.schema or batch.schema
        if batch.num_rows == 0:
            return
        self.rows += batch.num_rows
        if self.jsonl:
            self.file.write("".join(json.dumps(r, default=str) + "\n" for r in batch.to_pylist()).encode())
            return
        self.pending.append(batch)
        self.pending_bytes += batch.nbytes
        if self.pending_bytes >= ROW_GROUP_BYTES:
            self._flush()

    def _flush(self) -> None:
        table = pa.Table.from_batches(self.pending, schema=self.schema or pa.schema([]))
        self.pending, self.pending_bytes = [], 0
        if self.writer is None:
            self.writer = pq.ParquetWriter(self.local, table.schema, compression="zstd")
        if table.num_rows:
            self.writer.write_table(table, row_group_size=table.num_rows)

    def close(self) -> None:
        """Finish the file (a Parquet file without rows still has the schema)."""
        if not self.jsonl:
            self._flush()
        self.abort()

    def abort(self) -> None:
        """Release the file as it is (the caller removes it)."""
        self.pending = []
        for f in (self.file, self.writer):
            if f is not None:
                f.close()
        self.file = self.writer = None


def write_batches(batches: Iterable[pa.RecordBatch], fs, path: str, empty: str | None = None,
                  schema: pa.Schema | None = None) -> int:
    """Publish the batches at `path` atomically, written as they come: JSON lines for `.jsonl`, else
    zstd Parquet (in `schema`, default the first batch's). Returns the rows written. With no rows and
    `empty` given, raises ConfigError(empty) and publishes nothing."""
    with staged_file(fs, path) as tmp:
        sink = _Sink(tmp, path.lower().endswith(".jsonl"), schema)
        try:
            for batch in batches:
                sink.write(batch)
            if sink.rows == 0 and empty is not None:
                raise ConfigError(empty)
        except BaseException:
            sink.abort()
            raise
        sink.close()
    return sink.rows


def write_table(table: pa.Table, fs, path: str) -> None:
    """Publish `table` at `path` atomically: JSON lines for `.jsonl`, else zstd Parquet."""
    write_batches(table.to_batches(), fs, path, schema=table.schema)


def archive_dataset(run: RunDir):
    """The run's committed archive (L3), a pyarrow dataset; a ConfigError when it holds no rows, and
    a warning when L1 holds rows it does not yet (a run not finalized: with `sampler.oversample` its
    archive holds the groups not handed over from the start)."""
    from .buffer import ReplayBuffer

    buffer = ReplayBuffer(run.buffer_url, run.config().buffer)
    dataset = buffer.archive_dataset()
    hint = f"finalize the run first, or archive what the trainer consumed with `rlhf buffer compact {run.url}`"
    if dataset.count_rows() == 0:  # Parquet footers only
        raise ConfigError(f"{run.url}: the archive (L3) is empty; {hint} (--all for everything)")
    pending = sum(s.rows for s in buffer.state.tier_shards("l1"))
    if pending:
        log.warning("%s: %d rows in L1 are not in the archive yet, and not in what this reads; %s", run.url,
                    pending, hint)
    return dataset


def archive_batches(dataset, columns: Iterable[str] | None = None, groups: pa.Array | None = None,
                    batch_size: int | None = None) -> Iterator[pa.RecordBatch]:
    """The archived rows in archive order (what `dataset.to_table()` gives, without the partition
    columns `run` and `policy`), in batches of `batch_size` rows (default READ_BATCH; the last one
    shorter), read file by file a batch at a time: `columns` only when given, the rows of `groups`
    only when given."""
    batch_size = batch_size or READ_BATCH
    schema = dataset.schema
    names = [n for n in (columns or schema.names) if n not in ("run", "policy")]
    schema = pa.schema([schema.field(n) for n in names], metadata=schema.metadata)
    pending, held = [], 0
    for fragment in dataset.get_fragments():
        with pq.ParquetFile(fragment.path, filesystem=fragment.filesystem, buffer_size=READ_BUFFER,
                            pre_buffer=False) as pf:
            have = [n for n in names if n in pf.schema_arrow.names]
            for batch in pf.iter_batches(batch_size=batch_size, columns=have, use_threads=False):
                batch = _conformed(batch, schema)
                if groups is not None:
                    batch = batch.filter(pc.is_in(batch.column("group_id"), value_set=groups))
                pending.append(batch)
                held += batch.num_rows
                while held >= batch_size:
                    out, pending = _take(pending, batch_size)
                    held -= batch_size
                    yield out
    if held:
        yield _take(pending, held)[0]


def _take(batches: list[pa.RecordBatch], n: int) -> tuple[pa.RecordBatch, list[pa.RecordBatch]]:
    """The first `n` rows of `batches` as one batch, and the rest."""
    if len(batches) == 1 and batches[0].num_rows == n:
        return batches[0], []
    table = pa.Table.from_batches(batches)
    return table.slice(0, n).combine_chunks().to_batches()[0], table.slice(n).to_batches()


def _conformed(batch: pa.RecordBatch, schema: pa.Schema) -> pa.RecordBatch:
    """`batch` in `schema` (the dataset's: a file without a column gives nulls, as the dataset would)."""
    if batch.schema.equals(schema, check_metadata=True):
        return batch
    cols = [batch.column(f.name).cast(f.type) if f.name in batch.schema.names else pa.nulls(batch.num_rows, f.type)
            for f in schema]
    return pa.RecordBatch.from_arrays(cols, schema=schema)


class _Tally:
    """Batches passed through, counting their rows and distinct groups."""

    def __init__(self, batches: Iterable[pa.RecordBatch]):
        self.batches, self.rows, self.groups = batches, 0, set()

    def __iter__(self) -> Iterator[pa.RecordBatch]:
        for batch in self.batches:
            self.rows += batch.num_rows
            self.groups.update(pc.unique(batch.column("group_id")).to_pylist())
            yield batch


def prompts_by_id(run: RunDir, wanted: set[str] | None = None) -> dict:
    """The run's training prompts whose id is in `wanted` (None: all of them); rows of the others
    are never made (a million-prompt set took 2.4 GB here as rows)."""
    from .data import read_prompts

    return read_prompts(run.child_url("data", "train.parquet"), "data.train").by_id(wanted)


def version_groups(run: RunDir, version: int | None) -> pa.Array | None:
    """The ids of the groups that made policy `version` (None: no filter)."""
    if version is None:
        return None
    from .lineage import check_version, groups_of_version, read_ledger

    ledger = read_ledger(run)
    check_version(ledger, version, run.url)
    return pa.array([g["group_id"] for g in groups_of_version(ledger, version)], pa.string())


def usage_counts(run: RunDir) -> dict[str, list[int]]:
    """group id -> [fresh uses, replay uses], from the lineage ledger."""
    from .lineage import read_ledger

    uses: dict[str, list[int]] = {}
    for gid, kind in zip(*read_ledger(run).select(["group_id", "kind"]).to_pydict().values()):
        uses.setdefault(gid, [0, 0])[kind != "fresh"] += 1
    return uses


def with_usage(batch: pa.RecordBatch, uses: dict[str, list[int]]) -> pa.RecordBatch:
    """`batch` plus `fresh_uses`, `replay_uses`: how often the trainer used each row's group."""
    ids = batch.column("group_id").to_pylist()
    batch = batch.append_column("fresh_uses", pa.array([uses.get(g, [0, 0])[0] for g in ids], pa.int32()))
    return batch.append_column("replay_uses", pa.array([uses.get(g, [0, 0])[1] for g in ids], pa.int32()))


def _groups(rows: pa.Table | Iterable[pa.RecordBatch]) -> list[list[dict]]:
    """Per group (by group id) the rows `sft_rows` and `dpo_rows` pick from: its highest- and its
    lowest-reward row, the first by sample id of equal rewards (one row when they are the same),
    kept as the batches go by. Rows whose reward is not a finite number (NaN from a reward model)
    are left out: no order ranks them."""
    keep: dict[str, list[dict]] = {}
    for batch in rows.to_batches() if isinstance(rows, pa.Table) else rows:
        for r in batch.select(list(LIGHT_COLUMNS)).to_pylist():
            if r["reward"] is None or not math.isfinite(r["reward"]):
                continue
            k = keep.get(r["group_id"])
            if k is None:
                keep[r["group_id"]] = [r, r]
                continue
            best, worst = k
            if r["reward"] > best["reward"] or (r["reward"] == best["reward"] and r["sample_id"] < best["sample_id"]):
                k[0] = r
            if r["reward"] < worst["reward"] or (r["reward"] == worst["reward"] and r["sample_id"] < worst["sample_id"]):
                k[1] = r
    return [sorted({id(r): r for r in k}.values(), key=lambda r: r["sample_id"]) for _, k in sorted(keep.items())]


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
    dataset = archive_dataset(run)
    groups = version_groups(run, version)
    if fmt == "parquet":
        uses = usage_counts(run)
        tally = _Tally(archive_batches(dataset, groups=groups))
        rows = write_batches((with_usage(b, uses) for b in tally), fs, path, empty=f"{run.url}: no archived rows"
                             f"{'' if version is None else f' of the groups that made version {version}'}")
    else:
        tally = _Tally(archive_batches(dataset, LIGHT_COLUMNS, groups))
        rows = _write_pairs(fmt, run, _groups(tally), fs, path, min_reward)
    return {"out": fs.unstrip_protocol(path), "format": fmt, "rows": rows,
            "archived_rows": tally.rows, "groups": len(tally.groups)}


def _write_pairs(fmt: str, run: RunDir, groups: list[list[dict]], fs, path: str, min_reward: float | None) -> int:
    """Write the `sft` or `dpo` rows of `groups` (see `_groups`); returns their number."""
    prompts = prompts_by_id(run, {g[0]["prompt_id"] for g in groups})
    groups = [g for g in groups if g[0]["prompt_id"] in prompts]
    rows = sft_rows(groups, prompts, min_reward) if fmt == "sft" else dpo_rows(groups, prompts)
    if not rows:
        raise ConfigError(f"{run.url}: no {fmt} rows (no group has "
                          f"{'two completions with different rewards' if fmt == 'dpo' else 'a completion'}"
                          f"{'' if min_reward is None or fmt == 'dpo' else f' with reward >= {min_reward}'})")
    write_table(pa.Table.from_pylist(rows), fs, path)
    return len(rows)
