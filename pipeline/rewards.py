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

import ast
import importlib.util
import inspect
import math
import numbers
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
        extra = _extras(out)
        value = _number(out["score"])
    else:
        extra, value = {}, _number(out)
    if not math.isfinite(value):
        raise ValueError(f"reward function returned a non-finite score {value!r}")
    return Score(value, extra)


def _is_number(v: Any) -> bool:
    """A real number: Python's, NumPy's (np.float32, np.int64, np.bool_ ...) or a one-element
    tensor; not a string, which float() would parse."""
    return isinstance(v, numbers.Real) or (not isinstance(v, (str, bytes)) and hasattr(type(v), "__float__"))


def _number(v: Any) -> float:
    if not _is_number(v):
        raise ValueError(f"reward function returned {type(v).__name__} {str(v)[:40]!r}, not a number")
    return float(v)


def _extras(out: dict) -> dict[str, float]:
    """The dict's other finite numbers (metrics `reward/<key>`); anything else is left out."""
    extra = {}
    for k, v in out.items():
        try:
            if k != "score" and _is_number(v) and math.isfinite(x := float(v)):
                extra[k] = x
        except (TypeError, ValueError, RuntimeError):  # an array of several values, say
            pass
    return extra


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


def check_reward_spec(spec: str, batched: bool | None = None) -> None:
    """`load_reward_fn`'s checks without running the user's file: it is read, not imported.

    For the places that must not run user code, such as the Airflow worker's prepare task: that
    process holds the deployment's secrets, while the sampler and its reward worker (which import
    the file and check it again, exactly) run with an allow-listed environment. The file must
    parse and bind `function` at its top level; a `def` has its parameters checked as
    `load_reward_fn` checks them. A name bound otherwise (an import, an assignment) is checked when
    the sampler loads it."""
    if spec == "auto" or ":" not in spec:
        load_reward_fn(spec, batched)  # built-in: no user code
        return
    path, name = _user_file(spec)
    try:
        with open(path, "rb") as f:
            tree = ast.parse(f.read(), filename=path)
    except (SyntaxError, ValueError) as e:
        raise ConfigError(f"reward.fn: {path!r} is not valid Python: {e}") from None
    bound = _binding(tree, name)
    if bound is False:
        raise ConfigError(f"reward.fn: {path!r} has no function {name!r}")
    if bound is True:
        return
    a = bound.args
    names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]
    positional_only = {x.arg for x in a.posonlyargs}
    if batched is None:
        batched = "solution_strs" in names
    keys = BATCH_KEYS if batched else SAMPLE_KEYS
    if a.kwarg is not None:
        return
    ok = {k for k in keys if k in names and k not in positional_only}
    if not set(keys[:-1]) <= ok:
        raise ConfigError(
            f"reward.fn: {spec} takes ({ast.unparse(a)}); it must accept the keywords "
            + (f"{', '.join(keys[:-1])} (batched, reward.batched=true)" if batched else
               f"{', '.join(keys[:-1])}, extra_info=None (verl's compute_score)")
        )


def _binding(tree: ast.Module, name: str) -> ast.FunctionDef | bool:
    """The last top-level undecorated `def name`, unless something after it binds `name` again;
    True when something else may bind it (a decorator, an import, an assignment, a class, or a
    statement such as `if` or `try` whose body may); False when nothing does."""
    found: ast.FunctionDef | bool = False
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            found = (True if node.decorator_list else node) if node.name == name else found
        elif isinstance(node, (ast.AsyncFunctionDef, ast.ClassDef)):
            found = True if node.name == name else found
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            if any(a.name == "*" or (a.asname or a.name.split(".")[0]) == name for a in node.names):
                found = True
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == name for tg in targets for t in ast.walk(tg)):
                found = True
        elif not isinstance(node, (ast.Expr, ast.Pass)) and _may_bind(node, name):
            found = True  # e.g. a `try` or `if` that defines it again
    return found


_DYNAMIC_BINDERS = {"globals", "locals", "vars", "exec", "eval", "setattr", "__import__"}


def _may_bind(node: ast.AST, name: str) -> bool:
    """Whether anything inside the statement `node` binds `name`, or may (`globals()`, `exec`...)."""
    for n in ast.walk(node):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in _DYNAMIC_BINDERS:
            return True
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.name == name:
            return True
        if isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Store):
            return True
        if isinstance(n, (ast.Import, ast.ImportFrom)) and any(
                a.name == "*" or (a.asname or a.name.split(".")[0]) == name for a in n.names):
            return True
    return False


REWARD_ROOTS_ENV = "RLHF_REWARD_ROOTS"
"""Comma-separated folders a deployment allows reward files in (unset: anywhere). Set it where
people who may not run code on the workers start runs (the Airflow form): a reward file runs there."""


def _user_file(spec: str) -> tuple[str, str]:
    path, name = spec.rsplit(":", 1)
    roots = [r.strip() for r in os.environ.get(REWARD_ROOTS_ENV, "").split(",") if r.strip()]
    real = os.path.realpath(path)
    if roots and not any(real.startswith(os.path.realpath(r).rstrip("/") + "/") for r in roots):
        raise ConfigError(f"reward.fn: {path!r} is outside the folders this deployment allows reward files in "
                          f"(${REWARD_ROOTS_ENV}: {', '.join(roots)})")
    if not os.path.isfile(path):
        raise ConfigError(f"reward.fn: file {path!r} not found; give 'path/to/file.py:function'")
    return path, name


def _import_user_fn(spec: str) -> RewardFn:
    path, name = _user_file(spec)
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
