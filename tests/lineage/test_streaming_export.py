"""`rlhf export` and `rlhf rescore` on an archive of several L3 files: the output is what the whole
archive read as one table gives (same rows, columns, order), while the archive is read a batch at a
time (the Arrow memory held stays a small part of the archive) and `sft` / `dpo` never read the
token columns. A run built in-process with the buffer's own writer and compaction (no sampler)."""

from __future__ import annotations

import io
import json
import math
import os
import uuid
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import yaml

from pipeline import export as export_mod
from pipeline import rescore as rescore_mod
from pipeline.buffer import ReplayBuffer
from pipeline.buffer.schema import ROLLOUT_SCHEMA
from pipeline.config import BufferConfig, ConfigError, parse_config
from pipeline.data import load_prompts, write_rows
from pipeline.export import dpo_rows, export, prompts_by_id, sft_rows
from pipeline.lineage import LineageWriter, groups_of_version, read_ledger
from pipeline.rescore import rescore
from pipeline.rundir import RunDir

REPO = Path(__file__).resolve().parents[2]
GROUPS, GROUP_SIZE, PROMPT_TOKENS, RESPONSE_TOKENS = 2000, 4, 200, 400
HEAVY = ("prompt_token_ids", "response_token_ids", "behavior_logprobs")
LIGHT = ("group_id", "prompt_id", "sample_id", "response_text", "reward", "policy_version", "data_source")


def _rollouts(pids: list[str], first: int, n_groups: int, rng) -> pa.Table:
    """Whole groups, each listed in another order than by sample id; rewards from a few values
    (ties), some NaN; every 7th group's last sample made by the next policy version (its rows then
    lie in two archive files). Token ids and log-probs of realistic length: about 4 kB a row."""
    g = np.repeat(np.arange(first, first + n_groups), GROUP_SIZE)
    j = np.tile(np.arange(GROUP_SIZE), n_groups)
    n = len(g)

    def lists(width: int, values: np.ndarray) -> pa.Array:
        return pa.ListArray.from_arrays(pa.array(np.arange(0, n * width + 1, width, dtype=np.int32)), pa.array(values))

    reward = rng.choice(np.array([0.0, 0.25, 0.5, 1.0], np.float32), n)
    reward[rng.random(n) < 0.05] = np.nan
    cols = {
        "sample_id": [f"g{a:05d}-s{(b * 3) % GROUP_SIZE}" for a, b in zip(g, j)],
        "prompt_id": [pids[a % len(pids)] for a in g], "group_id": [f"g{a:05d}" for a in g], "data_source": ["synth"] * n,
        "prompt_token_ids": lists(PROMPT_TOKENS, rng.integers(0, 32000, n * PROMPT_TOKENS, dtype=np.int32)),
        "response_token_ids": lists(RESPONSE_TOKENS, rng.integers(0, 32000, n * RESPONSE_TOKENS, dtype=np.int32)),
        "response_text": [f"answer {a} {b} " + "x" * int(k) for a, b, k in zip(g, j, rng.integers(0, 40, n))],
        "behavior_logprobs": lists(RESPONSE_TOKENS, -rng.random(n * RESPONSE_TOKENS, dtype=np.float32)),
        "reward": reward, "token_rewards": pa.nulls(n, pa.list_(pa.float32())), "reward_extra": pa.nulls(n, pa.string()),
        "finish_reason": ["stop"] * n, "policy_version": g * 4 // GROUPS + ((g % 7 == 0) & (j == GROUP_SIZE - 1)),
        "sampler_id": ["s0"] * n, "created_at": pa.array([datetime.now(timezone.utc)] * n, pa.timestamp("us", tz="UTC")),
        "content_hash": [uuid.uuid4().hex for _ in range(n)], "tier": ["l1"] * n,
        "replay_count": np.zeros(n, np.int32), "priority": np.ones(n, np.float32),
    }
    return pa.table(cols, schema=ROLLOUT_SCHEMA)


def _archive_per_version(buf: ReplayBuffer) -> None:
    """Archive L1 as compaction once did, a `policy=<version>` folder per version: a group whose rows
    were made by two versions lies in two files, which exports must put back together."""
    from pipeline.buffer.actions import AddShard, RemoveShard
    from pipeline.buffer.shards import encode, group_layout, policy_range, write_shard

    l1 = buf.refresh().tier_shards("l1")
    table = pa.concat_tables([buf.load_shard(s) for s in l1])
    table = table.set_column(table.schema.get_field_index("tier"), "tier", pa.array(["l3"] * table.num_rows))
    actions = [RemoveShard(s.path) for s in l1]
    for pv in sorted(pc.unique(table.column("policy_version")).to_pylist()):
        part, sizes = group_layout(table.filter(pc.equal(table.column("policy_version"), pv)))
        for k in range(0, part.num_rows, 1000):
            chunk, rel = part.slice(k, 1000), f"l3/run=synth/policy={pv}/part-{k}.parquet"
            data = encode(chunk, "zstd")
            write_shard(buf.fs, buf.root, rel, data)
            actions.append(AddShard(rel, "l3", chunk.num_rows, len(data), (), policy_range(chunk), 0.0))
    buf.commit(actions)


