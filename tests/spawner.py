"""Processes a test starts, and the guarantee that none outlives it (the `spawn` fixture in conftest).

Each process starts in a process group of its own with default signal dispositions and an empty
signal mask, whatever this pytest inherited: a background job of a script ignores SIGINT, nohup
ignores SIGHUP, and a test must not depend on how the suite was started. When the test ends,
passed, failed or timed out (pytest-timeout's default method on POSIX, "signal", fails the test
from SIGALRM, so fixture teardown runs), everything left is SIGKILLed: the group, every
descendant, and every process that carries the spawn's tag in its environment, since the local
runner's sampler and trainer and torchrun's workers start sessions of their own and outlive a
parent that dies first.
"""

from __future__ import annotations

import os
import signal
import subprocess
import uuid

import psutil

SPAWN_TAG = "RLHF_TEST_SPAWN_TAG"
DEFAULT_DISPOSITIONS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


class Spawner:
    """`spawner(cmd, ignore=(signal.SIGINT,), **popen_kwargs)` -> Popen; `spawner.run(cmd, timeout=...)`
    -> CompletedProcess, like `subprocess.run`. As a context manager, kills everything on exit."""

    def __init__(self):
        self.tags: dict[subprocess.Popen, str] = {}

    def __enter__(self) -> Spawner:
        return self

    def __exit__(self, *exc) -> None:
        self.kill_all()

    def __call__(self, cmd, *, env=None, ignore=(), **kwargs) -> subprocess.Popen:
        """Start `cmd`; `ignore` lists signals it starts with ignored (all others get SIG_DFL)."""
        tag = uuid.uuid4().hex
        env = {**(os.environ if env is None else env), SPAWN_TAG: tag}
        dispositions = {sig: signal.SIG_DFL for sig in DEFAULT_DISPOSITIONS}
        dispositions.update({sig: signal.SIG_IGN for sig in ignore})

        def set_dispositions():
            signal.pthread_sigmask(signal.SIG_SETMASK, set())
            for sig, handler in dispositions.items():
                signal.signal(sig, handler)

        proc = subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=set_dispositions, **kwargs)
        self.tags[proc] = tag
        return proc

    def run(self, cmd, *, timeout: float, capture_output: bool = False, **kwargs) -> subprocess.CompletedProcess:
        """Run to the end; whatever it started is killed when it returns, fails or times out."""
        if capture_output:
            kwargs.update(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        proc = self(cmd, **kwargs)
        try:
            out, err = proc.communicate(timeout=timeout)
        finally:
            self.kill(proc)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def leftovers(self, proc: subprocess.Popen) -> list[psutil.Process]:
        """Every live process `proc` started, directly or not, and `proc` itself if alive."""
        found: dict[int, psutil.Process] = {}
        if proc.poll() is None:
            try:
                root = psutil.Process(proc.pid)
                found.update({q.pid: q for q in [root, *root.children(recursive=True)]})
            except psutil.NoSuchProcess:
                pass
        for q in psutil.process_iter():
            if q.pid in found or q.pid == os.getpid():
                continue
            try:
                if q.uids().real == os.getuid() and q.environ().get(SPAWN_TAG) == self.tags[proc]:
                    found[q.pid] = q
            except (psutil.Error, OSError):
                pass
        return list(found.values())

    def kill(self, proc: subprocess.Popen) -> None:
        """SIGKILL `proc`'s group and whatever else it started; reap it, close its pipes."""
        if proc.poll() is None:  # not reaped yet, so proc.pid is still its group's id
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        left = self.leftovers(proc)
        for q in left:
            try:
                q.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(left, timeout=10)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()

    def kill_all(self) -> None:
        for proc in self.tags:
            self.kill(proc)
