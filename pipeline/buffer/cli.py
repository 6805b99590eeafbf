"""`rlhf buffer stats|verify|compact|vacuum URL`: inspect and maintain a buffer from a shell.

`rlhf buffer gc` is the same command as `vacuum`, under its earlier name. `rlhf buffer rescore
RUN_DIR --reward SPEC --out PATH` scores a run's archive with another reward into a new dataset
(pipeline.rescore).

URL is a buffer (`.../<run_id>/buffer`) or a run directory (its `buffer/` and the buffer settings
of its frozen config are used; empty until the sampler's first commit). Any other path is an error
(exit 2, one line naming it): reading it as an empty buffer would report a missing buffer as healthy.
"""

from __future__ import annotations

import json
import sys
from contextlib import contextmanager

from ..config import BufferConfig, ConfigError


def open_buffer(url: str):
    from ..storage import join, url_to_fs
    from .buffer import ReplayBuffer
    from .logfiles import LOG_DIR

    fs, root = url_to_fs(url)
    if fs.exists(join(root, "config.yaml")):
        from ..rundir import RunDir

        run = RunDir(url)
        return ReplayBuffer(run.buffer_url, run.config().buffer)
    if not fs.exists(join(root, LOG_DIR)):
        raise ConfigError(f"{url}: no buffer there (no commit log {LOG_DIR}/); pass a buffer folder "
                          "(<run dir>/buffer) or a run directory")
    return ReplayBuffer(url, BufferConfig())


def _print(obj) -> None:
    print(json.dumps(obj, indent=1, sort_keys=True, default=str))


@contextmanager
def _one_line(url: str):
    """A log from a newer version, a damaged log or a shard of a newer schema: one line (exit 2),
    not a traceback."""
    from .logfiles import CorruptLog, UnsupportedLogFormat
    from .schema import SchemaError

    try:
        yield
    except (CorruptLog, UnsupportedLogFormat, SchemaError) as e:
        raise ConfigError(f"buffer {url}: {e}") from None


def cmd_stats(args) -> int:
    with _one_line(args.url):
        _print(open_buffer(args.url).stats(current_version=args.current_version))
    return 0


def cmd_verify(args) -> int:
    report = open_buffer(args.url).verify()
    _print(report)
    if not report["ok"]:
        for p in report["problems"]:
            print(f"problem: {p}", file=sys.stderr)
        return 1
    return 0


def cmd_compact(args) -> int:
    with _one_line(args.url):
        _print(open_buffer(args.url).compact(everything=args.all))
    return 0


def cmd_vacuum(args) -> int:
    with _one_line(args.url):
        _print(open_buffer(args.url).vacuum(grace_s=args.grace_s, log_retention_s=args.log_retention_s))
    return 0


def cmd_rescore(args) -> int:
    from ..rescore import rescore

    _print(rescore(args.run_dir, args.reward, args.out, overrides=args.set, force=args.force))
    return 0


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("buffer", help="inspect and maintain a replay buffer")
    sub = p.add_subparsers(dest="buffer_cmd", required=True)

    s = sub.add_parser("stats", help="rows, bytes, shards per tier; staleness and replay histograms")
    s.add_argument("url")
    s.add_argument("--current-version", type=int, default=None,
                   help="policy version to measure staleness against (default: newest in the buffer)")
    s.set_defaults(fn=cmd_stats)

    s = sub.add_parser("verify", help="check every committed shard against the log and schema (exit 1 on a problem)")
    s.add_argument("url")
    s.set_defaults(fn=cmd_verify)

    s = sub.add_parser("compact", help="archive consumed L1 shards into large L3 files")
    s.add_argument("url")
    s.add_argument("--all", action="store_true", help="archive all of L1, consumed or not (end of run)")
    s.set_defaults(fn=cmd_compact)

    s = sub.add_parser("vacuum", aliases=["gc"],
                       help="delete orphaned files and log entries covered by a checkpoint (alias: gc)")
    s.add_argument("url")
    s.add_argument("--grace-s", type=float, default=None, help="minimum age of an orphan (default: config)")
    s.add_argument("--log-retention-s", type=float, default=None,
                   help="minimum age of a log entry to delete (default: config)")
    s.set_defaults(fn=cmd_vacuum)

    s = sub.add_parser("rescore", help="score a run's archived rollouts with another reward into a new dataset")
    s.add_argument("run_dir")
    s.add_argument("--reward", required=True, metavar="SPEC",
                   help="as reward.fn (auto, sort, gsm8k, path/file.py:function) or model:PATH for a reward model")
    s.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="other reward.* settings, e.g. timeout_s=5 or on_error=zero")
    s.add_argument("--out", required=True, help="output file (.jsonl: JSON lines, else Parquet), outside the run")
    s.add_argument("--force", action="store_true", help="replace an existing output file")
    s.set_defaults(fn=cmd_rescore)
