"""Many writer processes, readers killed and restarted, writers killed at random instants.

These start real processes (and, for S3, moto's server) and take tens of seconds.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
from rollout_factory import make_groups
from spawner import Spawner

from pipeline.buffer import ReplayBuffer

WORKER = str(Path(__file__).parent / "buffer_worker.py")
ROOT = str(Path(__file__).resolve().parents[2])


def _env():
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)


def _start(spawn: Spawner, *args) -> subprocess.Popen:
    return spawn([sys.executable, WORKER, *map(str, args)], env=_env(), cwd=ROOT,
                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _finish(procs, timeout=120):
    for p in procs:
        try:
            _, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            raise
        assert p.returncode == 0, err.decode()[-2000:]


def _read_ids(state_dir: Path) -> list[str]:
    return (state_dir / "ids.txt").read_text().splitlines()


def _writers_and_readers(spawn: Spawner, url: str, tmp_path: Path, writers: int, shards: int, groups: int,
                         reader_kills: int) -> None:
    total = writers * shards * groups
    readers = [tmp_path / f"reader{i}" for i in range(2)]
    for d in readers:
        d.mkdir()
    wprocs = [_start(spawn, "write", url, f"w{i}", shards, groups, tmp_path / f"w{i}.ack") for i in range(writers)]
    rprocs = [_start(spawn, "read", url, d, total, i) for i, d in enumerate(readers)]
    # a trainer killed and restarted, several times: reader 0 is SIGKILLed and resumed from its checkpoint
    rng = random.Random(0)
    for _ in range(reader_kills):
        time.sleep(rng.uniform(0.5, 2.0))
        if rprocs[0].poll() is None:
            rprocs[0].send_signal(signal.SIGKILL)
            rprocs[0].wait()
            rprocs[0] = _start(spawn, "read", url, readers[0], total, 100 + _)
    _finish(wprocs)
    _finish(rprocs)
    expected = {f"w{w}-{s}-g{g}" for w in range(writers) for s in range(shards) for g in range(groups)}
    orders = []
    for d in readers:
        ids = _read_ids(d)
        assert len(ids) == len(set(ids)) == total, "duplicated or lost groups"
        assert set(ids) == expected
        # each writer's shards arrive in the order it committed them
        for w in range(writers):
            mine = [int(i.split("-")[1]) for i in ids if i.startswith(f"w{w}-")]
            assert mine == sorted(mine)
        orders.append(ids)
    assert orders[0] == orders[1], "two readers saw different commit orders"
    buf = ReplayBuffer(url)
    st = buf.stats()
    assert st["tiers"]["l1"]["groups"] == total and st["version"] >= 1
    report = buf.verify()
    assert report["ok"], report["problems"]


@pytest.mark.integration
def test_8_writer_processes_2_readers_local_disk(tmp_path, spawn):
    """8 x 250 = 2,000 commits (one per shard) while two readers consume; one reader is killed
    and resumed 3 times. Zero lost, zero duplicated, same order for both readers."""
    _writers_and_readers(spawn, str(tmp_path / "buffer"), tmp_path, writers=8, shards=250, groups=2, reader_kills=3)


@pytest.mark.integration
def test_8_writer_processes_2_readers_s3(tmp_path, s3_url, spawn):
    """The same on S3 (conditional PUTs against moto's server, which shares this machine's cores
    with the ten client processes): 8 x 125 = 1,000 commits, one reader killed and resumed 3 times."""
    _writers_and_readers(spawn, s3_url, tmp_path, writers=8, shards=125, groups=2, reader_kills=3)


def test_8_writer_threads_2_readers_memory(tmp_path):
    """memory:// lives in one process: the same protocol exercised by threads with separate handles."""
    url = f"memory://buffers/{uuid.uuid4().hex}"
    writers, shards, total = 8, 40, 8 * 40 * 2
    seen: list[list[str]] = [[], []]

    def write(i):
        with ReplayBuffer(url).writer(f"w{i}") as w:
            for s in range(shards):
                w.write(make_groups(f"w{i}-{s}", 2, group_size=2, seed=s, response_len=4))
                w.flush()

    def read(i):
        buf, cursor, deadline = ReplayBuffer(url), None, time.time() + 60
        while len(seen[i]) < total and time.time() < deadline:
            table, cursor = buf.read_fresh(cursor, 3)
            seen[i].extend(dict.fromkeys(table.column("group_id").to_pylist()))
            if table.num_rows == 0:
                time.sleep(0.005)

    threads = [threading.Thread(target=write, args=(i,)) for i in range(writers)]
    threads += [threading.Thread(target=read, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(seen[0]) == len(set(seen[0])) == total
    assert seen[0] == seen[1]


def _kill_writers_repeatedly(spawn: Spawner, url: str, tmp_path: Path, kills: int, window_s: float) -> None:
    rng = random.Random(1)
    ack = tmp_path / "acks.txt"
    for k in range(kills):
        p = _start(spawn, "write", url, f"k{k}", 10_000, 3, ack)
        deadline = time.time() + 60
        while f"attempt k{k}-0" not in (ack.read_text() if ack.exists() else "") and time.time() < deadline:
            time.sleep(0.02)  # the process is up and writing
        time.sleep(rng.uniform(0.0, window_s))  # then die at a random phase of a commit
        p.send_signal(signal.SIGKILL)
        p.wait()
    lines = ack.read_text().splitlines()
    attempted = {ln.split()[1] for ln in lines if ln.startswith("attempt ")}
    acked = {ln.split()[1] for ln in lines if ln.startswith("ack ")}
    buf = ReplayBuffer(url)
    report = buf.verify()
    assert report["ok"], report["problems"]  # no partial or missing shard is committed
    table, _ = buf.read_fresh(None, 10**9)
    gids = table.column("group_id").to_pylist()
    committed = {g.rsplit("-g", 1)[0] for g in gids}
    assert acked <= committed <= attempted  # acknowledged commits are durable, nothing invented
    for prefix in committed:  # every committed shard is whole: 3 groups of 2 rows
        assert [gids.count(f"{prefix}-g{i}") for i in range(3)] == [2, 2, 2], prefix
    stats = buf.stats()["tiers"]["l1"]
    assert stats["rows"] == table.num_rows == len(committed) * 6  # nothing counted that cannot be read
    vacuumed = buf.vacuum(grace_s=0)
    # leftovers of killed writers are removed, committed data untouched
    assert buf.verify()["ok"] and ReplayBuffer(url).read_fresh(None, 10**9)[0].num_rows == table.num_rows
    assert len(acked) > 0 and vacuumed["orphans_kept_young"] == 0


@pytest.mark.integration
def test_writers_killed_at_random_points_leave_nothing_partial_local(tmp_path, spawn):
    _kill_writers_repeatedly(spawn, str(tmp_path / "buffer"), tmp_path, kills=12, window_s=0.5)


@pytest.mark.integration
def test_writers_killed_at_random_points_leave_nothing_partial_s3(tmp_path, s3_url, spawn):
    _kill_writers_repeatedly(spawn, s3_url, tmp_path, kills=6, window_s=1.5)
