"""Rule rewards with verl's calling convention, chosen by name, by data source or by file.

Called by keyword, as verl calls them, so verl's signature works and so does a keyword-only one:

    compute_score(data_source=..., solution_str=..., ground_truth=..., extra_info=...) -> float | dict

A dict result must hold `score` (the reward); its other numeric entries are kept as metrics
(`reward/<key>`). `ground_truth` and `extra_info` arrive as the dataset holds them: a string, a
number, a list or a dict. A function that takes `solution_strs` is batched (verl's batch reward
manager): `compute_score(data_sources=[...], solution_strs=[...], ground_truths=[...],
extra_infos=[...]) -> list[float | dict]`, one call per rollout batch.

`reward.fn` is `auto` (the built-in scorer of each row's `data_source`, see `REWARD_SOURCES`), a
built-in name (`sort`, `digit`, `repeat`, `gsm8k`, `math`) or `path/to/file.py:function`.
"""

from __future__ import annotations

import importlib.util
import inspect
import math
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from .config_yaml import ConfigError  # (not .config: the reward worker starts without pydantic)
from .math_rewards import boxed_math_score, gsm8k_score
from .builtin_tasks import SCORERS

RewardFn = Callable[..., "float | dict"]

BUILTIN: dict[str, RewardFn] = {**SCORERS, "gsm8k": gsm8k_score, "math": boxed_math_score}
# data_source -> built-in scorer used by `reward.fn: auto` (verl's default_compute_score names)
REWARD_SOURCES: dict[str, str] = {
    **{f"builtin/{task}": task for task in SCORERS},
    "openai/gsm8k": "gsm8k", "gsm8k": "gsm8k",
    "lighteval/MATH": "math", "DigitalLearningGmbH/MATH-lighteval": "math", "HuggingFaceH4/MATH-500": "math",
    "math": "math",
}
SAMPLE_KEYS = ("data_source", "solution_str", "ground_truth", "extra_info")
BATCH_KEYS = ("data_sources", "solution_strs", "ground_truths", "extra_infos")


def unknown_source_message(sources: Iterable[str]) -> str:
    return (f"reward.fn=auto: no built-in reward for data_source {', '.join(map(repr, sorted(sources)))}; "
            f"known: {', '.join(sorted(REWARD_SOURCES))}; set reward.fn to 'path/to/file.py:function'")


def auto_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None):
    """The built-in scorer registered for `data_source`."""
    name = REWARD_SOURCES.get(data_source)
    if name is None:
        raise ValueError(unknown_source_message([data_source]))
    return BUILTIN[name](data_source=data_source, solution_str=solution_str, ground_truth=ground_truth,
                         extra_info=extra_info)


@dataclass
class Score:
    reward: float
    extra: dict[str, float] = field(default_factory=dict)


def to_score(out: Any) -> Score:
    """A reward function's return value (a number, or a dict holding `score`) -> Score."""
    if isinstance(out, dict):
        if "score" not in out:
            raise ValueError(f"reward function returned a dict without 'score': {sorted(out)}")
        extra = {k: float(v) for k, v in out.items() if k != "score" and isinstance(v, (int, float, bool))}
        value = float(out["score"])
    else:
        extra, value = {}, float(out)
    if not math.isfinite(value):
        raise ValueError(f"reward function returned a non-finite score {value!r}")
    return Score(value, extra)


@dataclass(frozen=True)
class RewardFunction:
    """A loaded rule reward. Calling it scores one sample by keyword, whatever kind it is."""

    spec: str
    fn: RewardFn
    batched: bool
    keywords: tuple[str, ...]  # the keywords passed (extra_info(s) only when the function takes it)

    def __call__(self, data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None):
        if self.batched:
            return self.call_batch([(data_source, solution_str, ground_truth, extra_info)])[0]
        values = (data_source, solution_str, ground_truth, extra_info)
        return self.fn(**{k: v for k, v in zip(SAMPLE_KEYS, values) if k in self.keywords})

    def call_batch(self, items: list[tuple]) -> list:
        """Raw outputs for (data_source, solution_str, ground_truth, extra_info) items: one call of a
        batched function, else one call per item."""
        if not self.batched:
            return [self(*item) for item in items]
        columns = [list(c) for c in zip(*items)] if items else [[], [], [], []]
        out = self.fn(**{k: v for k, v in zip(BATCH_KEYS, columns) if k in self.keywords})
        if not isinstance(out, (list, tuple)) or len(out) != len(items):
            got = f"{len(out)} values" if isinstance(out, (list, tuple)) else type(out).__name__
            raise ValueError(f"batched reward function returned {got} for {len(items)} samples; "
                             "return a list with one float or dict per sample")
        return list(out)


def _accepted(fn: RewardFn, keys: tuple[str, ...]) -> tuple[str, ...] | None:
    """The keywords of `keys` that `fn` takes (all of them with **kwargs); None if a required one
    (all but the last, extra_info/extra_infos) cannot be passed by keyword."""
    params = inspect.signature(fn).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return keys
    ok = tuple(k for k in keys if k in params and params[k].kind is not params[k].POSITIONAL_ONLY)
    return ok if set(keys[:-1]) <= set(ok) else None


def _import_user_fn(spec: str) -> RewardFn:
    path, name = spec.rsplit(":", 1)
    if not os.path.isfile(path):
        raise ConfigError(f"reward.fn: file {path!r} not found; give 'path/to/file.py:function'")
    mod_name = f"rlhf_user_reward_{abs(hash(os.path.abspath(path)))}"
    module_spec = importlib.util.spec_from_file_location(mod_name, path)
    if module_spec is None or module_spec.loader is None:
        raise ConfigError(f"reward.fn: cannot import {path!r} as a Python file")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[mod_name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:  # the user's file: report whatever it raised, in one line
        raise ConfigError(f"reward.fn: importing {path!r} failed: {type(e).__name__}: {e}") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ConfigError(f"reward.fn: {path!r} has no function {name!r}")
    return fn


def load_reward_fn(spec: str, batched: bool | None = None) -> RewardFunction:
    """`auto`, a built-in name or `path/to/file.py:function`. `batched=None` tells a batched
    function by its signature (a parameter named `solution_strs`)."""
    if spec == "auto":
        fn = auto_score
    elif ":" not in spec:
        if spec not in BUILTIN:
            raise ConfigError(
                f"reward.fn: unknown reward {spec!r}; use auto, one of {', '.join(sorted(BUILTIN))} "
                "or 'path/to/file.py:function'"
            )
        fn = BUILTIN[spec]
    else:
        fn = _import_user_fn(spec)
    if batched is None:
        params = inspect.signature(fn).parameters
        batched = "solution_strs" in params
    keys = BATCH_KEYS if batched else SAMPLE_KEYS
    accepted = _accepted(fn, keys)
    if accepted is None:
        raise ConfigError(
            f"reward.fn: {spec} takes {inspect.signature(fn)}; it must accept the keywords "
            + (f"{', '.join(keys[:-1])} (batched, reward.batched=true)" if batched else
               f"{', '.join(keys[:-1])}, extra_info=None (verl's compute_score)")
        )
    return RewardFunction(spec, fn, batched, accepted)


def score(fn: RewardFn, data_source: str, solution_str: str, ground_truth: Any, extra_info: Any) -> Score:
    """One sample scored in this process, by keyword (no timeout: see `reward_worker`)."""
    if not isinstance(fn, RewardFunction):
        fn = RewardFunction(getattr(fn, "__name__", "fn"), fn, False, SAMPLE_KEYS)
    return to_score(fn(data_source, solution_str, ground_truth, extra_info))
