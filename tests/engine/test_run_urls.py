"""Where a run directory may be: no '..' segments, never inside a folder that is not a run's."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.config import ConfigError, parse_config
from pipeline.rundir import RunDir, run_url_for, url_is_under, validate_run_url

REPO = Path(__file__).resolve().parents[2]
TRAVERSALS = [
    "file:///some/dir/../../etc",
    "/tmp/runs/../../etc/r1",
    "runs/../../etc",
    "..",
    "s3://bucket/runs/%2e%2e/other/r1",
    "s3://bucket/runs/%2E%2E/r1",
    "s3://bucket/runs/%252e%252e/r1",  # encoded twice
    "/tmp/runs\\..\\..\\etc",
]


@pytest.mark.parametrize("url", TRAVERSALS)
def test_run_urls_with_dot_dot_segments_are_refused_naming_the_value_and_the_fix(url):
    with pytest.raises(ConfigError) as e:
        validate_run_url(url)
    msg = str(e.value)
    assert repr(url) in msg and "'..'" in msg and "absolute path" in msg and "\n" not in msg


@pytest.mark.parametrize("url", ["/data/v1..2/runs/r1", "s3://bucket/runs/r1", "file:///data/./runs/r1", "runs/r1"])
def test_dots_that_are_not_a_parent_segment_are_accepted(url):
    assert validate_run_url(url) == url


def test_run_dir_refuses_a_traversal_before_writing_anything(tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    with pytest.raises(ConfigError, match=r"\.\."):
        RunDir(f"file://{tmp_path}/a/b/../../victim")
    assert list(victim.iterdir()) == []


def test_runs_root_with_a_traversal_is_refused():
    with pytest.raises(ConfigError, match="runs root"):
        run_url_for("/data/runs/../../etc", "r1")
    assert run_url_for("s3://bucket/runs/", "r1") == "s3://bucket/runs/r1"


def test_relative_runs_root_resolves_against_the_working_directory():
    assert run_url_for("runs", "r1") == os.path.join(os.getcwd(), "runs", "r1")


def test_create_refuses_a_non_empty_folder_that_is_not_a_run_directory(tmp_path):
    folder = tmp_path / "r1"
    folder.mkdir()
    (folder / "passwd").write_text("root:x:0:0\n")
    run = RunDir(str(folder))
    with pytest.raises(ConfigError) as e:
        run.create(parse_config({}))
    assert str(folder) in str(e.value) and "not a run directory" in str(e.value)
    assert sorted(p.name for p in folder.iterdir()) == ["passwd"]


def test_create_refuses_a_folder_whose_config_yaml_is_not_a_run_config(tmp_path):
    folder = tmp_path / "r1"
    folder.mkdir()
    (folder / "config.yaml").write_text("apiVersion: v1\nkind: Pod\n")
    with pytest.raises(ConfigError, match="not a run config"):
        RunDir(str(folder)).create(parse_config({}))
    assert (folder / "config.yaml").read_text() == "apiVersion: v1\nkind: Pod\n"


def test_create_in_an_empty_folder_then_again_on_retry_and_after_the_run_wrote_files(tmp_path):
    folder = tmp_path / "r1"
    folder.mkdir()
    run = RunDir(f"file://{folder}")
    cfg = parse_config({})
    assert run.create(cfg) is True
    run.write_json("prepare.json", {"time": 0})
    (folder / "data").mkdir()
    assert run.create(cfg) is False  # a retried prepare of the same run
    assert RunDir(str(tmp_path / "new" / "r2")).create(cfg) is True  # a folder that does not exist yet


def test_a_crashed_create_leaves_a_temporary_that_does_not_block_the_retry(tmp_path):
    folder = tmp_path / "r1"
    folder.mkdir()
    (folder / f".config.yaml.tmp-{'0' * 32}").write_text("partial")
    assert RunDir(str(folder)).create(parse_config({})) is True


@pytest.mark.parametrize("url, root, inside", [
    ("file:///data/runs/r1", "/data/runs", True),
    ("/data/runs/team/r1", "file:///data/runs/", True),
    ("/data/runs", "/data/runs", True),
    ("/data/./runs//r1", "/data/runs", True),
    ("local:///data/runs/r1", "file:///data/runs", True),
    ("/data/runs2/r1", "/data/runs", False),  # a prefix, not a parent folder
    ("/data", "/data/runs", False),
    ("s3://bucket/runs/r1", "s3://bucket/runs", True),
    ("s3a://bucket/runs/r1", "s3://bucket/runs", True),
    ("s3://bucket-2/runs/r1", "s3://bucket/runs", False),
    ("s3://data/runs/r1", "/data/runs", False),  # another protocol
    ("gs://bucket/runs/r1", "s3://bucket/runs", False),
])
def test_url_is_under_compares_protocol_and_whole_path_segments(url, root, inside):
    assert url_is_under(url, root) is inside


def test_url_is_under_refuses_traversals_instead_of_resolving_them():
    with pytest.raises(ConfigError, match=r"\.\."):
        url_is_under("/data/runs/../../etc", "/data/runs")


def _rlhf(*argv: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "pipeline", *argv], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.integration
def test_rlhf_run_refuses_a_run_dir_with_dot_dot_and_writes_nothing(tmp_path):
    victim = tmp_path / "etc"
    victim.mkdir()
    (tmp_path / "some" / "dir").mkdir(parents=True)
    url = f"file://{tmp_path}/some/dir/../../etc"
    out = _rlhf("run", "configs/tiny-test.yaml", "--run-dir", url, "--no-progress")
    assert out.returncode == 2, out.stderr
    assert url in out.stderr and "'..'" in out.stderr
    assert list(victim.iterdir()) == []


@pytest.mark.integration
def test_rlhf_run_refuses_a_non_empty_folder_that_is_not_a_run_directory(tmp_path):
    victim = tmp_path / "etc"
    victim.mkdir()
    (victim / "hosts").write_text("127.0.0.1 localhost\n")
    out = _rlhf("run", "configs/tiny-test.yaml", "--run-dir", str(victim), "--no-progress")
    assert out.returncode == 2, out.stderr
    assert str(victim) in out.stderr and "not a run directory" in out.stderr
    assert sorted(p.name for p in victim.iterdir()) == ["hosts"]
