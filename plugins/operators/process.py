"""An operator that supervises one long-running subprocess (a sampler, a trainer, an evaluation).

Airflow supervises the loop; it does not host it. The process runs in its own session (process
group) so that everything it spawns (torchrun workers, vLLM engine processes) is stopped together:
on `on_kill` (task cleared or marked failed in the UI), on `execution_timeout`, and when the worker
itself is interrupted. Its output is streamed line by line into the task log. Once the process has
exited, what is still written to its output is read for `output_drain_s` more, then whatever is
left of its group is stopped: a leftover holding the pipe open (a program a reward started) does
not keep the task running (the local runner's `_terminate` does the same).

The environment. The process imports user code (the run's reward file, a model's remote code), so
it does not inherit the worker's environment, which holds the deployment's secrets (metadata
database URL, Fernet key, JWT secret, connections). `engine_environment` keeps an allow-list of
what the engine needs: paths and locale, Python and virtualenv, thread counts, accelerators
(CUDA_*, NVIDIA_*, ROCR_*, HIP_*), Hugging Face, torch and vLLM settings, the RLHF_* settings, and
the storage credentials and proxies the run directory may need (AWS_*, AZURE_*,
GOOGLE_APPLICATION_CREDENTIALS, FSSPEC_*). Everything else is dropped, and Airflow's own variables
(AIRFLOW*, anything naming a connection, SQLAlchemy, Fernet or JWT) are dropped even when a
deployment asks to pass more with `pass_env`. The operator's `env` is applied last: what a DAG
author sets there explicitly reaches the process.

Retries restart the same command; the engine resumes from the run directory. The process group is
kept in the task state store, so a retry that lands after a worker crash first stops the orphaned
group of the previous try instead of running two trainers on one run. A process id says little
once the machine or the container restarted (the same pid and hostname come back for a stranger),
so the record also holds the kernel's boot id and the group leader's start time, and the retry
kills the group only when the host, the boot id and the start time of the live process with that
pid all match (`pipeline.processes`). Where /proc is missing (not Linux) nothing is verifiable and
nothing is killed.
"""

from __future__ import annotations

import codecs
import io
import os
import selectors
import subprocess
import threading
import time
from collections import deque
from typing import Any, Mapping, Sequence

from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import AirflowException

from pipeline.processes import identity_mismatch, process_identity, stop_group

# Thread defaults for the child: several busy processes share the machine's cores.
THREAD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
# Progress bars would flood the task log; the engine logs one line every N steps instead.
QUIET_ENV = {"TQDM_DISABLE": "1", "PYTHONUNBUFFERED": "1"}
STATE_KEY = "supervised_process"

# What the engine process may inherit from the worker: exact names, and prefixes.
ENGINE_ENV_NAMES = frozenset({
    "PATH", "HOME", "USER", "LOGNAME", "LANG", "LANGUAGE", "TZ", "TMPDIR", "TEMP", "TMP",
    "LD_LIBRARY_PATH", "XDG_CACHE_HOME",
    "PYTHONPATH", "PYTHONHOME", "PYTHONHASHSEED", "PYTHONWARNINGS", "VIRTUAL_ENV",
    "GOOGLE_APPLICATION_CREDENTIALS", "GOOGLE_CLOUD_PROJECT",
    # TLS and proxies on the way to object stores
    "SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE",
    "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "no_proxy",
})
ENGINE_ENV_PREFIXES = (
    "LC_", "OMP_", "MKL_", "OPENBLAS_", "TOKENIZERS_",
    "CUDA_", "NVIDIA_", "ROCR_", "HIP_",
    "HF_", "TRANSFORMERS_", "RLHF_", "VLLM_", "TORCH", "PYTORCH_", "NCCL_", "GLOO_", "MASTER_",
    "AWS_", "AZURE_", "FSSPEC_",
)
# Never passed on, whatever the allow-list or `pass_env` say: the orchestrator's secrets.
DENIED_ENV_PREFIXES = ("AIRFLOW",)
DENIED_ENV_PARTS = ("_CONN_", "SQL_ALCHEMY", "FERNET", "JWT")


def _denied(name: str) -> bool:
    upper = name.upper()
    return upper.startswith(DENIED_ENV_PREFIXES) or any(part in upper for part in DENIED_ENV_PARTS)


def _allowed(name: str, pass_env: Sequence[str]) -> bool:
    if name in ENGINE_ENV_NAMES or name.startswith(ENGINE_ENV_PREFIXES):
        return True
    return any(name.startswith(p[:-1]) if p.endswith("*") else name == p for p in pass_env)


def engine_environment(worker_env: Mapping[str, str], extra: Mapping[str, Any] | None = None,
                       pass_env: Sequence[str] = ()) -> dict[str, str]:
    """The environment of an engine subprocess, built from the worker's (see the module docstring).

    `pass_env`: more names to keep (`NAME`, or `PREFIX*`), e.g. an experiment tracker's key;
    Airflow's variables stay out regardless. `extra`: set explicitly, applied last.
    """
    kept = {k: v for k, v in worker_env.items() if _allowed(k, pass_env) and not _denied(k)}
    return {**THREAD_ENV, **kept, **QUIET_ENV, **{k: str(v) for k, v in (extra or {}).items()}}


