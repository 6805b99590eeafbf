"""Form -> run config translation, and the embedded launcher's configuration (no processes)."""

import importlib
import json
from pathlib import Path

import pytest

from pipeline.config import ConfigError
from plugins.dag_params import build_config, check_conf_keys, config_dict, run_name_from, run_params, runs_root


def form(**values):
    params = {k: p.value for k, p in run_params().items()}
    params.update(values)
    return params


def test_form_fields_override_the_base_config_file_and_empty_fields_keep_it():
    cfg = build_config(form(config_file="tiny-test.yaml", steps=4, phases=2, replay_epochs=1, sampler_backend="hf",
                            overrides={"trainer.lr": 0.005}), {}, "exp-1")
    assert (cfg.trainer.steps, cfg.trainer.phases, cfg.trainer.replay_epochs) == (4, 2, 1)
    assert cfg.trainer.lr == 0.005
    assert cfg.reward.fn == "digit"  # from tiny-test.yaml: the form left it empty
    assert cfg.run_id == "exp-1"


def test_nested_overrides_merge_into_their_section_like_dotted_keys():
    # a JSON body nests naturally; replacing the trainer section would drop the form's fields and the file's
    cfg = build_config(form(config_file="tiny-grpo.yaml", steps=40, phases=2,
                            overrides={"trainer": {"kl_coef": 0.01}, "sampler": {"vllm": {"max_model_len": 512}}}),
                       {}, "exp-1")
    assert (cfg.trainer.steps, cfg.trainer.phases, cfg.trainer.kl_coef) == (40, 2, 0.01)
    assert cfg.trainer.lr == 5e-4  # tiny-grpo.yaml's
    assert cfg.sampler.vllm == {"max_model_len": 512}


def test_unknown_trigger_keys_are_rejected_by_name():
    with pytest.raises(ValueError, match="unknown parameter.*learning_rate"):
        build_config(form(), {"learning_rate": 1}, "exp-1")


def test_unknown_config_keys_in_overrides_fail_through_the_engine_loader():
    with pytest.raises(ConfigError, match="trainer.lrr"):
        build_config(form(overrides={"trainer.lrr": 1}), {}, "exp-1")


def test_strings_that_look_like_numbers_stay_strings():
    assert config_dict(form(model_path="007"))["model"]["path"] == "007"


def test_config_file_must_be_a_name_inside_configs():
    with pytest.raises(ValueError, match="config_file"):
        config_dict(form(config_file="../pyproject.yaml"))
    with pytest.raises(ValueError, match="not found"):
        config_dict(form(config_file="missing.yaml"))


def test_run_names_from_airflow_run_ids_are_path_safe():
    from pipeline.locations import validate_run_id

    name = run_name_from("rlhf_train", "manual__2026-11-29T18:30:00.123456+00:00")
    assert validate_run_id(name) == name and "/" not in name and ":" not in name
    for run_id in ("my...run", "..x", "_a", "a" * 300, "b" * 200 + ":.."):
        name = run_name_from("rlhf_train", run_id)
        assert validate_run_id(name) == name
    # cut to 128 characters, two ids sharing a long prefix still name two directories
    long = "scheduled__" + "x" * 200
    assert run_name_from("rlhf_train", long + "1") != run_name_from("rlhf_train", long + "2")


@pytest.mark.parametrize("bad", ["abc\n", "abc\r", "a\nb"])
def test_names_with_a_line_break_are_rejected(bad):
    from pipeline.config import ConfigError
    from pipeline.locations import validate_name

    with pytest.raises(ConfigError, match="invalid value"):
        validate_name(bad, "--sampler-id")


@pytest.mark.parametrize("bad", ["http://example.com/runs", "relative/runs", "file://relative", "ftp://x/y"])
def test_runs_root_rejects_non_storage_urls_and_relative_paths(bad):
    with pytest.raises(ValueError, match="storage_url"):
        runs_root(bad)


