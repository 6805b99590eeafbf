"""What the resharder knows of a model: the checks it applies, tied embeddings and the TP split rules.

Any Hugging Face causal LM reshards between `hf` and `dcp:N`: those layouts hold every tensor under
its own name, whatever the architecture, so tensors are copied as they are. For the families whose
layout is known (`FAMILIES`: Qwen2/2.5, Qwen3, Llama, Mistral, Gemma 1-3, Phi-3) the source is also
checked against its config.json first: every layer present, lm_head present unless the embeddings
are tied, and each recognised tensor of the shape the config implies.

Tied embeddings (`tie_word_embeddings`): the output layer is the input embedding. The sampler
layouts (`hf`, `tp:N`) hold it once, as `model.embed_tokens.weight`, as `save_pretrained` writes
it; the trainer layout (`dcp:N`) holds it under both names, as the trainer's state dict does (a
trainer resumes by those names). A source that holds both must hold the same matrix twice.

`tp:N` splits each tensor by the role of its module (the Megatron/vLLM rules), decided from the
module's name:

- column-parallel, output dim (dim 0), weights and biases: q_proj, k_proj, v_proj, gate_proj, up_proj;
- fused column-parallel: qkv_proj (Phi-3) is the blocks [q | k | v] of heads*head_dim,
  kv_heads*head_dim, kv_heads*head_dim rows and gate_up_proj the halves [gate | up]; each block is
  split by its own rule and a rank holds its slice of every block, concatenated in block order;
- row-parallel, input dim (dim 1): o_proj, down_proj weights (their biases, if any, are replicated:
  the sum over ranks adds them once);
- vocabulary-parallel (dim 0): embed_tokens, lm_head; contiguous ranges of ceil(V/N) rows;
- replicated: every norm (model.norm, input/post_attention layernorms, Gemma's
  pre/post_feedforward layernorms, Qwen3's and Gemma 3's per-head q_norm/k_norm);
- k/v projections (and the k/v blocks of qkv_proj) when there are fewer KV heads than ranks: rank r
  holds KV head r // (N / KV), so each head is replicated N / KV times (vLLM's rule).

Any other tensor in tp mode (experts, vision towers, biases of unknown shape) is refused, naming the
tensor and the architecture.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from .layout import ReshardError, TensorSpec, ordered

# model_type -> the families whose tensor layout (names and shapes) is checked against config.json
FAMILIES = {"qwen2": "Qwen2", "qwen3": "Qwen3", "llama": "Llama", "mistral": "Mistral", "gemma": "Gemma",
            "gemma2": "Gemma2", "gemma3_text": "Gemma3", "phi3": "Phi3"}

# families whose transformers config class ties the embeddings when config.json does not say
# (PretrainedConfig's default; Gemma's Hub configs leave the key out)
TIED_BY_DEFAULT = {"gemma", "gemma2", "gemma3", "gemma3_text"}

EMBED = "model.embed_tokens.weight"
LM_HEAD = "lm_head.weight"
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_LINEAR = re.compile(r"^(self_attn|mlp)\.([a-z_]+)\.(weight|bias)$")
_NORM = re.compile(r"^(?:model\.norm|model\.layers\.\d+\.(?:[a-z_]*layernorm|self_attn\.[qk]_norm))\.weight$")
COLUMN = {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"}
FUSED = {"qkv_proj", "gate_up_proj"}
ROW = {"o_proj", "down_proj"}
KV = {"k_proj", "v_proj"}


def ties_embeddings(config: dict) -> bool:
    """Whether a config.json ties the output layer to the input embedding, as transformers reads it:
    the key, else the family's default (`TIED_BY_DEFAULT`)."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    if "tie_word_embeddings" in config:
        return bool(config["tie_word_embeddings"])
    if "tie_word_embeddings" in text:
        return bool(text["tie_word_embeddings"])
    return config.get("model_type") in TIED_BY_DEFAULT or text.get("model_type") in TIED_BY_DEFAULT


