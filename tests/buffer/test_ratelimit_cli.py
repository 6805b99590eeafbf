"""Flow control for the sampler, and the `rlhf buffer` commands."""

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from rollout_factory import make_groups

from pipeline.buffer import ReplayBuffer
from pipeline.buffer.cli import add_parser
from pipeline.config import BufferConfig


def _write(buf, n, groups=2):
    with buf.writer("w") as w:
        for i in range(n):
            w.write(make_groups(f"s{i}", groups, seed=i))


def test_fresh_backlog_bound_blocks_until_the_trainer_consumes(buffer_url):
    buf = ReplayBuffer(buffer_url, BufferConfig(max_fresh_backlog=4))
    lim = buf.rate_limiter()
    assert lim.blocked_by(2) is None
    _write(buf, 2)
    reason = lim.blocked_by(2)
    assert reason is not None and "max_fresh_backlog=4" in reason
    _, cursor = buf.read_fresh(None, 2)
    buf.mark_consumed(cursor)
    assert lim.blocked_by(2) is None


def test_a_sampler_held_a_minute_by_a_bound_of_the_rate_limiter_logs_the_bound_once(buffer_url, caplog):
    from types import SimpleNamespace

    from pipeline.sampler.loop import NAME_WAIT_S, Sampler

    buf = ReplayBuffer(buffer_url, BufferConfig(max_fresh_backlog=4))
    _write(buf, 2)
    s = object.__new__(Sampler)  # the state throttled() reads, around a real buffer
    s.cfg = SimpleNamespace(sampler=SimpleNamespace(prompts_per_batch=2, max_staleness=1, fixed_lag=False))
    s._stale_at, s.version, s.sampler_id = None, 0, "sampler-0"
    s.claims, s.ahead = SimpleNamespace(alone=True), lambda draw=None: 0
    s.limiter, s.waited, s._named = buf.rate_limiter(), 0.0, None
    buf.refresh()
    with caplog.at_level("INFO", logger="rlhf.sampler"):
        assert s.throttled() and not caplog.records  # a short wait is not worth a line
        s.waited = NAME_WAIT_S
        assert s.throttled() and s.throttled()
    [line] = [r.getMessage() for r in caplog.records]
    assert line == ("sampler sampler-0: waiting 60 s so far on the buffer's max_fresh_backlog=4: "
                    "4 groups not yet consumed")


