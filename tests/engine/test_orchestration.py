"""The run's steps (`pipeline.orchestration`), which the local runner and the DAG tasks both take."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline import orchestration
from pipeline.buffer import ReplayBuffer
from pipeline.config import ConfigError, parse_config
from pipeline.models import load_tokenizer
from pipeline.policy import PolicyStore, version_dirname
from pipeline.reshard import ReshardError
from pipeline.rundir import RunDir

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "trainer"))
from trainer_rollouts import synthetic_shard  # noqa: E402

GROUPS, GROUP_SIZE, SHARDS = 4, 4, 3
CONFIG = {
    "seed": 0,
    "model": {"path": "builtin:digit"},
    "data": {"train": "builtin:digit", "eval": "builtin:digit", "eval_size": 8},
    "reward": {"fn": "digit"},
    "sampler": {"group_size": GROUP_SIZE, "prompts_per_batch": GROUPS},
    "trainer": {"steps": 4, "groups_per_step": GROUPS, "phases": 2, "replay_epochs": 2},
}


@pytest.fixture
def run(tmp_path) -> RunDir:
    """A prepared run whose L1 holds SHARDS shards of GROUPS groups (as if a sampler had run)."""
    run = orchestration.prepare(parse_config(CONFIG), run_url=f"file://{tmp_path}/runs/r1")
    tok = load_tokenizer(PolicyStore(run).local_dir(0))
    prompts = [tok(f"digits {i}: ", add_special_tokens=False)["input_ids"] for i in range(8)]
    with ReplayBuffer(run.buffer_url, run.config().buffer).writer("test") as w:
        for shard in range(SHARDS):
            w.write(synthetic_shard(tok, prompts, shard, GROUPS, GROUP_SIZE, seed=0))
    return run


def tiers(run: RunDir) -> dict:
    return ReplayBuffer(run.buffer_url, run.config().buffer).stats()["tiers"]


def corrupt(run: RunDir, version: int) -> None:
    """Change the bytes (not the size) of the first file the version's manifest lists."""
    folder = Path(run.path("policy", version_dirname(version)))
    name = sorted(json.loads((folder / "manifest.json").read_text())["files"])[0]
    data = bytearray((folder / name).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (folder / name).write_bytes(bytes(data))


def test_finalize_refuses_a_run_the_trainer_may_still_resume(run, monkeypatch):
    monkeypatch.setattr(orchestration, "evaluate_policy", lambda *a, **k: pytest.fail("evaluated"))
    for stop in (None, {"by": "runner", "reason": "runner failed"}, {"by": "stop_sampler", "attempt": 0}):
        if stop is not None:
            run.request_stop(stop["reason"] if "reason" in stop else "", by=stop["by"], attempt=stop.get("attempt"))
        with pytest.raises(ConfigError, match="the trainer has not finished"):
            orchestration.finalize(run)
    assert tiers(run)["l1"]["rows"] == SHARDS * GROUPS * GROUP_SIZE  # nothing archived
    run.request_stop("enough", by="alice")  # a user's stop ends the run where it is
    monkeypatch.setattr(orchestration, "evaluate_policy", lambda *a, **k: {"score": 0.0})
    assert orchestration.finalize(run)["compaction"]["rows"] == SHARDS * GROUPS * GROUP_SIZE


def test_finalize_verifies_the_final_policy_compacts_l1_into_l3_and_writes_the_summary(run, monkeypatch):
    run.set_marker(RunDir.TRAINER_DONE_MARKER, {"step": 4})
    rows = SHARDS * GROUPS * GROUP_SIZE
    assert tiers(run)["l1"]["rows"] == rows
    summary = orchestration.finalize(run)
    assert tiers(run)["l1"]["rows"] == 0 and tiers(run)["l3"]["rows"] == rows
    assert summary["compaction"]["l1_shards_in"] >= 1 and summary["compaction"]["rows"] == rows
    assert summary["final_policy"]["version"] == 0 and summary["final_policy"]["verified"] is True
    assert summary["final_policy"]["files"] >= 1
    assert run.read_json("summary.json") == summary
    assert {"eval_before", "eval_after", "steps", "policy_versions"} <= summary.keys()
    # a retried finalize evaluates nothing again and archives nothing twice
    monkeypatch.setattr(orchestration, "evaluate_policy", lambda *a, **k: pytest.fail("evaluated again"))
    again = orchestration.finalize(run)
    assert again["eval_after"] == summary["eval_after"] and again["compaction"]["l1_shards_in"] == 0
    assert tiers(run)["l3"]["rows"] == rows


def test_a_retried_finalize_sends_each_tracker_the_evaluations_it_did_not_take(tmp_path, monkeypatch):
    """An attempt killed after it evaluated v0 (eval.json holds it) but before it sent it; and a
    tracker that is down at finalize: the next finalize sends them, and none twice."""
    import pipeline.tracking

    run = orchestration.prepare(parse_config({**CONFIG, "tracking": {"backends": ["tensorboard", "mlflow"]}}),
                                run_url=f"file://{tmp_path}/runs/r2")
    run.set_marker(RunDir.TRAINER_DONE_MARKER, {"step": 4})
    run.write_json("eval.json", {"0": {"score": 0.25}})
    sent, down = [], {"mlflow"}

    def log_evaluations(run, results, backends):
        sent.append((backends[0], dict(results)))
        return backends[0] not in down

    monkeypatch.setattr(pipeline.tracking, "log_evaluations", log_evaluations)
    monkeypatch.setattr(orchestration, "evaluate_policy", lambda *a, **k: pytest.fail("evaluated again"))
    orchestration.finalize(run)
    down.clear()  # the MLflow server is back
    orchestration.finalize(run)
    orchestration.finalize(run)
    assert sent == [("tensorboard", {0: {"score": 0.25}}), ("mlflow", {0: {"score": 0.25}}),
                    ("mlflow", {0: {"score": 0.25}})]


def test_finalize_refuses_a_final_policy_that_does_not_verify_before_any_work(run, monkeypatch):
    run.set_marker(RunDir.TRAINER_DONE_MARKER, {"step": 4})
    corrupt(run, 0)
    monkeypatch.setattr(orchestration, "evaluate_policy", lambda *a, **k: pytest.fail("evaluated a bad policy"))
    with pytest.raises(ReshardError, match="does not verify"):
        orchestration.finalize(run)
    assert tiers(run)["l1"]["rows"] == SHARDS * GROUPS * GROUP_SIZE and run.read_json("summary.json") is None


def test_publish_phase_reshards_into_a_verified_policy_version_and_is_idempotent(run):
    checkpoint = orchestration.resolve_sources(run.config())["model"]  # any layout reshard reads
    out = orchestration.publish_phase(run, 0, 2, checkpoint)
    assert (out["phase"], out["version"], out["published_now"]) == (0, 2, True) and out["files"] >= 1
    assert PolicyStore(run).exists(2) and PolicyStore(run).latest() == 2
    assert orchestration.publish_phase(run, 0, 2, checkpoint)["published_now"] is False  # a retried task
    corrupt(run, 2)
    with pytest.raises(ReshardError):  # a retry verifies again
        orchestration.publish_phase(run, 0, 2, checkpoint)


def test_the_replay_gate_condition_is_one_step_of_eligible_groups(run):
    cfg = run.config()
    assert orchestration.replay_gate_min_groups(cfg) == cfg.trainer.groups_per_step == GROUPS
    assert not orchestration.replay_gate_ready(GROUPS - 1, GROUPS)
    assert orchestration.replay_gate_ready(GROUPS, GROUPS)


def test_advance_publishes_finished_phases_and_opens_gates_in_order_once_ready(run, monkeypatch):
    checkpoint = orchestration.resolve_sources(run.config())["model"]
    eligible = [GROUPS - 1]
    monkeypatch.setattr(orchestration, "eligible_replay_groups", lambda r: eligible[0])
    run.set_marker(RunDir.phase_done_marker(0), {"step": 2, "checkpoint": checkpoint})
    assert orchestration.advance(run) == ["published policy v2 from phase 0"]
    assert not run.has_marker(RunDir.replay_gate_marker(0))
    gate = orchestration.check_replay_gate(run, 0)
    assert (gate["open"], gate["ready"], gate["eligible"], gate["min_groups"]) == (False, False, GROUPS - 1, GROUPS)

    eligible[0] = GROUPS
    assert orchestration.advance(run) == [f"opened replay gate 0 ({GROUPS} eligible groups)",
                                          f"opened replay gate 1 ({GROUPS} eligible groups)"]
    assert run.marker(RunDir.replay_gate_marker(0))["eligible"] == GROUPS
    eligible[0] = 0  # an open gate stays open, with the count it opened with
    assert orchestration.advance(run) == []
    assert orchestration.check_replay_gate(run, 1) == {"epoch": 1, "open": True, "ready": True, "eligible": GROUPS,
                                                       "min_groups": GROUPS}


def test_stop_after_trainer_names_the_attempt_of_an_unfinished_trainer_and_is_final_after_a_finished_one(
        run, tmp_path):
    stop = orchestration.stop_after_trainer(run, by="runner", attempt=3, unfinished="trainer exited with 1")
    assert (stop["reason"], stop["by"], stop["attempt"]) == ("trainer exited with 1", "runner", 3)
    assert orchestration.stop_after_trainer(run, by="other", attempt=3)["by"] == "runner"  # stopped already
    assert orchestration.stop_after_trainer(run, by="other", attempt=4)["attempt"] == 4  # that stop was stale
    finished = RunDir(f"file://{tmp_path}/runs/r2")
    finished.create(parse_config({}))
    finished.set_marker(RunDir.TRAINER_DONE_MARKER, {"step": 4})
    stop = orchestration.stop_after_trainer(finished, by="runner", attempt=4)
    assert (stop["reason"], stop["attempt"]) == ("trainer finished", None)


def test_a_repeated_prepare_keeps_the_time_the_run_was_first_prepared(run):
    first = run.read_json("prepare.json")
    assert first["created"] == first["time"]
    again = orchestration.prepare(parse_config(CONFIG), run_url=run.url)
    assert again.read_json("prepare.json")["created"] == first["created"]


def test_preparing_a_run_loads_no_distributed_checkpointing(tmp_path):
    """`prepare` publishes v0 from a Hugging Face folder, which needs no DCP: importing
    torch.distributed.checkpoint (and with it torch.distributed.tensor, ~1 s) stays with the
    trainer's checkpoints, off the path every new run waits on before its engines start."""
    orchestration.resolve_sources(parse_config(CONFIG))  # the built-in example is built (by transformers) beforehand
    script = ("import json, sys\nfrom pipeline import orchestration\nfrom pipeline.config import parse_config\n"
              f"run = orchestration.prepare(parse_config({CONFIG!r}), run_url={(tmp_path / 'r').as_uri()!r})\n"
              "print(json.dumps({'v0': run.fs.exists(run.path('policy')), 'loaded': sorted(m for m in sys.modules "
              "if m.startswith(('torch.distributed.checkpoint', 'torch.distributed.tensor')))}))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.splitlines()[-1]) == {"v0": True, "loaded": []}


def test_init_example_never_replaces_a_folder_it_did_not_build(tmp_path):
    from pipeline.config import ConfigError
    from pipeline.example import build_example

    (tmp_path / "proj" / "src").mkdir(parents=True)
    (tmp_path / "proj" / "src" / "notes.txt").write_text("precious")
    with pytest.raises(ConfigError, match="not an example folder"):
        build_example(str(tmp_path / "proj"), "digit")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="not an example folder"):
        build_example(str(tmp_path / "file"), "digit")
    assert (tmp_path / "proj" / "src" / "notes.txt").read_text() == "precious"


def test_held_out_prompts_over_max_prompt_tokens_are_left_out_of_the_evaluation_or_refused(tmp_path, caplog):
    """A 405-token held-out prompt on a 256-position model was scored without a word (vLLM would
    have refused it at finalize, after training). The training prompts' rule now holds for them,
    and the sampler checks them when it starts, before training."""
    import pyarrow.parquet as pq

    from pipeline.data import read_prompts, write_rows
    from pipeline.sampler.loop import _within_length

    def sampler_start(run):
        return _within_length(read_prompts(run.child_url("data", "train.parquet")),
                              load_tokenizer(PolicyStore(run).local_dir(0)), run.config().data, "sampler-0",
                              run.metrics("sampler-0"), run)

    for policy in ("filter", "fail"):
        cfg = {**CONFIG, "data": {**CONFIG["data"], "max_prompt_tokens": 64, "overlong_prompts": policy}}
        run = orchestration.prepare(parse_config(cfg), run_url=f"file://{tmp_path}/runs/{policy}")
        url = run.child_url("data", "eval.parquet")
        rows = pq.read_table(run.path("data", "eval.parquet")).to_pylist()
        rows[3]["prompt"] = [{"role": "user", "content": "7" * 200}]
        write_rows(rows, url)
        if policy == "filter":
            with caplog.at_level("WARNING", logger="rlhf.sampler"):
                sampler_start(run)
            assert "over data.max_prompt_tokens=64 left out: 0 for training, 1 held-out" in caplog.text
            result = orchestration.evaluate_policy(run, 0, threads=1)
            assert result["n"] == len(rows) - 1 and result["overlong_left_out"] == 1
        else:
            refused = "data.max_prompt_tokens: prompt .* of data.eval .* over the limit of 64"
            with pytest.raises(ConfigError, match=refused):
                sampler_start(run)
            with pytest.raises(ConfigError, match=refused):
                orchestration.evaluate_policy(run, 0, threads=1)
