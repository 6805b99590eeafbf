"""Reward functions with verl's signature, chosen by name or by `path/to/file.py:function`.

    compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float | dict

A dict result must hold `score` (the reward); its other numeric entries are kept as metrics
(e.g. `acc`). A user's existing verl reward file works unchanged.
"""

from __future__ import annotations

import importlib.util
import inspect
import math
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Callable

from .config import ConfigError
from .tasks import SCORERS

RewardFn = Callable[..., "float | dict"]


@dataclass
class Score:
    reward: float
    extra: dict[str, float] = field(default_factory=dict)


def load_reward_fn(spec: str) -> RewardFn:
    """`sort` / `digit` (built-in) or `path/to/file.py:function_name`."""
    if ":" not in spec:
        if spec in SCORERS:
            return SCORERS[spec]
        raise ConfigError(
            f"reward.fn: unknown reward {spec!r}; use one of {', '.join(sorted(SCORERS))} "
            "or 'path/to/file.py:function'"
        )
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
    params = list(inspect.signature(fn).parameters)
    if len(params) < 3 and not any(p in params for p in ("args", "kwargs")):
        raise ConfigError(
            f"reward.fn: {spec} must accept (data_source, solution_str, ground_truth, extra_info=None)"
        )
    return fn


def score(fn: RewardFn, data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None) -> Score:
    out = fn(data_source, solution_str, ground_truth, extra_info)
    if isinstance(out, dict):
        if "score" not in out:
            raise ValueError(f"reward function returned a dict without 'score': {sorted(out)}")
        extra = {k: float(v) for k, v in out.items() if k != "score" and isinstance(v, (int, float, bool))}
        value = float(out["score"])
    else:
        extra, value = {}, float(out)
    if not math.isfinite(value):
        raise ValueError(f"reward function returned a non-finite score {value!r} for {data_source}")
    return Score(value, extra)
