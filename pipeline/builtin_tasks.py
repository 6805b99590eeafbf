"""Built-in tasks: prompt generators with verl-format rows and their reward functions.

- `sort`: sort a string of 3-7 digits. Reward = share of positions right (partial credit), 1.0 for
  an exact answer. Measures correctness; the demo task.
- `digit`: answer with as many copies of a given digit as possible. Reward = share of the
  response's characters equal to the digit. Dense and fast: the test task.
- `repeat`: repeat a pattern of 3-6 digits a given number of times (`repeat 472 15:` ->
  `472472...`, 40-64 digits, one token each). Reward = share of positions right over the longer of
  answer and response, as for `sort`; the answer's length must be right too. A generation-heavy
  correctness task: sampling 40-64 tokens per answer is most of a step's work, as in real
  post-training (`configs/tiny-grpo-long.yaml`, `bench/peer.py`).

Rewards follow verl's signature `compute_score(data_source, solution_str, ground_truth,
extra_info=None) -> float | dict`.
"""

from __future__ import annotations

import random
from typing import Callable, Collection

TASKS = ("sort", "digit", "repeat")
ABILITY = {"sort": "sorting", "digit": "copying", "repeat": "repetition"}


def _clean(solution_str: str) -> str:
    return solution_str.strip().split("\n", 1)[0].strip()


def sort_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None) -> dict:
    """Partial credit: positions equal to the sorted digits over the longer of the two strings."""
    sol = _clean(solution_str)
    gt = str(ground_truth)
    right = sum(1 for a, b in zip(sol, gt) if a == b)
    score = right / max(len(gt), len(sol), 1)
    return {"score": score, "acc": float(sol == gt)}


def digit_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    sol = _clean(solution_str)
    if not sol:
        return 0.0
    return sum(1 for c in sol if c == str(ground_truth)) / len(sol)


def repeat_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None) -> dict:
    """Partial credit per position over the longer string (wrong length costs), 1.0 when exact."""
    return sort_score(data_source, solution_str, ground_truth, extra_info)


SCORERS: dict[str, Callable[..., float | dict]] = {"sort": sort_score, "digit": digit_score, "repeat": repeat_score}


def _row(task: str, content: str, answer: str, index: int, split: str) -> dict:
    return {
        "data_source": f"builtin/{task}",
        "prompt": [{"role": "user", "content": content}],
        "ability": ABILITY[task],
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {"split": split, "index": index, "answer": answer},
    }


def make_rows(task: str, n: int, seed: int, split: str, exclude: Collection[str] = ()) -> list[dict]:
    """`n` deterministic rows of `task` for `split` (its own random stream per split). With
    `exclude` (the train split's prompts, for a held-out split), no prompt is one of those, and no
    two are alike: held-out scores are then measured on prompts the policy never trained on. `digit`
    has ten prompts in all, so its splits are the same ten."""
    if task not in TASKS:
        raise ValueError(f"unknown built-in task {task!r}; choose one of {', '.join(TASKS)}")
    rng = random.Random(f"{task}/{split}/{seed}")
    seen = set(exclude) if exclude and task != "digit" else None
    rows: list[dict] = []
    while len(rows) < n:
        prompt, answer = _draw(task, rng)
        if seen is not None:
            if prompt in seen:
                continue
            seen.add(prompt)
        rows.append(_row(task, prompt, answer, len(rows), split))
    return rows


def prompts_of(rows: list[dict]) -> set[str]:
    return {r["prompt"][0]["content"] for r in rows}


def _draw(task: str, rng: random.Random) -> tuple[str, str]:
    if task == "sort":
        k = rng.randint(3, 7)
        digits = "".join(rng.choice("0123456789") for _ in range(k))
        return f"sort {digits}:", "".join(sorted(digits))
    if task == "repeat":
        pattern = "".join(rng.choice("0123456789") for _ in range(rng.randint(3, 6)))
        times = rng.randint(-(-40 // len(pattern)), 64 // len(pattern))  # 40-64 digits in all
        return f"repeat {pattern} {times}:", pattern * times
    d = str(rng.randint(0, 9))
    return f"say {d}:", d


def corpus(task: str, seed: int, n: int = 4000) -> list[str]:
    """Text the built-in tokenizer is trained on: prompts followed by their answers."""
    return [r["prompt"][0]["content"] + " " + r["reward_model"]["ground_truth"]
            for r in make_rows(task, n, seed, "train")]
