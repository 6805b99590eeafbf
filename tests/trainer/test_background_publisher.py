"""The trainer's publication thread: versions in order, a waiting one replaced by a newer one
(or, for a sampler on a fixed lag, the trainer held until it is taken),
retention after keep_policy_versions publications (at most every RETAIN_EVERY_S) and at the end,
the deferred `latest.json` written once idle and at the end, failures surfaced."""

import threading

import pytest

from pipeline.config import TrainerConfig
from pipeline.trainer import publish as publish_mod
from pipeline.trainer.publish import BackgroundPublisher


class SlowStore:
    """Stands in for PolicyStore: records publications; the first waits until released."""

    def __init__(self, fail_at: int | None = None):
        self.published, self.fail_at = [], fail_at
        self.release = threading.Event()
        self.started = threading.Event()
        self.flushes: list[int] = []  # len(published) at each flush

    def publish_model(self, version, model, tokenizer, meta, weights, defer=False):
        assert defer  # the thread flushes what waits
        self.started.set()
        self.release.wait(timeout=30)
        if version == self.fail_at:
            raise OSError("storage went away")
        self.published.append((version, weights["w"]))
        return True

    def flush(self):
        self.flushes.append(len(self.published))


@pytest.fixture
def retentions(monkeypatch):
    calls = []
    monkeypatch.setattr(publish_mod, "prune_policies", lambda store, tc: calls.append(list(store.published)))
    return calls


def test_a_version_waiting_behind_an_upload_is_replaced_by_the_newer_one(retentions, monkeypatch):
    monkeypatch.setattr(publish_mod, "RETAIN_EVERY_S", 0.0)
    store = SlowStore()
    pub = BackgroundPublisher(store, TrainerConfig(keep_policy_versions=2))
    pub.submit(1, None, None, {}, {"w": 1})
    assert store.started.wait(timeout=30)  # v1 is uploading
    pub.submit(2, None, None, {}, {"w": 2})
    pub.submit(3, None, None, {}, {"w": 3})  # v2 never started: v3 takes its place
    store.release.set()
    pub.close()
    assert store.published == [(1, 1), (3, 3)] and pub.replaced == 1
    assert retentions == [[(1, 1), (3, 3)]]  # after the second publication; none left for close


def test_without_replacement_the_trainer_waits_and_every_version_is_published(retentions):
    store = SlowStore()
    pub = BackgroundPublisher(store, TrainerConfig(keep_policy_versions=2), replace=False)
    pub.submit(1, None, None, {}, {"w": 1})
    assert store.started.wait(timeout=30)  # v1 is uploading
    pub.submit(2, None, None, {}, {"w": 2})  # queued
    third = threading.Thread(target=pub.submit, args=(3, None, None, {}, {"w": 3}))
    third.start()
    third.join(timeout=0.3)
    assert third.is_alive()  # v2 still waits: the trainer is held rather than v2 replaced
    store.release.set()
    third.join(timeout=30)
    pub.close()
    assert store.published == [(1, 1), (2, 2), (3, 3)] and pub.replaced == 0


def test_retention_waits_for_its_interval_and_the_end_applies_it(retentions, monkeypatch):
    monkeypatch.setattr(publish_mod, "RETAIN_EVERY_S", 3600.0)
    store = SlowStore()
    store.release.set()
    pub = BackgroundPublisher(store, TrainerConfig(keep_policy_versions=2))
    for v in range(1, 6):
        pub.submit(v, None, None, {}, {"w": v})
        while len(store.published) < v:  # each one published before the next is queued
            threading.Event().wait(0.01)
    assert retentions == []  # 5 publications, keep 2: due, but not within the interval
    pub.close()
    assert len(retentions) == 1 and retentions[0] == [(v, v) for v in range(1, 6)]


def test_a_failed_publication_fails_the_trainer_when_it_closes_the_publisher(retentions):
    store = SlowStore(fail_at=1)
    store.release.set()
    pub = BackgroundPublisher(store, TrainerConfig(keep_policy_versions=3))
    pub.submit(1, None, None, {}, {"w": 1})
    with pytest.raises(RuntimeError, match="storage went away"):
        pub.close()
    assert store.published == [] and retentions == []


def test_the_deferred_hint_goes_out_once_the_thread_is_idle_and_at_the_end(retentions, monkeypatch):
    monkeypatch.setattr(publish_mod, "REMOTE_POLL_S", 0.05)
    store = SlowStore()
    store.release.set()
    pub = BackgroundPublisher(store, TrainerConfig(keep_policy_versions=3))
    pub.submit(1, None, None, {}, {"w": 1})
    deadline = threading.Event()
    for _ in range(600):
        if store.flushes and store.flushes[-1] == 1:
            break
        deadline.wait(0.01)
    assert store.flushes and store.flushes[-1] == 1  # idle after v1: its hint is not left waiting
    pub.close()
    assert store.flushes[-1] == 1 and len(store.published) == 1


def test_in_one_process_the_thread_gets_a_copy_of_every_weight(tmp_path):
    """`publish_policy` without ranks reads the module's own weights (no gathering) and hands the
    thread copies: the next optimizer step, in place, must not change a version being written."""
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from pipeline.rundir import RunDir
    from pipeline.trainer.distributed import World
    from pipeline.trainer.publish import publish_policy

    class Capture:
        def submit(self, version, model, tokenizer, meta, weights):
            self.version, self.weights = version, weights

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(5, 4), torch.nn.Linear(4, 5))
    model[1].weight = model[0].weight  # tied, as the built-in models' embeddings and LM head are
    model.register_buffer("steps", torch.tensor(3))
    actor = type("Actor", (), {"policy": model})()
    want = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    cap = Capture()
    assert publish_policy(RunDir(f"file://{tmp_path}"), 7, actor, None, World(), dtype=torch.float32, publisher=cap)
    assert cap.version == 7 and sorted(cap.weights) == sorted(want)
    assert all(torch.equal(cap.weights[k], v) for k, v in want.items())
    before = {k: v.clone() for k, v in cap.weights.items()}
    with torch.no_grad():
        model[0].weight.add_(1.0)
        model[1].bias.add_(1.0)
    assert all(torch.equal(cap.weights[k], before[k]) for k in before)


def test_versions_wait_their_turn_only_for_one_replica_on_a_fixed_lag():
    from pipeline.config import SamplerConfig
    from pipeline.trainer.publish import replaces

    assert replaces(SamplerConfig(fixed_lag=False, replicas=1))
    assert not replaces(SamplerConfig(fixed_lag=True, replicas=1))
    assert replaces(SamplerConfig(fixed_lag=True, replicas=2))  # several replicas load the newest anyway
