"""L2: quality filter, dedup, prioritized draws with importance weights, replay limits."""

import numpy as np
import pytest
from rollout_factory import make_groups

from pipeline.buffer import ReplayBuffer
from pipeline.buffer.replay import annealed_beta, draw
from pipeline.buffer.state import ReplayGroup
from pipeline.config import BufferConfig

SPREAD = [0.0, 1.0, 0.0, 1.0]
FLAT = [1.0, 1.0, 1.0, 1.0]


def _buf(url, **kw):
    return ReplayBuffer(url, BufferConfig(checkpoint_interval=5, **kw))


def test_promote_keeps_only_groups_with_reward_spread(buffer_url):
    buf = _buf(buffer_url)
    t = make_groups("a", 4, rewards=[SPREAD, FLAT, SPREAD, [0.0] * 4])
    out = buf.promote(t)
    assert (out["promoted"], out["no_variance"]) == (2, 2)
    assert sorted(buf.state.l2_groups) == ["a-g0", "a-g2"]
    assert buf.eligible_replay_groups() == 2


def test_promote_applies_reward_thresholds(buffer_url):
    buf = _buf(buffer_url, l2_min_reward_mean=0.3, l2_max_reward_mean=0.7)
    t = make_groups("a", 3, rewards=[[0, 0, 0, 1], SPREAD, [1, 1, 1, 0]])
    out = buf.promote(t)
    assert (out["promoted"], out["threshold"]) == (1, 2)
    assert list(buf.state.l2_groups) == ["a-g1"]


def test_promote_drops_groups_already_in_l2_by_content_hash(buffer_url):
    buf = _buf(buffer_url)
    t = make_groups("a", 2, rewards=[SPREAD, SPREAD], seed=1)
    buf.promote(t)
    # same completions under new group ids (e.g. a restarted trainer promoting again)
    again = make_groups("b", 2, rewards=[SPREAD, SPREAD], seed=1)
    out = buf.promote(again)
    assert (out["promoted"], out["duplicate"]) == (0, 2)
    assert buf.stats()["tiers"]["l2"]["groups"] == 2


def test_dedup_can_be_turned_off(buffer_url):
    buf = _buf(buffer_url, l2_dedup=False)
    buf.promote(make_groups("a", 2, rewards=[SPREAD, SPREAD], seed=1))
    assert buf.promote(make_groups("b", 2, rewards=[SPREAD, SPREAD], seed=1))["promoted"] == 2


def test_replays_stop_after_max_replays_per_group(buffer_url):
    buf = _buf(buffer_url, max_replays_per_group=2)
    buf.promote(make_groups("a", 3, rewards=[SPREAD] * 3))
    drawn = []
    for step in range(5):
        batch = buf.sample_replay(2, step=step, rng_seed=step)
        drawn.extend(batch.keys)
        buf.update_priorities(batch.keys, np.ones(len(batch.keys)))
    assert sorted(drawn) == sorted(["a-g0", "a-g1", "a-g2"] * 2)
    assert buf.eligible_replay_groups() == 0
    assert buf.sample_replay(2, step=9, rng_seed=0).table.num_rows == 0
    assert buf.stats()["l2_replay_groups"] == {"2": 3}


def test_replay_batch_rows_and_weights_line_up(buffer_url):
    buf = _buf(buffer_url)
    buf.promote(make_groups("a", 6, group_size=3, rewards=[[0, 1, 0]] * 6))
    batch = buf.sample_replay(4, step=0, rng_seed=7)
    assert len(batch.keys) == 4
    assert batch.table.num_rows == 12 and batch.weights.shape == (12,)
    gids = batch.table.column("group_id").to_pylist()
    assert [gids[i * 3] for i in range(4)] == batch.keys
    assert set(batch.table.column("tier").to_pylist()) == {"l2"}
    assert np.all(batch.weights > 0) and np.all(batch.weights <= 1.0 + 1e-6)
    # the same state, step and seed give the same batch
    assert buf.sample_replay(4, step=0, rng_seed=7).keys == batch.keys


def test_higher_priority_is_drawn_more_often_and_weighted_less():
    groups = {f"k{i}": ReplayGroup("p", i, 1, f"h{i}", 1.0) for i in range(10)}
    groups["k0"].priority = 20.0
    counts = {k: 0 for k in groups}
    for seed in range(400):
        keys, probs, weights = draw(groups, 2, 1, alpha=1.0, beta=1.0, eps=1e-3, rng_seed=seed)
        counts[keys[0]] += 1
        if keys[0] == "k0":
            w_hi = weights[0]
        else:
            w_lo = weights[0]
    # P(k0) = 20 / 29 ~ 0.69
    assert 0.6 < counts["k0"] / 400 < 0.78
    assert w_hi < w_lo == pytest.approx(1.0)


def test_uniform_priorities_give_unit_weights():
    groups = {f"k{i}": ReplayGroup("p", i, 1, f"h{i}", 1.0) for i in range(5)}
    _, probs, weights = draw(groups, 2, 3, alpha=0.6, beta=0.4, eps=1e-3, rng_seed=0)
    assert np.allclose(probs, 0.2) and np.allclose(weights, 1.0)


def test_beta_anneals_linearly_to_one():
    assert annealed_beta(0, 0.4, 100) == pytest.approx(0.4)
    assert annealed_beta(50, 0.4, 100) == pytest.approx(0.7)
    assert annealed_beta(500, 0.4, 100) == 1.0
    assert annealed_beta(3, 0.4, 0) == 1.0


