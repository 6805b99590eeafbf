"""Policy retention: the newest K plus protected versions stay, leased versions are never deleted,
loaders fall back to the newest version, and local copies of a remote run stay bounded."""

import json
import os
import sys
import uuid
from collections import Counter
from pathlib import Path

import pytest

from pipeline.policy import LOCAL_COPIES, PolicyStore, version_dirname
from pipeline.rundir import RunDir
from pipeline.weights import load_state_dict


@pytest.fixture
def model_dir(digit_example):
    return os.path.join(digit_example, "model")


def _store(url: str) -> PolicyStore:
    return PolicyStore(RunDir(url))


def _folders(store: PolicyStore) -> list[str]:
    return sorted(n for n in store.fs.ls(store.run.path("policy"), detail=False)
                  if n.rstrip("/").rsplit("/", 1)[-1].startswith("v"))


@pytest.mark.parametrize("scheme", ["file", "memory"])
def test_retention_keeps_the_newest_k_v0_and_phase_versions_and_nothing_else(model_dir, tmp_path, scheme):
    url = str(tmp_path / "run-1") if scheme == "file" else f"memory://policy-test-{uuid.uuid4().hex}/run-1"
    store = _store(url)
    store.publish_folder(0, model_dir)
    deleted = []
    for v in range(1, 10):
        store.publish_folder(v, model_dir)
        deleted += store.retain(2, protected={0, 5})
        assert len(store.versions()) <= 2 + 2  # bounded all along, not only at the end
    assert store.versions() == [0, 5, 8, 9] and store.latest() == 9
    assert deleted == [1, 2, 3, 4, 6, 7]
    assert len(_folders(store)) == 4  # the deleted versions' files went too, not only their manifests


def test_a_version_being_loaded_is_not_deleted_until_its_lease_ends(model_dir, tmp_path):
    store = _store(str(tmp_path / "run-1"))
    for v in range(4):
        store.publish_folder(v, model_dir)
    with store.lease_latest("sampler-0") as lease:
        assert lease.version == 3
        for v in (4, 5, 6):
            store.publish_folder(v, model_dir)
        assert store.retain(2, protected={0}) == [1, 2, 4]
        assert store.exists(3) is False  # uncommitted: no new loader starts on it
        assert load_state_dict(lease.path)  # but every file the loader reads is still there
    assert store.retain(2, protected={0}) == []  # the holder runs what it loaded: still leased
    store.release("sampler-0")
    assert not os.path.exists(store.run.path("policy", "leases", "sampler-0.json"))
    assert store.retain(2, protected={0}) == [3]
    assert store.versions() == [0, 5, 6] and len(_folders(store)) == 3


def test_a_lease_written_while_retention_uncommits_keeps_the_files(model_dir, tmp_path, monkeypatch):
    """A loader that read the manifest just before retention removed it has already written its
    lease; retention reads the leases only after the uncommit, so it sees that lease."""
    store = _store(str(tmp_path / "run-1"))
    for v in range(4):
        store.publish_folder(v, model_dir)
    real = PolicyStore.leased

    def lease_arrives_during_retention(self):
        store.run.write_json("policy/leases/sampler-1.json", {"version": 1, "time": 1e12})
        return real(self)

    monkeypatch.setattr(PolicyStore, "leased", lease_arrives_during_retention)
    assert store.retain(2, protected={0}) == []
    assert not store.exists(1) and load_state_dict(store.run.path("policy", version_dirname(1)))
    monkeypatch.undo()
    os.remove(store.run.path("policy", "leases", "sampler-1.json"))
    assert store.retain(2, protected={0}) == [1]  # a later pass removes the uncommitted folder
    assert len(_folders(store)) == 3


def test_a_loader_whose_version_was_deleted_takes_the_newest_one(model_dir, tmp_path, monkeypatch):
    store = _store(str(tmp_path / "run-1"))
    for v in range(4):
        store.publish_folder(v, model_dir)
    store.retain(1, protected={0})
    answers = iter([1])  # a version that existed when the loader looked, gone before it loaded
    real = PolicyStore.latest
    monkeypatch.setattr(PolicyStore, "latest", lambda self: next(answers, None) or real(self))
    with store.lease_latest("sampler-0") as lease:
        assert lease.version == 3 and load_state_dict(lease.path)


def test_local_copies_of_a_remote_run_stay_bounded_and_a_held_copy_is_kept(model_dir):
    store = _store(f"memory://policy-test-{uuid.uuid4().hex}/run-1")
    store.publish_folder(0, model_dir)
    store.local_dir(0)
    cache = store._cache()
    for v in range(1, 6):
        store.publish_folder(v, model_dir)
        store.local_dir(v)
        assert len(os.listdir(cache)) <= LOCAL_COPIES + 1
    assert sorted(os.listdir(cache)) == [version_dirname(v) for v in (0, 4, 5)]
    with store.lease_latest("sampler-0") as lease:
        assert lease.version == 5
        for v in (6, 7):
            store.publish_folder(v, model_dir)
            store.local_dir(v)
        assert os.path.isdir(lease.path) and load_state_dict(lease.path)  # held: not pruned under the loader
    store.publish_folder(8, model_dir)
    store.local_dir(8)
    assert sorted(os.listdir(cache)) == [version_dirname(v) for v in (0, 7, 8)]
    assert json.load(open(os.path.join(cache, version_dirname(8), "manifest.json")))["version"] == 8


def test_the_next_lease_replaces_the_last_one_in_one_request(model_dir, tmp_path, monkeypatch):
    store = _store(str(tmp_path / "run-1"))
    for v in range(3):
        store.publish_folder(v, model_dir)
    with store.lease_latest("sampler-0") as lease:
        assert lease.version == 2
    deletes = []
    monkeypatch.setattr("pipeline.policy.delete", lambda fs, path: deletes.append(path))
    with store.lease_latest("sampler-0", 1) as lease:
        assert lease.version == 1
    assert deletes == [] and store.leased() == {1}  # overwritten, not deleted and written again


@pytest.mark.integration
def test_retention_on_s3_costs_the_same_few_requests_however_many_versions_go(model_dir):
    sys.path.insert(0, str(Path(__file__).parent / "buffer"))
    from s3_endpoint import moto_s3, new_prefix
    import s3fs

    calls: Counter = Counter()
    real = s3fs.S3FileSystem._call_s3

    async def counting(self, method, *args, **kwargs):
        calls[method] += 1
        return await real(self, method, *args, **kwargs)

    with moto_s3("policy-test") as bucket, pytest.MonkeyPatch.context() as mp:
        store = _store(new_prefix(bucket) + "/run-1")
        for v in range(8):
            store.publish_folder(v, model_dir)
        with store.lease_latest("sampler-0", 7):
            pass
        mp.setattr(s3fs.S3FileSystem, "_call_s3", counting)
        assert store.retain(2, protected={0}) == [1, 2, 3, 4, 5]
        # a listing, the uncommit, the leases (a listing and one read), the files
        assert sum(calls.values()) == 5, calls
        assert calls["delete_objects"] == 2
        mp.undo()
        assert store.versions() == [0, 6, 7] and len(_folders(store)) == 3
