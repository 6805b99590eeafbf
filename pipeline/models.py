"""Model loading: user models in Hugging Face format.

User models: any local folder or fsspec URL holding a Hugging Face causal LM (config.json,
safetensors weights, tokenizer). Remote folders are copied to a local cache first
(`pipeline.model_cache`). Nothing is downloaded from a model hub: `local_files_only=True` everywhere.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from .model_cache import localize


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
    (Llama 3 and Qwen2.5-Instruct list several, e.g. <|eot_id|> beside <|end_of_text|>), or of
    config.json for a folder without one (transformers then takes its generation settings there)."""
    import json

    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    folder = Path(localize(path))
    gen = folder / "generation_config.json"
    source = gen if gen.is_file() else folder / "config.json"
    if source.is_file():
        listed = json.loads(source.read_text()).get("eos_token_id")
        for i in listed if isinstance(listed, list) else [listed]:
            if isinstance(i, int) and not isinstance(i, bool) and i not in ids:
                ids.append(i)
    if not ids:
        raise ValueError(f"{path}: neither the tokenizer nor generation_config.json (or config.json) names an EOS token")
    return ids


def load_model(path: str, dtype: str = "float32", *, trust_remote_code: bool = False):
    """Any Hugging Face causal LM; `trust_remote_code` (the run's `model.trust_remote_code`) runs
    the modelling code a folder ships for architectures transformers does not know."""
    import torch
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


def prompt_token_ids(tokenizer, prompts: list) -> list[list[int]]:
    """The token ids the model continues, for each prompt (as `render_prompt` takes them). Text from
    the chat template is taken as it is (the template writes the BOS token it wants); text without
    one (no template, or a plain-string prompt) starts with the BOS token when the tokenizer puts one
    there, as the model was trained (Llama and Gemma base models)."""
    texts = [render_prompt(tokenizer, p) for p in prompts]
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None or not _starts_with_bos(tokenizer):
        return ids
    templated = bool(getattr(tokenizer, "chat_template", None))
    return [t if (templated and not isinstance(p, str)) or t[:1] == [bos] else [bos, *t] for p, t in zip(prompts, ids)]


def _starts_with_bos(tokenizer) -> bool:
    """Whether the tokenizer starts what it encodes with its BOS token (asked once per tokenizer)."""
    known = getattr(tokenizer, "_rlhf_starts_with_bos", None)
    if known is None:
        ids = tokenizer("a")["input_ids"]
        known = bool(ids) and ids[0] == tokenizer.bos_token_id
        try:
            tokenizer._rlhf_starts_with_bos = known
        except AttributeError:
            pass
    return known


@contextlib.contextmanager
def tokenizing_on_every_core():
    """While open, a fast tokenizer encodes a batch of texts on every core. Hugging Face tokenizers
    read TOKENIZERS_PARALLELISM at each call, and the engines set it to false, so that a running
    engine's tokenizer never competes with its compute threads; a pass over a whole dataset before
    the first batch is the exception. Tokenizing 4000 prompts of 1-4k tokens took 9.1 s on one core
    of this 2-core machine and 5.0 s on both (250k such prompts: 606 s on one core). A process
    forked afterwards starts with parallelism off (tokenizers turns it off in the child)."""
    before = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "true"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = before


def render_prompt(tokenizer, messages) -> str:
    """verl `prompt` (list of chat messages) or plain string -> the text the model continues."""
    if isinstance(messages, str):
        return messages
    messages = [dict(m) for m in messages]
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return "\n".join(m["content"] for m in messages)


