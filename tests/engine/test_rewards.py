import pytest

from pipeline.config import ConfigError
from pipeline.rewards import load_reward_fn, score
from pipeline.tasks import make_rows, sort_score


def test_builtin_sort_reward_partial_credit():
    assert sort_score("s", "0123", "0123")["score"] == 1.0
    assert sort_score("s", "0123", "0123")["acc"] == 1.0
    assert sort_score("s", "0132", "0123")["score"] == 0.5
    assert sort_score("s", "01", "0123")["score"] == 0.5
    assert sort_score("s", "012345", "0123")["score"] == 4 / 6


def test_reward_by_name_and_unknown_name():
    assert load_reward_fn("digit")("d", "777", "7") == 1.0
    with pytest.raises(ConfigError, match="reward.fn: unknown reward 'nope'"):
        load_reward_fn("nope")


def test_user_reward_file_with_verl_signature(tmp_path):
    f = tmp_path / "my_reward.py"
    f.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return {'score': float(solution_str.strip() == ground_truth), 'len': len(solution_str)}\n"
    )
    fn = load_reward_fn(f"{f}:compute_score")
    s = score(fn, "x", " 42", "42", None)
    assert s.reward == 1.0 and s.extra == {"len": 3.0}


def test_user_reward_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_reward_fn(f"{tmp_path}/missing.py:f")
    f = tmp_path / "r.py"
    f.write_text("x = 1\n")
    with pytest.raises(ConfigError, match="no function 'f'"):
        load_reward_fn(f"{f}:f")


def test_dict_reward_without_score_is_an_error():
    with pytest.raises(ValueError, match="without 'score'"):
        score(lambda *a: {"acc": 1.0}, "x", "y", "z", None)


def test_task_rows_are_deterministic_and_splits_differ():
    a = make_rows("sort", 20, 0, "train")
    assert a == make_rows("sort", 20, 0, "train")
    assert a != make_rows("sort", 20, 0, "test")
    r = a[0]
    assert set(r) == {"data_source", "prompt", "ability", "reward_model", "extra_info"}
    digits = r["prompt"][0]["content"].split()[1].rstrip(":")
    assert r["reward_model"]["ground_truth"] == "".join(sorted(digits))
