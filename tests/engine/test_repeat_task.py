from pipeline.builtin_tasks import SCORERS, TASKS, make_rows, repeat_score
from pipeline.rewards import REWARD_SOURCES


def test_repeat_rows_are_long_deterministic_repetitions():
    rows = make_rows("repeat", 200, 0, "train")
    assert rows == make_rows("repeat", 200, 0, "train")
    assert rows != make_rows("repeat", 200, 0, "test")
    for r in rows:
        _, pattern, times = r["prompt"][0]["content"].rstrip(":").split(" ")
        answer = r["reward_model"]["ground_truth"]
        assert 3 <= len(pattern) <= 6 and answer == pattern * int(times)
        assert 40 <= len(answer) <= 64 and answer.isdigit()
        assert r["data_source"] == "builtin/repeat"


def test_repeat_reward_gives_partial_credit_and_charges_length():
    gt = "123" * 14
    assert repeat_score("builtin/repeat", gt, gt)["score"] == 1.0
    assert repeat_score("builtin/repeat", gt[:21], gt)["score"] == 0.5
    assert repeat_score("builtin/repeat", gt + gt, gt)["score"] == 0.5
    assert repeat_score("builtin/repeat", "9" * 42, gt)["score"] == 0.0


def test_every_builtin_task_has_a_reward_by_data_source():
    for task in TASKS:
        assert REWARD_SOURCES[f"builtin/{task}"] == task and task in SCORERS
