"""Commit-log actions: typed records that read today's entries as they are and write the same JSON.

LOG_TODAY is a log written in the format buffers on disk hold today (sealed entries, one older entry
without a checksum, format or txn, an archive add with "ngroups"): it must keep opening to the same
state, and tools that read entries with `json.loads` must keep finding the same keys.
"""

from __future__ import annotations

import json
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rollout_factory import make_groups

from pipeline.buffer import ReplayBuffer
from pipeline.buffer.actions import (ACTIONS, AddShard, LogEntry, MalformedEntry, MarkConsumed, PromotedGroup,
                                     Quarantine, RecordReplays, RemoveShard, RestoreReplays, UnknownAction,
                                     parse_actions)
from pipeline.buffer.logfiles import LOG_DIR, entry_name, seal, unseal
from pipeline.config import BufferConfig, ConfigError, parse_config

T0 = 1_700_000_000.25
L1_A = {"op": "add", "path": "l1/sampler-0-a.parquet", "tier": "l1", "rows": 8, "bytes": 9000,
        "gsizes": [4, 4], "pv": [0, 0], "t": T0}
L1_B = {**L1_A, "path": "l1/sampler-0-b.parquet", "gsizes": [3, 5], "pv": [0, 1]}
L1_C = {**L1_A, "path": "l1/sampler-1-c.parquet", "gsizes": [8], "pv": [1, 1]}
L2 = {"op": "add", "path": "l2/promote-x.parquet", "tier": "l2", "rows": 8, "bytes": 5000, "gsizes": [4, 4],
      "pv": [0, 0], "t": T0 + 3, "groups": [["s-g0", 0, 4, "h0", 1.0], ["s-g1", 4, 4, "h1", 1.0]]}
CONSUMED = {"op": "consumed", "consumer": "trainer", "cursor": {"seq": 1, "group": 0}, "groups": 2}
PRIO = {"op": "prio", "keys": ["s-g0"], "p": [2.5]}
PRIO_WITH_PREVIOUS = {**PRIO, "q": [1.0]}
UNREPLAY = {"op": "unreplay", "keys": ["s-g0"], "p": [1.0], "n": [1]}
L3_OLD = {"op": "add", "path": "l3/run=r/policy=0/part-1.parquet", "tier": "l3", "rows": 8, "bytes": 20000,
          "ngroups": 2, "pv": [0, 0], "t": T0 + 5}
CONSUMED_NO_COUNT = {"op": "consumed", "consumer": "trainer", "cursor": {"seq": 2, "group": 1}}
QUARANTINE = {"op": "quarantine", "path": "l1/sampler-1-c.parquet", "reason": "unreadable: not Parquet"}

LOG_TODAY = [  # (actions, sealed)
    ([L1_A], True),
    ([L1_B, L1_C], True),  # a group commit of two shards
    ([L2, CONSUMED], True),  # promotion with the trainer's cursor
    ([PRIO], True),
    ([{"op": "remove", "path": L1_A["path"]}, L3_OLD], True),  # compaction into an archive file
    ([CONSUMED_NO_COUNT], True),
    ([QUARANTINE], True),
    ([{"op": "remove", "path": L1_B["path"]}], False),
]


def _write_log_today(url: str) -> None:
    os.makedirs(os.path.join(url, LOG_DIR))
    for v, (actions, sealed) in enumerate(LOG_TODAY, start=1):
        doc = {"format": 1, "v": v, "txn": f"t{v}", "time": T0 + v, "writer": "sampler-0", "actions": actions}
        if not sealed:  # written before entries carried a checksum, format and txn
            doc = {"v": v, "time": T0 + v, "actions": actions}
        with open(os.path.join(url, LOG_DIR, entry_name(v)), "wb") as f:
            f.write(seal(doc) if sealed else json.dumps(doc).encode())


def test_a_log_in_todays_format_opens_to_the_state_its_entries_give(tmp_path):
    url = str(tmp_path / "buffer")
    _write_log_today(url)
    st_ = ReplayBuffer(url, BufferConfig(checkpoint_interval=50)).refresh()
    assert st_.version == len(LOG_TODAY) and st_.quarantined == {QUARANTINE["path"]: QUARANTINE["reason"]}
    assert sorted(st_.shards) == sorted([L2["path"], L3_OLD["path"]])
    assert (st_.next_seq, st_.l1_groups_added, st_.l1_seqs) == (3, 5, [])
    l3 = st_.shards[L3_OLD["path"]]
    assert (l3.groups, l3.gsizes, l3.pv) == (2, [], (0, 0))  # the archive add's count, kept as a count
    assert {k: (g.priority, g.replays) for k, g in st_.l2_groups.items()} == {"s-g0": (2.5, 1), "s-g1": (1.0, 0)}
    assert st_.replays_done == 1 and st_.l2_by_path == {L2["path"]: ["s-g0", "s-g1"]}
    assert st_.consumed == {"trainer": {"seq": 2, "group": 1, "groups": 0}}
    assert st_.tombstones == {L1_A["path"]: T0 + 5, L1_B["path"]: T0 + 8}


