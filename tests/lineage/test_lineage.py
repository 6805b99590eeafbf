"""The lineage ledger and the archive read back, on one tiny run with replay epochs: checked
against what the buffer's commit log, the L3 archive and the trainer's metrics say (never
against the ledger itself)."""

from __future__ import annotations

import json
import os
import sys
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from spawner import Spawner

from pipeline.buffer import ReplayBuffer
from pipeline.buffer.actions import RecordReplays
from pipeline.lineage import LineageWriter, ledger_files, read_ledger
from pipeline.rundir import RunDir
from pipeline.storage import list_files

pytestmark = pytest.mark.integration
STEPS, GROUPS, GROUP_SIZE = 4, 8, 4


def rlhf(*args, timeout=300):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with Spawner() as spawn:
        return spawn.run([sys.executable, "-m", "pipeline", *args], capture_output=True, text=True, timeout=timeout,
                         env=env)


@pytest.fixture(scope="module")
def replay_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("lineage") / "runs" / "lin"
    p = rlhf("run", "configs/tiny-test.yaml", "--run-dir", f"file://{run_dir}", "--no-progress",
             "--set", f"trainer.steps={STEPS}", "--set", "trainer.replay_epochs=2",
             "--set", "trainer.replay_rows=positive", "--set", "model.path=builtin:sort",
             "--set", "data.train=builtin:sort", "--set", "data.eval=builtin:sort", "--set", "reward.fn=sort")
    assert p.returncode == 0, p.stderr[-3000:]
    return RunDir(str(run_dir))


def archive(run) -> pa.Table:
    buf = ReplayBuffer(run.buffer_url, run.config().buffer)
    return buf.archive_dataset().to_table(columns=["sample_id", "group_id", "prompt_id", "reward", "created_at", "response_text"])


def groups_in_commit_order(run) -> list[str]:
    """Group ids as the sampler committed them: an archive file keeps a batch's rows in order and a
    batch's rows share its creation time."""
    rows = archive(run).select(["group_id", "created_at"]).to_pylist()
    order = sorted(range(len(rows)), key=lambda i: (rows[i]["created_at"], i))
    return list(dict.fromkeys(rows[i]["group_id"] for i in order))


def replays_in_buffer_log(run) -> Counter:
    buf = ReplayBuffer(run.buffer_url, run.config().buffer)
    seen: Counter = Counter()
    for v in buf.log.entry_versions():
        for action in buf.log.read_entry(v).actions:
            if isinstance(action, RecordReplays):
                seen.update(action.keys)
    return seen


def test_the_ledger_lists_the_groups_the_trainer_consumed(replay_run):
    run = replay_run
    ledger = read_ledger(run).to_pylist()
    committed = groups_in_commit_order(run)
    fresh = [r for r in ledger if r["kind"] == "fresh"]
    for step in range(1, STEPS + 1):  # each fresh step: the next groups_per_step committed groups
        assert [r["group_id"] for r in fresh if r["step"] == step] == \
            sorted(committed[(step - 1) * GROUPS:step * GROUPS]), step
    assert len({r["group_id"] for r in fresh}) == len(fresh) == STEPS * GROUPS  # each fresh exactly once

    replays = Counter(r["group_id"] for r in ledger if r["kind"] == "replay")
    assert replays and replays == replays_in_buffer_log(run)  # one row per replay the buffer counted
    # replay_rows=positive: a replay trains the rows that beat their group, never all of a group's rows
    assert all(0 < r["rows"] < GROUP_SIZE for r in ledger if r["kind"] == "replay")
    assert all(r["rows"] == GROUP_SIZE for r in fresh)
    assert all(r["group_id"] in committed[:STEPS * GROUPS] for r in ledger)

    # one ledger batch per trainer metrics record, with the same rows, kind and reward
    records = [r for r in run.read_metrics("trainer") if "step" in r]
    assert sorted({r["update"] for r in ledger}) == [r["updates"] for r in records]
    for rec in records:
        rows = [r for r in ledger if r["update"] == rec["updates"]]
        assert {r["step"] for r in rows} == {rec["step"]}
        assert {r["kind"] for r in rows} == {"replay" if rec["replay/is_replay"] else "fresh"}
        assert sum(r["rows"] for r in rows) == rec["trainer/samples"]
        mean = sum(r["reward_mean"] * r["rows"] for r in rows) / rec["trainer/samples"]
        assert mean == pytest.approx(rec["reward/mean"], abs=1e-5)
        if rec["replay/is_replay"]:
            weights = [r["is_weight"] for r in rows for _ in range(r["rows"])]
            assert sum(weights) / len(weights) == pytest.approx(rec["replay/weight_mean"], rel=1e-5)


