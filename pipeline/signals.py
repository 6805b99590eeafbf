"""How `rlhf` processes stop on a signal: SIGINT, SIGTERM and SIGHUP unwind like Ctrl-C.

A stop signal raises `StopSignal` (a `KeyboardInterrupt`) in the main thread, so `finally` blocks
run: the sampler commits its queued shards, metrics are flushed, the local runner stops its
sampler and trainer. The process then exits with 128 + the signal's number, as a shell reports a
process the signal killed. The first stop signal starts this clean path; later ones are reported
and change nothing, so a second signal cannot cut a commit or the runner's clean-up short (the
runner still SIGKILLs a child that outlives its grace period).

SIGTERM is always handled: it is how Airflow (`on_kill`), Kubernetes and the local runner stop a
process. SIGINT and SIGHUP are handled unless the process started with them ignored, and then
stay ignored: a non-interactive shell starts a background job (`cmd &`) with SIGINT ignored and
`nohup` starts its command with SIGHUP ignored, both so that it outlives the terminal or the
script that started it. Whoever started it that way stops it with SIGTERM.
"""

from __future__ import annotations

import os
import signal

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class StopSignal(KeyboardInterrupt):
    """A stop signal arrived; `signum` is which."""

    def __init__(self, signum: int):
        self.signum = signal.Signals(signum)
        super().__init__(self.signum.name)

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def handle_stop_signals() -> list[signal.Signals]:
    """Make the stop signals raise `StopSignal` (see the module docstring); returns those handled."""
    stopping = False

    def on_stop_signal(signum, frame):
        nonlocal stopping
        if stopping:
            # os.write, not print or logging: the main thread may be inside a write to stderr
            os.write(2, f"{signal.Signals(signum).name} while stopping: the clean stop goes on\n".encode())
            return
        stopping = True
        raise StopSignal(signum)

    handled = []
    for sig in STOP_SIGNALS:
        if sig != signal.SIGTERM and signal.getsignal(sig) == signal.SIG_IGN:
            continue  # inherited as ignored: honoured
        signal.signal(sig, on_stop_signal)
        handled.append(sig)
    return handled


def default_stop_signals() -> None:
    """`preexec_fn` for engine processes the local runner starts: the stop signals get their
    default dispositions, whatever the runner inherited, so each child decides for itself (it
    handles all three) instead of inheriting an ignore meant for the runner."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_DFL)
    _term_when_parent_dies()


def _term_when_parent_dies() -> None:
    """Linux: SIGTERM this process when the process that started it dies, even by SIGKILL, so a
    killed runner leaves no sampler or trainer behind (they stop cleanly on SIGTERM)."""
    import ctypes
    import sys

    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
