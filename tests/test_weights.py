"""The Hugging Face folder writer: whole folders, every tensor under its name, loadable as is."""

import os

import pytest
import torch

from pipeline.weights import load_state_dict, write_hf_folder


def _tied_model():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                      tie_word_embeddings=True)
    torch.manual_seed(0)
    return Qwen2ForCausalLM(cfg).eval()


def test_tied_weights_are_written_under_each_name_and_the_folder_loads_with_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    model = _tied_model()
    weights = model.state_dict()
    assert weights["lm_head.weight"].data_ptr() == weights["model.embed_tokens.weight"].data_ptr()
    folder = str(tmp_path / "out")
    names = write_hf_folder(folder, config=model.config, generation_config=model.generation_config, weights=weights)
    assert names == sorted(os.listdir(folder))
    assert {"config.json", "generation_config.json", "model.safetensors"} <= set(names)
    saved = load_state_dict(folder)
    assert saved.keys() == weights.keys() and all(torch.equal(saved[k], v) for k, v in weights.items())
    again = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=torch.float32).eval()
    ids = torch.arange(8).view(1, 8)
    with torch.no_grad():
        assert torch.equal(again(input_ids=ids).logits, model(input_ids=ids).logits)


def test_a_folder_appears_whole_and_a_failed_write_leaves_nothing(tmp_path, monkeypatch):
    model = _tied_model()
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "keep.txt").write_text("x")
    with pytest.raises(OSError):
        write_hf_folder(str(occupied), config=model.config)
    assert os.listdir(occupied) == ["keep.txt"]

    def broken(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr("pipeline.weights.save_file", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        write_hf_folder(str(tmp_path / "new"), config=model.config, weights=model.state_dict())
    assert sorted(os.listdir(tmp_path)) == ["occupied"]  # no temporary folder left behind either
