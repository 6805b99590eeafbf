import pytest

from pipeline.summary import overlap_ratio


@pytest.mark.parametrize("wall, s, t, expected", [(10.0, 10.0, 4.0, 1.0), (10.0, 5.0, 5.0, 2.0),
                                                  (12.0, 3.0, 8.0, 1.5), (5.0, 0.0, 0.0, None)])
def test_overlap_ratio_is_wall_over_the_busier_process(wall, s, t, expected):
    assert overlap_ratio(wall, s, t) == expected


def test_the_wall_of_a_resumed_run_leaves_out_the_time_between_its_attempts():
    from pipeline.summary import attempts_wall

    # attempt 1: started at 0, steps until 10; resumed an hour later: started at 3600, steps until 3605
    busy = [(1.0, 4.0), (2.0, 10.0), (3601.0, 3605.0)]
    assert attempts_wall([0.0, 3600.0], [0.5, 3600.2], busy) == 10.0 + 5.0
    # a sampler restarted while the trainer waits for it does not end the attempt
    assert attempts_wall([0.0], [0.5, 12.0], [(1.0, 10.0), (13.0, 20.0)]) == 20.0
    assert attempts_wall([0.0], [], []) == 0.0


def test_staleness_and_last_reward_in_the_summary_are_the_fresh_steps(tmp_path):
    """Replayed groups are older than sampler.max_staleness by design, and a replay update's reward
    is that of the rows it replays: neither belongs in the fresh-data figures."""
    from pipeline.rundir import RunDir
    from pipeline.summary import build_summary

    run = RunDir(str(tmp_path / "r"))
    m = run.metrics("trainer")
    for step, replay, stale, reward in [(1, 0, 1, 0.2), (1, 1, 5, 0.9), (2, 0, 1, 0.3), (2, 1, 7, 0.95)]:
        m.log({"step": step, "replay/is_replay": replay, "staleness/max": stale, "reward/mean": reward,
               "trainer/samples": 4, "trainer/response_tokens": 8, "time/start": step, "time/end": step + 0.5})
    m.flush()
    s = build_summary(run, {"score": 0.1}, {"score": 0.2}, 2)
    assert (s["max_staleness_seen"], s["reward_first"], s["reward_last"], s["steps"]) == (1, 0.2, 0.3, 2)
