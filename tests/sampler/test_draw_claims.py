"""Prompt draws claimed by sampler replicas: each draw goes to exactly one replica."""

import multiprocessing as mp

import pytest

from pipeline.rundir import RunDir
from pipeline.sampler.claims import DrawClaims


def _claim(url: str, sampler_id: str, n: int, batch_s: float | None, out) -> None:
    claims, drawn = DrawClaims(RunDir(url), sampler_id), []
    for _ in range(n):
        drawn.append(claims.next())
        claims.release(drawn[-1], batch_s)
    out.put((sampler_id, drawn))


@pytest.mark.parametrize("batch_s", [None, 0.1])  # 0.1: each claims blocks of 10 draws until it meets another
def test_concurrent_replicas_never_claim_the_same_draw(tmp_path, batch_s):
    url = f"file://{tmp_path / 'run'}"
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_claim, args=(url, f"sampler-{i}", 25, batch_s, out)) for i in range(4)]
    try:
        for p in procs:
            p.start()
        got = dict(out.get(timeout=60) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            p.kill()
    drawn = [k for ks in got.values() for k in ks]
    assert len(set(drawn)) == 100  # none twice
    if batch_s is None:
        assert sorted(drawn) == list(range(100))  # and, one by one, none skipped while all are alive
    owners = DrawClaims(RunDir(url), "reader")
    for sid, ks in got.items():
        assert all(owners.owner(k) == sid for k in ks)


def test_a_lone_replica_claims_a_second_of_draws_at_once_and_a_joiner_starts_past_them(tmp_path):
    from pipeline.sampler import claims as claims_mod

    run = RunDir(f"file://{tmp_path / 'run'}")
    first = DrawClaims(run, "sampler-0")
    first.release(first.next(), batch_s=claims_mod.CLAIM_AHEAD_S / 4)  # draw 0: batch time not known yet
    assert [first.next() for _ in range(3)] == [1, 2, 3]
    assert sorted(p.name for p in (tmp_path / "run" / "claims").iterdir()) == ["0000000000.json", "0000000001.json"]
    late = DrawClaims(run, "sampler-1")  # draws 1-4 are sampler-0's, though it has made only 1-3
    assert late.next() == 5 and late.owner(4) == "sampler-0" and late.owner(5) == "sampler-1"
    assert first.next() == 4 and first.alone  # the rest of its block: no request, nothing met yet
    assert first.next() == 6 and not first.alone  # it found draw 5 taken, and goes draw by draw
    assert first.next() == 7 and first.owner(8) is None
    first.release(7, batch_s=0.001)
    assert first.next() == 8 and first.owner(9) is None  # not alone: no block however fast it goes


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


def test_a_replica_that_stops_goes_on_with_its_block_when_restarted_and_after_a_crash_starts_past_it(tmp_path):
    from pipeline.sampler import claims as claims_mod

    run = RunDir(f"file://{tmp_path / 'run'}")
    claims_dir = tmp_path / "run" / "claims"
    first = DrawClaims(run, "sampler-0")
    first.release(first.next(), batch_s=claims_mod.CLAIM_AHEAD_S / 4)
    assert [first.next() for _ in range(2)] == [1, 2]  # of its block 1-4
    first.flush()  # it stops
    again = DrawClaims(run, "sampler-0")
    assert [again.next() for _ in range(2)] == [3, 4] and len(list(claims_dir.iterdir())) == 2  # no new claim
    assert again.next() == 5 and again.alone
    # killed without its flush: the next process cannot know which draws of the block were made
    crashed = DrawClaims(run, "sampler-0")
    assert crashed.next() == 9 and crashed.owner(12) == "sampler-0"  # a new block, 9-12
    assert DrawClaims(run, "sampler-3").next() == 13  # another replica starts past it


def test_a_torn_claim_covers_its_own_draw_and_a_recent_claim_of_another_replica_means_not_alone(tmp_path):
    run = RunDir(f"file://{tmp_path / 'run'}")
    first = DrawClaims(run, "sampler-0")
    assert first.next() == 0
    (tmp_path / "run" / "claims" / "0000000001.json").write_bytes(b'{"sampler_id": "samp')  # a machine crash
    late = DrawClaims(run, "sampler-5")
    assert not late.alone  # sampler-0 claimed a moment ago: it runs
    assert late.next() == 2 and late.owner(1) is None
    assert DrawClaims(run, "sampler-5").alone is False and DrawClaims(run, "sampler-2").next() == 3


def test_a_replica_the_config_does_not_name_ends_being_alone(tmp_path):
    run = RunDir(f"file://{tmp_path / 'run'}")
    first = DrawClaims(run, "sampler-0", replicas=1)
    first.next()
    assert first.alone  # its staleness checks may rely on counting only its own groups
    DrawClaims(run, "sampler-7", replicas=1).next()  # joins the running run
    assert first.next() == 2 and not first.alone  # it found draw 1 taken: checks against others again


def test_the_prompt_stream_is_one_shuffled_pass_after_another_readable_from_any_position():
    import random

    from pipeline.sampler.loop import PromptStream

    n, seed = 7, 3
    expected = []
    for epoch in range(3):  # the definition: pass e is range(n) shuffled by a generator seeded from (seed, e)
        order = list(range(n))
        random.Random(seed * 1_000_003 + epoch).shuffle(order)
        expected += order
    stream = PromptStream(list(range(n)), seed)
    got = stream.take(4) + stream.take(10) + stream.take(7)
    assert got == expected
    assert sorted(got[:n]) == list(range(n)) and got[:n] != got[n:2 * n]
    assert PromptStream(list(range(n)), seed, position=5).take(9) == expected[5:14]


def test_a_lone_replica_writes_its_state_marker_every_few_seconds_and_when_it_stops(tmp_path, monkeypatch):
    from pipeline.sampler import claims as claims_mod

    now = [0.0]
    monkeypatch.setattr(claims_mod.time, "monotonic", lambda: now[0])
    run = RunDir(f"file://{tmp_path / 'run'}")
    alone = DrawClaims(run, "sampler-0")
    key = RunDir.sampler_state_marker("sampler-0")
    for k in range(4):  # four batches in one second
        now[0] += 0.25
        alone.release(alone.next(), batch_s=0.25)
    assert (run.marker(key) or {}).get("batches") is None  # nobody else reads it: not yet written
    now[0] += claims_mod.SAVE_ALONE_S
    alone.release(alone.next(), batch_s=0.25)
    assert run.marker(key)["batches"] == 5
    alone.release(alone.next(), batch_s=0.25)
    alone.flush()  # the sampler stops
    assert {k: run.marker(key)[k] for k in ("last_draw", "batches", "holding")} == {"last_draw": 5, "batches": 6,
                                                                                 "holding": None}
    assert DrawClaims(run, "sampler-0").batches == 6  # a restarted replica goes on counting


class _Writer:
    def __init__(self):
        self.groups_written = self.pending = 0

    def pending_groups(self) -> int:
        return self.pending


class _Buffer:
    def __init__(self):
        self.committed = self.reads = 0

    def committed_groups(self) -> int:
        self.reads += 1
        return self.committed


def _sampler(monkeypatch, replicas: int = 1, **buffer_cfg):
    from types import SimpleNamespace

    from pipeline.config import BufferConfig
    from pipeline.sampler import loop as loop_mod

    now = [0.0]
    monkeypatch.setattr(loop_mod.time, "monotonic", lambda: now[0])
    s = object.__new__(loop_mod.Sampler)
    s.writer, s.buffer = _Writer(), _Buffer()
    s.claims = SimpleNamespace(alone=replicas == 1)
    s.cfg = SimpleNamespace(buffer=BufferConfig(**buffer_cfg))
    s._counted, s._counted_at = 0, -loop_mod.RECOUNT_S
    return s, now, loop_mod.RECOUNT_S


def test_a_lone_replica_counts_the_groups_ahead_of_it_and_reads_the_log_every_few_seconds(monkeypatch):
    s, now, recount = _sampler(monkeypatch)
    s.buffer.committed = 40  # committed by an earlier process of this replica
    assert s._groups_ahead() == 40 and s.buffer.reads == 1
    for _ in range(5):  # five batches of 16 groups, each handed to the writer, two still in it
        s.writer.groups_written += 16
        now[0] += recount / 10
    s.writer.pending, s.buffer.committed = 32, 88
    assert s._groups_ahead() == 120 and s.buffer.reads == 1  # counted, not read
    now[0] += recount
    assert s._groups_ahead() == 120 and s.buffer.reads == 2  # read again: the same number

    for replicas, cfg in ((2, {}), (1, {"max_fresh_backlog": 64}), (1, {"samples_per_insert": 2.0})):
        s, now, _ = _sampler(monkeypatch, replicas, **cfg)  # others commit too, or a bound on the trainer reads the log
        s._groups_ahead(), s._groups_ahead()
        assert s.buffer.reads == 2


def test_a_commit_while_the_groups_ahead_are_counted_is_not_counted_twice(monkeypatch):
    """The writer commits a batch of 16 groups between the reads of its pending groups and of the
    log: counted as both, the position would be a batch ahead of the truth, and a lone sampler on
    a fixed lag, held by the staleness bound at the version it already runs, would wait forever."""
    s, _, _ = _sampler(monkeypatch, max_fresh_backlog=64)  # reads the log at every count
    s.writer.pending, s.buffer.committed = 16, 32
    real = _Buffer.committed_groups

    def committing(buf):
        if s.writer.pending:  # the commit lands while the log is read
            s.writer.pending, buf.committed = 0, buf.committed + 16
        return real(buf)

    monkeypatch.setattr(_Buffer, "committed_groups", committing)
    assert s._groups_ahead() == 48 and s.buffer.reads == 2


def test_a_refusal_that_lands_while_the_refusals_are_recorded_is_recorded_by_the_next_call():
    """The writer's commit thread appends to `writer.dropped` while the sampler records it: a draw
    refused between reading the list and counting it was once counted but never recorded."""
    from types import SimpleNamespace

    from pipeline.sampler import loop as loop_mod

    class Racing(list):
        """Another refusal arrives right after the sampler has read the list."""

        def __getitem__(self, i):
            out = list.__getitem__(self, i)
            if isinstance(i, slice) and len(self) < 2:
                self.append(14)
            return out

    logged = []
    s = object.__new__(loop_mod.Sampler)
    s.sampler_id, s._dropped_logged = "sampler-2", 0
    s.writer = SimpleNamespace(dropped=Racing([1]))
    s.metrics = SimpleNamespace(log=logged.append)
    assert s._log_dropped() == 1  # what it recorded, not what the list held by the end
    assert s._log_dropped() == 2
    assert [r["sampler/dropped_draw"] for r in logged if r["event"] == "dropped_stale"] == [1, 14]
    assert s._log_dropped() == 2 and len(logged) == 2
