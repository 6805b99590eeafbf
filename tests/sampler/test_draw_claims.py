"""Prompt draws claimed by sampler replicas: each draw goes to exactly one replica."""

import multiprocessing as mp

from pipeline.rundir import RunDir
from pipeline.sampler.claims import DrawClaims


def _claim(url: str, sampler_id: str, n: int, out) -> None:
    claims = DrawClaims(RunDir(url), sampler_id)
    out.put((sampler_id, [claims.next() for _ in range(n)]))


def test_concurrent_replicas_never_claim_the_same_draw(tmp_path):
    url = f"file://{tmp_path / 'run'}"
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_claim, args=(url, f"sampler-{i}", 25, out)) for i in range(4)]
    for p in procs:
        p.start()
    got = dict(out.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    drawn = [k for ks in got.values() for k in ks]
    assert sorted(drawn) == list(range(100))  # none twice, none skipped while all are alive
    owners = DrawClaims(RunDir(url), "reader")
    for sid, ks in got.items():
        assert all(owners.owner(k) == sid for k in ks)


def test_a_replica_that_joins_later_starts_after_the_highest_claim(tmp_path):
    run = RunDir(f"file://{tmp_path / 'run'}")
    first = DrawClaims(run, "sampler-0")
    assert [first.next() for _ in range(3)] == [0, 1, 2]
    late = DrawClaims(run, "sampler-1")
    assert late.next() == 3
    assert first.next() == 4  # probes past the draw the late replica took
    assert late.owner(3) == "sampler-1" and late.owner(5) is None


def test_the_staleness_gate_counts_live_holds_of_other_replicas_below_a_draw(tmp_path, monkeypatch):
    import time

    from pipeline.sampler import claims as claims_mod

    run = RunDir(f"file://{tmp_path / 'run'}")
    a, b, c = (DrawClaims(run, f"sampler-{i}", replicas=3) for i in range(3))
    assert a.next() == 0 and b.next() == 1
    assert c.held_below() == 2 and b.held_below(1) == 1 and a.held_below(0) == 0
    a.release(0, batch_s=0.5)  # handed over: no longer held
    assert c.held_below() == 1 and a.batches == 1

    # a hold older than its expiry (a replica lost while holding it) stops counting
    now = time.time()
    monkeypatch.setattr(claims_mod.time, "time", lambda: now + claims_mod.HOLD_MIN_S + 1)
    assert c.held_below() == 0
    monkeypatch.undo()

    # a replica restarted under the same id drops its predecessor's hold at once, keeps its count
    assert c.held_below() == 1
    again = DrawClaims(run, "sampler-1", replicas=3)
    assert c.held_below() == 0 and again.next() == 2
    again.release(2)  # given up unmade (the run stopped): not a batch
    assert again.batches == 0 and DrawClaims(run, "sampler-0", replicas=3).batches == 1


def test_a_replica_the_config_does_not_name_ends_being_alone(tmp_path):
    run = RunDir(f"file://{tmp_path / 'run'}")
    first = DrawClaims(run, "sampler-0", replicas=1)
    first.next()
    assert first.alone  # its staleness checks may rely on counting only its own groups
    DrawClaims(run, "sampler-7", replicas=1).next()  # joins the running run
    assert first.next() == 2 and not first.alone  # it found draw 1 taken: checks against others again
