"""Tied input/output embeddings: a reload must refresh the output layer too (on CPU vLLM keeps a
packed copy of it that `reload_weights` does not touch)."""

import pytest
import torch

from pipeline.models import load_model
from pipeline.sampler.backend import GenParams
from pipeline.sampler.parity import GAP_ALARM, measure_gap

pytestmark = pytest.mark.vllm


def _tied_versions(tokenizer, root) -> list[str]:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    cfg = Qwen2Config(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=True, bos_token_id=eos, eos_token_id=eos, pad_token_id=pad)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg)
    out = []
    for k in range(2):
        path = str(root / f"tied-v{k}")
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        out.append(path)
        with torch.no_grad():  # the next version differs in the shared matrix itself
            model.model.embed_tokens.weight.add_(torch.randn_like(model.model.embed_tokens.weight) * 0.03)
    return out


def test_reload_of_a_tied_model_refreshes_the_output_layer(tokenizer, prompts, tmp_path):
    from pipeline.sampler.vllm import VLLMBackend, ties_embeddings

    v0, v1 = _tied_versions(tokenizer, tmp_path)
    assert ties_embeddings(v0)
    engine = VLLMBackend(v0, threads=1, seed=0, options={"max_model_len": 256})
    try:
        engine.load_weights(v1)
        gap = measure_gap(engine, load_model(v1).eval(), tokenizer.pad_token_id, prompts, 4,
                          GenParams(max_new_tokens=8, temperature=1.0))
    finally:
        engine.close()
    assert gap["mean_abs_gap"] < GAP_ALARM
