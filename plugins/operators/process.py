"""An operator that supervises one long-running subprocess (a sampler, a trainer, an evaluation).

Airflow supervises the loop; it does not host it. The process runs in its own session (process
group) so that everything it spawns (torchrun workers, vLLM engine processes) is stopped together:
on `on_kill` (task cleared or marked failed in the UI), on `execution_timeout`, and when the worker
itself is interrupted. Its output is streamed line by line into the task log.

Retries restart the same command; the engine resumes from the run directory. The process group
id is kept in the task state store, so a retry that lands after a worker crash first stops the
orphaned group of the previous try instead of running two trainers on one run.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections import deque
from typing import Any, Sequence

from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import AirflowException

# Thread defaults for the child: several busy processes share the machine's cores.
THREAD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
# Progress bars would flood the task log; the engine logs one line every N steps instead.
QUIET_ENV = {"TQDM_DISABLE": "1", "PYTHONUNBUFFERED": "1"}
STATE_KEY = "supervised_process"


def stop_process_group(pgid: int, grace_s: float = 30.0) -> bool:
    """SIGTERM the group, wait up to `grace_s` for it to go, then SIGKILL. True if it existed."""
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return False
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return True


class SupervisedProcessOperator(BaseOperator):
    """Runs `command` (argv list) to completion, streaming its output; non-zero exit fails the task.

    :param command: argv of the process (templated).
    :param env: extra environment variables (templated), on top of the worker's environment.
    :param cwd: working directory.
    :param kill_grace_s: seconds between SIGTERM and SIGKILL when the task is stopped.
    :param tail_lines: lines of output quoted in the failure message.
    """

    template_fields: Sequence[str] = ("command", "env")
    ui_color = "#d8e8f8"

    def __init__(self, *, command: Sequence[str], env: dict[str, str] | None = None, cwd: str | None = None,
                 kill_grace_s: float = 30.0, tail_lines: int = 20, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.command = command
        self.env = env
        self.cwd = cwd
        self.kill_grace_s = kill_grace_s
        self.tail_lines = tail_lines
        self._proc: subprocess.Popen | None = None

    # hooks for subclasses --------------------------------------------------------------------
    def build_command(self, context) -> list[str]:
        return [str(c) for c in self.command]

    def on_retry_start(self, context) -> None:
        """Called before the process starts on a try > 1."""

    def handle_line(self, line: str) -> None:
        """One line of the process's output (stdout and stderr, merged)."""
        self.log.info("%s", line)

    # state store (Airflow >= 3.3; absent in older runtimes and in unit tests) ------------------
    @staticmethod
    def _state_store(context):
        try:
            return context.get("task_state_store")
        except AttributeError:
            return None

    def _stop_orphan(self, context) -> None:
        store = self._state_store(context)
        if store is None:
            return
        try:
            previous = store.get(STATE_KEY)
        except Exception:  # the store is best effort; never fail a task because of it
            return
        if previous and previous.get("host") == socket.gethostname() and previous.get("pgid"):
            if stop_process_group(int(previous["pgid"]), self.kill_grace_s):
                self.log.warning("stopped process group %s left by a previous try", previous["pgid"])

    def _remember(self, context, pgid: int | None) -> None:
        store = self._state_store(context)
        if store is None:
            return
        try:
            store.set(STATE_KEY, {"host": socket.gethostname(), "pgid": pgid} if pgid else None)
        except Exception:
            pass

    # execution -------------------------------------------------------------------------------
    def execute(self, context) -> dict:
        argv = self.build_command(context)
        ti = context.get("ti")
        try_number = getattr(ti, "try_number", 1) or 1
        if try_number > 1:
            self._stop_orphan(context)
            self.on_retry_start(context)
        env = {**THREAD_ENV, **os.environ, **QUIET_ENV, **{k: str(v) for k, v in (self.env or {}).items()}}
        self.log.info("starting (try %s): %s", try_number, " ".join(argv))
        tail: deque[str] = deque(maxlen=self.tail_lines)
        started = time.monotonic()
        self._proc = subprocess.Popen(
            argv, cwd=self.cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, bufsize=1, start_new_session=True,
        )
        self._remember(context, self._proc.pid)
        try:
            assert self._proc.stdout is not None
            for line in self._proc.stdout:
                line = line.rstrip("\n")
                tail.append(line)
                self.handle_line(line)
            code = self._proc.wait()
        finally:
            # Reached on success, on a non-zero exit, and when execution_timeout or a signal
            # interrupts the loop above: never leave the group behind.
            if self._proc.poll() is None:
                self.log.warning("stopping process group %s", self._proc.pid)
            stop_process_group(self._proc.pid, self.kill_grace_s)
            self._remember(context, None)
        elapsed = round(time.monotonic() - started, 1)
        if code != 0:
            quoted = "\n".join(tail)
            raise AirflowException(f"{argv[0]} exited with code {code} after {elapsed}s; last lines:\n{quoted}")
        self.log.info("finished in %ss", elapsed)
        return {"returncode": code, "elapsed_s": elapsed}

    def on_kill(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self.log.warning("task killed: stopping process group %s", self._proc.pid)
            stop_process_group(self._proc.pid, self.kill_grace_s)
