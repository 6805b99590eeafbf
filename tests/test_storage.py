"""Storage primitives on local disk, memory:// and a real S3 endpoint (moto's server)."""

import sys
import threading
import time
from pathlib import Path

import pytest

from pipeline.storage import delete, list_files, list_names, put_atomic, put_if_absent, url_to_fs

sys.path.insert(0, str(Path(__file__).parent / "buffer"))
from s3_endpoint import moto_s3, new_prefix  # noqa: E402


@pytest.fixture(scope="module")
def s3_bucket():
    with moto_s3("storage-test") as bucket:
        yield bucket


@pytest.fixture(params=["file", "memory", pytest.param("s3", marks=pytest.mark.integration)])
def base_url(request, tmp_path):
    if request.param == "file":
        return str(tmp_path / "store")
    if request.param == "memory":
        return f"memory://store/{tmp_path.name}"
    return new_prefix(request.getfixturevalue("s3_bucket"))


def test_put_if_absent_creates_once(base_url):
    fs, root = url_to_fs(base_url)
    assert put_if_absent(fs, f"{root}/x/0001.json", b"first")
    assert not put_if_absent(fs, f"{root}/x/0001.json", b"second")
    assert fs.cat_file(f"{root}/x/0001.json") == b"first"


def test_exactly_one_of_many_concurrent_creators_wins(base_url):
    fs, root = url_to_fs(base_url)
    path = f"{root}/race.json"
    wins = []

    def attempt(i):
        if put_if_absent(fs, path, f"writer-{i}".encode()):
            wins.append(i)

    threads = [threading.Thread(target=attempt, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(wins) == 1
    assert fs.cat_file(path) == f"writer-{wins[0]}".encode()


def test_put_atomic_replaces_and_list_skips_temporaries(base_url):
    fs, root = url_to_fs(base_url)
    put_atomic(fs, f"{root}/d/a.json", b"1")
    put_atomic(fs, f"{root}/d/a.json", b"2")
    put_atomic(fs, f"{root}/d/sub/b.json", b"3")
    fs.pipe_file(f"{root}/d/.c.tmp-1", b"partial")
    assert fs.cat_file(f"{root}/d/a.json") == b"2"
    assert list_names(fs, f"{root}/d") == ["a.json", "sub"]
    files = list_files(fs, f"{root}/d")
    assert [f.rel for f in files] == ["a.json", "sub/b.json"]
    assert all(abs(f.mtime - time.time()) < 600 for f in files)
    assert [f.rel for f in list_files(fs, f"{root}/d", include_hidden=True)] == [".c.tmp-1", "a.json", "sub/b.json"]
    delete(fs, f"{root}/d/a.json")
    delete(fs, f"{root}/d/a.json")  # already gone: not an error
    assert not fs.exists(f"{root}/d/a.json")
    assert list_files(fs, f"{root}/missing") == []


def test_unknown_protocol_refuses_create_only_writes(tmp_path):
    from fsspec.implementations.http import HTTPFileSystem

    with pytest.raises(NotImplementedError, match="create-only"):
        put_if_absent(HTTPFileSystem(), "http://127.0.0.1:9/x", b"1")


def test_s3_clients_skip_botocore_checksums_under_the_users_own_settings(monkeypatch):
    import fsspec

    from pipeline.storage import S3_CLIENT_DEFAULTS, url_to_fs

    monkeypatch.setitem(fsspec.config.conf, "s3", {"endpoint_url": "http://127.0.0.1:9",
                                                   "config_kwargs": {"response_checksum_validation": "when_supported"}})
    fs, _ = url_to_fs("s3://bucket-a/run")
    assert fs.config_kwargs == {**S3_CLIENT_DEFAULTS, "response_checksum_validation": "when_supported"}
    fs, _ = url_to_fs("s3://bucket-a/run", config_kwargs={"parameter_validation": True})
    assert fs.config_kwargs["parameter_validation"] is True
    assert fs.config_kwargs["request_checksum_calculation"] == "when_required"
    local, _ = url_to_fs("file:///tmp")
    assert not hasattr(local, "config_kwargs")


def test_a_create_retried_after_its_reply_was_lost_is_a_success(base_url, monkeypatch):
    """botocore retries a create whose connection reset after S3 stored it, and the retry meets
    412: the writer's own object, not another writer's (a sampler took its own claim for another
    replica's and skipped draws; a metrics chunk was written twice)."""
    import os

    fs, root = url_to_fs(base_url)
    if base_url.startswith("/"):
        link = os.link

        def lost_reply(src, dst):  # the link is made, its reply lost, the retry finds it
            link(src, dst)
            raise FileExistsError(dst)

        monkeypatch.setattr(os, "link", lost_reply)
    else:
        pipe = fs.pipe_file  # s3fs sets its sync methods on the instance

        def lost_reply(path, data, **kwargs):  # stored, then the retry sees the object
            pipe(path, data, **kwargs)
            return pipe(path, data, **kwargs)

        monkeypatch.setattr(fs, "pipe_file", lost_reply)
    assert put_if_absent(fs, f"{root}/lost/0001.json", b"mine")
    assert not put_if_absent(fs, f"{root}/lost/0001.json", b"someone else's")
    assert fs.cat_file(f"{root}/lost/0001.json") == b"mine"
    if not base_url.startswith("memory"):  # callers with their own recovery skip the check (and its read)
        assert not put_if_absent(fs, f"{root}/lost/0002.json", b"mine", own_check=False)


def test_errors_of_object_store_clients_count_as_storage_errors():
    from botocore.exceptions import EndpointConnectionError

    from pipeline.storage import is_storage_error

    assert is_storage_error(EndpointConnectionError(endpoint_url="http://127.0.0.1:9/bucket"))
    assert is_storage_error(OSError(5, "I/O error")) and is_storage_error(OSError(16, "Service Unavailable"))
    assert is_storage_error(ConnectionResetError(104, "reset")) and is_storage_error(PermissionError(13, "denied"))
    assert not is_storage_error(FileNotFoundError(2, "policy version 7 is not published"))
    assert not is_storage_error(TimeoutError("a wait of the project's own")) and not is_storage_error(OSError(12, "ENOMEM"))
    assert not is_storage_error(ValueError("a bug")) and not is_storage_error(KeyboardInterrupt())


def test_a_dataset_is_a_parquet_file_or_a_folder_of_them_on_every_store(base_url):
    from pipeline.builtin_tasks import make_rows
    from pipeline.data import data_sources, read_prompts, stage, write_rows

    write_rows(make_rows("sort", 5, 1, "train"), f"{base_url}/ds/part-0.parquet")
    write_rows(make_rows("repeat", 7, 2, "train"), f"{base_url}/ds/part-1.parquet")
    for src, rows in ((f"{base_url}/ds", 12), (f"{base_url}/ds/", 12), (f"{base_url}/ds/part-1.parquet", 7)):
        assert stage(src, *url_to_fs(f"{base_url}/run/train.parquet"), "data.train") == rows
        assert len(read_prompts(f"{base_url}/run/train.parquet")) == len(read_prompts(src)) == rows
    assert data_sources(f"{base_url}/ds", "data.train") == {"builtin/sort", "builtin/repeat"}
