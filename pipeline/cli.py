"""`rlhf` command line: one entry point for users, the local runner and the Airflow tasks."""

from __future__ import annotations

import argparse
import gc
import importlib
import importlib.util
import json
import logging
import os
import sys
import traceback
from importlib.metadata import entry_points

from .config import ConfigError
from .processes import RunFailed
from .scoring import RewardError
from .signals import StopSignal, handle_stop_signals

COMMAND_GROUPS = "rlhf.commands"  # entry-point group of the command groups installed packages add


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _config(args):
    from .config import load_config

    return load_config(args.config, args.set)


def cmd_init_example(args) -> int:
    from .example import build_example

    out = build_example(os.path.abspath(args.dir), args.task, args.seed)
    print(json.dumps({"model": os.path.join(out, "model"), "train": os.path.join(out, "data", "train.parquet"),
                      "test": os.path.join(out, "data", "test.parquet")}, indent=1))
    return 0


def cmd_prepare(args) -> int:
    from .orchestration import prepare

    run = prepare(_config(args), args.run_dir, args.runs_root)
    print(run.url)
    return 0


def cmd_sampler(args) -> int:
    run_sampler = _engine(args, ".sampler.loop", "run_sampler")
    if run_sampler is not None:
        run_sampler(args.run_dir, args.sampler_id)
    return 0


def cmd_trainer(args) -> int:
    run_trainer = _engine(args, ".trainer.loop", "run_trainer")
    if run_trainer is not None:
        run_trainer(args.run_dir)
    return 0


def _engine(args, module: str, name: str):
    """The engine's entry point, loaded; with --after-prepare, once the run is prepared. None:
    stopped before that, which is how the local runner ends the engines of a run it could not
    prepare (nothing to report)."""
    gc.disable()  # for the start-up: see pipeline.devices.engine_loaded, which resumes it
    try:
        entry = getattr(importlib.import_module(module, __package__), name)
        if args.after_prepare:
            from .rundir import RunDir

            run = RunDir(args.run_dir)
            if not run.prepared():
                _preload()  # (seconds of imports, while the runner prepares the run)
            run.wait_prepared()
    except StopSignal:
        if args.after_prepare:
            return None
        raise
    return entry


def _preload() -> None:
    """Import what an engine loads first, whatever the model's architecture: torch, transformers'
    auto classes and the modules every model class imports (3-4 s of a core on this project's CPU
    machines)."""
    import torch  # noqa: F401
    import transformers.masking_utils  # noqa: F401
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationMixin, PreTrainedModel  # noqa: F401


def cmd_finalize(args) -> int:
    from .orchestration import finalize
    from .rundir import RunDir

    run = RunDir(args.run_dir)
    run.config()  # a folder that is not a run: one line naming it
    print(json.dumps(finalize(run), indent=1))
    return 0


def cmd_eval(args) -> int:
    from .orchestration import evaluate_policy
    from .policy import PolicyStore
    from .rundir import RunDir

    run = RunDir(args.run_dir)
    run.config()  # a folder that is not a run: one line naming it
    store = PolicyStore(run)
    version = args.version if args.version is not None else store.latest()
    if version is None or not store.exists(version):
        raise ConfigError(f"--version: {run.url} has no policy version {version}; it has {store.versions()}")
    print(json.dumps({"version": version, **evaluate_policy(run, version)}))
    return 0


def cmd_run(args) -> int:
    from .local_runner import run_local

    summary = run_local(_config(args), args.run_dir, progress=not args.no_progress, runs_root=args.runs_root)
    keys = ["run_dir", "eval_before", "eval_after", "reward_first", "reward_last", "steps", "samples_generated",
            "samples_trained", "generated_tokens", "trained_tokens", "wall_s", "sampler_busy_s", "trainer_busy_s",
            "overlap_s", "overlap_ratio", "policy_versions", "max_staleness_seen", "total_s"]
    print(json.dumps({k: summary.get(k) for k in keys}, indent=1))
    return 0


