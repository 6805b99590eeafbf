"""Phases and replay epochs: when the trainer closes a phase and when it replays L2.

The trainer's `trainer.steps` fresh steps are split into `trainer.phases` equal phases. At the end
of phase k it saves a checkpoint and writes marker `RunDir.phase_done_marker(k)` = {"step",
"checkpoint"}; the policy of that boundary reaches the sampler only through the reshard path
(`pipeline.orchestration.publish_phase`: the DAG's reshard task, or the local runner's `advance`).
`trainer.replay_epochs` replay passes over L2 are spread evenly over the fresh steps; before epoch
e the trainer waits for marker `RunDir.replay_gate_marker(e)`, which the orchestrator writes once
`orchestration.replay_gate_ready` holds. An epoch that falls due while that condition does not
hold is deferred to a later fresh step instead of waited for: only fresh steps add to L2, so that
wait could never end. Each epoch makes eligible // groups_per_step draws by priority; new
priorities (the group's mean |advantage|) and replay counts go back to the buffer after every draw.
"""

from __future__ import annotations

from ..config import TrainerConfig
from ..rundir import RunDir


def phase_end_steps(tc: TrainerConfig) -> dict[int, int]:
    """{fresh step that ends phase k: k}."""
    per = tc.steps // tc.phases
    return {(k + 1) * per: k for k in range(tc.phases)}


def replay_epoch_steps(tc: TrainerConfig) -> list[int]:
    """The fresh step after which replay epoch e runs, for each e (evenly spread, the last at the end)."""
    E = tc.replay_epochs
    return [max(1, round((e + 1) * tc.steps / E)) for e in range(E)]


def mark_closed_phases(run: RunDir, tc: TrainerConfig, step: int) -> list[int]:
    """Write the missing markers of the phases a resumed trainer at `step` has closed. A trainer that
    stopped between a phase's checkpoint and its marker (killed there, or its last in-phase
    publication failed, which it reports only then) left the marker out; the orchestrator publishes
    phases in order and would never publish that one or any after it. Returns the phases marked."""
    from .checkpoint import list_checkpoints

    closed = {s: k for s, k in phase_end_steps(tc).items() if s <= step}
    missing = {s: k for s, k in closed.items() if not run.has_marker(RunDir.phase_done_marker(k))}
    if not missing:
        return []
    cks = {c.step: c for c in list_checkpoints(run)}
    for s, k in sorted(missing.items()):
        if s in cks:
            run.set_marker(RunDir.phase_done_marker(k), {"step": s, "checkpoint": cks[s].url})
    return [k for s, k in sorted(missing.items()) if s in cks]
