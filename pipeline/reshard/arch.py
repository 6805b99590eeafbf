"""Model architectures the resharder understands, their parameter shapes and the TP split rules.

Qwen2 and Llama share parameter names; Qwen2 adds biases on q/k/v. The split rules are the
Megatron/vLLM ones:

- column-parallel (split on the output dimension, dim 0): q_proj, k_proj, v_proj, gate_proj,
  up_proj (weights and biases);
- row-parallel (split on the input dimension, dim 1): o_proj, down_proj;
- vocabulary-parallel (dim 0): embed_tokens, lm_head; contiguous ranges of ceil(V/N) rows;
- replicated: every norm;
- k_proj/v_proj when there are fewer KV heads than ranks: rank r holds KV head r // (N / KV),
  so each head is replicated N / KV times (vLLM's rule).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from .layout import ReshardError, TensorSpec

ARCHITECTURES = {"Qwen2ForCausalLM": "qwen2", "LlamaForCausalLM": "llama"}

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
COLUMN = {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"}
ROW = {"self_attn.o_proj", "mlp.down_proj"}
KV = {"self_attn.k_proj", "self_attn.v_proj"}
NORMS = {"input_layernorm", "post_attention_layernorm"}


@dataclass(frozen=True)
class Piece:
    """Which slice of the full tensor one TP rank holds: rows/cols [start, stop) of `dim`, or the
    whole tensor when dim is None."""

    dim: int | None
    start: int = 0
    stop: int = 0

    def byte_ranges(self, spec: TensorSpec) -> list[tuple[int, int]]:
        """Where this slice lies in the bytes of the full (row-major) tensor: [begin, end) runs, in
        order. One run for a split on dim 0 or a whole tensor; one per leading index otherwise."""
        if self.dim is None:
            return [(0, spec.nbytes)]
        outer = math.prod(spec.shape[: self.dim])
        inner = spec.dtype.itemsize * math.prod(spec.shape[self.dim + 1 :])
        row = spec.shape[self.dim] * inner
        return [(i * row + self.start * inner, i * row + self.stop * inner) for i in range(outer)]


@dataclass(frozen=True)
class Architecture:
    name: str
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    tied: bool
    attention_bias: bool

    @classmethod
    def from_config(cls, config: dict, where: str) -> "Architecture":
        archs = config.get("architectures") or []
        known = [a for a in archs if a in ARCHITECTURES]
        if not archs:  # configs saved without `architectures` still name their model type
            known = [a for a, t in ARCHITECTURES.items() if t == config.get("model_type")]
        if not known:
            raise ReshardError(
                f"{where}/config.json: unknown architecture {archs or config.get('model_type')!r}; "
                f"supported: {', '.join(ARCHITECTURES)}"
            )
        name = known[0]
        try:
            hidden = int(config["hidden_size"])
            heads = int(config["num_attention_heads"])
            kv = int(config.get("num_key_value_heads") or heads)
            head_dim = int(config.get("head_dim") or hidden // heads)
            bias = bool(config.get("attention_bias", ARCHITECTURES[name] == "qwen2"))
            return cls(
                name=name, vocab=int(config["vocab_size"]), hidden=hidden, layers=int(config["num_hidden_layers"]),
                heads=heads, kv_heads=kv, head_dim=head_dim, intermediate=int(config["intermediate_size"]),
                tied=bool(config.get("tie_word_embeddings", False)), attention_bias=bias,
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ReshardError(f"{where}/config.json: missing or invalid field {e}; it must be a {name} config") from None

    # shapes ---------------------------------------------------------------------------------
    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        h, q, kv, i = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim, self.intermediate
        out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab, h), "model.norm.weight": (h,)}
        if not self.tied:
            out["lm_head.weight"] = (self.vocab, h)
        for n in range(self.layers):
            p = f"model.layers.{n}."
            out.update({
                p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                p + "mlp.down_proj.weight": (h, i), p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
            })
            if self.attention_bias:
                out.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                            p + "self_attn.v_proj.bias": (kv,)})
        return out

    def check(self, specs: list[TensorSpec], where: str) -> None:
        """Every expected parameter present with its expected shape; nothing unknown."""
        expected = self.expected_shapes()
        have = {s.name: s for s in specs}
        missing = sorted(set(expected) - set(have))
        if missing:
            raise ReshardError(
                f"{where}: {len(missing)} parameter(s) of the {self.name} config are missing, first "
                f"{missing[0]!r}; the checkpoint is incomplete or does not match its config.json"
            )
        for name, spec in have.items():
            if name == "lm_head.weight" and self.tied:
                want = (self.vocab, self.hidden)
            elif name not in expected:
                raise ReshardError(f"{where}: unknown parameter {name!r} for {self.name}; it cannot be placed")
            else:
                want = expected[name]
            if tuple(spec.shape) != want:
                raise ReshardError(
                    f"{where}: parameter {name!r} has shape {list(spec.shape)} but config.json implies "
                    f"{list(want)}; the weights do not match the config"
                )

    # tensor parallelism ---------------------------------------------------------------------
    def check_tp(self, n: int) -> None:
        if self.heads % n:
            raise ReshardError(f"--to tp:{n}: {n} does not divide num_attention_heads={self.heads}; choose a divisor")
        if self.kv_heads >= n and self.kv_heads % n:
            raise ReshardError(f"--to tp:{n}: {n} does not divide num_key_value_heads={self.kv_heads}; choose a divisor")
        if self.kv_heads < n and n % self.kv_heads:
            raise ReshardError(
                f"--to tp:{n}: num_key_value_heads={self.kv_heads} < {n} ranks, so KV heads are replicated, "
                f"which needs {n} to be a multiple of {self.kv_heads}"
            )
        if self.intermediate % n:
            raise ReshardError(f"--to tp:{n}: {n} does not divide intermediate_size={self.intermediate}")

    def tp_pieces(self, spec: TensorSpec, n: int) -> list[Piece]:
        """The slice of `spec` each of the n ranks holds (see the module docstring)."""
        name = spec.name
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            step = -(-spec.shape[0] // n)
            return [Piece(0, min(r * step, spec.shape[0]), min((r + 1) * step, spec.shape[0])) for r in range(n)]
        if name == "model.norm.weight":
            return [Piece(None)] * n
        m = _LAYER.match(name)
        if not m:
            raise ReshardError(f"{name!r}: no tensor-parallel rule for this parameter")
        module, _, kind = m.group(2).rpartition(".")
        if module in NORMS:
            return [Piece(None)] * n
        if module in KV and self.kv_heads < n:
            reps, d = n // self.kv_heads, self.head_dim
            return [Piece(0, (r // reps) * d, (r // reps + 1) * d) for r in range(n)]
        if module in COLUMN:
            size = spec.shape[0] // n
            return [Piece(0, r * size, (r + 1) * size) for r in range(n)]
        if module in ROW and kind == "weight":
            size = spec.shape[1] // n
            return [Piece(1, r * size, (r + 1) * size) for r in range(n)]
        raise ReshardError(f"{name!r}: no tensor-parallel rule for this parameter")


def piece_shape(spec: TensorSpec, piece: Piece) -> tuple[int, ...]:
    if piece.dim is None:
        return tuple(spec.shape)
    shape = list(spec.shape)
    shape[piece.dim] = piece.stop - piece.start
    return tuple(shape)
