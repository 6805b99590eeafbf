"""Test-side handling of a `LocalAirflow` deployment's processes."""

import os
import signal

from pipeline.processes import group_alive


def tear_down(af, grace_s: float = 5) -> None:
    """`af.down()`, then SIGKILL the supervisor and component groups it left (a failed test must
    not leave processes behind)."""
    state = af.state()
    af.down(grace_s=grace_s)
    for pid in [state.get("pid"), *(c.get("pid") for c in state.get("components", {}).values())]:
        if pid and group_alive(int(pid)):
            os.killpg(int(pid), signal.SIGKILL)
