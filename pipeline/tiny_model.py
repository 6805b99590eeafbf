"""The built-in tiny model: a byte-level BPE tokenizer trained on the task's text and a random Qwen2.

Tiny models of other families and tied layouts: `pipeline.example.build_tiny_arch`.
"""

from __future__ import annotations

import torch

TINY_SIZES = {
    # hidden, layers, heads, kv heads, mlp
    "tiny": (128, 2, 4, 2, 384),
    "small": (256, 4, 8, 4, 768),
}

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