def test_priority_updates_are_append_only_and_visible_to_other_processes(buffer_url):
    buf = _buf(buffer_url)
    buf.promote(make_groups("a", 2, rewards=[SPREAD] * 2))
    shard_files = sorted(buf.state.shards)
    buf.update_priorities(["a-g1"], [5.0])
    other = _buf(buffer_url)
    other.refresh()
    g = other.state.l2_groups["a-g1"]
    assert (g.priority, g.replays) == (5.0, 1)
    assert sorted(other.state.shards) == shard_files  # no shard rewritten


def test_update_priorities_validates_its_input(buffer_url):
    buf = _buf(buffer_url)
    with pytest.raises(ValueError, match="2 keys but 1 priorities"):
        buf.update_priorities(["a", "b"], [1.0])
    with pytest.raises(ValueError, match="finite"):
        buf.update_priorities(["a"], [float("nan")])


def test_l2_bound_evicts_exhausted_groups_then_oldest(buffer_url):
    buf = _buf(buffer_url, l2_max_groups=4, max_replays_per_group=1)
    buf.promote(make_groups("a", 2, rewards=[SPREAD] * 2, seed=1))
    buf.promote(make_groups("b", 2, rewards=[SPREAD] * 2, seed=2))
    buf.update_priorities(["b-g0", "b-g1"], [1.0, 1.0])  # b used up its single replay
    out = buf.promote(make_groups("c", 2, rewards=[SPREAD] * 2, seed=3))
    assert out["evicted_shards"] == 1
    assert sorted(buf.state.l2_groups) == ["a-g0", "a-g1", "c-g0", "c-g1"]
    buf.promote(make_groups("d", 2, rewards=[SPREAD] * 2, seed=4))  # over the bound: oldest (a) goes
    assert sorted(buf.state.l2_groups) == ["c-g0", "c-g1", "d-g0", "d-g1"]


def test_promote_with_cursor_records_consumption(buffer_url):
    buf = _buf(buffer_url)
    with buf.writer("w") as w:
        w.write(make_groups("a", 3, rewards=[SPREAD] * 3))
    table, cursor = buf.read_fresh(None, 2)
    buf.promote(table, cursor=cursor)
    assert buf.state.consumed["trainer"] == {"seq": 0, "group": 2, "groups": 2}


def _replays(buf) -> dict:
    return {k: (g.priority, g.replays) for k, g in buf.refresh().l2_groups.items()}


def test_restore_replays_takes_back_those_after_a_version_once_however_often_resumed(buffer_url):
    buf = _buf(buffer_url)
    buf.promote(make_groups("a", 3, rewards=[SPREAD] * 3))
    start = buf.state.version
    buf.update_priorities(["a-g0", "a-g1"], [3.0, 4.0])
    checkpoint = buf.state.version  # a trainer's checkpoint is taken here
    at_checkpoint = _replays(buf)
    buf.update_priorities(["a-g0"], [5.0])  # the killed attempt's replays after it
    buf.update_priorities(["a-g2"], [6.0])
    assert buf.state.replays_done == 4
    assert buf.restore_replays(checkpoint) == 2
    assert _replays(buf) == at_checkpoint == {"a-g0": (3.0, 1), "a-g1": (4.0, 1), "a-g2": (1.0, 0)}
    buf.update_priorities(["a-g2"], [7.0])  # the second attempt, killed too before a new checkpoint
    other = _buf(buffer_url)  # the third attempt, in another process
    assert other.restore_replays(checkpoint) == 1
    assert _replays(other) == at_checkpoint and other.state.replays_done == 2
    assert _replays(buf) == at_checkpoint  # every reader sees it
    assert other.restore_replays(checkpoint) == 0  # nothing left to take back
    assert other.restore_replays(start) == 2  # back to before any replay
    assert _replays(other) == {k: (1.0, 0) for k in at_checkpoint} and other.state.replays_done == 0


def test_restore_replays_changes_nothing_when_the_log_after_the_version_is_gone(buffer_url, tmp_path):
    from pipeline.buffer.logfiles import LOG_DIR, entry_name

    buf = _buf(str(tmp_path / "b"))
    buf.promote(make_groups("a", 2, rewards=[SPREAD] * 2))
    checkpoint = buf.state.version
    buf.update_priorities(["a-g0"], [5.0])
    (tmp_path / "b" / LOG_DIR / entry_name(checkpoint + 1)).unlink()  # as vacuum would, past retention
    assert buf.restore_replays(checkpoint) == -1
    assert _replays(buf)["a-g0"] == (5.0, 1)


def test_restore_replays_of_a_group_evicted_since_takes_back_its_count(buffer_url):
    """A shard whose groups used up their replays leaves L2 at the next promotion: the trainer
    resumed from a checkpoint before those replays must start (it failed on the missing group)."""
    buf = _buf(buffer_url, max_replays_per_group=1, l2_max_groups=2)
    buf.promote(make_groups("a", 2, rewards=[SPREAD] * 2, seed=1))
    checkpoint = buf.state.version
    buf.update_priorities(["a-g0", "a-g1"], [3.0, 4.0])
    buf.promote(make_groups("b", 2, rewards=[SPREAD] * 2, seed=2))  # a is used up: evicted
    assert sorted(buf.state.l2_groups) == ["b-g0", "b-g1"] and buf.state.replays_done == 2
    assert buf.restore_replays(checkpoint) == 2
    assert _buf(buffer_url).refresh().replays_done == 0
