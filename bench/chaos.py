"""Chaos benchmark: SIGKILL the processes of real runs at random moments, then check each run.

Prints ONE JSON line. Every run is a real run of the built-in sort task (configs/tiny-grpo.yaml with
small overrides); a seeded RNG picks the moment and the victim of each kill:

- local: `rlhf run CONFIG --run-dir file://...`; victims: the sampler, the trainer, the runner.
  The local runner fails the run when a child dies (it does not restart it), so the controller
  does what a user does: kill the processes a dead runner left behind (the runner's children run
  in sessions of their own and outlive it), remove the stale stop marker the failed attempt wrote
  (a rerun would otherwise stop at once and finalize an unfinished run), and rerun the same
  command on the same run directory, which resumes it.
- s3: the same with the run directory on an S3 endpoint (moto's server on 127.0.0.1, started as
  the tests start it: tests/buffer/s3_endpoint.py).
- airflow: an embedded Airflow (plugins.local.deployment.LocalAirflow, LocalExecutor, SQLite) runs
  `rlhf_train`; victims: the scheduler, the triggerer, and the task process supervising the
  sampler or the trainer (the parent of `python -m pipeline sampler|trainer`). A killed component
  is started again by the deployment's supervisor when it has one, else by the controller; the
  run must finish through the tasks' own retries (a victim is picked only when every task its death
  takes down has a retry left). AIRFLOW_DETECTION_ENV shortens how long Airflow takes to notice.

After each run: it finished (summary.json, the trainer's `trainer_done`, every step), `rlhf buffer
verify RUN` exits 0, every fresh group was trained exactly once, no process of the run is left,
and the run directory stays within the retention bounds.

How the figures are computed:
- kills: SIGKILLs delivered to a live victim. runs / runs_succeeded: runs started / finished.
- groups_lost, groups_trained_twice: from data only. The committed fresh stream is every L1 `add`
  of the buffer's commit log, in log order (the order the trainer reads), each group read from its
  data file (rows, tokens, rewards). The trainer's training is its metrics stream: one record per
  fresh step with the batch's sample, token and response-token counts and mean reward; a `start`
  record of a resumed trainer drops the records past the step it resumed from (the steps it
  redoes: their weights died with the killed process). Each remaining step record is matched to
  the window of `groups_per_step` consecutive committed groups with the same counts and mean
  reward (the expected window first, then any other). A group matched by two steps is trained
  twice (also when one group id was committed twice); a committed group before the last trained
  one that no step matched is lost. A step record that matches no window counts in
  `unmatched_steps` (and fails the run's check). The buffer's own record (its `consumed` cursor for
  the trainer) must equal steps x groups_per_step.
- orphans: processes whose command line names the run's URL, alive once the run is over (and,
  under Airflow, any process carrying this benchmark's tag after the deployment is down).
- verify_errors: problems reported by `rlhf buffer verify` (1 if it fails without a report).
- disk_mb per run; `retention_violations`: policy versions on storage above keep + phases + 2
  (when the config has a field keeping the newest K policy versions), or checkpoints above
  keep_checkpoints + phases.

    .venv/bin/python bench/chaos.py                          # local, s3, airflow; 62 kills, ~15-20 min
    .venv/bin/python bench/chaos.py --quick --mode local      # the short version `make test` runs
    .venv/bin/python bench/chaos.py --mode s3 --runs 1 --kills-per-run 4 --seed 7
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

CONFIG = "configs/tiny-grpo.yaml"
TAG_ENV = "RLHF_CHAOS_TAG"  # every process this benchmark starts carries it (cleanup, orphan scan)
MODES = ("local", "s3", "airflow")
# per mode: runs, kills per run, trainer steps, phases
DEFAULTS = {"local": (3, 10, 90, 2), "s3": (2, 6, 50, 2), "airflow": (1, 20, 200, 2)}
QUICK = {"local": (1, 4, 40, 2), "s3": (1, 3, 30, 2), "airflow": (1, 6, 80, 2)}
CHECKPOINT_EVERY = 3
KEEP_POLICY_VERSIONS = 4
# Airflow: seconds between two kills (a restarted component takes ~15 s to serve again on 2 cores)
AIRFLOW_KILL_INTERVAL_S = (3.0, 9.0)
# How soon Airflow notices the tasks of a killed scheduler or task process. The tasks of a scheduler
# that died stay `running` until a scheduler declares its job dead (every orphaned_tasks_check_interval,
# default 300 s) and their heartbeat is older than task_instance_heartbeat_timeout (default 300 s):
# up to 10 minutes of a run doing nothing per kill with the defaults.
AIRFLOW_DETECTION_ENV = {"AIRFLOW__SCHEDULER__ORPHANED_TASKS_CHECK_INTERVAL": "15",
                         "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT": "60",
                         "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT_DETECTION_INTERVAL": "5"}


def log(msg: str) -> None:
    print(f"[chaos {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------
# processes
# ------------------------------------------------------------------------------------------------
@dataclass
class Proc:
    pid: int
    ppid: int
    pgid: int
    argv: list[str]


def processes() -> list[Proc]:
    """Every live, non-zombie process (from /proc)."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()
            argv = Path(f"/proc/{d}/cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
        except (OSError, IndexError):
            continue
        if stat[0] == "Z":
            continue
        out.append(Proc(int(d), int(stat[1]), int(stat[2]), argv))
    return out


def tagged(tag: str) -> list[Proc]:
    """Processes whose environment carries this benchmark's tag (other than this one)."""
    want = f"{TAG_ENV}={tag}".encode()
    found = []
    for p in processes():
        if p.pid == os.getpid():
            continue
        try:
            env = Path(f"/proc/{p.pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if want in env:
            found.append(p)
    return found


def run_procs(run_url: str) -> list[Proc]:
    """Processes whose command line names the run (runner, sampler, trainer, torchrun, finalize)."""
    return [p for p in processes() if p.pid != os.getpid() and any(run_url in a for a in p.argv)]


def engine_procs(run_url: str, role: str) -> list[Proc]:
    """`python -m pipeline <role> --run-dir <run_url> [options]` processes (a sampler replica ends
    with `--sampler-id ID`)."""
    want = ["-m", "pipeline", role, "--run-dir", run_url]
    return [p for p in processes() if _contains(p.argv, want)]


def _contains(argv: list[str], want: list[str]) -> bool:
    return any(argv[i:i + len(want)] == want for i in range(len(argv) - len(want) + 1))


def kill_now(procs: list[Proc], timeout_s: float = 10.0) -> int:
    """SIGKILL each process and its group; wait until they are gone. Returns how many were alive."""
    n = 0
    for p in procs:
        for fn, arg in ((os.killpg, p.pgid), (os.kill, p.pid)):
            if fn is os.killpg and (p.pgid == os.getpgid(0) or p.pgid <= 1):
                continue  # never our own group
            try:
                fn(arg, signal.SIGKILL)
                n += fn is os.kill
            except (ProcessLookupError, PermissionError):
                pass
    deadline = time.monotonic() + timeout_s
    alive = {p.pid for p in procs}
    while alive and time.monotonic() < deadline:
        live = {p.pid for p in processes()}
        alive &= live
        for pid in list(alive):
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitpid(pid, os.WNOHANG)
        time.sleep(0.1)
    return n


def cleanup(tag: str) -> int:
    """Kill everything this benchmark started (in rounds: a supervisor caught between two starts
    may start one more process before it dies)."""
    n = 0
    for _ in range(3):
        left = tagged(tag)
        if not left:
            break
        n += kill_now(left)
    return n


def spawn(argv: list[str], env: dict, log_path: Path, cwd: str | None = None) -> subprocess.Popen:
    """Start a process in its own session with default signal dispositions, output to a file."""
    def dispositions():
        signal.pthread_sigmask(signal.SIG_SETMASK, set())
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
            signal.signal(sig, signal.SIG_DFL)

    with open(log_path, "ab") as out:
        return subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                cwd=cwd or str(REPO), start_new_session=True, preexec_fn=dispositions)


# ------------------------------------------------------------------------------------------------
# checks after a run
# ------------------------------------------------------------------------------------------------
def log_actions(buf) -> list[dict]:
    """Every action of the buffer's commit log, in commit order (entries 1 .. the current version;
    gc deletes entries only after `log_retention_s`, a week by default)."""
    from pipeline.buffer.logfiles import LOG_DIR, entry_name
    from pipeline.storage import join, read_bytes

    out = []
    for v in range(1, buf.refresh().version + 1):
        out += json.loads(read_bytes(buf.fs, join(buf.root, LOG_DIR, entry_name(v)))).get("actions", [])
    return out


def committed_fresh_groups(buf, actions: list[dict]) -> list[dict]:
    """Every group ever committed to L1, in commit order (compacted shards' files stay on storage
    until gc): {"id", "rows", "tokens", "response_tokens", "rewards"}; groups of a quarantined
    shard (which the trainer skips) have no rewards and match no step."""
    from pipeline.buffer.shards import read_shard

    quarantined = buf.refresh().quarantined
    out, seen = [], set()
    for a in actions:
        if a.get("op") != "add" or a.get("tier") != "l1" or a["path"] in seen:
            continue  # an add of a known path changes nothing (the state applies it once)
        seen.add(a["path"])
        gsizes = list(a.get("gsizes") or [])
        if a["path"] in quarantined:
            out += [{"id": f"quarantined:{a['path']}:{i}", "rows": n, "tokens": -1, "response_tokens": -1,
                     "rewards": None} for i, n in enumerate(gsizes)]
            continue
        cols = read_shard(buf.fs, buf.root, a["path"]).select(
            ["group_id", "prompt_token_ids", "response_token_ids", "reward"]).to_pydict()
        row = 0
        for n in gsizes:  # rows of a group are contiguous, in file order (as read_fresh slices them)
            sl = slice(row, row + n)
            prompt, resp = cols["prompt_token_ids"][sl], cols["response_token_ids"][sl]
            out.append({"id": cols["group_id"][row], "rows": n,
                        "tokens": sum(len(p) + len(r) for p, r in zip(prompt, resp)),
                        "response_tokens": sum(len(r) for r in resp),
                        "rewards": np.asarray(cols["reward"][sl], dtype=np.float32)})
            row += n
    return out


def trainer_lineage(records: list[dict]) -> tuple[list[dict], int]:
    """The fresh-step records behind the final weights, and how many records a resumed trainer left
    in the stream past the step it resumed from (it should have dropped them: it redoes them)."""
    steps: list[dict] = []
    stale = 0
    for r in records:
        if r.get("event") == "start":
            keep = [x for x in steps if x["step"] <= int(r.get("resumed_step", 0))]
            stale += len(steps) - len(keep)
            steps = keep
        elif "step" in r and not r.get("replay/is_replay"):
            steps.append(r)
    return steps, stale


def _window_matches(groups: list[dict], start: int, g: int, rec: dict) -> bool:
    """Whether the trainer's step record `rec` describes the `g` committed groups from `start`."""
    win = groups[start:start + g]
    if len(win) < g or any(x["rewards"] is None for x in win):
        return False
    if sum(x["rows"] for x in win) != rec.get("trainer/samples") or \
            sum(x["tokens"] for x in win) != rec.get("trainer/tokens") or \
            sum(x["response_tokens"] for x in win) != rec.get("trainer/response_tokens"):
        return False
    rewards = np.concatenate([x["rewards"] for x in win])
    if abs(float(rewards.mean(dtype=np.float64)) - rec["reward/mean"]) > 1e-5:
        return False
    return len(rewards) < 2 or abs(float(rewards.std(ddof=1, dtype=np.float64)) - rec["reward/std"]) < 1e-4


def exactly_once(run) -> dict:
    """Which committed fresh groups the final weights were trained on, from data (see the module doc)."""
    from pipeline.buffer import ReplayBuffer

    cfg = run.config()
    g, steps_cfg = cfg.trainer.groups_per_step, cfg.trainer.steps
    buf = ReplayBuffer(run.buffer_url, cfg.buffer)
    actions = log_actions(buf)
    groups = committed_fresh_groups(buf, actions)
    lineage, stale = trainer_lineage(run.read_metrics("trainer"))
    step_numbers = [r["step"] for r in lineage]
    trained = [0] * len(groups)
    unmatched = 0
    for rec in lineage:
        expected = (rec["step"] - 1) * g
        starts = [expected] + [s for s in range(len(groups) - g + 1) if s != expected]
        hit = next((s for s in starts if _window_matches(groups, s, g, rec)), None)
        if hit is None:
            unmatched += 1
            continue
        for i in range(hit, hit + g):
            trained[i] += 1
    by_id: dict[str, int] = {}
    for grp, n in zip(groups, trained):
        by_id[grp["id"]] = by_id.get(grp["id"], 0) + n
    frontier = max((i + 1 for i, n in enumerate(trained) if n), default=0)
    lost = sum(1 for i in range(frontier) if trained[i] == 0)
    consumed_commits = sum(1 for a in actions if a.get("op") == "consumed" and a.get("consumer") == "trainer")
    consumed = int((buf.refresh().consumed.get("trainer") or {}).get("groups", -1))
    return {
        "groups_committed": len(groups),
        "groups_trained": sum(1 for n in by_id.values() if n),
        "groups_lost": lost,
        "groups_trained_twice": sum(1 for n in by_id.values() if n >= 2),
        "duplicate_group_ids": len(groups) - len(by_id),
        "unmatched_steps": unmatched,
        "steps_recorded_ok": step_numbers == list(range(1, steps_cfg + 1)),
        "stale_step_records": stale,
        "buffer_consumed_ok": consumed == steps_cfg * g,
        "steps_redone_after_kills": consumed_commits - steps_cfg,  # fresh steps whose weights a kill discarded
        "samples_trained_by_lineage": sum(int(r.get("trainer/samples", 0)) for r in lineage),
    }


def disk_use(run) -> dict:
    from pipeline.policy import VERSION_RE
    from pipeline.storage import is_local, list_names
    from pipeline.trainer.checkpoint import STEP_RE

    if is_local(run.fs):
        total = sum(f.stat().st_size for f in Path(run.root).rglob("*") if f.is_file())
    else:
        run.fs.invalidate_cache(run.root)
        total = sum(run.fs.du(run.root, total=False).values())
    return {"disk_mb": round(total / 2**20, 1),
            "policy_dirs": sum(1 for n in list_names(run.fs, run.path("policy")) if VERSION_RE.match(n)),
            "checkpoint_dirs": sum(1 for n in list_names(run.fs, run.path("checkpoints")) if STEP_RE.match(n))}


def retention_field() -> str | None:
    """The trainer config field that keeps the newest K policy versions, when this checkout has one."""
    from pipeline.config import TrainerConfig

    names = [n for n in TrainerConfig.model_fields if "keep" in n and "polic" in n]
    return names[0] if names else None


def verify_buffer(run_url: str, env: dict) -> tuple[int, list[str]]:
    """`rlhf buffer verify RUN`: (number of problems, the problems)."""
    p = subprocess.run([sys.executable, "-m", "pipeline", "buffer", "verify", run_url], env=env, cwd=str(REPO),
                       capture_output=True, text=True, timeout=300)
    try:
        problems = json.loads(p.stdout)["problems"]
    except (ValueError, KeyError, TypeError):
        problems = [f"exit {p.returncode}: {p.stderr.strip()[-500:]}"]
    if p.returncode != 0 and not problems:
        problems = [f"exit {p.returncode}"]
    return len(problems), problems


def check_run(run_url: str, env: dict, finished: bool) -> dict:
    """Every property of a finished (or given-up) run; processes of the run are killed afterwards."""
    from pipeline.rundir import RunDir

    run = RunDir(run_url)
    cfg = run.config()
    out: dict = {}
    left = run_procs(run_url)
    out["orphans"] = len(left)
    out["orphan_cmdlines"] = [" ".join(p.argv)[-160:] for p in left][:5]
    kill_now(left)
    summary = run.read_json("summary.json")
    out["verify_errors"], problems = verify_buffer(run_url, env)
    out["verify_problems"] = problems[:5]
    try:
        out.update(exactly_once(run))
    except Exception as e:  # a broken run directory is a finding, not a crash of the benchmark
        out.update({"groups_lost": 0, "groups_trained_twice": 0, "analysis_error": f"{type(e).__name__}: {e}"})
    out.update(disk_use(run))
    tc = cfg.trainer
    keep_field = retention_field()
    violations = []
    if keep_field is not None:
        bound = int(getattr(tc, keep_field)) + tc.phases + 2
        if out["policy_dirs"] > bound:
            violations.append(f"{out['policy_dirs']} policy versions > {keep_field} + phases + 2 = {bound}")
    if out["checkpoint_dirs"] > tc.keep_checkpoints + tc.phases:
        violations.append(f"{out['checkpoint_dirs']} checkpoints > keep_checkpoints + phases = "
                          f"{tc.keep_checkpoints + tc.phases}")
    out["steps"], out["groups_per_step"] = tc.steps, tc.groups_per_step
    out["retention_checked"] = ["checkpoints"] + (["policy_versions"] if keep_field else [])
    out["retention_violations"] = violations
    complete = bool(finished and summary and summary.get("steps") == tc.steps and run.has_marker("trainer_done"))
    out["summary_samples_ok"] = bool(summary) and summary.get("samples_trained") == out.get("samples_trained_by_lineage")
    out["complete"] = complete
    out["checks_ok"] = (complete and out["orphans"] == 0 and out["verify_errors"] == 0
                        and out.get("groups_lost") == 0 and out.get("groups_trained_twice") == 0
                        and out.get("unmatched_steps") == 0 and out.get("steps_recorded_ok") is True
                        and out.get("buffer_consumed_ok") is True and not violations)
    return out


# ------------------------------------------------------------------------------------------------
# local runner (local disk or S3)
# ------------------------------------------------------------------------------------------------
@dataclass
class Chaos:
    tag: str
    rng: random.Random
    work: Path
    env: dict
    results: list[dict] = field(default_factory=list)


def overrides(steps: int, phases: int) -> dict:
    out = {"trainer.steps": steps, "trainer.phases": phases, "trainer.checkpoint_every": CHECKPOINT_EVERY,
           "data.eval_size": 16, "trainer.wait_timeout_s": 120}
    keep = retention_field()
    if keep:
        out[f"trainer.{keep}"] = KEEP_POLICY_VERSIONS
    return out


def _trainer_step(run_url: str, since: float = 0.0) -> tuple[int, int | None]:
    """(last step the trainer recorded, first step it recorded after `since`, a wall-clock time)."""
    from pipeline.rundir import RunDir

    try:
        records = [r for r in RunDir(run_url).read_metrics("trainer") if "step" in r]
    except Exception:  # not created yet, or a read racing a rewrite: no progress seen
        return 0, None
    new = [r["step"] for r in records if r.get("time", 0) > since]
    return (records[-1]["step"] if records else 0), (new[0] if new else None)


def local_run(ch: Chaos, mode: str, run_url: str, kills: int, steps: int, phases: int) -> dict:
    """Run `rlhf run` on `run_url` until it finishes, with `kills` SIGKILLs, one per attempt, at a
    random moment. A quarter of the kills fall 1-8 s after the attempt starts (prepare, start-up,
    model loading); the others fall in the loops: a random number of trainer steps after the
    attempt's first step (at most the remaining steps shared among the remaining kills, so that
    every kill lands whatever the machine's speed), plus up to half a second."""
    from pipeline.rundir import RunDir

    t0 = time.monotonic()
    sets = [x for k, v in overrides(steps, phases).items() for x in ("--set", f"{k}={v}")]
    argv = [sys.executable, "-m", "pipeline", "run", CONFIG, "--run-dir", run_url, "--no-progress", *sets]
    out_path = ch.work / f"{run_url.rstrip('/').rsplit('/', 1)[-1]}.log"
    res = {"mode": mode, "run_url": run_url, "kills": 0, "kills_by_target": {}, "attempts": 0,
           "left_by_killed_runner": 0, "left_after_runner_exit": 0, "stop_markers_cleared": 0,
           "unexpected_failures": 0}
    events = []
    finished = False
    victims = ["sampler", "trainer", "runner"]
    ch.rng.shuffle(victims)  # each in turn, from a random first one
    poll_s = 0.1 if run_url.startswith("file:") else 0.5  # metrics reads (on S3: requests)
    while res["attempts"] < kills + 4:
        res["attempts"] += 1
        run = RunDir(run_url)
        if run.exists() and run.stop_requested() and not run.read_json("summary.json"):
            run.fs.rm(run.path("markers", "stop.json"))  # left by the failed attempt
            res["stop_markers_cleared"] += 1
        wall0 = time.time()
        runner = spawn(argv, ch.env, out_path)
        started = time.monotonic()
        armed = res["kills"] < kills
        victim = victims[res["kills"] % len(victims)]
        from_start = ch.rng.random() < 0.25
        kill_at = started + ch.rng.uniform(1.0, 8.0) if from_start else None
        after_steps, jitter = ch.rng.random(), ch.rng.uniform(0.0, 0.5)
        target_step, killed, next_poll = None, None, 0.0
        while runner.poll() is None:
            now = time.monotonic()
            if armed and killed is None and kill_at is None and now >= next_poll:
                next_poll = now + poll_s
                last, first = _trainer_step(run_url, wall0)
                if target_step is None and first is not None:
                    share = max(1, (steps - first) // (kills - res["kills"] + 1))
                    target_step = first + int(after_steps * share)
                if target_step is not None and last >= target_step:
                    kill_at = now + jitter
                elif now - started > 60:
                    kill_at = now  # no step in this attempt (the trainer was done): kill what is there
            if armed and killed is None and kill_at is not None and now >= kill_at:
                alive = {"runner": [Proc(runner.pid, 0, runner.pid, argv)],
                         "sampler": engine_procs(run_url, "sampler"), "trainer": engine_procs(run_url, "trainer")}
                if not alive[victim] and now < kill_at + 15:
                    time.sleep(0.05)  # not started yet, or already gone (finalize): wait a little
                    continue
                target = victim if alive[victim] else "runner"
                pid = alive[target][0].pid
                step = _trainer_step(run_url)[0]
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    continue
                killed = target
                res["kills"] += 1
                res["kills_by_target"][target] = res["kills_by_target"].get(target, 0) + 1
                events.append({"t": round(now - t0, 1), "victim": target, "trainer_step": step,
                               "after": "start" if from_start else "steps"})
                log(f"{mode}: kill {res['kills']}/{kills}: {target} (pid {pid}) at trainer step {step}, "
                    f"{now - started:.1f}s into attempt {res['attempts']}")
            if now - started > 900:
                log(f"{mode}: runner still running after 900 s; killing it")
                os.killpg(runner.pid, signal.SIGKILL)
            time.sleep(0.05)
        rc = runner.wait()
        if rc == 0 and killed is None:
            finished = True  # what this attempt left behind is counted as orphans by check_run
            break
        left = run_procs(run_url)
        if left:  # a rerun must not run beside them
            kill_now(left)
            res["left_by_killed_runner" if killed == "runner" else "left_after_runner_exit"] += len(left)
        if killed is None:
            res["unexpected_failures"] += 1
            log(f"{mode}: runner exited with {rc} without a kill; see {out_path}")
    res["events"] = events
    res.update(check_run(run_url, ch.env, finished))
    res["succeeded"] = res["checks_ok"] and res["unexpected_failures"] == 0  # failed without a kill: a finding
    res["wall_s"] = round(time.monotonic() - t0, 1)
    if not res["succeeded"]:
        res["runner_log_tail"] = out_path.read_text(errors="replace")[-2000:] if out_path.exists() else ""
    return res


@contextlib.contextmanager
def s3_endpoint(ch: Chaos, bucket: str = "rlhf-chaos"):
    """moto's S3 server on 127.0.0.1 in a process of its own; this process and its children use it."""
    import fsspec

    server = subprocess.Popen([sys.executable, str(REPO / "tests" / "buffer" / "s3_endpoint.py")], env=ch.env,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    try:
        port = server.stdout.readline().strip()
        if not port.isdigit():
            raise RuntimeError(f"moto server did not start (exit code {server.poll()})")
        endpoint = f"http://127.0.0.1:{port}"
        s3env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                 "AWS_DEFAULT_REGION": "us-east-1", "FSSPEC_S3_ENDPOINT_URL": endpoint}
        saved = dict(ch.env)
        ch.env.update(s3env)
        os.environ.update(s3env)
        fsspec.config.conf.setdefault("s3", {})["endpoint_url"] = endpoint
        import s3fs

        s3fs.S3FileSystem.clear_instance_cache()
        s3fs.S3FileSystem().mkdir(bucket)
        try:
            yield f"s3://{bucket}"
        finally:
            ch.env.clear()
            ch.env.update(saved)
            for k in s3env:
                os.environ.pop(k, None)
            fsspec.config.conf.get("s3", {}).pop("endpoint_url", None)
            s3fs.S3FileSystem.clear_instance_cache()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGKILL)
        server.wait()


# ------------------------------------------------------------------------------------------------
# Airflow
# ------------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def task_processes(run_url: str, role: str) -> tuple[Proc | None, Proc | None]:
    """(task runner, task supervisor) of the task running `python -m pipeline <role>`: the engine
    process's parent (`airflow worker -- <ti>`, the operator's process) and its parent (the
    executor's supervisor of that task instance)."""
    by_pid = {p.pid: p for p in processes()}
    for engine in engine_procs(run_url, role):  # an engine a killed try left behind has no task process
        runner = by_pid.get(engine.ppid)
        if runner is not None and runner.pid > 1 and runner.pid != os.getpid():
            sup = by_pid.get(runner.ppid)
            return runner, (sup if sup is not None and sup.pid > 1 and sup.pid != os.getpid() else None)
    return None, None


def airflow_run(ch: Chaos, kills: int, steps: int, phases: int, timeout_s: float = 1800) -> dict:
    """One `rlhf_train` run on an embedded Airflow, with `kills` SIGKILLs of the scheduler, the
    triggerer and the task processes of the sampler and the trainer, each within the retries of the
    tasks it takes down (see `_airflow_kill`)."""
    from plugins.local.deployment import LocalAirflow

    t0 = time.monotonic()
    home = ch.work / "airflow"
    af = LocalAirflow(home=home, port=_free_port(), runs_root=str(ch.work / "runs"),
                      extra_env={TAG_ENV: ch.tag, **AIRFLOW_DETECTION_ENV})
    res = {"mode": "airflow", "kills": 0, "kills_by_target": {}, "restarted_by_controller": 0, "events": []}
    run_name = f"chaos-airflow-{uuid.uuid4().hex[:6]}"
    conf = {"config_file": "tiny-grpo.yaml", "steps": steps, "phases": phases, "replay_epochs": 0,
            "run_name": run_name,
            "overrides": {k: v for k, v in overrides(steps, phases).items()
                          if k not in ("trainer.steps", "trainer.phases")}}
    run_url = None
    state = "not started"
    try:
        client = af.up(wait_s=400)
        log(f"airflow: up in {time.monotonic() - t0:.0f}s at {af.base_url}; supervisor: "
            f"{'yes' if hasattr(af, 'supervisor_alive') else 'no (the controller restarts killed components)'}")
        client.wait_for_dag("rlhf_train", timeout_s=300)
        client.unpause("rlhf_train")
        run_id = client.trigger("rlhf_train", conf)["dag_run_id"]
        res["dag_run_id"] = run_id
        next_kill = time.monotonic() + ch.rng.uniform(*AIRFLOW_KILL_INTERVAL_S)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            state = client.dag_run("rlhf_train", run_id)["state"]
            if state in ("success", "failed"):
                break
            if run_url is None:
                code, body = client.call("GET", f"/api/v2/dags/rlhf_train/dagRuns/{run_id}/taskInstances/"
                                                f"prepare/xcomEntries/run_url")
                run_url = body["value"] if code == 200 else None
            _restart_dead(af, res)
            if run_url and res["kills"] < kills and time.monotonic() >= next_kill:
                if _airflow_kill(ch, af, client, run_id, run_url, res, t0):
                    next_kill = time.monotonic() + ch.rng.uniform(*AIRFLOW_KILL_INTERVAL_S)
            time.sleep(1.0)
        res["state"] = state
        tis = client.task_instances("rlhf_train", run_id)
        res["tasks"] = {t["task_id"] + (f"[{t['map_index']}]" if (t.get("map_index") if t.get("map_index") is not None else -1) >= 0 else ""):
                        f"{t['state']} (try {t.get('try_number')})" for t in tis}
    except Exception as e:
        res["failure"] = f"{type(e).__name__}: {e}"[:1000]
        log(f"airflow: {res['failure']}")
    finally:
        with contextlib.suppress(Exception):
            af.down(grace_s=30)
    if run_url is None:
        res.update({"succeeded": False, "orphans": 0, "verify_errors": 0, "groups_lost": 0,
                    "groups_trained_twice": 0})
    else:
        res["run_url"] = run_url
        res.update(check_run(run_url, ch.env, state == "success"))
        res["succeeded"] = bool(res["checks_ok"] and state == "success")
    time.sleep(2)
    left = tagged(ch.tag)  # after `down`, nothing of the deployment may be left
    res["orphans"] = res.get("orphans", 0) + len(left)
    if left:
        res["orphan_cmdlines"] = res.get("orphan_cmdlines", []) + [" ".join(p.argv)[-160:] for p in left][:5]
        res["succeeded"] = False
        kill_now(left)
    res.pop("_dead", None)
    res["wall_s"] = round(time.monotonic() - t0, 1)
    return res


def _airflow_kill(ch: Chaos, af, client, run_id: str, run_url: str, res: dict, t0: float) -> bool:
    """Pick a victim whose death the run can survive and SIGKILL it. True if one was killed.

    Survivable: every task instance the kill takes down has a retry left (try_number <= max_tries).
    A scheduler kill takes down every running or queued task (LocalExecutor: they are its children;
    the deployment's supervisor kills what the dead scheduler left in its process group); a task
    process kill takes down that task; the triggerer's deferred sensors resume on the next one."""
    tis = client.task_instances("rlhf_train", run_id)

    def spare(ti: dict) -> bool:
        return int(ti.get("try_number") or 0) <= int(ti.get("max_tries") or 0)

    active = [t for t in tis if t.get("state") in ("running", "queued")]
    choices = ["triggerer"]
    if af.running().get("scheduler") and all(spare(t) for t in active):
        choices.append("scheduler")
    for t in active:
        if t["task_id"] in ("sampler", "trainer") and t["state"] == "running" and spare(t):
            choices += [f"{t['task_id']}-task-runner", f"{t['task_id']}-task-supervisor"]
    victim = ch.rng.choice(choices)
    if victim in ("scheduler", "triggerer"):
        if not af.running().get(victim):
            return False
        pid = af.pids()[victim]
    else:
        role, kind = victim.split("-task-")
        runner, sup = task_processes(run_url, role)
        proc = runner if kind == "runner" else sup
        if proc is None:
            return False
        pid = proc.pid
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return False
    res["kills"] += 1
    res["kills_by_target"][victim] = res["kills_by_target"].get(victim, 0) + 1
    step = _trainer_step(run_url)[0]
    hit = sorted(f"{t['task_id']}/{t['try_number']}" for t in active
                 if victim == "scheduler" or t["task_id"] == victim.split("-task-")[0])
    res["events"].append({"t": round(time.monotonic() - t0, 1), "victim": victim, "trainer_step": step,
                          "tasks_hit": hit})
    log(f"airflow: kill {res['kills']}: {victim} (pid {pid}) at trainer step {step}; tasks hit: {', '.join(hit) or '-'}")
    return True


def _restart_dead(af, res: dict) -> None:
    """A component killed by the benchmark comes back through the deployment's supervisor. Without
    one (older LocalAirflow), the controller starts it again once it has stayed dead for 5 s."""
    dead = res.setdefault("_dead", {})
    for name, alive in af.running().items():
        if alive:
            dead.pop(name, None)
            continue
        since = dead.setdefault(name, time.monotonic())
        if hasattr(af, "supervisor_alive"):
            if time.monotonic() - since > 120 and not res.get(f"not_restarted_{name}"):
                res[f"not_restarted_{name}"] = True
                log(f"airflow: {name} still dead after 120 s; the supervisor did not restart it")
        elif time.monotonic() - since > 5:
            log(f"airflow: {name} stayed dead; starting it again")
            af._start(name)
            res["restarted_by_controller"] += 1
            dead.pop(name, None)


# ------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", default=",".join(MODES), help="comma-separated: local,s3,airflow")
    ap.add_argument("--runs", type=int, default=None, help="runs per mode (default: per mode, see DEFAULTS)")
    ap.add_argument("--kills-per-run", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None, help="trainer steps per run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="a few kills on one short run per mode")
    ap.add_argument("--keep", action="store_true", help="keep the run directories and logs (the folder is logged at the end)")
    args = ap.parse_args(argv)
    modes = [m.strip() for m in args.mode.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad:
        ap.error(f"--mode: unknown {bad}; use {','.join(MODES)}")

    tag = os.environ.get(TAG_ENV) or uuid.uuid4().hex  # a caller may tag us to clean up after us too
    os.environ[TAG_ENV] = tag
    work = Path(tempfile.mkdtemp(prefix="rlhf-chaos-"))
    ch = Chaos(tag=tag, rng=random.Random(args.seed), work=work, env=dict(os.environ, OMP_NUM_THREADS="1"))

    def on_signal(signum, frame):
        raise KeyboardInterrupt()

    signal.signal(signal.SIGTERM, on_signal)
    t0 = time.monotonic()
    results: list[dict] = []
    try:
        from pipeline.example import ensure_example

        ensure_example("sort", 0)  # the tiny model, built once before the runs compete for the cores
        for mode in modes:
            runs, kills, steps, phases = (QUICK if args.quick else DEFAULTS)[mode]
            runs = args.runs if args.runs is not None else runs
            kills = args.kills_per_run if args.kills_per_run is not None else kills
            steps = args.steps or steps
            if mode == "airflow":
                for i in range(runs):
                    log(f"airflow: run {i + 1}/{runs}, {kills} kills, {steps} steps")
                    results.append(_guarded("airflow", airflow_run, ch, kills, steps, phases))
                    r = results[-1]
                    log(f"airflow: run {i + 1} {'ok' if r['succeeded'] else 'FAILED'} in {r['wall_s']}s")
                continue
            ctx = s3_endpoint(ch) if mode == "s3" else contextlib.nullcontext(f"file://{work}/runs")
            with ctx as root:
                for i in range(runs):
                    url = f"{root}/chaos-{mode}-{i}-{uuid.uuid4().hex[:6]}"
                    log(f"{mode}: run {i + 1}/{runs}, {kills} kills, {steps} steps: {url}")
                    results.append(_guarded(mode, local_run, ch, mode, url, kills, steps, phases))
                    r = results[-1]
                    log(f"{mode}: run {i + 1} {'ok' if r['succeeded'] else 'FAILED'} in {r['wall_s']}s: "
                        + json.dumps({k: r.get(k) for k in ("kills", "groups_lost", "groups_trained_twice",
                                                            "orphans", "verify_errors", "unmatched_steps")}))
    finally:
        cleaned = cleanup(tag)
        if cleaned:
            log(f"killed {cleaned} leftover processes")
        if args.keep:
            log(f"run directories and logs kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)

    def total(key: str, rs: list[dict]) -> int:
        return int(sum(int(r.get(key) or 0) for r in rs))

    keys = ("kills", "groups_lost", "groups_trained_twice", "orphans", "verify_errors")
    per_mode = {}
    for mode in modes:
        rs = [r for r in results if r["mode"] == mode]
        per_mode[mode] = {"runs": len(rs), "runs_succeeded": sum(1 for r in rs if r["succeeded"]),
                          **{k: total(k, rs) for k in keys},
                          "kills_by_target": _merge([r.get("kills_by_target", {}) for r in rs]),
                          "steps_redone_after_kills": total("steps_redone_after_kills", rs),
                          "unmatched_steps": total("unmatched_steps", rs),
                          "unexpected_failures": total("unexpected_failures", rs),
                          "stale_step_records": total("stale_step_records", rs),
                          "retention_violations": sum(len(r.get("retention_violations", [])) for r in rs),
                          "disk_mb_max": max((r.get("disk_mb", 0) for r in rs), default=0)}
    out = {"kills": total("kills", results), "runs": len(results),
           "runs_succeeded": sum(1 for r in results if r["succeeded"]),
           **{k: total(k, results) for k in keys[1:]},
           "seed": args.seed, "wall_s": round(time.monotonic() - t0, 1), "modes": per_mode,
           "runs_detail": [{k: v for k, v in r.items() if k not in ("events",)} for r in results]}
    print(json.dumps(out))
    return 0 if out["runs"] and out["runs_succeeded"] == out["runs"] else 1


def _guarded(mode: str, fn, *args) -> dict:
    """One run; a crash of the controller itself is a failed run in the output, not a lost line."""
    try:
        return fn(*args)
    except Exception as e:
        import traceback

        log(f"{mode}: the run's controller failed: {traceback.format_exc()[-1500:]}")
        return {"mode": mode, "succeeded": False, "kills": 0, "failure": f"{type(e).__name__}: {e}"[:1000],
                "wall_s": 0}


def _merge(dicts: list[dict]) -> dict:
    out: dict = {}
    for d in dicts:
        for k, v in d.items():
            out[k] = out.get(k, 0) + v
    return out


if __name__ == "__main__":
    sys.exit(main())
