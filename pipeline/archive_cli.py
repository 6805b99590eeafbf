"""`rlhf lineage RUN_DIR --step N | --version K` and `rlhf export RUN_DIR --format F --out PATH`.

`lineage` answers "what data made this policy": `--version K` lists each group the updates up to
version K consumed (fresh once, replayed n times), `--step N` the rows of the batches logged at
trainer step N. `export` writes an SFT, DPO or raw Parquet dataset from the archive
(pipeline.export). Both print JSON.
"""

from __future__ import annotations

import json


def cmd_lineage(args) -> int:
    from .export import open_run
    from .lineage import check_version, groups_of_version, read_ledger, rows_of_step

    run = open_run(args.run_dir)
    ledger = read_ledger(run)
    if args.version is not None:
        check_version(ledger, args.version, run.url)
        rows = groups_of_version(ledger, args.version)
        out = {"run": run.url, "version": args.version, "groups": len(rows),
               "fresh_uses": sum(r["fresh"] for r in rows), "replay_uses": sum(r["replays"] for r in rows)}
    else:
        rows = rows_of_step(ledger, args.step).to_pylist()
        out = {"run": run.url, "step": args.step, "batches": len({r["update"] for r in rows}),
               "groups": len({r["group_id"] for r in rows}),
               "fresh_uses": sum(r["kind"] == "fresh" for r in rows), "replay_uses": sum(r["kind"] == "replay" for r in rows)}
    print(json.dumps({**out, "rows": rows}, indent=1, default=str))
    return 0


def cmd_export(args) -> int:
    from .export import export

    print(json.dumps(export(args.run_dir, args.format, args.out, force=args.force, version=args.version,
                            min_reward=args.min_reward), indent=1))
    return 0


def add_parser(subparsers) -> None:
    s = subparsers.add_parser("lineage", help="which rollout groups trained a step or made a policy version")
    s.add_argument("run_dir")
    which = s.add_mutually_exclusive_group(required=True)
    which.add_argument("--step", type=int, help="the batches logged at this trainer step (fresh and replays)")
    which.add_argument("--version", type=int, help="every group consumed by the updates up to this policy version")
    s.set_defaults(fn=cmd_lineage)

    s = subparsers.add_parser("export", help="an SFT, DPO or Parquet dataset from the run's archive (L3)")
    s.add_argument("run_dir")
    s.add_argument("--format", required=True, choices=["sft", "dpo", "parquet"])
    s.add_argument("--out", required=True, help="output file (.jsonl: JSON lines, else Parquet), outside the run")
    s.add_argument("--force", action="store_true", help="replace an existing output file")
    s.add_argument("--version", type=int, default=None, help="only the groups that made this policy version")
    s.add_argument("--min-reward", type=float, default=None, help="sft: drop groups whose best reward is lower")
    s.set_defaults(fn=cmd_export)
