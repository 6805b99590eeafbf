"""Writer and reader processes for the buffer's concurrency and crash tests.

    python buffer_worker.py write URL WRITER_ID SHARDS GROUPS ACK_FILE
        commits SHARDS shards of GROUPS groups (2 rows each), one commit per shard; appends
        "attempt <prefix>" before and "ack <prefix>" after each commit to ACK_FILE.
    python buffer_worker.py read URL STATE_DIR TOTAL_GROUPS SEED
        consumes the L1 stream like a trainer: after each read appends the group ids to
        STATE_DIR/ids.txt, then atomically saves {cursor, ids_bytes} to STATE_DIR/ckpt.json.
        Resumes from that checkpoint (truncating ids.txt to it) when restarted.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from rollout_factory import make_groups  # noqa: E402

from pipeline.buffer import ReplayBuffer  # noqa: E402
from pipeline.config import BufferConfig  # noqa: E402
from pipeline.storage import put_atomic, url_to_fs  # noqa: E402

CONFIG = BufferConfig(checkpoint_interval=20, writer_queue=2)
# a reader that has caught up polls the log this often; every poll is a request, and on S3 (moto
# on this machine's cores) polls by two readers otherwise cost as many requests as the commits
POLL_S = 0.2


def write(url: str, writer_id: str, shards: int, groups: int, ack_file: str) -> None:
    buf = ReplayBuffer(url, CONFIG)
    w = buf.writer(writer_id)
    with open(ack_file, "a", buffering=1) as ack:
        for i in range(shards):
            prefix = f"{writer_id}-{i}"
            ack.write(f"attempt {prefix}\n")
            w.write(make_groups(prefix, groups, group_size=2, seed=i, response_len=4))
            w.flush()
            ack.write(f"ack {prefix}\n")
    w.close()


def read(url: str, state_dir: str, total_groups: int, seed: int) -> None:
    fs, _ = url_to_fs(state_dir)
    ckpt_path = os.path.join(state_dir, "ckpt.json")
    ids_path = os.path.join(state_dir, "ids.txt")
    cursor, ids_bytes = None, 0
    if os.path.exists(ckpt_path):
        with open(ckpt_path) as f:
            saved = json.load(f)
        cursor, ids_bytes = saved["cursor"], saved["ids_bytes"]
    with open(ids_path, "ab") as f:
        f.truncate(ids_bytes)
    have = ids_bytes and open(ids_path).read().count("\n")
    rng = random.Random(seed)
    buf = ReplayBuffer(url, CONFIG)
    deadline = time.time() + 300
    while have < total_groups and time.time() < deadline:
        table, new_cursor = buf.read_fresh(cursor, rng.randint(1, 7))
        if table.num_rows == 0:
            time.sleep(POLL_S)
            continue
        gids = list(dict.fromkeys(table.column("group_id").to_pylist()))
        sizes = [table.column("group_id").to_pylist().count(g) for g in gids]
        if sizes != [2] * len(gids):
            raise SystemExit(f"split group in read: {list(zip(gids, sizes))}")
        with open(ids_path, "ab") as f:
            f.write("".join(g + "\n" for g in gids).encode())
            ids_bytes = f.tell()
        # no fsync: the test kills processes, not the machine, and the page cache survives that
        put_atomic(fs, ckpt_path, json.dumps({"cursor": new_cursor, "ids_bytes": ids_bytes}).encode(), fsync=False)
        cursor = new_cursor
        have += len(gids)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    cmd, args = sys.argv[1], sys.argv[2:]
    if cmd == "write":
        write(args[0], args[1], int(args[2]), int(args[3]), args[4])
    elif cmd == "read":
        read(args[0], args[1], int(args[2]), int(args[3]))
    else:
        raise SystemExit(f"unknown command {cmd!r}")
