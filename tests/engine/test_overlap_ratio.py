import pytest

from pipeline.summary import overlap_ratio


@pytest.mark.parametrize("wall, s, t, expected", [(10.0, 10.0, 4.0, 1.0), (10.0, 5.0, 5.0, 2.0),
                                                  (12.0, 3.0, 8.0, 1.5), (5.0, 0.0, 0.0, None)])
def test_overlap_ratio_is_wall_over_the_busier_process(wall, s, t, expected):
    assert overlap_ratio(wall, s, t) == expected