@pytest.fixture
def storage_roots(monkeypatch):
    """A deployment whose runs root is /data/runs and whose admin also allows s3://bucket/runs."""
    monkeypatch.setenv("RLHF_RUNS_ROOT", "/data/runs")
    monkeypatch.setenv("RLHF_ALLOWED_STORAGE_ROOTS", "s3://bucket/runs, file:///nfs/shared/rl")


def test_runs_root_accepts_object_stores_and_absolute_paths_under_the_allowed_roots(storage_roots):
    assert runs_root("s3://bucket/runs/") == "s3://bucket/runs"
    assert runs_root("/data/runs") == "/data/runs"
    assert runs_root("/data/runs/team-a") == "/data/runs/team-a"
    assert runs_root("file:///data/runs/team-a") == "file:///data/runs/team-a"
    assert runs_root("/nfs/shared/rl/exp") == "/nfs/shared/rl/exp"
    assert runs_root("") == "/data/runs"


@pytest.mark.parametrize("bad", ["/etc", "/data/runs2", "/data", "s3://other-bucket/runs", "s3://bucket/runsx",
                                 "gs://bucket/runs", "file:///nfs/shared"])
def test_storage_url_outside_the_allowed_roots_is_refused_naming_field_value_and_roots(storage_roots, bad):
    with pytest.raises(ValueError) as e:
        runs_root(bad)
    msg = str(e.value)
    assert msg.startswith("storage_url:") and repr(bad) in msg
    assert "/data/runs" in msg and "s3://bucket/runs" in msg and "RLHF_ALLOWED_STORAGE_ROOTS" in msg


@pytest.mark.parametrize("bad", ["/data/runs/../../etc", "s3://bucket/runs/%2e%2e/x", "/data/runs/a\\..\\..\\b"])
def test_storage_url_with_a_parent_segment_is_refused_even_under_an_allowed_root(storage_roots, bad):
    with pytest.raises(ValueError, match=r"storage_url.*'\.\.'"):
        runs_root(bad)


def test_a_malformed_allowed_root_names_the_variable(monkeypatch):
    monkeypatch.setenv("RLHF_RUNS_ROOT", "/data/runs")
    monkeypatch.setenv("RLHF_ALLOWED_STORAGE_ROOTS", "relative/runs")
    with pytest.raises(ValueError, match="RLHF_ALLOWED_STORAGE_ROOTS"):
        runs_root("/data/runs/x")


@pytest.mark.parametrize("bad", ["/data/runs/../../etc", "..", "s3://b/runs/%2E%2e/x", "C:\\runs", "/data/runs\nx"])
def test_trigger_form_rejects_parent_segments_backslashes_and_control_characters_in_storage_url(bad):
    from airflow.sdk.exceptions import ParamValidationError

    with pytest.raises(ParamValidationError):
        run_params()["storage_url"].resolve(bad)
    for good in ("", "s3://bucket/runs/v1..2", "/Users/me/Application Support/runs"):
        assert run_params()["storage_url"].resolve(good) == good


def test_prepare_run_refuses_a_storage_url_outside_the_allowed_roots_before_writing(storage_roots, tmp_path,
                                                                                    monkeypatch):
    import pipeline.orchestration
    from plugins.taskgroups import prepare_run

    monkeypatch.setattr(pipeline.orchestration, "prepare", lambda *a, **k: pytest.fail("prepare must not run"))
    with pytest.raises(ValueError, match=f"storage_url: '{tmp_path}'"):
        prepare_run("rlhf_train", form(storage_url=str(tmp_path)), {}, "exp-1")
    assert list(tmp_path.iterdir()) == []


def test_prepare_run_creates_the_run_under_an_allowed_storage_url(storage_roots, monkeypatch):
    import pipeline.orchestration
    from pipeline.rundir import RunDir
    from plugins.taskgroups import prepare_run

    urls = []
    monkeypatch.setattr(pipeline.orchestration, "prepare", lambda cfg, url: urls.append(url) or RunDir(url))
    out = prepare_run("rlhf_train", form(storage_url="s3://bucket/runs/team-a"), {}, "exp-1")
    assert urls == ["s3://bucket/runs/team-a/exp-1"] and out["run_id"] == "exp-1"


