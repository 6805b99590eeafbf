"""Scheduled retraining inputs: the dated prompt partition and the policy registry."""

from datetime import datetime, timezone
from types import SimpleNamespace

import pytest

from plugins.registry import PolicyRegistry
from plugins.retrain import partition_date, partition_url


def test_partition_date_is_the_logical_date_or_run_after_for_runs_without_one():
    when = datetime(2026, 11, 15, tzinfo=timezone.utc)
    assert partition_date(when, SimpleNamespace(run_after=None)) == "2026-11-15"
    assert partition_date(None, SimpleNamespace(logical_date=None, run_after=when)) == "2026-11-15"


def test_a_dates_partition_folder_is_its_training_dataset(tmp_path):
    """The partition's files were read whole into memory and written to a copy of their own, which
    prepare then copied into the run again; the folder is now the run's data.train."""
    from pipeline.builtin_tasks import make_rows
    from pipeline.data import read_prompts, stage, write_rows
    from pipeline.storage import url_to_fs

    part = tmp_path / "prompts" / "ds=2026-11-15"
    write_rows(make_rows("sort", 5, 1, "train"), str(part / "a.parquet"))
    write_rows(make_rows("sort", 7, 2, "train"), str(part / "b.parquet"))
    write_rows(make_rows("sort", 3, 3, "train"), str(tmp_path / "prompts" / "ds=2026-11-08" / "a.parquet"))
    url = partition_url(str(tmp_path / "prompts"), "2026-11-15")
    assert url == f"{tmp_path}/prompts/ds=2026-11-15"
    dst = tmp_path / "run" / "train.parquet"
    assert stage(url, *url_to_fs(str(dst)), "data.train") == 12 and len(read_prompts(str(dst))) == 12


def test_a_missing_partition_fails_naming_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="ds=2026-11-22"):
        partition_url(str(tmp_path), "2026-11-22")
    (tmp_path / "ds=2026-11-29").mkdir()
    (tmp_path / "ds=2026-11-29" / ".part.parquet").write_bytes(b"")  # a writer's temporary file is no data
    with pytest.raises(FileNotFoundError, match="ds=2026-11-29"):
        partition_url(str(tmp_path), "2026-11-29")
    with pytest.raises(ValueError, match="YYYY-MM-DD"):
        partition_url(str(tmp_path), "../../etc")


def test_registry_returns_the_latest_earlier_date_so_reruns_are_idempotent(tmp_path):
    reg = PolicyRegistry(f"file://{tmp_path}/registry/rlhf_retrain.json")
    assert reg.previous("2026-11-15") is None
    reg.record("2026-11-08", {"policy_url": "p8"})
    reg.record("2026-11-15", {"policy_url": "p15"})
    assert reg.previous("2026-11-15") == {"policy_url": "p8"}  # not its own entry
    assert reg.previous("2026-11-22") == {"policy_url": "p15"}
    reg.record("2026-11-08", {"policy_url": "p8-rerun"})  # a rerun replaces only its own date
    assert sorted(reg.entries()) == ["2026-11-08", "2026-11-15"]
    assert reg.previous("2026-11-15") == {"policy_url": "p8-rerun"}


def test_a_date_rerun_with_other_parameters_gets_its_own_run_directory(tmp_path, monkeypatch):
    """A backfill reruns dates that ran; the same parameters find the same run (a retried or
    resumed prepare), other parameters a new directory, so no finished experiment is overwritten."""
    from pipeline.data import write_rows
    from pipeline.builtin_tasks import make_rows
    from plugins.dag_params import run_params
    from plugins.retrain import prepare_retrain

    monkeypatch.setenv("RLHF_RUNS_ROOT", str(tmp_path / "runs"))
    write_rows(make_rows("sort", 8, 1, "train"), str(tmp_path / "prompts" / "ds=2026-11-15" / "a.parquet"))
    params = {k: p.value for k, p in run_params(with_dataset=False).items()}
    params.update(config_file="tiny-test.yaml", prompts_root=str(tmp_path / "prompts"), steps=2)

    def run_dir(**form) -> str:
        return prepare_retrain("rlhf_retrain", {**params, **form}, {}, "2026-11-15", str(tmp_path / "runs"))["run_id"]

    assert run_dir() == "rlhf_retrain-2026-11-15"
    assert run_dir() == "rlhf_retrain-2026-11-15"  # same parameters: the same run
    assert run_dir(steps=3) == "rlhf_retrain-2026-11-15-2"
    assert run_dir() == "rlhf_retrain-2026-11-15"
    assert run_dir(steps=3) == "rlhf_retrain-2026-11-15-2"


@pytest.mark.parametrize("root", ["relative/prompts", "http://127.0.0.1:8765/prompts", "file:///data/../etc",
                                  "hf://datasets/x"])
def test_a_prompts_root_outside_the_supported_stores_is_refused_before_anything_is_read(tmp_path, root):
    from plugins.retrain import prepare_retrain

    with pytest.raises(ValueError, match="prompts_root"):
        prepare_retrain("rlhf_retrain", {"prompts_root": root}, {}, "2026-11-15", str(tmp_path / "runs"))
    assert not (tmp_path / "runs").exists()