@dataclass(frozen=True)
class Piece:
    """Which slice of the full tensor one TP rank holds: the [start, stop) runs `segments` of `dim`,
    concatenated in that order (one run except for fused tensors), or the whole tensor when dim is None."""

    dim: int | None
    segments: tuple[tuple[int, int], ...] = ()

    @property
    def size(self) -> int:
        return sum(stop - start for start, stop in self.segments)

    def byte_ranges(self, spec: TensorSpec) -> list[tuple[int, int]]:
        """Where this slice lies in the bytes of the full (row-major) tensor: [begin, end) runs, in
        the order the slice holds them. One run for a whole tensor or one dim-0 segment."""
        if self.dim is None:
            return [(0, spec.nbytes)]
        outer = math.prod(spec.shape[: self.dim])
        inner = spec.dtype.itemsize * math.prod(spec.shape[self.dim + 1 :])
        row = spec.shape[self.dim] * inner
        return [(i * row + start * inner, i * row + stop * inner) for i in range(outer) for start, stop in self.segments]


REPLICATED = Piece(None)


def _int(config: dict, key: str) -> int | None:
    value = config.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


@dataclass(frozen=True)
class Architecture:
    name: str                 # config.json `architectures[0]` (or its model_type)
    model_type: str | None
    vocab: int | None
    hidden: int | None
    layers: int | None
    heads: int | None
    kv_heads: int | None
    head_dim: int | None
    intermediate: int | None
    tied: bool
    attention_bias: bool

    @classmethod
    def from_config(cls, config: dict, where: str) -> "Architecture":
        """Never refuses a config: fields it lacks are None, and only the checks that need them do."""
        text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
        num = {k: _int(config, k) or _int(text, k) for k in (
            "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "intermediate_size")}
        archs = config.get("architectures") or []
        model_type = config.get("model_type") or text.get("model_type")
        heads, hidden = num["num_attention_heads"], num["hidden_size"]
        head_dim = num["head_dim"] or (hidden // heads if hidden and heads and hidden % heads == 0 else None)
        tied = ties_embeddings(config)
        return cls(
            name=str(archs[0]) if archs else str(model_type or "unknown"), model_type=model_type,
            vocab=num["vocab_size"], hidden=hidden, layers=num["num_hidden_layers"], heads=heads,
            kv_heads=num["num_key_value_heads"] or heads, head_dim=head_dim, intermediate=num["intermediate_size"],
            tied=bool(tied), attention_bias=bool(config.get("attention_bias", model_type == "qwen2")),
        )

    @property
    def known(self) -> bool:
        """Whether this is a family whose tensor layout is checked against config.json."""
        return self.model_type in FAMILIES

    # shapes ---------------------------------------------------------------------------------
    def expected_shape(self, name: str) -> tuple[int, ...] | None:
        """The shape config.json implies for tensor `name`; None when the name has no known role or
        the config lacks a number it needs."""
        h, v, hd, i = self.hidden, self.vocab, self.head_dim, self.intermediate
        q = self.heads * hd if self.heads and hd else None
        kv = self.kv_heads * hd if self.kv_heads and hd else None
        if name in (EMBED, LM_HEAD):
            shape = (v, h)
        elif name == "model.norm.weight":
            shape = (h,)
        else:
            m = _LAYER.match(name)
            if not m:
                return None
            part = m.group(2)
            if _NORM.match(name):
                shape = (hd,) if part.startswith("self_attn.") else (h,)
            elif lin := _LINEAR.match(part):
                module, kind = lin.group(2), lin.group(3)
                out_in = {
                    "q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
                    "qkv_proj": (q + 2 * kv if q and kv else None, h), "gate_proj": (i, h), "up_proj": (i, h),
                    "gate_up_proj": (2 * i if i else None, h), "down_proj": (h, i),
                }.get(module)
                if out_in is None:
                    return None
                shape = out_in if kind == "weight" else out_in[:1]
            else:
                return None
        return None if any(d is None for d in shape) else tuple(shape)

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor of a Llama-layout model (Qwen2 adds q/k/v biases) of this config, by name."""
        out = {n: self.expected_shape(n) for n in (EMBED, "model.norm.weight")}
        if not self.tied:
            out[LM_HEAD] = self.expected_shape(LM_HEAD)
        for n in range(self.layers or 0):
            p = f"model.layers.{n}."
            names = [f"self_attn.{m}.weight" for m in ("q_proj", "k_proj", "v_proj", "o_proj")]
            names += [f"mlp.{m}.weight" for m in ("gate_proj", "up_proj", "down_proj")]
            names += ["input_layernorm.weight", "post_attention_layernorm.weight"]
            if self.attention_bias:
                names += [f"self_attn.{m}.bias" for m in ("q_proj", "k_proj", "v_proj")]
            out.update({p + x: self.expected_shape(p + x) for x in names})
        return out

    def check(self, specs: list[TensorSpec], where: str) -> None:
        """For a known family: every layer present with the tensors the others hold, lm_head unless
        tied, each recognised tensor of the shape config.json implies. Tied embeddings held twice must agree in shape anyway."""
        have = {s.name: s for s in specs}
        if self.tied and LM_HEAD in have and EMBED in have and have[LM_HEAD].shape != have[EMBED].shape:
            raise ReshardError(
                f"{where}: tie_word_embeddings is true but {LM_HEAD!r} has shape {list(have[LM_HEAD].shape)} and "
                f"{EMBED!r} {list(have[EMBED].shape)}; the output layer must be the input embedding"
            )
        if not self.known:
            return
        missing = [EMBED] if EMBED not in have else []
        if not self.tied and LM_HEAD not in have:
            missing.append(LM_HEAD)
        layers: dict[int, set[str]] = {}
        for n in have:
            if m := _LAYER.match(n):
                layers.setdefault(int(m.group(1)), set()).add(m.group(2))
        every = set().union(*layers.values()) if layers else set()  # the families' layers all hold the same tensors
        for n in range(self.layers or 0):
            missing += [f"model.layers.{n}.{x}" for x in sorted(every - layers.get(n, set()))] or \
                ([f"model.layers.{n}.*"] if n not in layers else [])
        if missing:
            raise ReshardError(
                f"{where}: {len(missing)} parameter(s) of the {self.name} config are missing, first "
                f"{missing[0]!r}; the checkpoint is incomplete or does not match its config.json"
            )
        for name, spec in have.items():
            want = self.expected_shape(name)
            if want is not None and tuple(spec.shape) != want:
                raise ReshardError(
                    f"{where}: parameter {name!r} has shape {list(spec.shape)} but config.json implies "
                    f"{list(want)}; the weights do not match the config"
                )
            m = _LAYER.match(name)
            if m and self.layers is not None and int(m.group(1)) >= self.layers:
                raise ReshardError(f"{where}: parameter {name!r} is beyond num_hidden_layers={self.layers}; "
                                   "the weights do not match the config")

    # tied embeddings ------------------------------------------------------------------------
    def output_names(self, names: list[str], kind: str) -> dict[str, str]:
        """{output tensor name: source tensor name} of a layout of kind `kind` ("hf", "tp", "dcp"):
        every source tensor under its own name, except the tied output layer (see the module
        docstring): dropped from hf and tp:N, added to dcp:N as a second name of the embedding."""
        out = {n: n for n in names}
        if not self.tied or EMBED not in out:
            return out
        if kind == "dcp":
            out.setdefault(LM_HEAD, EMBED)
        else:
            out.pop(LM_HEAD, None)
        return out

    # tensor parallelism ---------------------------------------------------------------------
    def check_tp(self, n: int, specs: list[TensorSpec] = ()) -> None:
        """Refuse a tensor without a rule, or a degree the config cannot be split by, before any output."""
        for spec in ordered(specs):
            if tp_role(spec.name) is None:
                raise self._no_rule(spec.name)
        for field, value in (("num_attention_heads", self.heads), ("num_key_value_heads", self.kv_heads),
                             ("head_dim", self.head_dim)):
            if value is None:
                raise ReshardError(f"--to tp:{n}: config.json of {self.name} gives no {field}; tp:N needs it to split attention")
        if self.heads % n:
            raise ReshardError(f"--to tp:{n}: {n} does not divide num_attention_heads={self.heads}; choose a divisor")
        if self.kv_heads >= n and self.kv_heads % n:
            raise ReshardError(f"--to tp:{n}: {n} does not divide num_key_value_heads={self.kv_heads}; choose a divisor")
        if self.kv_heads < n and n % self.kv_heads:
            raise ReshardError(
                f"--to tp:{n}: num_key_value_heads={self.kv_heads} < {n} ranks, so KV heads are replicated, "
                f"which needs {n} to be a multiple of {self.kv_heads}"
            )
        if self.intermediate is not None and self.intermediate % n:
            raise ReshardError(f"--to tp:{n}: {n} does not divide intermediate_size={self.intermediate}")
        for spec in specs:
            self.tp_pieces(spec, n)

    def _no_rule(self, name: str, why: str = "") -> ReshardError:
        return ReshardError(
            f"{name!r}: no tensor-parallel rule for this tensor of {self.name}{why}; "
            "reshard it to 'hf' or 'dcp:N' (any architecture), or use a model whose tensors tp:N knows"
        )

    def _kv_rows(self, n: int, base: int = 0) -> list[tuple[int, int]]:
        """Each rank's rows of a k or v projection (or block) that starts at row `base`."""
        d = self.head_dim
        if self.kv_heads < n:
            reps = n // self.kv_heads
            return [(base + (r // reps) * d, base + (r // reps + 1) * d) for r in range(n)]
        size = self.kv_heads * d // n
        return [(base + r * size, base + (r + 1) * size) for r in range(n)]

    def tp_pieces(self, spec: TensorSpec, n: int) -> list[Piece]:
        """The slice of `spec` each of the n ranks holds (see the module docstring)."""
        name, role = spec.name, tp_role(spec.name)
        if role is None:
            raise self._no_rule(name)
        if role == "vocab":
            step = -(-spec.shape[0] // n)
            return [Piece(0, ((min(r * step, spec.shape[0]), min((r + 1) * step, spec.shape[0])),)) for r in range(n)]
        if role == "norm":
            if name.endswith(("q_norm.weight", "k_norm.weight")) and tuple(spec.shape) != (self.head_dim,):
                raise self._no_rule(name, f" (shape {list(spec.shape)}: a per-head norm has [head_dim={self.head_dim}])")
            return [REPLICATED] * n
        module, kind = role
        rows = spec.shape[0]
        if module in ROW:
            if kind == "bias":
                return [REPLICATED] * n
            return self._even(spec, n, dim=1)
        if module in KV:
            self._expect_rows(spec, self.kv_heads * self.head_dim)
            return [Piece(0, (seg,)) for seg in self._kv_rows(n)]
        if module in COLUMN:
            return self._even(spec, n, dim=0)
        if module == "qkv_proj":
            q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
            self._expect_rows(spec, q + 2 * kv)
            qs = [(r * (q // n), (r + 1) * (q // n)) for r in range(n)]
            ks, vs = self._kv_rows(n, q), self._kv_rows(n, q + kv)
            return [Piece(0, (qs[r], ks[r], vs[r])) for r in range(n)]
        if module == "gate_up_proj":
            if rows % (2 * n):
                raise ReshardError(f"--to tp:{n}: {name!r} has {rows} rows, two halves that {n} must divide")
            half, size = rows // 2, rows // (2 * n)
            return [Piece(0, ((r * size, (r + 1) * size), (half + r * size, half + (r + 1) * size))) for r in range(n)]
        raise self._no_rule(name)

    def _even(self, spec: TensorSpec, n: int, dim: int) -> list[Piece]:
        if len(spec.shape) <= dim or spec.shape[dim] % n:
            raise ReshardError(f"--to tp:{n}: {spec.name!r} has shape {list(spec.shape)}; {n} must divide dim {dim}")
        size = spec.shape[dim] // n
        return [Piece(dim, ((r * size, (r + 1) * size),)) for r in range(n)]

    def _expect_rows(self, spec: TensorSpec, rows: int) -> None:
        if spec.shape[0] != rows:
            raise ReshardError(
                f"{spec.name!r} of {self.name} has {spec.shape[0]} rows but the config's heads imply {rows} "
                f"(heads={self.heads}, kv_heads={self.kv_heads}, head_dim={self.head_dim}); tp:N cannot split it"
            )


def tp_role(name: str) -> str | tuple[str, str] | None:
    """"vocab", "norm", (module, "weight" | "bias") of a linear layer with a TP rule, or None."""
    if name in (EMBED, LM_HEAD):
        return "vocab"
    if _NORM.match(name):
        return "norm"
    m = _LAYER.match(name)
    lin = _LINEAR.match(m.group(2)) if m else None
    if lin is None or lin.group(2) not in COLUMN | FUSED | ROW:
        return None
    return lin.group(2), lin.group(3)


def piece_shape(spec: TensorSpec, piece: Piece) -> tuple[int, ...]:
    if piece.dim is None:
        return tuple(spec.shape)
    shape = list(spec.shape)
    shape[piece.dim] = piece.size
    return tuple(shape)
