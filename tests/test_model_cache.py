"""Remote model folders are copied into the node's cache whole before anyone reads them."""

import os
import threading
import time

import pytest
from fsspec.implementations.memory import MemoryFileSystem

from pipeline import model_cache


@pytest.fixture
def remote(monkeypatch, tmp_path):
    monkeypatch.setenv(model_cache.CACHE_ENV, str(tmp_path / "cache"))
    fs = MemoryFileSystem()
    payload = os.urandom(1 << 20)
    fs.pipe_file("/bucket/policy/v1/model.safetensors", payload)
    fs.pipe_file("/bucket/policy/v1/config.json", b"{}")
    real = MemoryFileSystem.get_file

    def slow_get_file(self, rpath, lpath, **kw):  # the weights arrive over 0.4 s, as from S3
        if not rpath.endswith(".safetensors"):
            return real(self, rpath, lpath, **kw)
        data = self.cat_file(rpath)
        with open(lpath, "wb") as f:
            for i in range(4):
                f.write(data[i * len(data) // 4:(i + 1) * len(data) // 4])
                f.flush()
                time.sleep(0.1)

    monkeypatch.setattr(MemoryFileSystem, "get_file", slow_get_file)
    yield "memory://bucket/policy/v1", payload
    fs.rm("/bucket", recursive=True)


def test_processes_localizing_one_model_at_once_never_read_a_partial_copy(remote):
    url, payload = remote
    seen = {}

    def reader(i, delay):
        time.sleep(delay)
        with open(os.path.join(model_cache.localize(url), "model.safetensors"), "rb") as f:
            seen[i] = f.read() == payload

    threads = [threading.Thread(target=reader, args=(i, 0.25 * i)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == {0: True, 1: True, 2: True}
    cached = model_cache.cache_dir() / "remote"
    assert [p.name for p in cached.iterdir()] == [os.path.basename(model_cache.localize(url))]  # no copies left


def test_a_copy_abandoned_by_a_dead_process_is_removed(remote):
    url, _ = remote
    dst = model_cache.localize(url)
    key = os.path.basename(dst)
    old = model_cache.cache_dir() / "remote" / f".{key}-dead"
    old.mkdir()
    os.utime(old, (time.time() - model_cache.ABANDONED_S - 1,) * 2)
    fresh = model_cache.cache_dir() / "remote" / f".{key}-alive"
    fresh.mkdir()
    os.remove(os.path.join(dst, ".complete"))  # the next call copies again
    model_cache.localize(url)
    assert not old.exists() and fresh.exists()


def test_a_model_uploaded_again_to_the_same_url_is_copied_again(monkeypatch, tmp_path):
    """The cache was keyed by the URL alone: runs went on with the first copy for good."""
    monkeypatch.setenv(model_cache.CACHE_ENV, str(tmp_path / "cache"))
    fs = MemoryFileSystem()
    fs.pipe_file("/bucket2/m/config.json", b'{"v": 1}')
    try:
        first = model_cache.localize("memory://bucket2/m")
        assert model_cache.localize("memory://bucket2/m/") == first  # a trailing slash is the same folder
        time.sleep(0.01)
        fs.pipe_file("/bucket2/m/config.json", b'{"v": 22}')
        second = model_cache.localize("memory://bucket2/m")
        assert second != first and open(os.path.join(second, "config.json")).read() == '{"v": 22}'
        assert open(os.path.join(first, "config.json")).read() == '{"v": 1}'  # a run using it keeps it
    finally:
        fs.rm("/bucket2", recursive=True)