def test_new_commits_on_a_log_in_todays_format_write_the_same_json(tmp_path):
    url = str(tmp_path / "buffer")
    _write_log_today(url)
    buf = ReplayBuffer(url, BufferConfig(checkpoint_interval=50))
    v = buf.update_priorities(["s-g1"], [0.5])
    raw = (tmp_path / "buffer" / LOG_DIR / entry_name(v)).read_bytes()
    doc = json.loads(raw)  # plain JSON, as bench/chaos.py reads entries
    assert set(doc) == {"sum", "format", "v", "txn", "time", "writer", "actions"}
    assert doc["actions"] == [{"op": "prio", "keys": ["s-g1"], "p": [0.5], "q": [1.0]}]  # q: the one replaced
    assert ReplayBuffer(url).refresh().l2_groups["s-g1"].replays == 1


@pytest.mark.parametrize("action", [L1_A, L2, CONSUMED, PRIO, PRIO_WITH_PREVIOUS, UNREPLAY, L3_OLD, QUARANTINE,
                                    {"op": "remove", "path": "x"}],
                         ids=lambda a: a["op"] + ("-" + a["tier"] if "tier" in a else ""))
def test_todays_actions_read_and_write_back_unchanged(action):
    typed = ACTIONS[action["op"]].from_json(action)
    assert typed.to_json() == action


def test_typed_actions_name_what_the_json_abbreviates():
    add = AddShard.from_json(L2)
    assert (add.group_sizes, add.policy_versions, add.committed_at, add.num_groups) == ((4, 4), (0, 0), T0 + 3, 2)
    assert add.promoted_groups[1] == PromotedGroup("s-g1", 4, 4, "h1", 1.0)
    assert RecordReplays.from_json(PRIO) == RecordReplays(("s-g0",), (2.5,))
    assert MarkConsumed.from_json(CONSUMED_NO_COUNT) == MarkConsumed("trainer", 2, 1, 0)
    assert AddShard.from_json(L3_OLD).num_groups == 2


def test_every_add_is_written_with_group_sizes_archive_adds_included(tmp_path):
    url = str(tmp_path / "run-1" / "buffer")
    buf = ReplayBuffer(url, BufferConfig(checkpoint_interval=50))
    with buf.writer("sampler-3") as w:
        w.write(make_groups("a", 2, group_size=3))
    table, cursor = buf.read_fresh(None, 10)
    buf.promote(make_groups("b", 1, rewards=[[0, 1, 0, 1]]), cursor)
    buf.compact(everything=True)
    docs = [json.loads((tmp_path / "run-1" / "buffer" / LOG_DIR / entry_name(v)).read_bytes())
            for v in range(1, buf.state.version + 1)]
    adds = [a for d in docs for a in d["actions"] if a["op"] == "add"]
    assert [a["tier"] for a in adds] == ["l1", "l2", "l3"]
    assert all("ngroups" not in a for a in adds)
    assert [a["gsizes"] for a in adds] == [[3, 3], [4], [3, 3]]
    assert docs[0]["writer"] == "sampler-3"  # the writer that committed the shard is named in its entry
    assert buf.stats()["tiers"]["l3"]["groups"] == 2 and buf.verify()["ok"]


