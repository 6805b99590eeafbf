"""Dynamic batching shared by the sampler backends: a token budget per engine call, halving on OOM.

A generate call may carry more prompts than one engine call should hold. The cost of a prompt is
what it can occupy in the engine at its peak: `(prompt tokens + max_new_tokens) * n` tokens of
activations and KV cache. Consecutive prompts are packed into chunks whose cost stays within the
budget. When an engine call still runs out of memory (another process took memory, long prompts),
the chunk is halved and retried instead of crashing the sampler, and the budget is lowered for the
calls that follow; it grows back after a run of successful calls, so a transient squeeze does not
cost throughput for the rest of the run.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")

# Substrings of allocator errors that do not come as torch.OutOfMemoryError / MemoryError.
_OOM_MESSAGES = ("out of memory", "can't allocate memory", "cannot allocate memory", "failed to allocate")


def is_out_of_memory(exc: BaseException) -> bool:
    """True for the errors an allocator raises when memory runs out (CUDA, CPU, vLLM's)."""
    try:
        import torch

        if isinstance(exc, torch.OutOfMemoryError):
            return True
    except (ImportError, AttributeError):
        pass
    if isinstance(exc, MemoryError):
        return True
    if isinstance(exc, RuntimeError):
        msg = str(exc).lower()
        return any(m in msg for m in _OOM_MESSAGES)
    return False


def prompt_cost(prompt_len: int, max_new_tokens: int, n: int) -> int:
    """Peak tokens one prompt holds in the engine: its prompt and answers for all `n` samples."""
    return (prompt_len + max_new_tokens) * n


class TokenBudget:
    """The adaptive budget: `limit` from the config, `current` lowered on OOM, regrown on success."""

    def __init__(self, limit: int, regrow_after: int = 16):
        if limit <= 0:
            raise ValueError(f"sampler.max_batch_tokens: invalid value {limit}; use a positive token count")
        self.limit = limit
        self.current = limit
        self.regrow_after = regrow_after
        self.oom_retries = 0
        self._successes = 0

    def shrink(self, failed_cost: int) -> None:
        """An engine call of `failed_cost` tokens ran out of memory: stay below half of it."""
        self.oom_retries += 1
        self._successes = 0
        self.current = max(1, min(self.current, failed_cost // 2))

    def succeeded(self) -> None:
        self._successes += 1
        if self.current < self.limit and self._successes >= self.regrow_after:
            self.current = min(self.limit, self.current * 2)
            self._successes = 0


def run_batched(items: Sequence[T], cost: Callable[[T], int], budget: TokenBudget,
                engine_call: Callable[[list[T]], list]) -> list:
    """`engine_call` over chunks of `items` that fit `budget.current`, results concatenated in order.

    On an out-of-memory error the failing chunk is split in two and each half retried; a chunk of a
    single item that still runs out of memory re-raises (nothing smaller can be tried).
    """
    costs = [cost(x) for x in items]
    out: list = []
    start = 0
    while start < len(items):
        # Plan one chunk at a time against the current budget: an OOM lowers it for the rest.
        end, used = start, 0
        while end < len(items) and (end == start or used + costs[end] <= budget.current):
            used += costs[end]
            end += 1
        out.extend(_call_with_backoff(list(items[start:end]), costs[start:end], budget, engine_call))
        start = end
    return out


def _call_with_backoff(chunk: list[T], costs: list[int], budget: TokenBudget,
                       engine_call: Callable[[list[T]], list]) -> list:
    try:
        result = engine_call(chunk)
    except Exception as exc:  # noqa: BLE001 - filtered just below, everything else re-raised
        if not is_out_of_memory(exc) or len(chunk) == 1:
            raise
        budget.shrink(sum(costs))
        half = len(chunk) // 2
        return (_call_with_backoff(chunk[:half], costs[:half], budget, engine_call)
                + _call_with_backoff(chunk[half:], costs[half:], budget, engine_call))
    budget.succeeded()
    return result
