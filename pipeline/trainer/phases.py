"""Phases and replay gates: the contract between the trainer and its orchestrator.

The trainer's `trainer.steps` fresh steps are split into `trainer.phases` equal phases. At the end
of phase k it saves a checkpoint and writes marker `phase_<k>.done` = {"step", "checkpoint"}; the
policy of that boundary reaches the sampler only through the reshard path (the DAG's reshard task,
or `advance` below). `trainer.replay_epochs` replay passes over L2 are spread evenly over the fresh
steps; before epoch e the trainer waits for marker `replay_gate_<e>.open`. An epoch that falls due
while L2 holds less than one step of eligible groups (the gate's own condition) is deferred to a
later fresh step instead of waited for: only fresh steps add to L2, so that wait could never end.
Each epoch makes eligible // groups_per_step draws by priority; new priorities (the group's mean
|advantage|) and replay counts go back to the buffer after every draw.

`advance(run)` is what an orchestrator does between trainer and sampler: publish every finished
phase's checkpoint that is not yet a policy version, and open every replay gate whose condition
holds (L2 holds at least one step's worth of eligible groups, the Airflow sensor's threshold). The
local runner calls it in its progress loop; the Airflow tasks do the same through their sensors.
"""

from __future__ import annotations

import logging

from ..config import TrainerConfig
from ..runs import RunDir

log = logging.getLogger("rlhf.phases")


def phase_done_marker(phase: int) -> str:
    return f"phase_{int(phase)}.done"


def replay_gate_marker(epoch: int) -> str:
    return f"replay_gate_{int(epoch)}.open"


def phase_end_steps(tc: TrainerConfig) -> dict[int, int]:
    """{fresh step that ends phase k: k}."""
    per = tc.steps // tc.phases
    return {(k + 1) * per: k for k in range(tc.phases)}


def replay_epoch_steps(tc: TrainerConfig) -> list[int]:
    """The fresh step after which replay epoch e runs, for each e (evenly spread, the last at the end)."""
    E = tc.replay_epochs
    return [max(1, round((e + 1) * tc.steps / E)) for e in range(E)]


def advance(run: RunDir) -> list[str]:
    """Publish pending phase checkpoints and open due replay gates. Returns what it did."""
    from ..policy import PolicyStore
    from .publish import publish_phase_checkpoint

    cfg = run.config()
    tc = cfg.trainer
    done: list[str] = []
    store = PolicyStore(run)
    for k in range(tc.phases):
        m = run.marker(phase_done_marker(k))
        if m is None:
            break
        step = int(m["step"])
        if not store.exists(step):
            publish_phase_checkpoint(run.url, m["checkpoint"], step)
            done.append(f"published policy v{step} from phase {k}")
    if tc.replay_epochs:
        from ..buffer import ReplayBuffer

        for e in range(tc.replay_epochs):
            gate = replay_gate_marker(e)
            if run.has_marker(gate):
                continue
            try:
                eligible = ReplayBuffer(run.buffer_url, cfg.buffer).eligible_replay_groups()
            except FileNotFoundError:
                break
            if eligible < tc.groups_per_step:
                break
            run.set_marker(gate, {"eligible": eligible, "epoch": e})
            done.append(f"opened replay gate {e} ({eligible} eligible groups)")
    for line in done:
        log.info("%s", line)
    return done
