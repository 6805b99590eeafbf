"""Model loading (user models in Hugging Face format) and the built-in tiny model.

User models: any local folder or fsspec URL holding a Hugging Face causal LM (config.json,
safetensors weights, tokenizer). Remote folders are copied to a local cache first. Nothing is
downloaded from a model hub: `local_files_only=True` everywhere.
"""

from __future__ import annotations

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


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(localize(path), local_files_only=True)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_model(path: str, dtype: str = "float32"):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        localize(path), local_files_only=True, dtype=getattr(torch, dtype)
    )
    return model


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
    """A random-init Qwen2 causal LM with untied embeddings (vLLM reloads those in place)."""
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
