"""The supervisor of a `LocalAirflow`: `python -m plugins.local.supervisor HOME`.

`LocalAirflow.start_supervisor` writes `HOME/supervisor-spec.json` (component name -> argv, or
{"argv": [...], "cwd": folder, "env": {extra variables}} for a component that runs in a working
directory of its own, such as a Celery worker) and
starts this process detached, in its own session. It starts each component in its own process
group and restarts one whose leader exits (a scheduler that dies on an upstream bug comes back).
What it did goes to `HOME/supervisor.json` (its pid; per component: pid, status, restarts, last
exit code and time), which `LocalAirflow.status` reads.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from pipeline.processes import stop_group, stop_groups

RESTART_BACKOFF_S = (1, 2, 5, 10, 30)  # by restarts of that component in the last 10 minutes


class Supervisor:
    """Starts the components of `home/supervisor-spec.json`, each in its own process group, and
    restarts one whose leader exits, after what it left in its group (executor workers, task
    supervisors) is killed; Airflow then fails and retries the tasks those ran. A file
    `hold-<name>` keeps a component stopped. SIGTERM, SIGINT or SIGHUP stop everything."""

    def __init__(self, home: Path):
        self.home = home
        spec = json.loads((home / "supervisor-spec.json").read_text())
        self.spec: dict[str, dict] = {name: c if isinstance(c, dict) else {"argv": c} for name, c in spec.items()}
        self.procs: dict[str, subprocess.Popen | None] = dict.fromkeys(self.spec)
        self.comps = {name: {"pid": None, "status": "starting", "restarts": 0, "last_exit": None,
                             "last_exit_at": None} for name in self.spec}
        self.next_start = dict.fromkeys(self.spec, 0.0)
        self.exits: dict[str, list[float]] = {name: [] for name in self.spec}
        self.stopping = False

    def log(self, msg: str) -> None:
        print(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {msg}", flush=True)

    def save(self) -> None:
        tmp = self.home / ".supervisor.json.tmp"
        tmp.write_text(json.dumps({"pid": os.getpid(), "components": self.comps}, indent=1))
        os.replace(tmp, self.home / "supervisor.json")

    def spawn(self, name: str) -> None:
        comp = self.spec[name]
        cwd = Path(comp.get("cwd") or self.home)
        cwd.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **comp.get("env", {})}
        with open(self.home / "logs" / f"{name}.log", "ab") as out:
            proc = subprocess.Popen(comp["argv"], stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True, cwd=str(cwd), env=env)
        self.procs[name] = proc
        self.comps[name].update(pid=proc.pid, status="running", started_at=time.time())
        self.log(f"started {name} (pid {proc.pid})")

    def exited(self, name: str, proc: subprocess.Popen, held: bool) -> None:
        stop_group(proc.pid, grace_s=5)
        self.procs[name] = None
        comp = self.comps[name]
        comp.update(last_exit=proc.returncode, last_exit_at=time.time(), status="held" if held else "restarting")
        if held:
            return
        now = time.monotonic()
        self.exits[name] = [t for t in self.exits[name] if now - t < 600] + [now]
        delay = RESTART_BACKOFF_S[min(len(self.exits[name]), len(RESTART_BACKOFF_S)) - 1]
        self.next_start[name] = now + delay
        comp["restarts"] += 1
        self.log(f"{name} exited with code {proc.returncode}; restart {comp['restarts']} in {delay}s")

    def step(self) -> None:
        for name in self.spec:
            held = (self.home / f"hold-{name}").exists()
            proc = self.procs[name]
            if proc is not None and proc.poll() is not None:
                self.exited(name, proc, held)
            elif proc is not None and held:
                self.log(f"stopping {name} (held)")
                stop_group(proc.pid)
                proc.wait()
                self.exited(name, proc, held=True)
            elif proc is None and not held and time.monotonic() >= self.next_start[name]:
                self.spawn(name)
            else:
                continue
            self.save()

    def run(self, poll_s: float = 0.5) -> int:
        def on_signal(signum, frame):
            self.stopping = True

        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, on_signal)
        try:
            self.save()
            while not self.stopping:
                self.step()
                time.sleep(poll_s)
        finally:  # a signal, or a failure of the supervisor itself: it leaves no component behind
            self.log("stopping every component")
            stop_groups([p.pid for p in self.procs.values() if p is not None and p.poll() is None], grace_s=30)
            for comp in self.comps.values():
                comp["status"] = "stopped"
            self.save()
        return 0


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m plugins.local.supervisor AIRFLOW_HOME", file=sys.stderr)
        return 2
    return Supervisor(Path(argv[0])).run()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
