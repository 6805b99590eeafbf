"""The engine's long-running roles (`rlhf sampler`, `rlhf trainer`, `rlhf finalize`) as tasks."""

from __future__ import annotations

import sys
from typing import Any, Sequence

from plugins.operators.process import SupervisedProcessOperator

ROLES = ("sampler", "trainer", "finalize")


def engine_command(role: str, run_url: str, extra_args: Sequence[str] = ()) -> list[str]:
    """argv that runs one engine role with the worker's own interpreter (same environment)."""
    if role not in ROLES:
        raise ValueError(f"role {role!r}: choose one of {', '.join(ROLES)}")
    return [sys.executable, "-m", "pipeline", role, "--run-dir", run_url, *map(str, extra_args)]


class RlhfProcessOperator(SupervisedProcessOperator):
    """Supervises `rlhf <role> --run-dir URL`.

    Both sampler and trainer resume from the run directory when restarted (the trainer from its
    last complete checkpoint, the sampler from the latest published policy), so a retry runs the
    same command. Give GPU-heavy roles a `pool` with one slot per device.
    """

    template_fields: Sequence[str] = ("run_url", "extra_args", "env")

    def __init__(self, *, role: str, run_url: str, extra_args: Sequence[str] = (), **kwargs: Any) -> None:
        if role not in ROLES:
            raise ValueError(f"role {role!r}: choose one of {', '.join(ROLES)}")
        super().__init__(command=(), **kwargs)
        self.role = role
        self.run_url = run_url
        self.extra_args = extra_args

    def build_command(self, context) -> list[str]:
        return engine_command(self.role, self.run_url, self.extra_args)

    def on_retry_start(self, context) -> None:
        self.log.info("retry: %s resumes from the run directory %s", self.role, self.run_url)
