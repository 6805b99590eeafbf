"""The commit-log reader against truncated, reordered and corrupted logs (property-based).

A real buffer log (entries 1..10, checkpoints 3, 6 and 9) is damaged in generated ways. Whatever
the damage, opening the log either fails with the log's own error naming a damaged file, or gives
the state the original commits give, up to some version, with the entries it could not use counted
as empty commits (quarantined, and reported by verify). The one damage a reader cannot see, a
well-formed checkpoint that disagrees with the entries before it, is reported by verify.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from rollout_factory import make_groups

from pipeline.buffer import ReplayBuffer
from pipeline.buffer.actions import LogEntry, Quarantine, UnknownAction
from pipeline.buffer.logfiles import (LOG_DIR, LOG_FORMAT, POINTER, CorruptLog, UnsupportedLogFormat, checkpoint_name,
                                      entry_name, seal, unseal)
from pipeline.buffer.state import BufferState
from pipeline.config import BufferConfig

N = 10  # entries in the original log
CHECKPOINTS = (3, 6, 9)
CONFIG = BufferConfig(checkpoint_interval=3)
PROPERTY = settings(max_examples=300, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow])


def _build(url: str) -> None:
    """Every kind of action: L1 adds, an L2 add with a consumed cursor, priorities, a compaction
    (removes + an L3 add), a consumed cursor alone."""
    buf = ReplayBuffer(url, CONFIG)
    with buf.writer("w") as w:
        for i in range(4):  # 1-4
            w.write(make_groups(f"s{i}", 2, rewards=[[0, 1, 0, 1]] * 2, seed=i))
            w.flush()
    table, cursor = buf.read_fresh(None, 4)
    buf.promote(table, cursor)  # 5
    buf.update_priorities(["s0-g0", "s0-g1"], [2.0, 0.5])  # 6
    buf.compact()  # 7
    with buf.writer("w") as w:
        w.write(make_groups("s4", 2, seed=4))  # 8
    _, cursor = buf.read_fresh(cursor, 10)
    buf.mark_consumed(cursor)  # 9
    buf.update_priorities(["s0-g0"], [1.5])  # 10
    assert buf.state.version == N and buf.log.checkpoint_versions() == list(CHECKPOINTS)
    assert buf.verify()["ok"]


class Original:
    """The undamaged log: its files and the state after each prefix of its entries."""

    def __init__(self, url: str):
        self.url = url
        self.dir = os.path.join(url, LOG_DIR)
        self.files = {n: open(os.path.join(self.dir, n), "rb").read() for n in os.listdir(self.dir)}
        self.docs = {v: unseal(self.files[entry_name(v)]) for v in range(1, N + 1)}

    def state(self, version: int, skipped: frozenset[int] = frozenset(), edited: dict | None = None) -> BufferState:
        """The state after entries 1..version, those in `skipped` counted as empty commits and
        those in `edited` replaced by their edited document."""
        docs = {**self.docs, **(edited or {})}
        s = BufferState()
        for v in range(1, version + 1):
            if v in skipped or v not in docs:
                entry = LogEntry(v, 0.0, (Quarantine(f"{LOG_DIR}/{entry_name(v)}", "x"),))
            else:
                entry = LogEntry.from_json(docs[v])
            s.apply(entry)
        return s


def canonical(s: BufferState) -> dict:
    d = json.loads(json.dumps(s.to_json()))
    d["quarantined"] = sorted(d["quarantined"])  # reasons carry the reader's error text
    return d


@pytest.fixture(scope="module")
def original(tmp_path_factory) -> Original:
    url = str(tmp_path_factory.mktemp("log") / "buffer")
    _build(url)
    return Original(url)


# damage ---------------------------------------------------------------------------------------
entries = st.integers(1, N)
checkpoints = st.sampled_from(CHECKPOINTS)
# the files an opening reader reads (pointer, checkpoint 9, entry 10) are drawn about half the time
log_files = st.one_of(st.sampled_from([POINTER, checkpoint_name(9), entry_name(N)]),
                      entries.map(entry_name), checkpoints.map(checkpoint_name))
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=6), kids, max_size=3),
    max_leaves=8)
REQUIRED = {"add": ["path", "tier", "rows", "bytes", "pv", "t", "gsizes", "ngroups", "groups"],
            "remove": ["path"], "prio": ["keys", "p"], "consumed": ["consumer", "cursor"]}

damages = st.one_of(
    st.tuples(st.just("truncate"), log_files, st.floats(0, 1, exclude_max=True)),
    st.tuples(st.just("replace"), log_files, st.floats(0, 1, exclude_max=True), st.binary(min_size=1, max_size=8)),
    st.tuples(st.just("digit"), log_files, st.floats(0, 1, exclude_max=True), st.integers(1, 9)),  # JSON stays valid
    st.tuples(st.just("swap"), entries, entries).filter(lambda d: d[1] != d[2]),
    st.tuples(st.just("delete"), entries),
    st.tuples(st.just("delete_checkpoint"), checkpoints),
    st.tuples(st.just("duplicate"), entries, st.integers(1, N + 1)).filter(lambda d: d[1] != d[2]),
    st.tuples(st.just("garbage"), log_files, json_values),
    st.tuples(st.just("drop"), entries, st.integers(0, 3), st.integers(0, 8), st.booleans()),
    st.tuples(st.just("retype"), entries, st.integers(0, 3), st.integers(0, 8), json_values, st.booleans()),
    st.tuples(st.just("drop_top"), entries, st.sampled_from(["v", "time", "actions"]), st.booleans()),
    st.tuples(st.just("newer"), st.one_of(entries.map(entry_name), checkpoints.map(checkpoint_name)), st.booleans()),
    st.tuples(st.just("unknown_op"), entries, st.booleans()),
    st.tuples(st.just("lying_checkpoint"), checkpoints, st.integers(0, N)),
    st.tuples(st.just("stale_checkpoint"), checkpoints, checkpoints).filter(lambda d: d[1] != d[2]),
    st.tuples(st.just("pointer"), st.integers(0, 2 * N)),
)


def _write(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def apply_damage(d: tuple, orig: Original, log_dir: str, edited: dict) -> set[str]:
    """Damage the copy of the log in `log_dir`; returns the names of the files it touched. An
    entry rewritten with an edited document goes into `edited` (version -> document)."""
    kind, path = d[0], lambda name: os.path.join(log_dir, name)
    if kind in ("truncate", "replace", "digit", "garbage"):
        name = d[1]
        if not os.path.exists(path(name)):
            return set()
        raw = open(path(name), "rb").read()
        if kind == "truncate":
            raw = raw[: int(len(raw) * d[2])]
        elif kind == "replace":
            at = int(len(raw) * d[2])
            raw = raw[:at] + d[3][: len(raw) - at] + raw[at + len(d[3]):]
        elif kind == "digit":  # the digit nearest a position, plus 1..9 modulo 10
            digits = [i for i, b in enumerate(raw) if chr(b).isdigit()]
            if not digits:
                return set()
            at = min(digits, key=lambda i: abs(i - len(raw) * d[2]))
            raw = raw[:at] + str((int(chr(raw[at])) + d[3]) % 10).encode() + raw[at + 1:]
        else:
            raw = json.dumps(d[2]).encode()
        _write(path(name), raw)
        return {name}
    if kind == "swap":
        a, b = path(entry_name(d[1])), path(entry_name(d[2]))
        if not (os.path.exists(a) and os.path.exists(b)):
            return set()
        ra, rb = open(a, "rb").read(), open(b, "rb").read()
        _write(a, rb)
        _write(b, ra)
        return {entry_name(d[1]), entry_name(d[2])}
    if kind in ("delete", "delete_checkpoint"):
        name = entry_name(d[1]) if kind == "delete" else checkpoint_name(d[1])
        if os.path.exists(path(name)):
            os.remove(path(name))
        return {name}
    if kind == "duplicate":
        _write(path(entry_name(d[2])), orig.files[entry_name(d[1])])
        return {entry_name(d[2])}
    if kind == "pointer":
        _write(path(POINTER), json.dumps({"v": d[1]}).encode())
        return {POINTER}
    if kind == "lying_checkpoint":  # well-formed, sealed, at its own number, but not what the entries give
        c, source = d[1], d[2] if d[2] != d[1] else d[1] - 1
        lie = orig.state(source).to_json()
        lie["version"] = c
        _write(path(checkpoint_name(c)), seal({"format": LOG_FORMAT, "v": c, "time": 0.0, "state": lie}))
        return {checkpoint_name(c)}
    if kind == "stale_checkpoint":
        _write(path(checkpoint_name(d[1])), orig.files[checkpoint_name(d[2])])
        return {checkpoint_name(d[1])}
    if kind == "newer" and d[1].endswith(".ckpt.json"):
        doc = unseal(orig.files[d[1]])
        doc["format"] = LOG_FORMAT + 1
        _write(path(d[1]), seal(doc) if d[2] else json.dumps(doc).encode())
        return {d[1]}
    # edits of one entry's document, written sealed (a writer's bug) or without a checksum (an
    # older writer): the document itself must be checked
    v = int(d[1][:20]) if kind == "newer" else d[1]
    doc = json.loads(json.dumps(orig.docs[v]))
    if kind in ("drop", "retype"):
        actions = doc["actions"]
        a = actions[d[2] % len(actions)]
        fields = REQUIRED.get(a["op"], ["path"])
        field = fields[d[3] % len(fields)]
        if kind == "drop":
            if field in ("gsizes", "ngroups", "groups") and field not in a:
                return set()
            a.pop(field, None)
        else:
            a[field] = d[4]
    elif kind == "drop_top":
        doc.pop(d[2])
    elif kind == "newer":
        doc["format"] = LOG_FORMAT + 1
    elif kind == "unknown_op":
        doc["actions"].append({"op": "split_shard", "path": "l1/x.parquet"})
    sealed = d[-1]
    _write(path(entry_name(v)), seal(doc) if sealed else json.dumps(doc).encode())
    edited[v] = doc
    return {entry_name(v)}


def _matches(got: dict, orig: Original, version: int, skipped: frozenset[int], edited: dict) -> bool:
    """`got` is the state the original entries give, the skipped ones counted as empty and the
    edited ones as edited where the reader read them: past the checkpoint it started from."""
    for start in (0, *CHECKPOINTS):
        try:
            want = orig.state(version, skipped, {v: doc for v, doc in edited.items() if v > start})
        except (ValueError, UnknownAction):  # an edit no reader may apply
            continue
        if canonical(want) == got:
            return True
    return False


def _same_document(raw: bytes, original: bytes) -> bool:
    """True when the damage left the document itself as it was (e.g. it renamed the checksum's key)."""
    try:
        return unseal(raw) == unseal(original)
    except ValueError:
        return False


def _fresh_copy(orig: Original) -> tuple[str, str]:
    tmp = tempfile.mkdtemp(prefix="logprop-")
    url = os.path.join(tmp, "buffer")
    shutil.copytree(orig.url, url)
    return tmp, url


def check_damaged_log(orig: Original, damage: list[tuple]) -> None:
    tmp, url = _fresh_copy(orig)
    try:
        log_dir = os.path.join(url, LOG_DIR)
        touched: set[str] = set()
        edited: dict[int, dict] = {}
        for d in damage:
            touched |= apply_damage(d, orig, log_dir, edited)
        buf = ReplayBuffer(url, CONFIG)
        try:
            state = buf.refresh()
        except (CorruptLog, UnsupportedLogFormat) as e:
            assert any(name in str(e) for name in touched), f"error names no damaged file: {e}"
            return
        buf.stats()  # an accepted state is usable: no field of a wrong type got in
        if POINTER not in touched:  # a reader never ends up behind the checkpoint the log names
            assert state.version >= max(CHECKPOINTS), f"state at {state.version}, behind {POINTER}"
        skipped = frozenset(int(p[len(LOG_DIR) + 1:][:20]) for p in state.quarantined if p.startswith(LOG_DIR))
        assert {entry_name(v) for v in skipped} <= touched, "an undamaged entry was quarantined"
        present = sorted(int(n[:20]) for n in os.listdir(log_dir) if n.endswith(".json") and ".ckpt" not in n)
        report = buf.verify()
        problems = "\n".join(report["problems"])
        if not _matches(canonical(state), orig, state.version, skipped, edited):
            # a reader cannot tell a well-formed checkpoint from the truth: verify must
            assert any(d[0] == "lying_checkpoint" for d in damage), "state differs from what the commits give"
            assert not report["ok"], "a checkpoint that disagrees with the entries was not reported"
            return
        for v in skipped:
            assert entry_name(v) in problems, f"quarantined entry {v} not reported by verify"
        if skipped or any(v > state.version for v in present):  # commits lost, or entries past a gap
            assert not report["ok"], "lost commits not reported by verify"
        for d in damage:  # a checkpoint verify cannot read is named, whether the reader needed it or not
            name = d[1] if d[0] in ("truncate", "replace", "digit", "garbage", "newer") else \
                checkpoint_name(d[1]) if d[0] == "stale_checkpoint" else ""
            if name.endswith(".ckpt.json") and os.path.exists(os.path.join(log_dir, name)) and \
                    not _same_document(open(os.path.join(log_dir, name), "rb").read(), orig.files[name]):
                assert name in problems, f"damaged checkpoint {name} not reported by verify"
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@PROPERTY
@given(damage=st.lists(damages, min_size=1, max_size=3))
@example(damage=[("digit", entry_name(10), 0.9, 1)])  # a changed digit: the checksum, not the JSON, sees it
@example(damage=[("swap", 9, 10)])  # reordered entries
@example(damage=[("drop", 10, 0, 0, False)])  # an action without a field (no KeyError)
@example(damage=[("garbage", checkpoint_name(9), [1])])  # a checkpoint that is a JSON list
@example(damage=[("garbage", POINTER, "{")])  # a torn pointer
@example(damage=[("lying_checkpoint", 9, 5)])
@example(damage=[("truncate", checkpoint_name(9), 0.5), ("delete", 2)])  # history lost: a clear error
def test_damaged_log_gives_a_clear_error_or_the_state_of_its_good_commits(original, damage):
    check_damaged_log(original, damage)


def test_undamaged_log_opens_from_its_checkpoint_to_the_state_its_entries_give(original):
    tmp, url = _fresh_copy(original)
    try:
        buf = ReplayBuffer(url, CONFIG)
        assert canonical(buf.refresh()) == canonical(original.state(N))
        assert buf.log.files_read == 1 + 1  # checkpoint 9 and entry 10
        assert buf.verify()["ok"]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# regressions: one plain test per bug the property found ----------------------------------------
@pytest.fixture
def log_copy(original):
    tmp, url = _fresh_copy(original)
    yield url, os.path.join(url, LOG_DIR)
    shutil.rmtree(tmp, ignore_errors=True)


def test_entry_with_a_changed_digit_fails_its_checksum_and_is_quarantined(original, log_copy):
    url, d = log_copy
    raw = original.files[entry_name(10)]
    assert b'"p": [1.5]' in raw
    _write(os.path.join(d, entry_name(10)), raw.replace(b'"p": [1.5]', b'"p": [1.6]'))  # still valid JSON
    buf = ReplayBuffer(url, CONFIG)
    state = buf.refresh()
    reason = state.quarantined[f"{LOG_DIR}/{entry_name(10)}"]
    assert "changed commit-log entry" in reason and "checksum" in reason
    assert canonical(state) == canonical(original.state(N, frozenset({10})))
    assert not buf.verify()["ok"]


def test_swapped_entries_are_quarantined_not_replayed_out_of_order(original, log_copy):
    url, d = log_copy
    _write(os.path.join(d, entry_name(9)), original.files[entry_name(10)])
    _write(os.path.join(d, entry_name(10)), original.files[entry_name(9)])
    state = ReplayBuffer(url, CONFIG).refresh()  # from checkpoint 9: reads entry 10, which holds entry 9
    assert "misplaced commit-log entry (it is entry 9" in state.quarantined[f"{LOG_DIR}/{entry_name(10)}"]


def test_action_missing_a_field_is_quarantined_not_a_key_error(original, log_copy):
    url, d = log_copy
    doc = dict(original.docs[10])
    doc["actions"] = [{"op": "prio", "keys": ["s0-g0"]}]  # no "p"
    _write(os.path.join(d, entry_name(10)), json.dumps(doc).encode())
    state = ReplayBuffer(url, CONFIG).refresh()
    assert "malformed commit-log entry (action 0 (prio) has no 'p')" in state.quarantined[f"{LOG_DIR}/{entry_name(10)}"]
    assert canonical(state) == canonical(original.state(N, frozenset({10})))


def test_entry_that_is_not_a_json_object_is_quarantined(log_copy):
    url, d = log_copy
    _write(os.path.join(d, entry_name(10)), b"[1]")
    state = ReplayBuffer(url, CONFIG).refresh()
    assert "torn commit-log entry (a JSON list" in state.quarantined[f"{LOG_DIR}/{entry_name(10)}"]


def test_unknown_action_is_an_upgrade_error_naming_the_entry(original, log_copy):
    url, d = log_copy
    doc = dict(original.docs[10])
    doc["actions"] = doc["actions"] + [{"op": "split_shard"}]
    _write(os.path.join(d, entry_name(10)), seal(doc))
    with pytest.raises(UnsupportedLogFormat, match=f"{entry_name(10)}.*'split_shard'.*upgrade"):
        ReplayBuffer(url, CONFIG).refresh()


def test_torn_checkpoint_is_replayed_from_the_entries_and_reported(original, log_copy):
    url, d = log_copy
    _write(os.path.join(d, checkpoint_name(9)), original.files[checkpoint_name(9)][:100])
    buf = ReplayBuffer(url, CONFIG)
    assert canonical(buf.refresh()) == canonical(original.state(N))
    report = buf.verify()
    assert not report["ok"] and any(checkpoint_name(9) in p and "torn checkpoint" in p for p in report["problems"])


def test_checkpoint_holding_another_version_is_not_loaded(original, log_copy):
    url, d = log_copy
    _write(os.path.join(d, checkpoint_name(9)), original.files[checkpoint_name(3)])
    buf = ReplayBuffer(url, CONFIG)
    assert canonical(buf.refresh()) == canonical(original.state(N))
    assert any("misplaced checkpoint" in p for p in buf.verify()["problems"])


def test_unusable_checkpoint_whose_entries_are_gone_is_a_clear_error(log_copy):
    """Before: the reader silently started from an empty state at version 0 (and a writer would
    then have committed a second entry 1)."""
    url, d = log_copy
    os.remove(os.path.join(d, checkpoint_name(9)))
    for v in range(1, 9):
        os.remove(os.path.join(d, entry_name(v)))
    with pytest.raises(CorruptLog, match=f"{checkpoint_name(9)}.*entry 1 .*gone.*restore"):
        ReplayBuffer(url, CONFIG).refresh()


def test_torn_pointer_falls_back_to_the_newest_checkpoint_and_is_reported(original, log_copy):
    url, d = log_copy
    _write(os.path.join(d, POINTER), b'{"v": ')
    buf = ReplayBuffer(url, CONFIG)
    assert canonical(buf.refresh()) == canonical(original.state(N))
    assert buf.log.files_read == 2  # checkpoint 9 (found by listing) and entry 10
    assert any(POINTER in p and "unreadable" in p for p in buf.verify()["problems"])


def test_verify_reports_a_checkpoint_that_disagrees_with_its_entries(original, log_copy):
    url, d = log_copy
    lie = original.state(8).to_json()
    lie["version"] = 9
    _write(os.path.join(d, checkpoint_name(9)), seal({"format": LOG_FORMAT, "v": 9, "time": 0.0, "state": lie}))
    problems = ReplayBuffer(url, CONFIG).verify()["problems"]
    assert any(checkpoint_name(9) in p and "differs from the state its entries give" in p for p in problems)


def test_vacuum_keeps_the_entries_under_a_checkpoint_it_cannot_read(original, log_copy, monkeypatch):
    monkeypatch.setattr("pipeline.buffer.vacuum.MIN_LOG_RETENTION_S", 0.0)
    url, d = log_copy
    _write(os.path.join(d, checkpoint_name(9)), b"")
    buf = ReplayBuffer(url, CONFIG)
    assert buf.vacuum(grace_s=0, log_retention_s=0)["log_entries_deleted"] == 0
    assert canonical(ReplayBuffer(url, CONFIG).refresh()) == canonical(original.state(N))


def test_entries_and_checkpoints_without_a_checksum_are_read_as_before(original, log_copy):
    url, d = log_copy
    for name, raw in original.files.items():
        if name.endswith(".json"):
            _write(os.path.join(d, name), json.dumps(unseal(raw)).encode())
    buf = ReplayBuffer(url, CONFIG)
    assert canonical(buf.refresh()) == canonical(original.state(N))
    assert buf.verify()["ok"]


def test_an_appender_whose_state_lags_does_not_read_its_own_entries_back(tmp_path):
    from pipeline.buffer.actions import AddShard
    from pipeline.buffer.log import CommitLog
    from pipeline.storage import url_to_fs

    fs, root = url_to_fs(str(tmp_path / "buffer"))
    mine, other = CommitLog(fs, root, writer="a"), CommitLog(fs, root, writer="b")

    def add(log: CommitLog, name: str) -> int:
        return log.commit([AddShard(f"l1/{name}.parquet", "l1", 2, 10, (2,), (0, 0), 0.0)])

    assert add(mine, "a1") == 1 and add(other, "b1") == 2
    assert add(mine, "a2") == 3  # past its state (version 1): entry 2 is not read yet
    before = mine.files_read
    mine.refresh()
    assert mine.files_read - before == 1  # entry 2 only
    assert mine.state.version == 3
    assert {"l1/a1.parquet", "l1/b1.parquet", "l1/a2.parquet"} <= set(mine.state.shards)
