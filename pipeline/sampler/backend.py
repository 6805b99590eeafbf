"""The generation-engine interface every sampler backend implements (`hf`, `vllm`).

A backend holds one persistent engine for the life of the sampler process. It generates `n`
completions per prompt and returns, for each, the sampled token ids and the log-probability of each
sampled token under the sampling distribution (logits / temperature, before top-p): the behaviour
log-probs the trainer's off-policy corrections rely on. New policy weights are loaded in place.

The base class owns what both engines share: dynamic batching (a generate call is split into
engine calls that fit a token budget, halved on out-of-memory, see `batching`), per-prompt seeds,
and the throughput / batch-size / reload-time figures reported by `stats()`.
"""

from __future__ import annotations

import importlib.util
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass

from .batching import TokenBudget, prompt_cost, run_batched

DEFAULT_MAX_BATCH_TOKENS = 32768


@dataclass(frozen=True)
class GenParams:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    greedy: bool = False
    seed: int | None = None


@dataclass
class Completion:
    token_ids: list[int]
    """Sampled response tokens, including the final EOS token when the model stopped."""
    logprobs: list[float]
    """log p(token) under logits / temperature, one per token in `token_ids` (zeros when greedy)."""
    text: str
    """Decoded response without special tokens."""
    finish_reason: str
    """`stop` (EOS) or `length` (max_new_tokens reached)."""


class SamplerBackend(ABC):
    """One persistent engine. Constructed with the initial policy folder (HF layout).

    Subclasses implement `_generate_batch` (one engine call) and `_load_weights`; callers use
    `generate`, `load_weights` and `stats`.
    """

    name: str = "base"

    def __init__(self, *, seed: int = 0, max_batch_tokens: int | None = None):
        self.generator_seed = seed
        self.budget = TokenBudget(max_batch_tokens or DEFAULT_MAX_BATCH_TOKENS)
        self._calls = 0
        self._last: dict[str, float] = {}

    # --- what engines implement -------------------------------------------------------------

    @abstractmethod
    def _generate_batch(self, prompts: list[list[int]], n: int, params: GenParams,
                        seeds: list[int]) -> list[list[Completion]]:
        """One engine call: `n` completions for each prompt; `seeds[i]` seeds prompt i's samples."""

    @abstractmethod
    def _load_weights(self, policy_dir: str) -> None:
        """Replace the engine's weights in place with those of `policy_dir`."""

    # --- what callers use ---------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], n: int, params: GenParams) -> list[list[Completion]]:
        """For each prompt (token ids), `n` completions (one when `params.greedy`), in prompt order.

        Prompt i of this call is seeded with `base + i`, where base is `params.seed` when given and
        otherwise `call_seed` of this call's number. With vllm (a seed per request) the samples of a
        prompt do not depend on how the call was split into engine calls; with hf, one generator
        serves each engine call, seeded by its first prompt, so they do: the split follows from the
        config (`sampler.max_batch_tokens`), except a call halved after running out of memory.
        """
        if not prompts:
            return []
        self._calls += 1
        base = params.seed if params.seed is not None else self.call_seed(self._calls)
        n_eff = 1 if params.greedy else n
        sizes: list[int] = []

        def engine_call(chunk: list[tuple[int, list[int]]]) -> list[list[Completion]]:
            out = self._generate_batch([p for _, p in chunk], n, params, [base + i for i, _ in chunk])
            sizes.append(len(chunk) * n_eff)
            return out

        t0 = time.perf_counter()
        results = run_batched(list(enumerate(prompts)), lambda x: prompt_cost(len(x[1]), params.max_new_tokens, n_eff),
                              self.budget, engine_call)
        elapsed = time.perf_counter() - t0
        tokens = sum(len(c.token_ids) for group in results for c in group)
        self._last.update({
            "sampler/tokens_per_s": tokens / max(elapsed, 1e-9),
            "sampler/batch_size": sum(sizes) / len(sizes),
            "sampler/max_batch_size": float(max(sizes)),
            "sampler/engine_calls": float(len(sizes)),
        })
        return results

    def call_seed(self, k: int) -> int:
        """The seed base of generate call k (from 1) when `GenParams.seed` is not given. A caller
        that numbers its calls itself (the sampler, by prompt draw) passes this as the seed."""
        return self.generator_seed * 100003 + k * 7919

    def load_weights(self, policy_dir: str) -> float:
        """Replace the engine's weights in place with those of `policy_dir` (a local HF folder
        in sampler layout). Returns the seconds it took."""
        t0 = time.perf_counter()
        self._load_weights(policy_dir)
        return time.perf_counter() - t0

    def stats(self) -> dict[str, float]:
        """Figures of the latest generate call, plus the budget's state, for metrics.

        `sampler/tokens_per_s` (generated tokens over the call's wall time), `sampler/batch_size`
        (mean sequences per engine call), `sampler/max_batch_size`, `sampler/engine_calls`,
        `sampler/token_budget` (current, after any
        out-of-memory back-off), `sampler/oom_retries` (since start).
        """
        return {**self._last, "sampler/token_budget": float(self.budget.current),
                "sampler/oom_retries": float(self.budget.oom_retries)}

    def close(self) -> None:
        """Release the engine."""


def make_backend(name: str, model_dir: str, *, dtype: str, threads: int, seed: int, options: dict | None = None,
                 max_batch_tokens: int | None = None, trust_remote_code: bool = False) -> SamplerBackend:
    if name == "hf":
        from .hf import HFBackend

        return HFBackend(model_dir, dtype=dtype, threads=threads, seed=seed, max_batch_tokens=max_batch_tokens,
                         trust_remote_code=trust_remote_code)
    if name == "vllm":
        spec = importlib.util.find_spec("vllm")
        if spec is None or spec.origin is None:  # absent, or only a namespace folder named vllm
            raise RuntimeError(
                "sampler.backend=vllm needs vLLM installed in this environment; `pip install -e .[vllm]` "
                "on GPU machines or the CPU build in .venv-vllm (`make test-vllm`), or use sampler.backend=hf"
            )
        from .vllm import VLLMBackend

        return VLLMBackend(model_dir, dtype=dtype, threads=threads, seed=seed, options=options or {},
                           max_batch_tokens=max_batch_tokens, trust_remote_code=trust_remote_code)
    raise ValueError(f"sampler.backend: unknown backend {name!r}; use hf or vllm")
