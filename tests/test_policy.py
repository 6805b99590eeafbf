"""Policy retention: the newest K plus protected versions stay, leased versions are never deleted,
loaders fall back to the newest version, and local copies of a remote run stay bounded."""

import json
import os
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest
import torch

from pipeline.policy import PolicyStore, version_dirname
from pipeline.policy_cache import LOCAL_COPIES, LocalCopies
from pipeline.policy_upload import RECORD_EVERY_S
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


def test_local_copies_cover_the_staleness_bound_of_the_run(model_dir):
    """A fixed-lag sampler restarted on another node asks for the version max_staleness behind the
    newest: a run with a wider bound than LOCAL_COPIES - 1 keeps that many more copies."""
    store = _store(f"memory://policy-test-{uuid.uuid4().hex}/run-1")
    store.fs.pipe(store.run.path("config.yaml"), b"sampler: {max_staleness: 5}\n")
    assert store._copies().keep == 6 > LOCAL_COPIES
    for v in range(10):
        store.publish_folder(v, model_dir)
        store.local_dir(v)
    assert sorted(os.listdir(store._copies().root)) == [version_dirname(v) for v in (0, *range(4, 10))]


def test_an_exact_lease_of_a_deleted_version_fails_instead_of_taking_the_newest(model_dir, tmp_path):
    store = _store(str(tmp_path / "run-1"))
    for v in range(4):
        store.publish_folder(v, model_dir)
    store.retain(1, protected={0})
    with store.lease_latest("sampler-0", 3, exact=True) as lease:
        assert lease.version == 3
    with pytest.raises(FileNotFoundError, match="policy version 1 is not published"):
        with store.lease_latest("sampler-0", 1, exact=True):
            pass


def test_local_copies_of_a_remote_run_stay_bounded_and_a_held_copy_is_kept(model_dir):
    store = _store(f"memory://policy-test-{uuid.uuid4().hex}/run-1")
    store.publish_folder(0, model_dir)
    store.local_dir(0)
    cache = store._copies().root
    for v in range(1, 6):
        store.publish_folder(v, model_dir)
        store.local_dir(v)
        assert len(os.listdir(cache)) <= LOCAL_COPIES + 1
    assert sorted(os.listdir(cache)) == [version_dirname(v) for v in (0, *range(6 - LOCAL_COPIES, 6))]
    with store.lease_latest("sampler-0") as lease:
        assert lease.version == 5
        for v in range(6, 6 + LOCAL_COPIES):
            store.publish_folder(v, model_dir)
            store.local_dir(v)
        assert os.path.isdir(lease.path) and load_state_dict(lease.path)  # held: not pruned under the loader
    last = 6 + LOCAL_COPIES
    store.publish_folder(last, model_dir)
    store.local_dir(last)
    assert sorted(os.listdir(cache)) == [version_dirname(v) for v in (0, *range(last + 1 - LOCAL_COPIES, last + 1))]
    assert json.load(open(os.path.join(cache, version_dirname(last), "manifest.json")))["version"] == last


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


class _Counting:
    """Counts the run directory's reads of `store` by kind (memory:// has no request log)."""

    def __init__(self, store: PolicyStore, mp):
        self.calls: Counter = Counter()
        fs = store.fs
        for name in ("cat_file", "get_file", "exists", "info", "ls", "pipe_file", "put_file", "rm_file"):
            real = getattr(fs, name)
            mp.setattr(fs, name, self._wrap(name, real))

    def _wrap(self, name, real):
        def call(*a, **kw):
            self.calls[name] += 1
            return real(*a, **kw)
        return call


def _publish_model(store: PolicyStore, model_dir: str, version: int) -> bool:
    from pipeline.models import load_model, load_tokenizer

    return store.publish_model(version, load_model(model_dir, "float32"), load_tokenizer(model_dir), {"step": version})