def make_run(url: str) -> RunDir:
    run = RunDir(url)
    run.create(parse_config(yaml.safe_load((REPO / "configs" / "tiny-test.yaml").read_text())))
    write_rows([{"data_source": "synth", "prompt": [{"role": "user", "content": f"question {i}"}],
                 "reward_model": {"ground_truth": str(i)}} for i in range(50)], run.child_url("data", "train.parquet"))
    pids = [p.prompt_id for p in load_prompts(run.child_url("data", "train.parquet"))]
    buf = ReplayBuffer(run.buffer_url, BufferConfig(checkpoint_interval=5, compact_target_rows=2500))
    rng = np.random.default_rng(7)
    tables = [_rollouts(pids, first, 250, rng) for first in range(0, GROUPS, 250)]
    with buf.writer("w") as w:
        for t in tables:
            w.write(t)
    _archive_per_version(buf)
    lineage = LineageWriter(run, 0)  # v1: two groups that are not archived; v2: 0..63; v3: 64..127, replays
    lineage.add(_rollouts(pids, 10_000, 2, rng), step=1, update=1, version=1, kind="fresh", stats={})
    whole = pa.concat_tables(tables)
    for update, (lo, hi, kind) in enumerate([(0, 64, "fresh"), (64, 128, "fresh"), (0, 24, "replay")], start=2):
        part = whole.slice(lo * GROUP_SIZE, (hi - lo) * GROUP_SIZE)
        lineage.add(part, step=update, update=update, version=min(update, 3), kind=kind, stats={})
    lineage.flush()
    return run


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> RunDir:
    return make_run(str(tmp_path_factory.mktemp("streaming") / "runs" / "synth"))


def whole_archive(run: RunDir) -> pa.Table:
    """The archive as the export read it before: one table, less the partition columns."""
    table = ReplayBuffer(run.buffer_url, run.config().buffer).archive_dataset().to_table()
    return table.drop_columns(["run", "policy"])


def same_table(a: pa.Table, b: pa.Table) -> bool:
    """Equal schemas (metadata too) and values, in order; NaN equal to NaN (the archive holds some)."""
    def text(t: pa.Table) -> pa.Table:
        return pa.table({n: c.cast(pa.string()) if pa.types.is_floating(c.type) else c
                         for n, c in zip(t.column_names, t.columns)})

    return a.schema.equals(b.schema, check_metadata=True) and text(a).equals(text(b))


def as_written(table: pa.Table) -> pa.Table:
    """`table` as one Parquet write (what the export did with the whole table) reads back."""
    sink = io.BytesIO()
    pq.write_table(table, sink, compression="zstd")
    return pq.read_table(pa.BufferReader(sink.getvalue()))


class Probe:
    """Records what export reads from archive files (the columns asked for) and the most Arrow
    memory allocated, beyond what was allocated when it was made, whenever a batch is read."""

    def __init__(self, monkeypatch):
        self.columns: list = []
        self.base, self.peak = pa.total_allocated_bytes(), 0
        probe, real = self, pq.ParquetFile

        class Recording(real):
            def iter_batches(self, *args, **kwargs):
                probe.columns.append(kwargs.get("columns"))
                for batch in super().iter_batches(*args, **kwargs):
                    probe.peak = max(probe.peak, pa.total_allocated_bytes() - probe.base)
                    yield batch

        monkeypatch.setattr(pq, "ParquetFile", Recording)


@pytest.fixture
def small_batches(monkeypatch):
    for module, name, value in ((export_mod, "READ_BATCH", 32), (export_mod, "READ_BUFFER", 64 << 10),
                                (export_mod, "ROW_GROUP_BYTES", 256 << 10), (rescore_mod, "BATCH", 32)):
        monkeypatch.setattr(module, name, value, raising=False)


def test_the_synthetic_archive_has_several_files_and_groups_across_them(run):
    buf = ReplayBuffer(run.buffer_url, run.config().buffer)
    files = buf.archive_files()
    assert len(files) >= 6
    by_file = [set(pq.read_table(f.removeprefix("file://"), columns=["group_id"])["group_id"].to_pylist())
               for f in files]
    assert any(a & b for i, a in enumerate(by_file) for b in by_file[i + 1:])  # a group in two files


