import pytest

from pipeline.config import ConfigError
from pipeline.rewards import REWARD_SOURCES, check_reward_spec, load_reward_fn, score
from pipeline.builtin_tasks import make_rows, sort_score


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
        score(lambda **kw: {"acc": 1.0}, "x", "y", "z", None)


def test_task_rows_are_deterministic_and_splits_differ():
    a = make_rows("sort", 20, 0, "train")
    assert a == make_rows("sort", 20, 0, "train")
    assert a != make_rows("sort", 20, 0, "test")
    r = a[0]
    assert set(r) == {"data_source", "prompt", "ability", "reward_model", "extra_info"}
    digits = r["prompt"][0]["content"].split()[1].rstrip(":")
    assert r["reward_model"]["ground_truth"] == "".join(sorted(digits))


def _user_fn(tmp_path, body: str, name: str = "compute_score") -> str:
    f = tmp_path / "user_reward.py"
    f.write_text(body)
    return f"{f}:{name}"


def test_reward_is_called_by_keyword_so_a_keyword_only_function_works(tmp_path):
    spec = _user_fn(tmp_path,
                    "def compute_score(*, data_source, solution_str, ground_truth, extra_info=None):\n"
                    "    return {'score': float(solution_str in ground_truth['answers']), 'k': extra_info['k']}\n")
    fn = load_reward_fn(spec)
    assert not fn.batched
    s = score(fn, "src", "b", {"answers": ["a", "b"]}, {"k": 2})
    assert s.reward == 1.0 and s.extra == {"k": 2.0}


def test_ground_truth_reaches_the_function_with_its_type(tmp_path):
    spec = _user_fn(tmp_path, "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                              "    return {'score': 0.0, 'is_list': isinstance(ground_truth, list)}\n")
    assert score(load_reward_fn(spec), "s", "x", ["1", "2"], None).extra == {"is_list": 1.0}


def test_a_function_without_extra_info_is_called_without_it(tmp_path):
    spec = _user_fn(tmp_path, "def compute_score(data_source, solution_str, ground_truth):\n"
                              "    return float(solution_str == ground_truth)\n")
    assert load_reward_fn(spec)("s", "4", "4", {"unused": 1}) == 1.0


def test_positional_only_reward_is_refused_with_the_signature_named(tmp_path):
    spec = _user_fn(tmp_path, "def compute_score(a, b, c, /):\n    return 0.0\n")
    with pytest.raises(ConfigError, match=r"takes \(a, b, c, /\); it must accept the keywords data_source"):
        load_reward_fn(spec)


def test_batched_reward_is_told_by_its_signature_and_gets_lists(tmp_path):
    spec = _user_fn(tmp_path,
                    "def compute_score(data_sources, solution_strs, ground_truths, extra_infos=None):\n"
                    "    return [{'score': float(s == g), 'n': len(solution_strs)}\n"
                    "            for s, g in zip(solution_strs, ground_truths)]\n")
    fn = load_reward_fn(spec)
    assert fn.batched
    out = fn.call_batch([("s", "1", "1", None), ("s", "2", "3", None)])
    assert out == [{"score": 1.0, "n": 2}, {"score": 0.0, "n": 2}]
    assert fn("s", "1", "1") == {"score": 1.0, "n": 1}  # one sample = a batch of one


def test_batched_reward_returning_the_wrong_length_is_an_error(tmp_path):
    spec = _user_fn(tmp_path, "def f(**kw):\n    return [1.0]\n", "f")
    fn = load_reward_fn(spec, batched=True)
    with pytest.raises(ValueError, match="returned 1 values for 2 samples"):
        fn.call_batch([("s", "a", "a", None), ("s", "b", "b", None)])


def test_auto_dispatches_by_data_source():
    fn = load_reward_fn("auto")
    assert fn("builtin/digit", "777", "7") == 1.0
    assert fn("openai/gsm8k", "so 3+4 = 7. #### 7", "7") == 1.0
    assert fn("HuggingFaceH4/MATH-500", "the answer is $\\boxed{\\dfrac{1}{2}}$", "\\frac{1}{2}") == 1.0
    assert fn("lighteval/MATH", "\\boxed{3}", "4") == 0.0
    assert REWARD_SOURCES["gsm8k"] == "gsm8k"


def test_auto_with_an_unknown_data_source_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"no built-in reward for data_source 'my/task'; known: .*openai/gsm8k"):
        load_reward_fn("auto")("my/task", "x", "y")