@pytest.mark.parametrize("action, why", [
    ({**PRIO, "p": None}, "action 0 (prio): invalid 'p'"),
    ({"op": "prio", "keys": ["k"]}, "action 0 (prio) has no 'p'"),
    ({**UNREPLAY, "n": [1, 2]}, "action 0 (unreplay): 1 keys, 1 priorities, 2 counts"),
    ({k: v for k, v in L1_A.items() if k != "gsizes"}, "action 0 (add to l1) has no 'gsizes'"),
    ({**{k: v for k, v in L1_A.items() if k != "gsizes"}, "ngroups": 2}, "action 0 (add to l1) has no 'gsizes'"),
    ({**L3_OLD, "gsizes": [4]}, "'ngroups' 2 disagrees with the 1 'gsizes'"),
    ({k: v for k, v in L2.items() if k != "groups"}, "action 0 (add to l2) has no 'groups'"),
    ({**L2, "groups": [["s-g0", 0, 4, "h0"]]}, "action 0 (add): invalid 'groups'"),
    ({**L1_A, "tier": "l4"}, "action 0 (add): invalid 'tier'"),
    ({**L1_A, "t": float("nan")}, "action 0 (add): invalid 't'"),
    ({**L1_A, "rows": True}, "action 0 (add): invalid 'rows'"),
    ({**CONSUMED, "cursor": {"seq": 1}}, "action 0 (consumed): invalid 'cursor'"),
    ({"op": "quarantine", "path": "x"}, "action 0 (quarantine) has no 'reason'"),
    ({"path": "x"}, "action 0 is not an object with an 'op'"),
])
def test_a_malformed_action_is_named_with_its_field(action, why):
    with pytest.raises(MalformedEntry) as e:
        parse_actions([action])
    assert why in str(e.value)


def test_an_unknown_action_is_reported_after_the_known_ones_are_checked():
    with pytest.raises(UnknownAction) as e:
        parse_actions([{"op": "split_shard"}, PRIO])
    assert e.value.op == "split_shard"
    with pytest.raises(MalformedEntry):  # a bad known action makes the entry malformed, not newer
        parse_actions([{"op": "split_shard"}, {"op": "prio"}])


def test_commit_takes_typed_actions_only(tmp_path):
    buf = ReplayBuffer(str(tmp_path / "buffer"))
    with pytest.raises(TypeError, match="not a log action"):
        buf.commit([{"op": "remove", "path": "l1/x.parquet"}])
    assert buf.commit([RemoveShard("l1/x.parquet")]) == 1


def test_the_old_config_key_num_epochs_per_sample_still_sets_max_replays_per_group():
    cfg = parse_config({"buffer": {"num_epochs_per_sample": 3}})  # run configs and snapshots written before
    assert cfg.buffer.max_replays_per_group == 3 and "max_replays_per_group: 3" in cfg.to_yaml()
    assert parse_config({}, ["buffer.num_epochs_per_sample=1"]).buffer.max_replays_per_group == 1
    assert BufferConfig(num_epochs_per_sample=0).max_replays_per_group == 0
    with pytest.raises(ConfigError, match="'buffer.num_epochs_per_sample' is the old name of"):  # not both
        parse_config({"buffer": {"num_epochs_per_sample": 3, "max_replays_per_group": 1}})


# round trip of generated actions ---------------------------------------------------------------
names = st.text(min_size=1, max_size=12)
counts = st.integers(0, 2**40)
finite = st.floats(allow_nan=False, allow_infinity=False)
promoted = st.builds(PromotedGroup, names, counts, counts, names, finite)


@st.composite
def adds(draw) -> AddShard:
    tier = draw(st.sampled_from(["l1", "l2", "l3"]))
    legacy = tier == "l3" and draw(st.booleans())
    return AddShard(draw(names), tier, draw(counts), draw(counts),
                    () if legacy else tuple(draw(st.lists(st.integers(1, 64), max_size=8))),
                    (draw(counts), draw(counts)), draw(finite),
                    tuple(draw(st.lists(promoted, max_size=3))) if tier == "l2" else (),
                    draw(counts) if legacy else None)


actions = st.one_of(
    adds(), st.builds(RemoveShard, names),
    st.lists(st.tuples(names, finite), max_size=4).map(
        lambda kp: RecordReplays(tuple(k for k, _ in kp), tuple(p for _, p in kp))),
    st.lists(st.tuples(names, finite, finite), max_size=4).map(
        lambda kp: RecordReplays(tuple(k for k, _, _ in kp), tuple(p for _, p, _ in kp), tuple(q for *_, q in kp))),
    st.lists(st.tuples(names, finite, counts), max_size=4).map(
        lambda kp: RestoreReplays(tuple(k for k, _, _ in kp), tuple(p for _, p, _ in kp), tuple(n for *_, n in kp))),
    st.builds(MarkConsumed, names, counts, counts, counts), st.builds(Quarantine, names, st.text(max_size=40)))


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(entry=st.builds(LogEntry, st.integers(1, 2**40), finite, st.lists(actions, max_size=4).map(tuple),
                       st.none() | st.text(max_size=8), st.text(max_size=8)))
def test_every_entry_reads_back_as_written(entry):
    assert LogEntry.from_json(unseal(seal(entry.to_json()))) == entry
