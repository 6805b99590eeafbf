"""The `rlhf airflow up|down|status|demo|backfill` command group.

Registered with the engine's CLI through the `rlhf.commands` entry point (pyproject.toml), so
`pipeline.cli` never names this package.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from plugins.local.client import AirflowError
from plugins.local.demo import DEMO_CONF, demo
from plugins.local.deployment import DEFAULT_HOME, DEFAULT_RUNS_ROOT, REPROCESS_BEHAVIOURS, LocalAirflow
from plugins.local.folders import dags_folder


def _deployment(args) -> LocalAirflow:
    return LocalAirflow(home=args.home, port=args.port, runs_root=args.runs_root)


def cmd_up(args) -> int:
    af = _deployment(args)
    user, password = af.credentials()
    af.up()
    print(f"Airflow UI: {af.base_url}  (user {user}, password {password})")
    print(f"DAGs: {dags_folder()}; logs: {af.home / 'logs'}; stop with `rlhf airflow down`")
    return 0


def cmd_down(args) -> int:
    stopped = _deployment(args).down()
    print(f"stopped: {', '.join(stopped) or 'nothing was running'}")
    return 0


def cmd_status(args) -> int:
    """Each component: alive or dead, pid, restarts and last exit code; exit 1 if one is down."""
    af = _deployment(args)
    report = af.status()
    print(json.dumps(report, indent=1))
    return 0 if report["healthy"] else 1


def cmd_backfill(args) -> int:
    af = _deployment(args)
    if not af.supervisor_alive():
        print(f"error: Airflow of {af.home} is not running; start it with `rlhf airflow up`", file=sys.stderr)
        return 2
    try:
        conf = json.loads(args.conf) if args.conf else None
    except json.JSONDecodeError as e:
        print(f"error: --conf is not JSON: {e}", file=sys.stderr)
        return 2
    try:
        runs = af.backfill(args.dag_id, args.from_date, args.to_date, conf=conf,
                           max_active_runs=args.max_active_runs, reprocess=args.reprocess)
    except AirflowError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for run in runs:
        print(f"{run['logical_date'][:10]}: {run['dag_run_id']} ({run['state']})")
    return 0


def cmd_demo(args) -> int:
    from pipeline.config_yaml import apply_overrides

    conf = dict(DEMO_CONF)
    if args.config_file:
        conf["config_file"] = args.config_file
    overrides = apply_overrides({}, args.set)
    flat: dict[str, Any] = {}

    def walk(prefix: str, node: Any) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(f"{prefix}.{k}" if prefix else k, v)
        else:
            flat[prefix] = node

    walk("", overrides)
    if flat:
        conf["overrides"] = flat
    return demo(_deployment(args), conf, timeout_s=args.timeout)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("airflow", help="embedded Airflow: up, down, status, demo, backfill")
    sub = p.add_subparsers(dest="airflow_cmd", required=True)
    for name, fn, help_ in (("up", cmd_up, "start api-server, scheduler, dag-processor, triggerer"),
                            ("down", cmd_down, "stop the components (SIGTERM to their process groups)"),
                            ("status", cmd_status, "show the components and their health"),
                            ("demo", cmd_demo, "up, trigger rlhf_train with the demo config, follow it, down"),
                            ("backfill", cmd_backfill, "queue a run for every date of a range (reruns dates that ran)")):
        s = sub.add_parser(name, help=help_)
        s.add_argument("--home", default=DEFAULT_HOME, help=f"AIRFLOW_HOME (default {DEFAULT_HOME}/ in the current directory)")
        s.add_argument("--port", type=int, default=8080)
        s.add_argument("--runs-root", default=None,
                       help=f"where run directories are created (default {DEFAULT_RUNS_ROOT}/ in the current directory)")
        if name == "backfill":
            s.add_argument("dag_id")
            s.add_argument("--from-date", required=True, help="YYYY-MM-DD, first logical date")
            s.add_argument("--to-date", required=True, help="YYYY-MM-DD, last logical date (inclusive)")
            s.add_argument("--conf", default=None, help="JSON run conf, as the trigger form's fields")
            s.add_argument("--max-active-runs", type=int, default=1)
            s.add_argument("--reprocess", choices=REPROCESS_BEHAVIOURS, default="completed",
                           help="dates that already ran: rerun them (completed, the default), only failed "
                                "ones (failed), or skip them (none)")
        if name == "demo":
            s.add_argument("--config-file", default=None, help="a YAML name in configs/ (default tiny-grpo.yaml)")
            s.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                           help="config override, e.g. --set trainer.steps=40")
            s.add_argument("--timeout", type=float, default=3600.0, help="seconds to wait for the run")
        s.set_defaults(fn=fn)