def test_lineage_of_a_version_and_of_a_step_from_the_command_line(replay_run):
    run = replay_run
    records = [r for r in run.read_metrics("trainer") if "step" in r]
    for version in (1, 2, STEPS):
        p = rlhf("lineage", run.url, "--version", str(version), timeout=120)
        assert p.returncode == 0, p.stderr[-2000:]
        out = json.loads(p.stdout)
        upto = [r for r in records if r["step"] <= version]
        assert out["fresh_uses"] == sum(r["trainer/samples"] for r in upto if not r["replay/is_replay"]) // GROUP_SIZE
        assert out["replay_uses"] == sum(r["replay/groups"] for r in upto if r["replay/is_replay"])
        assert out["groups"] == len(out["rows"]) == len({g for g in groups_in_commit_order(run)[:version * GROUPS]})
    replay_step = next(r["step"] for r in records if r["replay/is_replay"])
    out = json.loads(rlhf("lineage", run.url, "--step", str(replay_step), timeout=120).stdout)
    assert out["batches"] == sum(1 for r in records if r["step"] == replay_step) > 1
    assert out["fresh_uses"] == GROUPS and out["replay_uses"] > 0


def test_the_ledger_is_queryable_with_duckdb(replay_run):
    duckdb = pytest.importorskip("duckdb")
    glob = replay_run.path("lineage", "*.parquet")
    n, fresh = duckdb.sql(f"SELECT count(*), count(*) FILTER (WHERE kind = 'fresh') FROM read_parquet('{glob}')").fetchall()[0]
    assert (n, fresh) == (read_ledger(replay_run).num_rows, STEPS * GROUPS)
    assert [u.split("/")[-1] for u in ledger_files(replay_run)] == sorted(os.listdir(replay_run.path("lineage")))


