"""The generation-engine interface every sampler backend implements (`hf`, `vllm`).

A backend holds one persistent engine for the life of the sampler process. It generates `n`
completions per prompt and returns, for each, the sampled token ids and the log-probability of each
sampled token under the sampling distribution (logits / temperature, before top-p): the behaviour
log-probs the trainer's off-policy corrections rely on. New policy weights are loaded in place.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass


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
    """log p(token) under logits / temperature, one per token in `token_ids`."""
    text: str
    """Decoded response without special tokens."""
    finish_reason: str
    """`stop` (EOS) or `length` (max_new_tokens reached)."""


class SamplerBackend(ABC):
    """One persistent engine. Constructed with the initial policy folder (HF layout)."""

    name: str = "base"

    @abstractmethod
    def generate(self, prompts: list[list[int]], n: int, params: GenParams) -> list[list[Completion]]:
        """For each prompt (token ids), `n` completions."""

    @abstractmethod
    def load_weights(self, policy_dir: str) -> float:
        """Replace the engine's weights in place with those of `policy_dir` (a local HF folder
        in sampler layout). Returns the seconds it took."""

    def close(self) -> None:
        """Release the engine."""


def make_backend(name: str, model_dir: str, *, dtype: str, threads: int, seed: int, options: dict | None = None) -> SamplerBackend:
    if name == "hf":
        from .hf import HFBackend

        return HFBackend(model_dir, dtype=dtype, threads=threads, seed=seed)
    if name == "vllm":
        try:
            from .vllm import VLLMBackend
        except ImportError as e:
            raise RuntimeError(
                f"sampler.backend=vllm needs vLLM installed ({e}); `pip install -e .[vllm]` on GPU "
                "machines or `make test-vllm` for the CPU build, or use sampler.backend=hf"
            ) from None
        return VLLMBackend(model_dir, dtype=dtype, threads=threads, seed=seed, options=options or {})
    raise ValueError(f"sampler.backend: unknown backend {name!r}; use hf or vllm")