def test_parquet_export_streams_the_archive_and_writes_what_the_whole_table_gives(run, tmp_path, monkeypatch,
                                                                                  small_batches):
    whole = whole_archive(run)
    uses: dict[str, Counter] = {}
    for r in read_ledger(run).to_pylist():
        uses.setdefault(r["group_id"], Counter())[r["kind"]] += 1
    ids = whole["group_id"].to_pylist()
    expected = whole.append_column("fresh_uses", pa.array([uses.get(g, Counter())["fresh"] for g in ids], pa.int32()))
    expected = expected.append_column("replay_uses", pa.array([uses.get(g, Counter())["replay"] for g in ids], pa.int32()))
    archive_bytes = whole.nbytes
    del whole

    probe = Probe(monkeypatch)
    out = tmp_path / "raw.parquet"
    got = export(run.url, "parquet", str(out))
    assert probe.columns and 0 < probe.peak < archive_bytes / 4, (probe.peak, archive_bytes)  # read in batches
    assert same_table(pq.read_table(out), as_written(expected))  # same rows, columns, order and schema
    assert got["rows"] == got["archived_rows"] == expected.num_rows and got["groups"] == GROUPS
    assert pq.ParquetFile(out).metadata.num_row_groups > 1  # written as it was read

    # --version: the groups of updates 1..3, filtered batch by batch; JSON lines as before
    keep = {g["group_id"] for g in groups_of_version(read_ledger(run), 3)}
    jsonl = tmp_path / "v3.jsonl"
    got = export(run.url, "parquet", str(jsonl), version=3)
    lines = jsonl.read_text().splitlines()
    want = expected.filter(pc.is_in(expected["group_id"], value_set=pa.array(sorted(keep))))
    assert lines == [json.dumps(r, default=str) for r in want.to_pylist()]
    assert (got["rows"], got["archived_rows"], got["groups"]) == (want.num_rows, want.num_rows, 128)


def reference_groups(table: pa.Table) -> list[list[dict]]:
    """The grouping the export used before: every row of a group, by sample id, NaN rewards left out."""
    out: dict[str, list[dict]] = {}
    for r in table.select(list(LIGHT)).to_pylist():
        if not math.isnan(r["reward"]):
            out.setdefault(r["group_id"], []).append(r)
    return [sorted(rows, key=lambda r: r["sample_id"]) for _, rows in sorted(out.items())]


def test_sft_and_dpo_read_only_their_columns_and_pick_what_all_rows_give(run, tmp_path, monkeypatch, small_batches):
    whole = whole_archive(run)
    groups, prompts = reference_groups(whole), prompts_by_id(run)
    expected = {"sft": sft_rows(groups, prompts), "dpo": dpo_rows(groups, prompts),
                "sft-min": sft_rows(groups, prompts, min_reward=0.5)}
    heavy_bytes = sum(whole[c].nbytes for c in HEAVY)
    del whole
    for name, fmt, min_reward in (("sft", "sft", None), ("dpo", "dpo", None), ("sft-min", "sft", 0.5)):
        probe = Probe(monkeypatch)
        out = tmp_path / f"{name}.parquet"
        got = export(run.url, fmt, str(out), min_reward=min_reward)
        assert pq.read_table(out).to_pylist() == pa.Table.from_pylist(expected[name]).to_pylist()
        assert got["rows"] == len(expected[name]) and got["groups"] == GROUPS
        assert probe.columns and all(set(c) <= set(LIGHT) for c in probe.columns)  # no token columns
        assert probe.peak < heavy_bytes / 4, (probe.peak, heavy_bytes)
    assert 0 < len(expected["dpo"]) < GROUPS and 0 < len(expected["sft-min"]) < len(expected["sft"])


