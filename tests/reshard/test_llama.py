"""Llama shares Qwen2's parameter names without the q/k/v biases: the same rules apply."""

import torch
from reshard_loaders import load_hf, logits, model_with, state_from_tp

from pipeline.reshard import reshard


def test_llama_round_trips_through_tp4_and_dcp2_with_the_same_logits(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(tmp_path / "src")
    want = logits(model)

    m = reshard(str(tmp_path / "src"), str(tmp_path / "tp4"), to="tp:4")
    assert m["architecture"] == "LlamaForCausalLM" and "model.layers.0.self_attn.q_proj.bias" not in m["tensors"]
    state = state_from_tp(str(tmp_path / "tp4"))
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    reshard(str(tmp_path / "tp4"), str(tmp_path / "dcp2"), to="dcp:2")
    reshard(str(tmp_path / "dcp2"), str(tmp_path / "hf"), to="hf")
    torch.testing.assert_close(logits(model_with(model, state)), want, rtol=0, atol=1e-6)
    torch.testing.assert_close(logits(load_hf(str(tmp_path / "hf"))), want, rtol=0, atol=1e-6)
