"""Replay-buffer benchmark: prints ONE JSON line.

Measured side by side in the same run, on the same storage (a temporary folder on local disk
unless --dir is given), interleaving the two sides round by round so that load from other
processes hits both alike:

- write_ratio: rows/s of the buffer's write path (asynchronous writer: zstd Parquet data file and
  create-only log entry, default settings) / rows/s of plain `pyarrow.parquet.write_table` of the
  same shards (zstd, no commit). Goal >= 0.8. write_ratio_fsync: the same with `fsync=True`
  (durable across a machine crash), against the same plain writes.
- read_ratio: rows/s of `read_fresh` (16 groups per call, like a trainer) from a fresh handle /
  rows/s of `pyarrow.parquet.read_table` of the plain files. Goal >= 0.8.
- commit_p50_ms / commit_p99_ms: one shard written and flushed (data file + log entry), one by one.
- visible_p50_ms: from a commit returning to a polling reader (5 ms poll) returning its rows;
  end_to_end_p50_ms: from `write()` being called to the same.
- open_s: seconds to open a buffer (checkpoint + entries after it) whose log holds 100, 10k and
  100k commits, built through the real commit function with a realistic mix (sampler adds, trainer
  consumption, compaction every 50 commits; checkpoint every 64). Built on /dev/shm when present: building 100k
  fsync'ed entries on disk alone would take minutes.

    .venv/bin/python bench/buffer.py [--shards 120] [--dir /path]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

from pipeline.buffer import ReplayBuffer  # noqa: E402
from pipeline.buffer.actions import AddShard, MarkConsumed, RemoveShard  # noqa: E402
from pipeline.buffer.log import CommitLog  # noqa: E402
from pipeline.buffer.schema import ROLLOUT_SCHEMA  # noqa: E402
from pipeline.config import BufferConfig  # noqa: E402
from pipeline.storage import url_to_fs  # noqa: E402

GROUPS, GROUP_SIZE, PROMPT, RESPONSE = 16, 8, 32, 64
CHECKPOINT_INTERVAL = 64  # not a divisor of 100/10k/100k: each opened log ends with entries past its checkpoint


def make_shard(i: int, rng: np.random.Generator) -> pa.Table:
    """One sampler batch: 16 groups of 8 completions, 32 prompt and 64 response tokens."""
    n = GROUPS * GROUP_SIZE
    gid = [f"s{i}-g{g}" for g in range(GROUPS) for _ in range(GROUP_SIZE)]
    prompts = rng.integers(0, 32000, (GROUPS, PROMPT), dtype=np.int32).repeat(GROUP_SIZE, axis=0)
    resp = rng.integers(0, 32000, (n, RESPONSE), dtype=np.int32)
    lp = -rng.random((n, RESPONSE), dtype=np.float32)

    def lists(a, typ):
        return pa.ListArray.from_arrays(pa.array(np.arange(0, a.size + 1, a.shape[1], dtype=np.int32)),
                                        pa.array(a.reshape(-1), typ))

    now = datetime.now(timezone.utc)
    cols = {
        "sample_id": [f"s{i}-{k}" for k in range(n)], "prompt_id": [g.rsplit("-", 1)[0] for g in gid],
        "group_id": gid, "data_source": ["bench"] * n, "prompt_token_ids": lists(prompts, pa.int32()),
        "response_token_ids": lists(resp, pa.int32()), "response_text": [" ".join(map(str, r[:16])) for r in resp],
        "behavior_logprobs": lists(lp, pa.float32()), "reward": pa.array(rng.random(n, dtype=np.float32)),
        "token_rewards": pa.nulls(n, pa.list_(pa.float32())), "reward_extra": pa.nulls(n, pa.string()),
        "finish_reason": ["length"] * n, "policy_version": pa.array(np.full(n, i // 10, np.int64)),
        "sampler_id": ["bench"] * n, "created_at": pa.array([now] * n, pa.timestamp("us", tz="UTC")),
        "content_hash": [f"{i:08d}{k:08d}" for k in range(n)], "tier": ["l1"] * n,
        "replay_count": pa.array(np.zeros(n, np.int32)), "priority": pa.array(np.ones(n, np.float32)),
    }
    return pa.table(cols, schema=ROLLOUT_SCHEMA)


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.array(xs), q))


def _write_plain(shards, folder: Path) -> float:
    folder.mkdir()
    t0 = time.perf_counter()
    for i, t in enumerate(shards):
        pq.write_table(t, folder / f"{i:05d}.parquet", compression="zstd")
    return time.perf_counter() - t0


def _write_buffer(shards, folder: Path, fsync: bool) -> float:
    t0 = time.perf_counter()
    buf = ReplayBuffer(str(folder), BufferConfig(fsync=fsync))
    with buf.writer("bench") as w:
        for t in shards:
            w.write(t)
    return time.perf_counter() - t0


def _read_plain(folder: Path, n: int) -> tuple[float, int]:
    t0 = time.perf_counter()
    rows = sum(pq.read_table(folder / f"{i:05d}.parquet").num_rows for i in range(n))
    return time.perf_counter() - t0, rows


def _read_buffer(folder: Path) -> tuple[float, int]:
    t0 = time.perf_counter()
    reader, cursor, rows = ReplayBuffer(str(folder)), None, 0
    while True:
        table, cursor = reader.read_fresh(cursor, 16)
        if table.num_rows == 0:
            return time.perf_counter() - t0, rows
        rows += table.num_rows


def bench_throughput(shards: list[pa.Table], base: Path, rounds: int) -> dict:
    """Each round writes (and reads back) the same shards three ways, in a rotating order:
    plain pyarrow, the buffer (default settings) and the buffer with fsync."""
    rows = sum(t.num_rows for t in shards)
    t: dict[str, list[float]] = {k: [] for k in ("plain_w", "ours_w", "fsync_w", "plain_r", "ours_r")}
    mb = 0.0
    for r in range(rounds):
        d = base / f"round{r}"
        d.mkdir()
        steps = [("plain_w", lambda: _write_plain(shards, d / "plain")),
                 ("ours_w", lambda: _write_buffer(shards, d / "buf", False)),
                 ("fsync_w", lambda: _write_buffer(shards, d / "buf_fsync", True))]
        for name, fn in steps[r % 3:] + steps[: r % 3]:
            t[name].append(fn())
        mb = ReplayBuffer(str(d / "buf")).stats()["tiers"]["l1"]["bytes"] / 1e6
        reads = [("plain_r", lambda: _read_plain(d / "plain", len(shards))), ("ours_r", lambda: _read_buffer(d / "buf"))]
        for name, fn in reads if r % 2 == 0 else reads[::-1]:
            secs, got = fn()
            assert got == rows, (name, got, rows)
            t[name].append(secs)
        shutil.rmtree(d)
    med = statistics.median

    def ratio(a, b):  # throughput of b relative to a, per round, then the median
        return round(med([x / y for x, y in zip(t[a], t[b])]), 3)

    return {"write_ratio": ratio("plain_w", "ours_w"), "read_ratio": ratio("plain_r", "ours_r"),
            "write_ratio_fsync": ratio("plain_w", "fsync_w"),
            "write_rows_per_s": round(rows / med(t["ours_w"])), "plain_write_rows_per_s": round(rows / med(t["plain_w"])),
            "write_mb_per_s": round(mb / med(t["ours_w"]), 2),
            "read_rows_per_s": round(rows / med(t["ours_r"])), "plain_read_rows_per_s": round(rows / med(t["plain_r"])),
            "rows": rows, "shards": len(shards), "data_mb": round(mb, 2), "rounds": rounds}


def bench_latency(shards: list[pa.Table], base: Path, n: int) -> dict:
    url = str(base / "latency")
    buf = ReplayBuffer(url)
    committed: dict[str, float] = {}
    called: dict[str, float] = {}
    seen: dict[str, float] = {}
    lat: list[float] = []
    done = threading.Event()

    def poll():
        reader, cursor = ReplayBuffer(url), None
        while not done.is_set() or reader.fresh_backlog(cursor):
            table, cursor = reader.read_fresh(cursor, 10**6)
            now = time.perf_counter()
            for g in set(table.column("group_id").to_pylist()):
                seen.setdefault(g.split("-")[0], now)
            if table.num_rows == 0:
                time.sleep(0.005)

    th = threading.Thread(target=poll)
    th.start()
    with buf.writer("bench") as w:
        for i in range(n):
            t = shards[i % len(shards)]
            t = t.set_column(2, "group_id", pa.array([f"L{i}-{g.split('-', 1)[1]}" for g in t.column("group_id").to_pylist()]))
            called[f"L{i}"] = t0 = time.perf_counter()
            w.write(t)
            w.flush()
            committed[f"L{i}"] = t1 = time.perf_counter()
            lat.append(t1 - t0)
            time.sleep(0.02)
    done.set()
    th.join()
    vis = [max(seen[k] - committed[k], 0.0) for k in committed]
    e2e = [seen[k] - called[k] for k in called]
    return {"commit_p50_ms": round(pct(lat, 50) * 1e3, 2), "commit_p99_ms": round(pct(lat, 99) * 1e3, 2),
            "visible_p50_ms": round(pct(vis, 50) * 1e3, 2), "end_to_end_p50_ms": round(pct(e2e, 50) * 1e3, 2),
            "latency_commits": n}


def build_log(url: str, commits: int) -> None:
    """`commits` entries through CommitLog.commit: per 50, 48 sampler adds, one trainer
    consumption record and one compaction (consumed L1 shards -> one L3 file per policy)."""
    fs, root = url_to_fs(url)
    log = CommitLog(fs, root, checkpoint_interval=CHECKPOINT_INTERVAL, writer="bench", tombstone_retention_s=0.0)
    l3: dict[int, str] = {}
    for i in range(commits):
        k, pv = i % 50, i // 1000
        if k < 48:
            log.commit([AddShard(f"l1/bench-{i}.parquet", "l1", 128, 60000, (8,) * 16, (pv, pv), time.time())])
        elif k == 48:
            st = log.state
            log.commit([MarkConsumed("trainer", st.next_seq, 0, st.l1_groups_added)])
        else:
            st = log.state
            acts = [RemoveShard(st.l1_by_seq[s]) for s in st.l1_seqs]
            if pv in l3:
                acts.append(RemoveShard(l3[pv]))
            l3[pv] = f"l3/run=bench/policy={pv}/part-{i}.parquet"
            acts.append(AddShard(l3[pv], "l3", 128 * 48, 2_000_000, (8,) * (16 * 48), (pv, pv), time.time()))
            log.commit(acts)


def bench_open(base: Path, sizes: list[int]) -> dict:
    out, files, build = {}, {}, {}
    for n in sizes:
        url = str(base / f"open{n}")
        t0 = time.perf_counter()
        build_log(url, n)
        build[str(n)] = round(time.perf_counter() - t0, 1)
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            buf = ReplayBuffer(url)
            buf.refresh()
            times.append(time.perf_counter() - t0)
        assert buf.state.version == n
        out[str(n)] = round(statistics.median(times), 4)
        files[str(n)] = buf.log.files_read
        shutil.rmtree(url)
    return {"open_s": out, "open_files_read": files, "open_build_s": build,
            "open_checkpoint_interval": CHECKPOINT_INTERVAL}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shards", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--latency-commits", type=int, default=100)
    ap.add_argument("--dir", default=None, help="folder for the throughput and latency data (default: a temp dir)")
    ap.add_argument("--open-sizes", default="100,10000,100000")
    args = ap.parse_args()
    pa.set_cpu_count(1)
    pa.set_io_thread_count(1)
    t_start = time.perf_counter()
    rng = np.random.default_rng(0)
    shards = [make_shard(i, rng) for i in range(args.shards)]
    base = Path(tempfile.mkdtemp(prefix="bench-buffer-", dir=args.dir))
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else None
    open_base = Path(tempfile.mkdtemp(prefix="bench-buffer-open-", dir=shm))
    try:
        out = {"bench": "buffer", "storage": str(base), "open_storage": str(open_base)}
        out.update(bench_throughput(shards, base, args.rounds))
        out.update(bench_latency(shards, base, args.latency_commits))
        out.update(bench_open(open_base, [int(x) for x in args.open_sizes.split(",")]))
    finally:
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(open_base, ignore_errors=True)
    out["bench_s"] = round(time.perf_counter() - t_start, 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
