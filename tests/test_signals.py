"""Stop signals (pipeline/signals.py), in a process of their own: the first one unwinds, later ones
cannot cut the clean-up short, and an inherited ignore of SIGINT or SIGHUP is kept."""

import signal
import sys

import pytest

SCRIPT = """
import os, signal, time
from pipeline.signals import StopSignal, handle_stop_signals

print(*sorted(s.name for s in handle_stop_signals()))
try:
    os.kill(os.getpid(), signal.SIGINT)  # ignored or not, whatever the process inherited
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(30)
except StopSignal as e:
    os.kill(os.getpid(), signal.SIGHUP)  # while stopping: reported, changes nothing
    time.sleep(0.1)
    print(e.signum.name, e.exit_code)
"""


@pytest.mark.parametrize("ignore,handled,first", [
    ((), "SIGHUP SIGINT SIGTERM", "SIGINT 130"),
    ((signal.SIGINT, signal.SIGHUP), "SIGTERM", "SIGTERM 143"),
], ids=["defaults", "nohup-background-job"])
def test_first_stop_signal_unwinds_later_ones_change_nothing_inherited_ignores_are_kept(
        spawn, ignore, handled, first):
    p = spawn.run([sys.executable, "-c", SCRIPT], ignore=ignore, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines() == [handled, first]
    assert ("SIGHUP while stopping" in p.stderr) == ("SIGHUP" in handled)