def test_a_publisher_seeds_this_nodes_copy_and_a_sampler_beside_it_loads_it_without_requests(model_dir):
    url = f"memory://policy-test-{uuid.uuid4().hex}/run-1"
    publisher = _store(url)
    publisher.publish_folder(0, model_dir)
    sampler = _store(url)
    with sampler.lease_latest("sampler-0") as lease:  # v0 came from prepare: downloaded, under a lease
        assert lease.version == 0
    assert sampler.leased() == {0}
    assert _publish_model(publisher, model_dir, 1)
    copy = sampler._copies().get(1)
    assert copy is not None and os.path.exists(os.path.join(copy, ".seeded"))
    assert json.load(open(os.path.join(copy, "manifest.json"))) == publisher.manifest(1)
    with pytest.MonkeyPatch.context() as mp:
        counting = _Counting(sampler, mp)
        assert sampler.published_after(0) == 1
        with sampler.lease_latest("sampler-0", 1) as lease:
            assert lease.version == 1 and lease.path == copy
            assert load_state_dict(lease.path)
        assert sampler.published_after(1) is None  # reads latest.json once
        assert sampler.published_after(1) is None  # then, a local publisher being active, not again
    assert counting.calls == Counter(cat_file=1, rm_file=1), counting.calls  # the hint; the v0 lease removed
    assert sampler.leased() == set()
    assert publisher.verify(1).files == len(publisher.manifest(1)["files"])


def test_a_version_published_elsewhere_is_still_seen_while_a_local_seed_is_fresh(model_dir, monkeypatch):
    url = f"memory://policy-test-{uuid.uuid4().hex}/run-1"
    publisher = _store(url)
    publisher.publish_folder(0, model_dir)
    assert _publish_model(publisher, model_dir, 1)
    sampler = _store(url)
    assert sampler.published_after(1) is None
    publisher.publish_folder(2, model_dir)  # no local copy: as if published on another node
    assert sampler.published_after(1) is None  # within REMOTE_POLL_S of the last read
    monkeypatch.setattr("pipeline.policy.REMOTE_POLL_S", 0.0)
    assert sampler.published_after(1) == 2
    with sampler.lease_latest("sampler-0", 2) as lease:  # downloaded, under a lease
        assert lease.version == 2 and load_state_dict(lease.path)
    assert sampler.leased() == {2}


def _publish_deferred(store: PolicyStore, model_dir: str, version: int) -> bool:
    from pipeline.models import load_model, load_tokenizer

    return store.publish_model(version, load_model(model_dir, "float32"), load_tokenizer(model_dir), {"step": version},
                               defer=True)


def test_deferred_versions_are_this_nodes_copies_until_due_and_those_kept_here_go_up_with_flush(model_dir):
    url = f"memory://policy-test-{uuid.uuid4().hex}/run-1"
    _store(url).publish_folder(0, model_dir)  # prepare's
    publisher = _store(url)
    assert _publish_deferred(publisher, model_dir, 1) and publisher.exists(1) and publisher._hint() == 1  # the first
    for v in range(2, 3 + LOCAL_COPIES):
        assert _publish_deferred(publisher, model_dir, v)
    newest = 2 + LOCAL_COPIES
    assert not any(publisher.exists(v) for v in range(2, newest + 1)) and publisher._hint() == 1  # within REMOTE_POLL_S
    beside, elsewhere = _store(url), _store(url)
    assert beside.published_after(1) == newest and beside.committed(newest - 1)  # its local copies tell it
    with beside.lease_latest("sampler-0", newest - 1, exact=True) as lease:
        assert lease.version == newest - 1 and load_state_dict(lease.path)
    elsewhere._local = LocalCopies(Path(tempfile.mkdtemp()))  # another node: no copies
    assert elsewhere.published_after(1) is None and not elsewhere.committed(newest)
    publisher.flush()  # idle: the versions waiting whose copies this node keeps go up, oldest first
    assert [v for v in range(2, newest + 1) if publisher.exists(v)] == list(range(3, newest + 1))
    assert publisher._hint() == newest and elsewhere.published_after(1) == newest and elsewhere.committed(newest)
    with elsewhere.lease_latest("sampler-1", newest, exact=True) as lease:  # downloaded: the same weights
        mine, theirs = load_state_dict(lease.path), load_state_dict(beside._copies().get(newest))
        assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert elsewhere.leased() == {newest}
    # a reader on another node holds a lease: each version goes up at once
    publisher._uploads._elsewhere = (False, float("-inf"))  # its look at the leases is due
    assert _publish_deferred(publisher, model_dir, newest + 1) and _publish_deferred(publisher, model_dir, newest + 2)
    assert publisher.exists(newest + 1) and publisher.exists(newest + 2) and publisher._hint() == newest + 2
    elsewhere.release("sampler-1")
    publisher._uploads._elsewhere = (False, float("-inf"))
    assert _publish_deferred(publisher, model_dir, newest + 3) and not publisher.exists(newest + 3)  # none left
    publisher._uploads.uploaded_at -= RECORD_EVERY_S  # none for RECORD_EVERY_S: the next goes up, for the record
    assert _publish_deferred(publisher, model_dir, newest + 4) and publisher.exists(newest + 4)
    publisher._uploads.uploaded_at -= 1.0  # a second later, no reader elsewhere: not yet
    publisher._uploads._elsewhere = (False, float("-inf"))
    assert _publish_deferred(publisher, model_dir, newest + 5) and not publisher.exists(newest + 5)
    assert _publish_model(publisher, model_dir, newest + 6) and publisher.exists(newest + 6)  # no defer: at once
    publisher.flush()
    assert publisher.exists(newest + 5) and publisher._hint() == newest + 6  # the hint never goes back


