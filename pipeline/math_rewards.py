"""Rule rewards of the common verl math data sources, with verl's signature.

- `gsm8k_score` (`openai/gsm8k`): the final number of the answer (after the last `####`, else the
  last number in the text) equals the ground truth's, compared as numbers (`1,000` = `1000.0`; a
  comma counts only between groups of three digits).
- `boxed_math_score` (`lighteval/MATH`, `HuggingFaceH4/MATH-500`, ...): the content of the last
  `\\boxed{...}` (braces balanced) equals the ground truth after a light LaTeX normalisation
  (spaces, `\\left`/`\\right`, `\\!`, `\\dfrac`, a trailing `.`), or both are the same number.

A ground truth may be a list of acceptable answers: any match scores 1. Both return 1.0 or 0.0.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
_FRAC = re.compile(r"^(-?)\\frac\{(-?\d+)\}\{(-?\d+)\}$")
# a plain decimal (commas only as thousands separators) or a ratio of integers: no exponent, so
# that no answer a model writes (`1e999999999`) costs the scorer more than reading it
_DECIMAL = re.compile(r"^[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?$|^[-+]?\.\d+$")
_RATIO = re.compile(r"^([-+]?\d+)/([-+]?\d+)$")
MAX_NUMBER_CHARS = 200


def parse_number(text: str) -> Fraction | None:
    """`72`, `-3.5`, `1,000`, `$12.`, `3/4`, `\\frac{3}{4}` -> an exact number; None otherwise
    (`1,2` is not 12: a comma counts only between groups of three digits)."""
    t = text.strip().replace("$", "").strip().rstrip(".,").strip()
    if len(t) > MAX_NUMBER_CHARS:
        return None
    m = _FRAC.match(t)
    if m:
        t = f"{m.group(1)}{m.group(2)}/{m.group(3)}"
    m = _RATIO.match(t)
    if m:
        return Fraction(int(m.group(1)), int(m.group(2))) if int(m.group(2)) else None
    return Fraction(t.replace(",", "")) if _DECIMAL.match(t) else None


def final_number(text: str) -> str | None:
    """GSM8K's answer: what follows the last `####`, else the last number in the text."""
    if "####" in text:
        m = _NUMBER.search(text.rsplit("####", 1)[1])
        return m.group(0) if m else None
    found = _NUMBER.findall(text)
    return found[-1] if found else None


def _candidates(ground_truth: Any) -> list[str]:
    if isinstance(ground_truth, (list, tuple)):
        return [str(g) for g in ground_truth]
    return [str(ground_truth)]


def gsm8k_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> float:
    got = final_number(solution_str)
    value = parse_number(got) if got is not None else None
    if value is None:
        return 0.0
    for gt in _candidates(ground_truth):
        want = final_number(gt)
        if want is not None and parse_number(want) == value:
            return 1.0
    return 0.0


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`), nested braces balanced; `\\boxed 5` too."""
    boxed, fbox = text.rfind("\\boxed"), text.rfind("\\fbox")
    if boxed < 0 and fbox < 0:
        return None
    i = boxed + len("\\boxed") if boxed > fbox else fbox + len("\\fbox")  # just after the keyword
    if text.startswith(" ", i):  # `\boxed 5`: up to the next space or `$`
        return re.split(r"[\s$]", text[i + 1:], maxsplit=1)[0] or None
    if not text.startswith("{", i):
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1:j]
    return None  # unbalanced: no answer


_LATEX_DROP = ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "^\\circ", "^{\\circ}", "$", " ")


def normalize_math(answer: str) -> str:
    s = answer.strip()
    for token in _LATEX_DROP:
        s = s.replace(token, "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    return s.rstrip(".")


def _same_answer(got: str, want: str) -> bool:
    a, b = normalize_math(got), normalize_math(want)
    if a == b:
        return True
    na, nb = parse_number(a), parse_number(b)
    return na is not None and na == nb


def boxed_math_score(data_source: str, solution_str: str, ground_truth: Any,
                     extra_info: dict | None = None) -> float:
    got = last_boxed(solution_str)
    if got is None:
        return 0.0
    for gt in _candidates(ground_truth):
        want = last_boxed(gt) if "\\boxed" in gt or "\\fbox" in gt else gt
        if want is not None and _same_answer(got, want):
            return 1.0
    return 0.0