def test_l1_row_bound_blocks_until_the_trainer_records_that_it_consumed(buffer_url):
    """The bound counts rows not yet consumed: nothing compacts while a run trains (finalize does),
    so a bound on all of L1 would hold a long run's sampler for ever."""
    buf = ReplayBuffer(buffer_url, BufferConfig(l1_max_rows=16))
    lim = buf.rate_limiter()
    _write(buf, 1)
    rows = buf.read_fresh(None, 2)[0].num_rows
    assert 0 < rows < 16 and not lim.l1_full()
    _write(buf, -(-16 // rows) - 1)
    assert lim.l1_full() and "l1_max_rows=16" in lim.blocked_by(1)
    _, cursor = buf.read_fresh(None, 10_000)
    assert lim.blocked_by(1) is not None  # read, but not recorded as consumed
    buf.mark_consumed(cursor)
    assert lim.blocked_by(1) is None and not lim.l1_full()
    assert buf.stats()["tiers"]["l1"]["rows"] >= 16  # consumed shards stay in L1 until compaction
    _write(buf, -(-16 // rows))  # a full bound's worth more: held again, as unconsumed rows
    assert lim.l1_full()


def test_samples_per_insert_counts_fresh_and_replayed_groups(buffer_url):
    cfg = BufferConfig(samples_per_insert=2.0, rate_error_groups=2)
    buf = ReplayBuffer(buffer_url, cfg)
    lim = buf.rate_limiter()
    _write(buf, 1)  # 2 groups inserted, 0 sampled: 2*2 - 0 = 4 <= 2*2
    assert lim.blocked_by(1) is not None  # (3*2 - 0) > 4
    table, cursor = buf.read_fresh(None, 2)
    buf.promote(make_groups("r", 2, rewards=[[0, 1, 0, 1]] * 2), cursor=cursor)  # 2 fresh samples
    assert lim.blocked_by(1) is None  # 3*2 - 2 = 4: at the slack, allowed
    assert lim.blocked_by(2) is not None  # 4*2 - 2 = 6 > 4
    batch = buf.sample_replay(2, step=0, rng_seed=0)
    buf.update_priorities(batch.keys, [1.0, 1.0])  # 2 replays: samples = 4
    assert lim.blocked_by(2) is None  # 8 - 4 = 4


def test_wait_to_insert_returns_once_allowed_and_times_out_with_the_reason(buffer_url):
    buf = ReplayBuffer(buffer_url, BufferConfig(max_fresh_backlog=2))
    _write(buf, 1)
    lim = buf.rate_limiter()
    with pytest.raises(TimeoutError, match="max_fresh_backlog=2"):
        lim.wait_to_insert(2, timeout_s=0.2, poll_s=0.05)

    def consume():
        time.sleep(0.3)
        _, cursor = ReplayBuffer(buffer_url).read_fresh(None, 2)
        ReplayBuffer(buffer_url).mark_consumed(cursor)

    if buffer_url.startswith("memory://"):
        consume()
    else:
        threading.Thread(target=consume).start()
    waited = lim.wait_to_insert(2, timeout_s=10, poll_s=0.05)
    assert lim.blocked_by(2) is None and waited < 10


def rlhf(argv: list[str]) -> int:
    """`rlhf buffer ...` through the command group's own parser (the full CLI imports the engine)."""
    parser = argparse.ArgumentParser(prog="rlhf")
    add_parser(parser.add_subparsers(dest="cmd", required=True))
    args = parser.parse_args(argv)
    return args.fn(args)


def test_cli_stats_verify_compact_vacuum(tmp_path, capsys):
    url = str(tmp_path / "buffer")
    buf = ReplayBuffer(url)
    _write(buf, 3)
    assert rlhf(["buffer", "stats", url]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["tiers"]["l1"]["groups"] == 6 and stats["l1_staleness_rows"] == {"0": 24}
    assert rlhf(["buffer", "verify", url]) == 0
    capsys.readouterr()
    assert rlhf(["buffer", "compact", url, "--all"]) == 0
    assert json.loads(capsys.readouterr().out)["l1_shards_in"] == 3
    assert rlhf(["buffer", "vacuum", url, "--grace-s", "0"]) == 0
    assert json.loads(capsys.readouterr().out)["orphans_deleted"] == 3
    # a damaged archive file makes verify fail with its path
    l3 = buf.refresh().tier_shards("l3")[0].path
    (tmp_path / "buffer" / l3).write_bytes(b"garbage")
    assert rlhf(["buffer", "verify", url]) == 1
    assert l3 in capsys.readouterr().err



def test_cli_gc_is_the_vacuum_command_under_its_earlier_name(tmp_path, capsys):
    url = str(tmp_path / "buffer")
    _write(ReplayBuffer(url), 2)
    assert rlhf(["buffer", "compact", url, "--all"]) == 0
    capsys.readouterr()
    assert rlhf(["buffer", "gc", url, "--grace-s", "0"]) == 0
    assert json.loads(capsys.readouterr().out)["orphans_deleted"] == 2

@pytest.mark.integration
def test_rlhf_console_runs_buffer_commands(tmp_path):
    url = str(tmp_path / "run-1" / "buffer")
    _write(ReplayBuffer(url), 2)
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-m", "pipeline", "buffer", "stats", url], cwd=root, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["tiers"]["l1"]["shards"] == 2
    shard = ReplayBuffer(url).refresh().tier_shards("l1")[0].path
    (tmp_path / "run-1" / "buffer" / shard).write_bytes(b"x")
    out = subprocess.run([sys.executable, "-m", "pipeline", "buffer", "verify", url], cwd=root, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and shard in out.stderr


@pytest.mark.parametrize("cmd", ["stats", "verify", "compact", "vacuum", "gc"])
def test_buffer_commands_on_a_path_without_a_buffer_fail_naming_the_path(tmp_path, cmd):
    from pipeline.config import ConfigError

    missing = tmp_path / "nonexistent"
    unrelated = tmp_path / "unrelated"
    unrelated.mkdir()
    (unrelated / "notes.txt").write_text("not a buffer")
    for url in (str(missing), f"file://{missing}", str(unrelated)):
        with pytest.raises(ConfigError) as e:
            rlhf(["buffer", cmd, url])
        assert url.removeprefix("file://") in str(e.value) and "no buffer" in str(e.value)
    assert not missing.exists()  # compact and vacuum wrote nothing there either
    assert sorted(p.name for p in unrelated.iterdir()) == ["notes.txt"]


def test_buffer_of_a_run_directory_before_the_first_commit_is_empty_not_an_error(tmp_path, capsys):
    from pipeline.config import parse_config
    from pipeline.rundir import RunDir

    RunDir(str(tmp_path / "run-1")).create(parse_config({}))
    assert rlhf(["buffer", "stats", str(tmp_path / "run-1")]) == 0
    assert json.loads(capsys.readouterr().out)["version"] == 0


@pytest.mark.integration
def test_rlhf_console_buffer_verify_of_a_missing_path_exits_non_zero_with_one_line(tmp_path):
    url = f"file://{tmp_path}/nonexistent"
    root = str(Path(__file__).resolve().parents[2])
    out = subprocess.run([sys.executable, "-m", "pipeline", "buffer", "verify", url], cwd=root,
                         env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and f"{tmp_path}/nonexistent" in lines[0]


@pytest.mark.parametrize("cmd", ["stats", "compact", "vacuum"])
def test_buffer_commands_on_a_log_from_a_newer_version_fail_in_one_line(tmp_path, cmd):
    from pipeline.buffer.logfiles import LOG_DIR, entry_name, seal, unseal
    from pipeline.config import ConfigError

    url = str(tmp_path / "buffer")
    _write(ReplayBuffer(url), 2)
    # the newest entry (the writer may commit both shards in one entry under load)
    entry = max((tmp_path / "buffer" / LOG_DIR).glob("[0-9]*.json"))
    assert entry.name in {entry_name(1), entry_name(2)}
    doc = unseal(entry.read_bytes())
    entry.write_bytes(seal({**doc, "actions": doc["actions"] + [{"op": "split_shard"}]}))
    with pytest.raises(ConfigError, match=f"buffer {url}: .*'split_shard'.*upgrade"):
        rlhf(["buffer", cmd, url])
