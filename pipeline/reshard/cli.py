"""`rlhf reshard SRC DST --to FORMAT` and `rlhf reshard --verify DST`."""

from __future__ import annotations

import argparse
import json
import sys
import time


def add_parser(subparsers) -> None:
    s = subparsers.add_parser(
        "reshard", help="convert a checkpoint between layouts (hf, tp:N, dcp:N), or verify a published one",
        description="Convert a checkpoint between the trainer's and the sampler's layouts. SRC and DST are "
                    "folders or fsspec URLs; the format of SRC is detected.",
    )
    s.add_argument("src", nargs="?", help="source folder: HF model, tp:N output or trainer checkpoint (step_<N>/)")
    s.add_argument("dst", nargs="?", help="destination folder; committed by its manifest.json")
    s.add_argument("--to", default=None, metavar="FORMAT", help="hf | tp:N | dcp:N")
    s.add_argument("--policy-version", type=int, default=None, help="policy version recorded in the manifest")
    s.add_argument("--max-shard-gb", type=float, default=5.0, help="hf output: start a new safetensors file past this size")
    s.add_argument("--verify", metavar="DST", default=None, help="check a published folder against its manifest")
    s.set_defaults(fn=cmd_reshard)


def cmd_reshard(args: argparse.Namespace) -> int:
    from .layout import ReshardError

    try:
        if args.verify:
            if args.src or args.dst or args.to:
                raise ReshardError("--verify DST takes no SRC, DST or --to; run the conversion separately")
            return _verify(args.verify)
        if not (args.src and args.dst and args.to):
            raise ReshardError("usage: rlhf reshard SRC DST --to hf|tp:N|dcp:N  (or rlhf reshard --verify DST)")
        if not 0 < args.max_shard_gb < 1e9:  # also refuses nan and inf
            raise ReshardError(f"--max-shard-gb: {args.max_shard_gb} must be a positive number of GB")
        from .engine import publish

        t0 = time.monotonic()
        manifest, committed = publish(args.src, args.dst, args.to, policy_version=args.policy_version,
                                      max_shard_bytes=int(args.max_shard_gb * 1e9))
        files = manifest["files"]
        print(json.dumps({
            "dst": args.dst, "format": manifest["format"], "version": manifest.get("version"),
            "step": manifest.get("step"), "files": len(files), "bytes": sum(f["bytes"] for f in files.values()),
            "committed_now": committed, "seconds": round(time.monotonic() - t0, 3),
        }))
        return 0
    except ReshardError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a destination that is a file, a folder it may not write, storage errors
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2


def _verify(dst: str) -> int:
    from .manifest import verify

    report = verify(dst)
    print(json.dumps({"dst": dst, "ok": report.ok, "files": report.files, "bytes": report.bytes,
                      "problems": report.problems}))
    return 0 if report.ok else 1