def _run_location(value: str) -> str:
    """argparse type of --run-dir and --runs-root (a bad one: one line, exit 2)."""
    from .locations import validate_run_location

    try:
        return validate_run_location(value)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def build_parser() -> argparse.ArgumentParser:
    from .builtin_tasks import TASKS

    p = argparse.ArgumentParser(prog="rlhf", description="RL post-training of language models: sampler, trainer, buffer.")
    p.add_argument("-v", "--verbose", action="store_true")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("init-example", help="build the tiny model and prompt datasets offline")
    s.add_argument("dir")
    s.add_argument("--task", default="sort", choices=list(TASKS))
    s.add_argument("--seed", type=int, default=0)
    s.set_defaults(fn=cmd_init_example)

    for name, fn, help_ in (("prepare", cmd_prepare, "validate a config and create a run directory"),
                            ("run", cmd_run, "run sampler and trainer locally as two processes")):
        s = sub.add_parser(name, help=help_)
        s.add_argument("config", help="YAML run config, e.g. configs/tiny-grpo.yaml")
        s.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override, e.g. trainer.steps=20")
        s.add_argument("--run-dir", default=None, type=_run_location, help="run directory URL (default: runs/<run_id>)")
        s.add_argument("--runs-root", default="runs", type=_run_location, help="where new runs go (without --run-dir)")
        if name == "run":
            s.add_argument("--no-progress", action="store_true", help="log lines instead of a progress bar")
        s.set_defaults(fn=fn)

    s = sub.add_parser("sampler", help="the persistent sampler loop")
    s.add_argument("--run-dir", required=True, type=_run_location)
    s.add_argument("--sampler-id", default="sampler-0")
    s.set_defaults(fn=cmd_sampler)

    s = sub.add_parser("trainer", help="the persistent trainer loop")
    s.add_argument("--run-dir", required=True, type=_run_location)
    s.set_defaults(fn=cmd_trainer)
    for s in (sub.choices["sampler"], sub.choices["trainer"]):
        s.add_argument("--after-prepare", action="store_true",
                       help="start now and wait for the run's preparation to finish (`rlhf run` starts its engines so)")

    s = sub.add_parser("finalize", help="verify and evaluate the final policy, compact L1 into L3, write summary.json")
    s.add_argument("--run-dir", required=True, type=_run_location)
    s.set_defaults(fn=cmd_finalize)

    s = sub.add_parser("eval", help="held-out score of a policy version")
    s.add_argument("--run-dir", required=True, type=_run_location)
    s.add_argument("--version", type=int, default=None)
    s.set_defaults(fn=cmd_eval)

    for module in ("pipeline.buffer.cli", "pipeline.reshard.cli", "pipeline.sampler.cli", "pipeline.archive_cli"):
        if importlib.util.find_spec(module) is not None:  # command groups of the optional parts
            importlib.import_module(module).add_parser(sub)
    _add_installed_groups(sub)
    return p


def _add_installed_groups(sub) -> None:
    """Command groups other packages register under the `rlhf.commands` entry-point group (name =
    the command, value = a function that adds its subparser), e.g. `rlhf airflow` from the
    project's Airflow tooling. One that fails to load is left out, with a line saying why, so the
    engine's own commands keep working wherever they run."""
    seen = set()
    for ep in sorted(entry_points(group=COMMAND_GROUPS), key=lambda e: e.name):
        if ep.name in seen:
            continue
        seen.add(ep.name)
        try:
            add_parser = ep.load()
        except ImportError as e:
            print(f"rlhf: command group {ep.name!r} ({ep.value}) not available: {e}", file=sys.stderr)
            continue
        add_parser(sub)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _setup_logging(args.verbose)
    # SIGINT, SIGTERM and SIGHUP unwind like Ctrl-C, so `finally` blocks commit the buffer writer's
    # shards and flush the metrics; an inherited ignore of SIGINT or SIGHUP is honoured
    handle_stop_signals()
    try:
        return args.fn(args) or 0
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (RewardError, RunFailed) as e:  # their tracebacks, if any, are in the output above
        print(f"error: {e}", file=sys.stderr)
        return 1
    except StopSignal as e:
        print(f"stopped by {e.signum.name}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def run() -> None:
    """Console-script entry point (`rlhf`, `python -m pipeline`): `main`, then exit without running
    C++ static destructors. torch and pyarrow loaded in one process abort at interpreter exit now
    and then ("terminate called without an active exception"), which would turn a finished
    sampler or trainer into a crash; Python-level clean-up has run by then."""
    try:
        code = main()
    except SystemExit as e:  # argparse errors and --help
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
