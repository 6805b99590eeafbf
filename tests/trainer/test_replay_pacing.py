"""`trainer.replay_yield`: a replay epoch gives way to fresh data, so that replay fills only time
the trainer would spend waiting for the sampler; with a real trainer process on a pre-written buffer."""

from __future__ import annotations

import pytest

from pipeline.orchestration import open_replay_gate
from pipeline.rundir import RunDir

STEPS = 3


def replay_steps(path, replay_yield: bool) -> list[int]:
    """The fresh step after which each replay update ran, one replay epoch due after every step."""
    import test_resume as tr

    cfg = {**tr.CONFIG, "trainer": {**tr.CONFIG["trainer"], "steps": STEPS, "replay_epochs": STEPS,
                                    "checkpoint_every": 0, "replay_yield": replay_yield},
           "buffer": {"max_replays_per_group": 1}}
    url = tr.make_run(path, cfg)
    run = RunDir(url)
    for e in range(STEPS):  # the orchestrator's part (the gate sensors), done up front
        open_replay_gate(run, e, None)
    tr.trainer(url)
    return sorted(r["step"] for r in run.read_metrics("trainer") if r.get("replay/is_replay") == 1)


@pytest.mark.integration
def test_replay_gives_way_to_fresh_groups_that_are_already_there(tmp_path):
    """Every step's groups are in L1 before the trainer starts: after each fresh step but the last,
    the next step's groups have been read (while the step trained) before a replay update could
    start, so with replay_yield every replay comes after the last step, which has no fresh step to
    give way to. Without it the same run replays after the first steps."""
    given_way = replay_steps(tmp_path / "yield", True)
    scheduled = replay_steps(tmp_path / "schedule", False)
    assert given_way and set(given_way) == {STEPS}
    assert min(scheduled) < STEPS