def test_a_run_prepared_again_at_the_same_url_does_not_read_the_old_runs_copies(model_dir):
    url = f"memory://policy-test-{uuid.uuid4().hex}/run-1"
    first = _store(url)
    first.run.write_json("prepare.json", {"time": 1.0, "created": 1.0})
    first.publish_folder(0, model_dir)
    assert _publish_model(first, model_dir, 1) and first._copies().get(1)
    first.run.fs.rm(first.run.path(""), recursive=True)
    again = _store(url)
    again.run.write_json("prepare.json", {"time": 2.0, "created": 2.0})
    again.publish_folder(0, model_dir)
    assert again._copies().root != first._copies().root
    assert again._copies().get(1) is None and again.published_after(0) is None


def test_a_publisher_checks_for_an_existing_version_only_below_what_was_there_when_it_started(model_dir):
    url = f"memory://policy-test-{uuid.uuid4().hex}/run-1"
    before = _store(url)
    before.publish_folder(0, model_dir)
    assert _publish_model(before, model_dir, 1) and _publish_model(before, model_dir, 2)
    resumed = _store(url)  # a trainer resumed below what its last attempt published
    assert not _publish_model(resumed, model_dir, 2)  # already there: nothing rewritten
    calls: Counter = Counter()
    with pytest.MonkeyPatch.context() as mp:
        for name in ("exists", "_hint"):
            real = getattr(PolicyStore, name)
            mp.setattr(PolicyStore, name, lambda self, *a, _n=name, _r=real: calls.update([_n]) or _r(self, *a))
        assert _publish_model(resumed, model_dir, 3) and _publish_model(resumed, model_dir, 4)
    assert calls == Counter(_hint=1), calls  # new versions: not checked; the hint read once, then known
    assert resumed.latest() == 4 and resumed._hint() == 4


def test_in_phase_versions_on_object_stores_upload_only_their_weights_and_downloads_restore_the_rest(model_dir):
    import shutil

    url = f"memory://policy-test-{uuid.uuid4().hex}/run-1"
    publisher = _store(url)
    publisher.publish_folder(0, model_dir)
    assert _publish_model(publisher, model_dir, 1)
    puts: list[str] = []
    with pytest.MonkeyPatch.context() as mp:
        real = publisher.fs.pipe_file
        mp.setattr(publisher.fs, "pipe_file", lambda path, *a, **kw: puts.append(path) or real(path, *a, **kw))
        assert _publish_model(publisher, model_dir, 2)
    assert not [p for p in puts if "/files/" in p]  # the shared files went up once, with v1
    m = publisher.manifest(2)
    assert {"config.json", "tokenizer.json", "tokenizer_config.json"} <= set(m["shared"])
    assert set(m["files"]) == {"model.safetensors"}
    own = {n.rstrip("/").rsplit("/", 1)[-1] for n in publisher.fs.ls(publisher._dir(2), detail=False)}
    assert own == {"manifest.json", "model.safetensors"}
    shutil.rmtree(publisher._copies().root)  # a sampler on another node: no seeded copy
    elsewhere = _store(url)
    path = elsewhere.local_dir(2)
    assert set(m["shared"]) | set(m["files"]) <= set(os.listdir(path))
    from pipeline.models import load_model, load_tokenizer

    assert load_tokenizer(path)("digits 1 2 :")["input_ids"] == load_tokenizer(model_dir)("digits 1 2 :")["input_ids"]
    restored, original = load_model(path, "float32").state_dict(), load_model(model_dir, "float32").state_dict()
    assert restored.keys() == original.keys() and all(torch.equal(restored[k], original[k]) for k in original)
    assert publisher.verify(2).files == len(m["files"])


