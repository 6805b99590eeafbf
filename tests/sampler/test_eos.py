"""Ends of sequence: every EOS id a model's generation_config.json lists stops a completion."""

import json
import os
import shutil

from pipeline.models import eos_token_ids, load_tokenizer
from pipeline.sampler.backend import GenParams
from pipeline.sampler.hf import HFBackend


def test_generation_config_eos_ids_stop_generation_like_the_tokenizers(digit_example, tmp_path):
    src = os.path.join(digit_example, "model")
    tok = load_tokenizer(src)
    prompt = [tok("digits 3 1 4 :", add_special_tokens=False)["input_ids"]]
    free = HFBackend(src).generate(prompt, 1, GenParams(max_new_tokens=8, greedy=True))[0][0].token_ids
    # a second EOS id, as Llama 3 / Qwen2.5-Instruct list them: a token the model emits here first
    # after at least one other
    k = next(i for i in range(1, len(free)) if free[i] not in free[:i] and free[i] != tok.eos_token_id)
    assert tok.eos_token_id not in free[:k]
    model = shutil.copytree(src, tmp_path / "model")
    gen_path = model / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.exists() else {}
    gen["eos_token_id"] = [tok.eos_token_id, free[k]]
    gen_path.write_text(json.dumps(gen))
    assert eos_token_ids(str(model), tok) == [tok.eos_token_id, free[k]]
    out = HFBackend(str(model)).generate(prompt, 1, GenParams(max_new_tokens=8, greedy=True))[0][0]
    assert out.token_ids == free[:k + 1] and out.finish_reason == "stop"


def test_without_generation_config_the_eos_ids_of_config_json_count(digit_example, tmp_path):
    """transformers takes a folder's generation settings from config.json when it has no
    generation_config.json (Llama 3 folders saved that way list <|eot_id|> there)."""
    model = shutil.copytree(os.path.join(digit_example, "model"), tmp_path / "model")
    (model / "generation_config.json").unlink(missing_ok=True)
    tok = load_tokenizer(str(model))
    other = (tok.eos_token_id + 1) % len(tok)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "eos_token_id": [tok.eos_token_id, other]}))
    assert eos_token_ids(str(model), tok) == [tok.eos_token_id, other]