def test_rescore_streams_and_writes_what_the_whole_table_gives(run, tmp_path, monkeypatch, small_batches):
    reward = tmp_path / "length_reward.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return {'score': float(len(solution_str)), 'half': len(solution_str) / 2}\n")
    whole = whole_archive(run)
    texts, old = whole["response_text"].to_pylist(), whole["reward"].to_pylist()
    expected = whole.append_column("reward_original", whole["reward"])
    for name, values, kind in (("reward", [float(len(t)) for t in texts], pa.float32()),
                               ("reward_extra", [json.dumps({"half": len(t) / 2}) for t in texts], pa.string()),
                               ("token_rewards", [None] * whole.num_rows, pa.list_(pa.float32()))):
        expected = expected.set_column(expected.schema.get_field_index(name), name, pa.array(values, kind))
    archive_bytes = whole.nbytes
    del whole

    probe = Probe(monkeypatch)
    out = tmp_path / "rescored.parquet"
    got = rescore(run.url, f"{reward}:compute_score", str(out), overrides=["timeout_s=30"])
    assert probe.columns and 0 < probe.peak < archive_bytes / 4, (probe.peak, archive_bytes)  # read in batches
    assert same_table(pq.read_table(out), as_written(expected))
    assert got["rows"] == expected.num_rows and pq.ParquetFile(out).metadata.num_row_groups > 1
    assert got["mean_reward"] == pytest.approx(sum(len(t) for t in texts) / len(texts))
    assert got["mean_reward_original"] == pytest.approx(sum(old) / len(old), nan_ok=True)
    assert ["prompt_id"] in probe.columns  # the prompt ids are checked first, from that column alone


def test_a_failed_or_empty_export_publishes_nothing_and_object_stores_work(run, tmp_path, monkeypatch,
                                                                           small_batches):
    out = tmp_path / "raw.parquet"
    out.write_bytes(b"the old file")
    calls = []

    def failing(batch, uses):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("disk on fire")
        return real(batch, uses)

    real = export_mod.with_usage
    monkeypatch.setattr(export_mod, "with_usage", failing)
    with pytest.raises(RuntimeError, match="disk on fire"):
        export(run.url, "parquet", str(out), force=True)
    monkeypatch.setattr(export_mod, "with_usage", real)
    assert out.read_bytes() == b"the old file" and sorted(os.listdir(tmp_path)) == ["raw.parquet"]

    # version 1's groups are not in the archive: an error, as before, and no file
    with pytest.raises(ConfigError, match="no archived rows of the groups that made version 1"):
        export(run.url, "parquet", str(tmp_path / "v1.parquet"), version=1)
    assert sorted(os.listdir(tmp_path)) == ["raw.parquet"]

    # an fsspec URL (memory://): uploaded once complete, the same bytes as a local export
    url = f"memory://exports/{uuid.uuid4().hex}/sft.jsonl"
    export(run.url, "sft", url)
    export(run.url, "sft", str(tmp_path / "sft.jsonl"))
    fs = fsspec.filesystem("memory")
    assert fs.cat_file(url.removeprefix("memory://")) == (tmp_path / "sft.jsonl").read_bytes()
    with pytest.raises(ConfigError, match="--force"):
        export(run.url, "sft", url)


def test_a_run_on_an_object_store_exports_the_same_rows(tmp_path, small_batches):
    url = f"memory://runs-{uuid.uuid4().hex}/synth"
    mem = make_run(url)
    try:
        out = tmp_path / "raw.parquet"
        export(mem.url, "parquet", str(out))
        assert same_table(pq.read_table(out).drop_columns(["fresh_uses", "replay_uses"]), as_written(whole_archive(mem)))
    finally:
        fsspec.filesystem("memory").rm(url.removeprefix("memory://").split("/")[0], recursive=True)


def test_before_finalize_the_export_says_what_l1_holds_that_the_archive_does_not(tmp_path, caplog):
    """With sampler.oversample, L3 holds the groups not handed over from the start; the groups
    handed over reach it at finalize (or `rlhf buffer compact`)."""
    run = RunDir(str(tmp_path / "runs" / "early"))
    run.create(parse_config(yaml.safe_load((REPO / "configs" / "tiny-test.yaml").read_text())))
    write_rows([{"data_source": "synth", "prompt": [{"role": "user", "content": f"question {i}"}],
                 "reward_model": {"ground_truth": str(i)}} for i in range(4)], run.child_url("data", "train.parquet"))
    pids = [p.prompt_id for p in load_prompts(run.child_url("data", "train.parquet"))]
    rng = np.random.default_rng(3)
    with ReplayBuffer(run.buffer_url, run.config().buffer).writer("sampler-0") as w:
        w.write(_rollouts(pids, 0, 3, rng))
    with pytest.raises(ConfigError, match=r"the archive \(L3\) is empty; finalize the run first"):
        export(run.url, "parquet", str(tmp_path / "none.parquet"))
    with ReplayBuffer(run.buffer_url, run.config().buffer).writer("sampler-0") as w:
        w.write(_rollouts(pids, 3, 2, rng), archive=_rollouts(pids, 5, 1, rng))
    with caplog.at_level("WARNING", logger="rlhf.export"):
        assert export(run.url, "parquet", str(tmp_path / "early.parquet"))["rows"] == GROUP_SIZE
    assert "20 rows in L1 are not in the archive yet" in caplog.text and "finalize the run first" in caplog.text