def test_dpo_export_pairs_each_groups_best_with_its_worst(replay_run, tmp_path):
    out = tmp_path / "dpo.parquet"
    p = rlhf("export", replay_run.url, "--format", "dpo", "--out", str(out), timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    pairs = pq.read_table(out).to_pylist()
    by_group: dict[str, list[dict]] = {}
    for r in archive(replay_run).to_pylist():
        by_group.setdefault(r["group_id"], []).append(r)
    spread = {g for g, rows in by_group.items() if len({r["reward"] for r in rows}) > 1}
    assert pairs and {x["group_id"] for x in pairs} == spread  # one pair per group with a preference
    for x in pairs:
        rows = by_group[x["group_id"]]
        assert x["chosen_reward"] > x["rejected_reward"]
        assert x["chosen_reward"] == pytest.approx(max(r["reward"] for r in rows))
        assert x["rejected_reward"] == pytest.approx(min(r["reward"] for r in rows))
        assert x["chosen"][0]["role"] == "assistant" and x["prompt"][-1]["role"] == "user"
        assert {r["response_text"] for r in rows if r["reward"] == pytest.approx(x["chosen_reward"])} >= \
            {x["chosen"][0]["content"]}


def test_sft_and_parquet_exports_and_their_output_checks(replay_run, tmp_path):
    sft = tmp_path / "sft.jsonl"
    p = rlhf("export", replay_run.url, "--format", "sft", "--out", str(sft), "--version", "2", timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    rows = [json.loads(line) for line in sft.read_text().splitlines()]
    assert {r["group_id"] for r in rows} == set(groups_in_commit_order(replay_run)[:2 * GROUPS])
    assert all(r["completion"][0]["role"] == "assistant" for r in rows)

    again = rlhf("export", replay_run.url, "--format", "sft", "--out", str(sft), timeout=120)
    assert again.returncode == 2 and "--force" in again.stderr
    inside = rlhf("export", replay_run.url, "--format", "parquet", "--out", replay_run.path("x.parquet"), timeout=120)
    assert inside.returncode == 2 and "inside the run directory" in inside.stderr
    dots = rlhf("export", replay_run.url, "--format", "parquet", "--out", f"{tmp_path}/a/../b.parquet", timeout=120)
    assert dots.returncode == 2 and "'..'" in dots.stderr

    raw = tmp_path / "raw.parquet"
    assert rlhf("export", replay_run.url, "--format", "parquet", "--out", str(raw), timeout=120).returncode == 0
    table = pq.read_table(raw)
    uses = Counter(r["group_id"] for r in read_ledger(replay_run).to_pylist() if r["kind"] == "replay")
    assert table.num_rows == archive(replay_run).num_rows
    for r in table.select(["group_id", "fresh_uses", "replay_uses"]).to_pylist():
        assert r["replay_uses"] == uses.get(r["group_id"], 0)
    # no version 0 (nothing trained made it): refused, not an empty file
    from pipeline.config import ConfigError
    from pipeline.export import export

    for fmt in ("parquet", "sft"):
        with pytest.raises(ConfigError, match="--version 0: policy versions made by training start at 1"):
            export(replay_run.url, fmt, str(tmp_path / f"v0.{fmt}"), version=0)
    assert not list(tmp_path.glob("v0.*"))
    # output paths: through a link to the run, a folder, an upper-case extension; --min-reward is sft's
    link = tmp_path / "runlink"
    os.symlink(replay_run.root, link)
    with pytest.raises(ConfigError, match="inside the run directory"):
        export(str(link), "parquet", replay_run.path("inside.parquet"))
    with pytest.raises(ConfigError, match="names a folder"):
        export(replay_run.url, "sft", f"{tmp_path}/out/")
    export(replay_run.url, "sft", str(tmp_path / "upper.JSONL"))
    assert json.loads((tmp_path / "upper.JSONL").read_text().splitlines()[0])["completion"]
    with pytest.raises(ConfigError, match="--min-reward applies to --format sft"):
        export(replay_run.url, "dpo", str(tmp_path / "d.jsonl"), min_reward=0.5)
    from pipeline.cli import main

    assert main(["lineage", replay_run.url, "--version", "9999"]) == 2


def test_a_reward_that_is_not_a_number_pairs_nothing_whatever_its_place():
    import pyarrow as pa

    from pipeline.data import PromptRow
    from pipeline.export import _groups, dpo_rows, sft_rows

    prompts = {"p": PromptRow("p", "s", "hi", None, None)}
    nan = float("nan")
    for rewards in ([nan, 0.2, 0.9], [0.2, nan, 0.9], [0.2, 0.9, nan]):
        table = pa.Table.from_pylist([{"group_id": "g", "prompt_id": "p", "sample_id": f"s{i}", "response_text": f"r{i}",
                                       "reward": r, "policy_version": 1, "data_source": "s"} for i, r in enumerate(rewards)])
        groups = _groups(table)
        assert [(r["chosen_reward"], r["rejected_reward"]) for r in dpo_rows(groups, prompts)] == [(0.9, 0.2)]
        assert [r["reward"] for r in sft_rows(groups, prompts)] == [0.9]


def test_rescore_scores_the_archive_with_another_reward_and_leaves_the_run_alone(replay_run, tmp_path):
    reward = tmp_path / "length_reward.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return {'score': float(len(solution_str)), 'half': len(solution_str) / 2}\n")
    before = sorted((e.rel, e.size, e.mtime) for e in list_files(replay_run.fs, replay_run.root))
    out = tmp_path / "rescored.parquet"
    p = rlhf("buffer", "rescore", replay_run.url, "--reward", f"{reward}:compute_score", "--set", "timeout_s=30",
             "--out", str(out), timeout=180)
    assert p.returncode == 0, p.stderr[-2000:]
    table = pq.read_table(out).to_pylist()
    old = {r["sample_id"]: r["reward"] for r in archive(replay_run).to_pylist()}
    assert len(table) == archive(replay_run).num_rows
    for r in table:
        assert r["reward"] == float(len(r["response_text"]))
        assert json.loads(r["reward_extra"]) == {"half": len(r["response_text"]) / 2}
        assert r["reward_original"] == pytest.approx(old[r["sample_id"]])
    after = sorted((e.rel, e.size, e.mtime) for e in list_files(replay_run.fs, replay_run.root))
    assert after == before


def test_a_resumed_trainer_rolls_the_ledger_back_to_its_checkpoint(tmp_path):
    """Updates 1..6 written in two parts, the trainer resumes from a checkpoint after update 4 and
    redoes 5, 6 (with other replay draws): every update appears once, with the rows written last."""
    run = RunDir(str(tmp_path / "resumed"))

    def batch(update: int, tag: str) -> pa.Table:
        rows = [{"group_id": f"{tag}{update}-{g}", "prompt_id": f"p{g}", "policy_version": 0, "sampler_id": "s",
                 "reward": float(g)} for g in range(2)]
        return pa.Table.from_pylist(rows)

    first = LineageWriter(run, 0)
    for u in range(1, 7):
        first.add(batch(u, "a"), step=u, update=u, version=u, kind="fresh", stats={})
        if u == 3:
            first.flush()
    first.flush()
    assert sorted(os.listdir(run.path("lineage"))) == ["part-000000000001-000000000003.parquet",
                                                       "part-000000000004-000000000006.parquet"]
    second = LineageWriter(run, 4)  # rolled back: 5, 6 are gone, 4 stays
    assert sorted({r["update"] for r in read_ledger(run).to_pylist()}) == [1, 2, 3, 4]
    for u in (5, 6):
        second.add(batch(u, "b"), step=u, update=u, version=u, kind="fresh", stats={})
    second.flush()
    got = [(r["update"], r["group_id"]) for r in read_ledger(run).to_pylist()]
    assert got == [(u, f"{'a' if u <= 4 else 'b'}{u}-{g}") for u in range(1, 7) for g in range(2)]

    # a rollback killed between writing the truncated part and deleting the old one: readers keep
    # the truncated part, the next rollback finishes the job
    lin = run.path("lineage")
    straddler = os.path.join(lin, "part-000000000001-000000000003.parquet")
    saved = open(straddler, "rb").read()
    LineageWriter(run, 2)
    assert sorted(os.listdir(lin)) == ["part-000000000001-000000000002.parquet"]
    with open(straddler, "wb") as f:
        f.write(saved)
    assert sorted({r["update"] for r in read_ledger(run).to_pylist()}) == [1, 2]
    LineageWriter(run, 2)
    assert sorted(os.listdir(lin)) == ["part-000000000001-000000000002.parquet"]
