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
