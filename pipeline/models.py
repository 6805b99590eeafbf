"""Model loading (user models in Hugging Face format) and the built-in tiny model.

User models: any local folder or fsspec URL holding a Hugging Face causal LM (config.json,
safetensors weights, tokenizer). Remote folders are copied to a local cache first. Nothing is
downloaded from a model hub: `local_files_only=True` everywhere.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from pathlib import Path

import torch

from .storage import is_local, url_to_fs

CACHE_ENV = "RLHF_CACHE"
TINY_SIZES = {
    # hidden, layers, heads, kv heads, mlp
    "tiny": (128, 2, 4, 2, 384),
    "small": (256, 4, 8, 4, 768),
}


def cache_dir() -> Path:
    root = os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "rlhf-pipeline")
    p = Path(root)
    p.mkdir(parents=True, exist_ok=True)
    return p


def set_threads(n: int) -> None:
    """Explicit thread counts: two busy processes on two cores slow each other badly otherwise."""
    torch.set_num_threads(n)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass  # already set in this process


def localize(url: str) -> str:
    """A local folder with the contents of `url` (copied once into the cache if remote)."""
    fs, path = url_to_fs(url)
    if is_local(fs):
        if not os.path.isdir(path):
            raise FileNotFoundError(f"model folder {url!r} does not exist")
        return path
    key = hashlib.sha256(url.encode()).hexdigest()[:16]
    dst = cache_dir() / "remote" / key
    if not (dst / ".complete").exists():
        dst.mkdir(parents=True, exist_ok=True)
        fs.get(path.rstrip("/") + "/", str(dst) + "/", recursive=True)
        (dst / ".complete").write_text(url)
    return str(dst)


def load_tokenizer(path: str, *, trust_remote_code: bool = False):
    """The model's tokenizer; one without a pad token (Llama's) pads with its EOS token (batches
    carry attention masks, so padding is never read as text)."""
    from transformers import AutoTokenizer

    with _remote_code_hint(path):
        tok = AutoTokenizer.from_pretrained(localize(path), local_files_only=True, trust_remote_code=trust_remote_code)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def eos_token_ids(path: str, tokenizer) -> list[int]:
    """Every id that ends a completion: the tokenizer's EOS and those of generation_config.json
    (Llama 3 and Qwen2.5-Instruct list several, e.g. <|eot_id|> beside <|end_of_text|>)."""
    import json

    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    gen = Path(localize(path)) / "generation_config.json"
    if gen.is_file():
        listed = json.loads(gen.read_text()).get("eos_token_id")
        for i in listed if isinstance(listed, list) else [listed]:
            if isinstance(i, int) and i not in ids:
                ids.append(i)
    if not ids:
        raise ValueError(f"{path}: neither the tokenizer nor generation_config.json names an EOS token")
    return ids


def load_model(path: str, dtype: str = "float32", *, trust_remote_code: bool = False):
    """Any Hugging Face causal LM; `trust_remote_code` (the run's `model.trust_remote_code`) runs
    the modelling code a folder ships for architectures transformers does not know."""
    from transformers import AutoModelForCausalLM

    with _remote_code_hint(path):
        return AutoModelForCausalLM.from_pretrained(
            localize(path), local_files_only=True, dtype=getattr(torch, dtype), trust_remote_code=trust_remote_code
        )


def ships_required_code(config: dict) -> bool:
    """Whether a model's config.json (a dict) loads only by running code its folder ships: it maps
    Auto classes to its own files (`auto_map`) for a model type transformers does not know."""
    if not config.get("auto_map"):
        return False
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return config.get("model_type") not in CONFIG_MAPPING


@contextlib.contextmanager
def _remote_code_hint(path: str):
    """transformers refuses a folder whose architecture is its own code unless trusted: say which
    setting trusts it."""
    try:
        yield
    except ValueError as e:
        if "trust_remote_code" not in str(e):
            raise
        raise ValueError(f"{path}: the model ships its own code, which runs only with model.trust_remote_code: true "
                         f"(set it only for folders you trust); transformers said: {e}") from None


def render_prompt(tokenizer, messages) -> str:
    """verl `prompt` (list of chat messages) or plain string -> the text the model continues."""
    if isinstance(messages, str):
        return messages
    messages = [dict(m) for m in messages]
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return "\n".join(m["content"] for m in messages)


# --- the built-in tiny model -------------------------------------------------------------------

TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %} {% endif %}"
)


def build_tokenizer(texts: list[str], vocab_size: int = 320):
    """Byte-level BPE trained on the task's own text; digits stay single tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    special = ["<|endoftext|>", "<|pad|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|pad|>")
    fast.chat_template = TINY_CHAT_TEMPLATE
    fast.padding_side = "left"
    return fast


def build_tiny_model(vocab_size: int, eos_id: int, pad_id: int, seed: int, size: str = "tiny"):
    """A random-init Qwen2 causal LM with untied embeddings (tiny models of other families and
    tied layouts: `pipeline.example.build_tiny_arch`)."""
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    hidden, layers, heads, kv, mlp = TINY_SIZES[size]
    cfg = Qwen2Config(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=256,
        tie_word_embeddings=False, bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=pad_id,
        torch_dtype="float32", use_sliding_window=False,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg)
    model.generation_config = GenerationConfig(
        bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=pad_id, do_sample=True, top_k=0, top_p=1.0,
        temperature=1.0,
    )
    return model
