"""The sampler's reward step: one call per rollout batch, by a rule reward or a reward model.

`reward.kind: rule` scores with `reward.fn` in a worker process (`reward_worker`), `model` with
the sequence classifier at `reward.model` (`reward_model`). A rule reward that raises, returns a
bad value or runs past `reward.timeout_s` follows `reward.on_error`: `fail` stops the sampler
with the sample named (prompt id, data source, the error); `zero` scores it 0. Either way it is
counted: `reward/errors`, `reward/timeouts` in the batch's metrics.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, Iterable

from .config import ConfigError, RewardConfig
from .rewards import REWARD_SOURCES, Score, unknown_source_message
from .reward_worker import Outcome, rule_rewards

log = logging.getLogger("rlhf.rewards")


class RewardError(RuntimeError):
    """reward.on_error=fail: a sample's reward raised, returned a bad value or timed out."""


@dataclass(frozen=True)
class RewardSample:
    prompt_id: str
    data_source: str
    messages: Any  # the prompt: chat messages or a string (the reward model reads it)
    solution_str: str
    ground_truth: Any
    extra_info: Any = None


@dataclass
class BatchScores:
    scores: list[Score]
    errors: int = 0
    timeouts: int = 0
    extra_means: dict[str, float] = field(default_factory=dict)

    def metrics(self) -> dict[str, float]:
        """`reward/errors`, `reward/timeouts` and the mean of each extra entry as `reward/<key>`."""
        out = {f"reward/{k}": v for k, v in self.extra_means.items() if k not in ("errors", "timeouts", "mean")}
        out.update({"reward/errors": self.errors, "reward/timeouts": self.timeouts})
        return out


def _extra_means(scores: list[Score]) -> dict[str, float]:
    sums: dict[str, list[float]] = {}
    for s in scores:
        for k, v in s.extra.items():
            sums.setdefault(k, []).append(v)
    return {k: sum(v) / len(v) for k, v in sums.items()}


def describe(sample: RewardSample, index: int, outcome: Outcome) -> str:
    what = outcome.error if outcome.timed_out else f"raised {outcome.error}"
    return (f"reward of sample {index} (prompt {sample.prompt_id}, data_source {sample.data_source!r}) "
            f"{what}")


def check_sources(cfg: RewardConfig, sources: Iterable[str]) -> None:
    """`reward.fn: auto` must know every data source of the prompts: fail before generating."""
    if cfg.kind == "rule" and cfg.fn == "auto":
        unknown = set(sources) - set(REWARD_SOURCES)
        if unknown:
            raise ConfigError(unknown_source_message(unknown))


class RewardScorer:
    """Scores rollout batches as the config says; `close()` stops the worker or frees the model."""

    def __init__(self, cfg: RewardConfig, dtype: str = "float32"):
        self.cfg = cfg
        self.rules = self.model = None
        if cfg.kind == "model":
            from .reward_model import RewardModel

            self.model = RewardModel(cfg.model, device=cfg.device, dtype=dtype, label=cfg.model_label,
                                     batch_size=cfg.batch_size, sigmoid=cfg.model_sigmoid)
        else:
            self.rules = rule_rewards(cfg.fn, cfg.batched, cfg.timeout_s)
        self.errors_total = self.timeouts_total = 0

    def score_batch(self, samples: list[RewardSample]) -> BatchScores:
        if self.model is not None:
            values = self.model.score([s.messages for s in samples], [s.solution_str for s in samples])
            bad = [i for i, v in enumerate(values) if not math.isfinite(v)]
            if bad:  # a broken reward model (weights, overflow): its other scores are not to be trusted either
                raise RewardError(f"reward model {self.cfg.model!r} scored {len(bad)} of {len(values)} samples "
                                  f"{values[bad[0]]} (sample {bad[0]}); check the model and model.dtype")
            return BatchScores([Score(v) for v in values])
        items = [(s.data_source, s.solution_str, s.ground_truth, s.extra_info) for s in samples]
        outcomes = self.rules.score(items)
        scores, errors, timeouts = [], 0, 0
        for i, (sample, o) in enumerate(zip(samples, outcomes)):
            if o.score is not None:
                scores.append(o.score)
                continue
            message = describe(sample, i, o)
            if self.cfg.on_error == "fail":
                if o.detail:
                    log.error("%s\n%s", message, o.detail.rstrip())
                raise RewardError(f"{message}; reward.on_error=fail stops the run "
                                  "(reward.on_error=zero scores such samples 0 and counts them)")
            if errors + timeouts == 0:  # one line per batch, the counts are in the metrics
                log.warning("%s; scored 0 (reward.on_error=zero)", message)
            timeouts += o.timed_out
            errors += not o.timed_out
            scores.append(Score(0.0))
        self.errors_total += errors
        self.timeouts_total += timeouts
        return BatchScores(scores, errors, timeouts, _extra_means(scores))

    def close(self) -> None:
        if self.rules is not None:
            self.rules.close()
        if self.model is not None:
            self.model.close()

    def __enter__(self) -> "RewardScorer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