def test_the_reward_file_is_checked_without_running_it(tmp_path):
    """prepare runs in the Airflow worker, beside the deployment's secrets: it reads the file."""
    ran = tmp_path / "ran"
    good = _user_fn(tmp_path, f"open({str(ran)!r}, 'w').write('x')\n"
                              "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                              "    return 0.0\n")
    check_reward_spec(good)
    assert not ran.exists()
    load_reward_fn(good)  # the sampler's reward worker imports it
    assert ran.exists()


@pytest.mark.parametrize("body, message", [
    ("def other(data_source, solution_str, ground_truth):\n    return 0.0\n", "has no function 'compute_score'"),
    ("def compute_score(data_source, solution_str\n", "is not valid Python"),
    ("def compute_score(a, b, c, /):\n    return 0.0\n",
     r"takes \(a, b, c, /\); it must accept the keywords data_source"),
    ("def compute_score(data_sources, solution_strs):\n    return []\n",
     "data_sources, solution_strs, ground_truths \\(batched"),
])
def test_a_reward_file_read_without_running_it_names_what_is_wrong(tmp_path, body, message):
    with pytest.raises(ConfigError, match=message):
        check_reward_spec(_user_fn(tmp_path, body))


@pytest.mark.parametrize("body", [
    "from math import floor as compute_score\n",
    "compute_score = lambda **kw: 0.0\n",
    "import functools\n@functools.lru_cache\ndef compute_score(*a):\n    return 0.0\n",
    "try:\n    from fast import compute_score\nexcept ImportError:\n    pass\n",
    "def compute_score(**kwargs):\n    return 0.0\n",
    # a fallback with another signature, then the real one inside a `try` (a later def wins)
    "def compute_score(solution_str, ground_truth):\n    return 0.0\ntry:\n    import json\n"
    "    def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n        return 0.0\n"
    "except ImportError:\n    pass\n",
    "def compute_score(solution_str):\n    return 0.0\nfor n in ['compute_score']:\n"
    "    globals()[n] = lambda **kw: 1.0\n",  # bound at run time
])
def test_a_name_bound_otherwise_is_left_to_the_sampler(tmp_path, body):
    check_reward_spec(_user_fn(tmp_path, body))


def test_a_missing_reward_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        check_reward_spec(f"{tmp_path}/nope.py:compute_score")


def test_a_statement_that_binds_nothing_keeps_the_signature_check(tmp_path):
    body = "def compute_score(solution_str):\n    return 0.0\nif __name__ == '__main__':\n    print(1)\n"
    with pytest.raises(ConfigError, match="it must accept the keywords"):
        check_reward_spec(_user_fn(tmp_path, body))


def test_a_reward_is_a_real_number_not_a_string_and_extras_keep_finite_numbers():
    import numpy as np

    from pipeline.rewards import to_score

    got = to_score({"score": np.float32(0.5), "n": np.int64(3), "ok": np.bool_(True), "nan": float("nan"),
                    "text": "x", "many": np.ones(3)})
    assert (got.reward, got.extra) == (0.5, {"n": 3.0, "ok": 1.0})
    for bad in ("0.75", None, [1.0]):
        with pytest.raises(ValueError, match="not a number"):
            to_score(bad)


def test_a_deployment_can_allow_reward_files_only_in_its_folders(tmp_path, monkeypatch):
    allowed, other = tmp_path / "rewards", tmp_path / "elsewhere"
    allowed.mkdir()
    other.mkdir()
    body = "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n"
    (allowed / "ok.py").write_text(body)
    (other / "no.py").write_text(body)
    (allowed / "link.py").symlink_to(other / "no.py")
    monkeypatch.setenv("RLHF_REWARD_ROOTS", f"{tmp_path}/configs, {allowed}")
    check_reward_spec(f"{allowed}/ok.py:compute_score")
    for spec in (f"{other}/no.py", f"{allowed}/../elsewhere/no.py", f"{allowed}/link.py"):
        with pytest.raises(ConfigError, match=r"is outside the folders this deployment allows reward files in "
                                              r"\(\$RLHF_REWARD_ROOTS: .*/configs, .*/rewards\)"):
            check_reward_spec(f"{spec}:compute_score")
    with pytest.raises(ConfigError, match="outside the folders"):
        load_reward_fn(f"{other}/no.py:compute_score")