def test_without_v0_a_publisher_renders_config_and_tokenizer_once_for_the_model_it_publishes(model_dir, tmp_path,
                                                                                             monkeypatch):
    """A store without v0 (whose files versions otherwise carry: tests/test_policy_meta.py) renders
    the meta files of in-phase versions once per (config, generation config, tokenizer) and copies
    them after: every version holds the same files, and another tokenizer object is rendered afresh."""
    from pipeline.models import load_model, load_tokenizer

    store = _store(f"file://{tmp_path}/run-1")
    model, tok = load_model(model_dir, "float32"), load_tokenizer(model_dir)
    saves: Counter = Counter()
    for cls, name in ((type(model.config), "config"), (type(tok), "tokenizer")):
        real = cls.save_pretrained
        monkeypatch.setattr(cls, "save_pretrained", lambda self, *a, _r=real, _n=name, **kw:
                            saves.update([_n]) or _r(self, *a, **kw))
    for v in (1, 2, 3):
        assert store.publish_model(v, model, tok, {"step": v})
    assert saves == Counter(config=1, tokenizer=1), saves  # once, for three versions
    files = [{n: (Path(store.local_dir(v)) / n).read_bytes() for n in store.manifest(v)["files"] if n != "model.safetensors"}
             for v in (1, 3)]
    assert files[0] == files[1] and {"config.json", "tokenizer.json"} <= set(files[0])
    assert store.publish_model(4, model, load_tokenizer(model_dir), {"step": 4})
    assert saves == Counter(config=2, tokenizer=2), saves
    assert load_tokenizer(store.local_dir(4))("digits 1 2 :")["input_ids"] == tok("digits 1 2 :")["input_ids"]


def test_a_version_a_killed_trainer_left_waiting_here_goes_up_when_the_resumed_one_publishes_it(model_dir):
    """Deferred versions exist only as this node's copies; the list of those waiting dies with the
    process. The resumed trainer redoes the steps: its publication must upload the copy."""
    url = f"memory://policy-test-{uuid.uuid4().hex}/run-1"
    _store(url).publish_folder(0, model_dir)
    before = _store(url)
    assert _publish_deferred(before, model_dir, 1) and _publish_deferred(before, model_dir, 2)
    assert not before.exists(2)  # waiting here when the trainer is killed
    resumed = _store(url)
    assert _publish_model(resumed, model_dir, 2)  # not deferred: at once
    elsewhere = _store(url)
    elsewhere._local = LocalCopies(Path(tempfile.mkdtemp()))  # another node: no copies
    assert resumed.exists(2) and elsewhere.committed(2) and elsewhere.published_after(1) == 2


def test_copies_of_runs_idle_for_days_go_when_another_run_opens_its_own(tmp_path):
    from pipeline.policy_cache import IDLE_RUN_S, sweep_idle_runs

    parent = tmp_path / "policies"
    old, busy, mine = parent / "old-1", parent / "busy-2", parent / "mine-3"
    for run in (old, busy, mine):
        (run / "v000000").mkdir(parents=True)
    long_ago = time.time() - IDLE_RUN_S - 60
    for p in (old / "v000000", old, mine / "v000000", mine):
        os.utime(p, (long_ago, long_ago))
    assert sweep_idle_runs(parent, mine) == ["old-1"]
    assert sorted(p.name for p in parent.iterdir()) == ["busy-2", "mine-3"]