class SupervisedProcessOperator(BaseOperator):
    """Runs `command` (argv list) to completion, streaming its output; non-zero exit fails the task.

    :param command: argv of the process (templated).
    :param env: environment variables set for the process (templated), on top of what
        `engine_environment` keeps of the worker's environment.
    :param pass_env: more worker variables to pass on (`NAME` or `PREFIX*`); never Airflow's.
    :param cwd: working directory.
    :param kill_grace_s: seconds between SIGTERM and SIGKILL when the task is stopped.
    :param tail_lines: lines of output quoted in the failure message.
    """

    template_fields: Sequence[str] = ("command", "env")
    ui_color = "#d8e8f8"
    monitor_interval_s: float = 5.0
    output_drain_s: float = 5.0  # how long output is still read once the process has exited
    _stopped_because: str | None = None

    def __init__(self, *, command: Sequence[str], env: dict[str, str] | None = None, cwd: str | None = None,
                 pass_env: Sequence[str] = (), kill_grace_s: float = 30.0, tail_lines: int = 20,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.command = command
        self.env = env
        self.pass_env = tuple(pass_env)
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
        if not previous or not previous.get("pgid"):
            return
        why = identity_mismatch(previous)
        if why is not None:
            self.log.info("not stopping process group %s recorded by a previous try: %s", previous["pgid"], why)
            return
        if stop_group(int(previous["pgid"]), self.kill_grace_s):
            self.log.warning("stopped process group %s left by a previous try", previous["pgid"])

    def _remember(self, context, pgid: int | None) -> None:
        store = self._state_store(context)
        if store is None:
            return
        try:
            store.set(STATE_KEY, {"pgid": pgid, **process_identity(pgid)} if pgid else None)
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
        env = engine_environment(os.environ, {**self.process_environment(context), **(self.env or {})}, self.pass_env)
        self.log.info("starting (try %s): %s", try_number, " ".join(argv))
        tail: deque[str] = deque(maxlen=self.tail_lines)
        started = time.monotonic()
        self._proc = subprocess.Popen(
            argv, cwd=self.cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, start_new_session=True,
        )
        self._remember(context, self._proc.pid)
        watcher = self._start_monitor(context)
        try:
            self._stream(self._proc, tail)
            code = self._proc.wait()
        finally:
            # Reached on success, on a non-zero exit, and when execution_timeout or a signal
            # interrupts the loop above: never leave the group behind.
            watcher.set()
            if self._proc.poll() is None:
                self.log.warning("stopping process group %s", self._proc.pid)
            stop_group(self._proc.pid, self.kill_grace_s)
            self._proc.stdout.close()  # a leftover outside the group that writes on gets EPIPE
            self._remember(context, None)
        elapsed = round(time.monotonic() - started, 1)
        if self._stopped_because:
            raise AirflowException(f"stopped {argv[0]} after {elapsed}s: {self._stopped_because}")
        if code != 0:
            quoted = "\n".join(tail)
            raise AirflowException(f"{argv[0]} exited with code {code} after {elapsed}s; last lines:\n{quoted}")
        self.log.info("finished in %ss", elapsed)
        return {"returncode": code, "elapsed_s": elapsed}

    def _stream(self, proc: subprocess.Popen, tail: deque) -> None:
        """Pass the output to `handle_line` line by line (universal newlines, UTF-8) until it ends,
        or, once the process has exited, for `output_drain_s` at most: a process it started may
        hold the pipe open for good."""
        fd = proc.stdout.fileno()
        ready = selectors.DefaultSelector()  # poll/epoll: any descriptor number (select() stops at 1024)
        ready.register(fd, selectors.EVENT_READ)
        decoder = io.IncrementalNewlineDecoder(codecs.getincrementaldecoder("utf-8")("replace"), True)
        pending, deadline = "", None
        while True:
            if deadline is None and proc.poll() is not None:
                deadline = time.monotonic() + self.output_drain_s
            wait = 1.0 if deadline is None else deadline - time.monotonic()
            if wait <= 0:
                self.log.warning("the process exited with code %s, but its output is still open %ss "
                                 "later: a process it started holds it", proc.returncode, self.output_drain_s)
                break
            if not ready.select(wait):
                continue
            chunk = os.read(fd, 65536)
            *lines, pending = (pending + decoder.decode(chunk, final=not chunk)).split("\n")
            for line in lines:
                tail.append(line)
                self.handle_line(line)
            if not chunk:
                break
        ready.close()
        if pending:
            tail.append(pending)
            self.handle_line(pending)

    # watching the process while it runs ------------------------------------------------------
    def monitor(self, context) -> str | None:
        """Called every `monitor_interval_s` while the process runs (in a thread of the task): a
        reason to stop the process, or None. With a reason, the process group is stopped and the
        task fails with it (a retryable failure: retries take over)."""
        return None

    def on_monitor_stop(self, context, reason: str) -> None:
        """Called once when `monitor` returned a reason, before the process group is stopped."""

    def _start_monitor(self, context) -> threading.Event:
        done = threading.Event()
        self._stopped_because = None
        proc = self._proc

        def watch() -> None:
            while not done.wait(self.monitor_interval_s) and proc.poll() is None:
                try:
                    reason = self.monitor(context)
                except Exception as e:  # a failed look (storage hiccup) never stops a healthy process
                    self.log.warning("monitor: %s", e)
                    continue
                if reason:
                    self._stopped_because = reason
                    self.log.error("%s; stopping process group %s", reason, proc.pid)
                    try:
                        self.on_monitor_stop(context, reason)
                    finally:
                        stop_group(proc.pid, self.kill_grace_s)
                    return

        threading.Thread(target=watch, name=f"monitor-{self.task_id}", daemon=True).start()
        return done

    def process_environment(self, context) -> dict[str, str]:
        """Variables a subclass sets for the process (before the operator's own `env`)."""
        return {}

    def on_kill(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self.log.warning("task killed: stopping process group %s", self._proc.pid)
            stop_group(self._proc.pid, self.kill_grace_s)