def test_check_conf_keys_accepts_form_keys():
    check_conf_keys({"steps": 3, "phases": 1}, run_params())


# launcher -----------------------------------------------------------------------------------------
def test_local_airflow_binds_loopback_with_a_long_jwt_secret_and_the_repo_folders(tmp_path):
    from plugins.local.deployment import LocalAirflow

    repo = Path(__file__).resolve().parents[2]  # an editable install: the checkout's folders
    af = LocalAirflow(home=tmp_path / "home", port=18123, runs_root=str(tmp_path / "runs"))
    env = af.env()
    assert env["AIRFLOW__API__HOST"] == "127.0.0.1"
    assert env["AIRFLOW__CORE__EXECUTION_API_SERVER_URL"] == "http://127.0.0.1:18123/execution/"
    assert len(bytes.fromhex(env["AIRFLOW__API_AUTH__JWT_SECRET"])) >= 64
    assert env["AIRFLOW__CORE__DAGS_FOLDER"] == str(repo / "dags")
    assert env["AIRFLOW__CORE__PLUGINS_FOLDER"] == str(repo / "plugins")
    assert env["RLHF_CONFIGS_DIR"] == str(repo / "configs")
    assert env["AIRFLOW__CORE__EXECUTOR"] == "LocalExecutor"
    assert env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"].startswith("sqlite:///")
    module, _, name = env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONNECT_ARGS"].rpartition(".")  # imported by name
    assert getattr(importlib.import_module(module), name) == {"timeout": 60}
    assert int(env["AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL"]) <= 10
    assert env["AIRFLOW__API_AUTH__JWT_SECRET"] == af.env()["AIRFLOW__API_AUTH__JWT_SECRET"]  # stable across calls
    user, password = af.credentials()
    assert json.loads((tmp_path / "home" / "passwords.json").read_text()) == {user: password}
    assert oct((tmp_path / "home" / "passwords.json").stat().st_mode & 0o777) == "0o600"


def test_credentials_on_a_fresh_home_are_created_and_stable(tmp_path):
    from plugins.local.deployment import LocalAirflow

    af = LocalAirflow(home=tmp_path / "new" / "home")
    assert af.credentials() == LocalAirflow(home=tmp_path / "new" / "home").credentials()


def test_down_without_a_running_deployment_is_a_no_op(tmp_path):
    from plugins.local.deployment import LocalAirflow

    assert LocalAirflow(home=tmp_path / "home").down() == []


def test_cli_group_has_up_down_status_demo():
    import argparse

    from plugins.local.cli import add_parser

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="cmd"))
    args = parser.parse_args(["airflow", "demo", "--set", "trainer.steps=4", "--port", "18124"])
    assert args.fn.__name__ == "cmd_demo" and args.set == ["trainer.steps=4"] and args.port == 18124
    for name in ("up", "down", "status"):
        assert parser.parse_args(["airflow", name]).fn.__name__ == f"cmd_{name}"


def test_the_engine_cli_gets_the_airflow_group_from_its_entry_point():
    from pipeline.cli import build_parser

    args = build_parser().parse_args(["airflow", "backfill", "rlhf_retrain", "--from-date", "2026-11-08",
                                      "--to-date", "2026-11-15"])
    assert args.fn.__module__ == "plugins.local.cli" and args.fn.__name__ == "cmd_backfill"
    assert args.reprocess == "completed" and args.max_active_runs == 1


def test_more_phases_than_airflow_can_map_are_refused_before_the_run_directory_exists(tmp_path, monkeypatch):
    from plugins.taskgroups import prepare_run

    monkeypatch.setenv("RLHF_RUNS_ROOT", str(tmp_path / "runs"))
    with pytest.raises(ValueError, match=r"trainer.phases=2000: .*max_map_length"):
        prepare_run("rlhf_train", form(config_file="tiny-test.yaml", steps=2000, phases=2000), {}, "big")
    assert not (tmp_path / "runs" / "big").exists()
