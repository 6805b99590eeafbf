"""Built-in rule rewards of the common verl math data sources, by example."""

import pytest

from pipeline.math_rewards import boxed_math_score, final_number, gsm8k_score, last_boxed, normalize_math


@pytest.mark.parametrize("solution,truth,expected", [
    ("Natalia sold 48/2 = 24 clips in May. 48+24 = 72. #### 72", "72", 1.0),
    ("She pays $1,000 in total. #### $1,000", "1000", 1.0),
    ("The answer is 18.", "18", 1.0),                       # no ####: the last number
    ("#### 18.0", "18", 1.0),                               # compared as numbers
    ("#### 17", "18", 0.0),
    ("I think 18, no wait, #### 19", "18", 0.0),            # the number after #### wins
    ("no number here", "18", 0.0),
    ("#### -3", "-3", 1.0),
    ("5 apples #### 5", "She has 2 + 3 = 5 apples.\n#### 5", 1.0),  # ground truth as the full answer
    ("#### 0.50", ".5", 1.0),
    ("#### 6", ["5", "6"], 1.0),                            # a list of acceptable answers
])
def test_gsm8k_final_number(solution, truth, expected):
    assert gsm8k_score("openai/gsm8k", solution, truth) == expected


def test_final_number_extraction():
    assert final_number("a 1 b 2,500 c") == "2,500"
    assert final_number("#### 12 dollars, 13") == "12"
    assert final_number("nothing") is None


@pytest.mark.parametrize("text,content", [
    ("so $\\boxed{42}$.", "42"),
    ("\\boxed{1} then \\boxed{\\frac{a}{b+\\sqrt{2}}}", "\\frac{a}{b+\\sqrt{2}}"),  # the last, braces balanced
    ("\\fbox{x}", "x"),
    ("\\boxed 5$", "5"),
    ("\\boxed{unbalanced", None),
    ("no box", None),
])
def test_last_boxed(text, content):
    assert last_boxed(text) == content


@pytest.mark.parametrize("solution,truth,expected", [
    ("$\\boxed{\\dfrac{1}{2}}$", "\\frac{1}{2}", 1.0),
    ("\\boxed{\\left( 3, 4 \\right)}", "(3,4)", 1.0),
    ("\\boxed{10.}", "10", 1.0),
    ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),                 # same number
    ("\\boxed{90^\\circ}", "90", 1.0),
    ("\\boxed{3}", "The answer is $\\boxed{3}$.", 1.0),     # ground truth as a full solution
    ("\\boxed{x+1}", "x+2", 0.0),
    ("the answer is 3", "3", 0.0),                          # no box, no credit
    ("\\boxed{b}", ["a", "b"], 1.0),
])
def test_boxed_math_match(solution, truth, expected):
    assert boxed_math_score("lighteval/MATH", solution, truth) == expected


def test_normalize_math():
    assert normalize_math(" \\left[ 1,\\! 2 \\right] . ") == "[1,2]"
    assert normalize_math("\\tfrac{3}{4}") == "\\frac{3}{4}"


@pytest.mark.parametrize("solution, truth", [
    ("\\boxed{23}", "2, 3"),  # a list is not the number its digits make
    ("\\boxed{1,2}", "12"),
    ("\\boxed{357}", "3, 5, 7"),
    ("#### 1,2", "12"),
])
def test_a_comma_counts_only_between_groups_of_three_digits(solution, truth):
    score = boxed_math_score if "boxed" in solution else gsm8k_score
    assert score("x", solution, truth) == 0.0


@pytest.mark.parametrize("solution, truth", [("#### 1,234,567.", "1234567"), ("so 42, done", "42"),
                                             ("\\boxed{2, 3}", "2,3"), ("\\boxed{-3/4}", "-0.75")])
def test_numbers_still_match_in_their_usual_forms(solution, truth):
    score = boxed_math_score if "boxed" in solution else gsm8k_score
    assert score("x", solution, truth) == 1.0


def test_an_answer_with_an_exponent_is_not_a_number():
    """Fraction("1e999999999") builds 10**999999999: one such answer stopped a run (timeout)."""
    from pipeline.math_rewards import parse_number

    assert parse_number("1e5") is None and parse_number("2E-3") is None
    assert boxed_math_score("x", "\\boxed{1e999999999}", "1") == 0.0
    assert parse_number("9" * 10_000) is None and parse_number("3/0") is None
