"""The `hf` backend's decoding loop: a causal LM's own forward, one token per step, with a KV cache.

Why not `model.generate`: it keeps every sequence in the batch until the last one ends, so a
batch pays for `max_new_tokens` steps on every row however early most rows stop (on the
generation-heavy config, 42% of the slots were finished rows). Here:

- a prompt's prefill runs once and its KV cache is repeated for its `n` samples;
- rows that have stopped leave the batch (their cache rows are dropped), so each step costs about
  what the still-running rows need. They leave together, once an eighth of the batch has stopped
  (dropping rows copies the whole cache): on the generation-heavy config's batches, 10% less time
  per batch than dropping each row the step it stops;
- only the last position's logits are computed;
- full-attention cache layers write each step's keys and values into buffers sized for the whole
  answer, instead of concatenating (a copy of the whole cache per step and layer);
- sampling inverts the cumulative distribution with one uniform draw per row, which draws from p
  exactly like `multinomial`, at a fraction of its cost on CPU.

The behaviour log-prob of a sampled token is log softmax(logits / temperature) at that token,
before top-p, as the backend contract says.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from transformers.cache_utils import DynamicLayer


@dataclass
class Decoded:
    tokens: list[list[int]]     # per row (prompt i's sample j is row i * n + j), EOS included
    logprobs: list[list[float]]
    stopped: list[bool]         # True: ended on an EOS token; False: reached max_new_tokens


def _accepts(model, name: str) -> bool:
    try:
        return name in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def _nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Probabilities with everything outside the smallest set of mass >= top_p zeroed (unnormalised)."""
    sorted_p, order = probs.sort(-1, descending=True)
    outside = sorted_p.cumsum(-1) - sorted_p >= top_p  # the mass before this token already reaches top_p
    sorted_p = sorted_p.masked_fill(outside, 0.0)
    return torch.zeros_like(probs).scatter_(-1, order, sorted_p)


class _Preallocated(DynamicLayer):
    """A full-attention cache layer whose keys and values live in buffers with room for
    `capacity` positions: `update` writes the new positions in place and returns views."""

    @classmethod
    def adopt(cls, layer: DynamicLayer, capacity: int) -> None:
        k, v = layer.keys, layer.values
        layer.__class__ = cls
        layer._k = k.new_empty(k.shape[:2] + (capacity,) + k.shape[3:])
        layer._v = v.new_empty(v.shape[:2] + (capacity,) + v.shape[3:])
        layer._n = 0
        layer._put(k, v)

    def _put(self, k: torch.Tensor, v: torch.Tensor) -> None:
        end = self._n + k.shape[-2]
        if end > self._k.shape[-2]:  # more than planned: grow (the loop never asks for it)
            grow = (0, 0, 0, end)
            self._k = torch.nn.functional.pad(self._k[:, :, :self._n], grow)
            self._v = torch.nn.functional.pad(self._v[:, :, :self._n], grow)
        self._k[:, :, self._n:end] = k
        self._v[:, :, self._n:end] = v
        self._n = end
        self._view()

    def _view(self) -> None:
        self.keys, self.values = self._k[:, :, :self._n], self._v[:, :, :self._n]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self._put(key_states, value_states)
        return self.keys, self.values

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._k, self._v = self._k[indices], self._v[indices]
        self._view()

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._k, self._v = self._k.repeat_interleave(repeats, 0), self._v.repeat_interleave(repeats, 0)
        self._view()


def _preallocate(cache, extra: int) -> None:
    """Give every plain full-attention layer of `cache` room for `extra` more positions (sliding
    window and other layer kinds keep their own update)."""
    for layer in getattr(cache, "layers", ()):
        if type(layer) is DynamicLayer and layer.is_initialized and layer.keys.dim() == 4:
            _Preallocated.adopt(layer, layer.keys.shape[-2] + extra)


def _pick(logits: torch.Tensor, temperature: float, top_p: float, greedy: bool,
          generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [b], their log-probs under logits / temperature [b]; zeros when greedy)."""
    if greedy:
        tok = logits.argmax(-1)
        return tok, torch.zeros(tok.shape, dtype=torch.float32, device=logits.device)
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    probs = logp.exp()
    if top_p < 1.0:
        probs = _nucleus(probs, top_p)
    cdf = probs.double().cumsum(-1)
    u = torch.rand(cdf.shape[:-1] + (1,), dtype=torch.float64, device=cdf.device, generator=generator)
    # right=True: the first token whose cumulative mass exceeds u * total (never a zero-mass one)
    tok = torch.searchsorted(cdf, u * cdf[..., -1:], right=True).squeeze(-1).clamp_max(probs.shape[-1] - 1)
    return tok, logp.gather(-1, tok.unsqueeze(-1)).squeeze(-1)


@torch.no_grad()
def decode(model, ids: torch.Tensor, mask: torch.Tensor, *, n: int, max_new_tokens: int, eos_ids: list[int],
           temperature: float = 1.0, top_p: float = 1.0, greedy: bool = False,
           generator: torch.Generator) -> Decoded:
    """`n` continuations of each left-padded prompt row of `ids` / `mask` ([P, W] long)."""
    rows_total = ids.shape[0] * n
    tokens: list[list[int]] = [[] for _ in range(rows_total)]
    logprobs: list[list[float]] = [[] for _ in range(rows_total)]
    stopped = [False] * rows_total
    if max_new_tokens <= 0:
        return Decoded(tokens, logprobs, stopped)
    extra = {"logits_to_keep": 1} if _accepts(model, "logits_to_keep") else {}
    cache_arg = "cache" if _accepts(model, "cache") else "past_key_values"  # the name before transformers 5.2x
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, **extra)
    cache = out["cache"] if "cache" in out else out["past_key_values"]
    logits = out.logits[:, -1]
    _preallocate(cache, max_new_tokens)
    if n > 1:
        cache.batch_repeat_interleave(n)
        logits = logits.repeat_interleave(n, dim=0)
        mask = mask.repeat_interleave(n, dim=0)
        pos = pos.repeat_interleave(n, dim=0)
    pos = pos[:, -1:]
    rows = torch.arange(rows_total, device=ids.device)  # the output row of each batch row
    eos = torch.tensor(sorted(set(eos_ids)), dtype=torch.long, device=ids.device)
    live = torch.ones(rows_total, dtype=torch.bool, device=ids.device)  # batch rows still answering
    for step in range(max_new_tokens):
        tok, lp = _pick(logits, temperature, top_p, greedy, generator)
        done = torch.isin(tok, eos) & live
        for r, t, l, a in zip(rows.tolist(), tok.tolist(), lp.tolist(), live.tolist()):
            if a:
                tokens[r].append(t)
                logprobs[r].append(l)
        for r in rows[done].tolist():
            stopped[r] = True
        live &= ~done
        if step == max_new_tokens - 1:
            break
        n_live = int(live.sum())
        if n_live == 0:
            break
        if len(live) - n_live >= max(1, len(live) // 8):
            keep = live.nonzero().flatten()
            cache.batch_select_indices(keep)
            rows, tok, mask, pos, live = rows[keep], tok[keep], mask[keep], pos[keep], live[keep]
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=-1)
        pos = pos + 1
        out = model(input_ids=tok.unsqueeze(-1), attention_mask=mask, position_ids=pos, use_cache=True,
                    **{cache_arg: cache}, **extra)
        logits = out.logits[:, -1]
    return Decoded(tokens, logprobs, stopped)
