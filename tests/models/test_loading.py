"""Loading user models: code shipped in a folder runs only when trusted; tokenizers without a pad
token pad with EOS; every EOS id of the generation config ends a completion; chat templates render."""

import os

import pytest
import torch
from models_factory import model_with_shipped_code

from pipeline.config import RunConfig
from pipeline.example import LLAMA3_EOT, ensure_tiny_arch
from pipeline.models import eos_token_ids, load_model, load_tokenizer, render_prompt
from pipeline.sampler.backend import GenParams
from pipeline.sampler.hf import HFBackend


def test_code_shipped_in_a_model_folder_runs_only_when_trusted(tmp_path):
    folder = model_with_shipped_code(ensure_tiny_arch("qwen2"), str(tmp_path / "shipped"))
    assert RunConfig().model.trust_remote_code is False
    with pytest.raises(ValueError, match=r"ships its own code, which runs only with model.trust_remote_code: true"):
        load_model(folder)
    model = load_model(folder, trust_remote_code=True)
    assert type(model).__name__ == "ShippedForCausalLM"
    ids = torch.arange(6).view(1, 6)
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, load_model(ensure_tiny_arch("qwen2"))(input_ids=ids).logits)


def test_vllm_engine_arguments_cannot_override_the_trust_switch():
    from pipeline.sampler.vllm import RESERVED_OPTIONS, VLLMBackend

    assert "trust_remote_code" in RESERVED_OPTIONS
    with pytest.raises(ValueError, match=r"sampler.vllm.trust_remote_code: set by the pipeline .*model.trust_remote_code"):
        VLLMBackend("unused", options={"trust_remote_code": True})


def test_a_tokenizer_without_pad_pads_with_eos_and_every_listed_eos_ends_a_completion():
    folder = ensure_tiny_arch("llama3")
    tok = load_tokenizer(folder)
    eot = tok.convert_tokens_to_ids(LLAMA3_EOT)
    assert tok.pad_token_id == tok.eos_token_id  # Llama 3 ships no pad token
    assert eos_token_ids(folder, tok) == [tok.eos_token_id, eot]
    backend = HFBackend(folder, threads=1)
    prompts = [tok(render_prompt(tok, [{"role": "user", "content": f"sort {d}:"}]), add_special_tokens=False)["input_ids"]
               for d in ("31", "5926")]
    greedy = GenParams(max_new_tokens=6, greedy=True)
    alone = backend.generate(prompts[:1], 1, greedy)[0][0].token_ids
    assert backend.generate(prompts, 1, greedy)[0][0].token_ids == alone  # left-padded with EOS, masked out

    head = torch.nn.Linear(backend.model.config.hidden_size, len(tok), bias=True)
    with torch.no_grad():  # an output layer that makes the end-of-turn token the only likely one
        head.weight.zero_()
        head.bias.fill_(-30.0)
        head.bias[eot] = 30.0
    backend.model.lm_head = head
    groups = backend.generate(prompts, 2, GenParams(max_new_tokens=6, temperature=1.0))
    assert all(c.token_ids == [eot] and c.finish_reason == "stop" for g in groups for c in g)


@pytest.mark.parametrize("family", ["qwen2", "gemma2", "phi3"])
def test_families_with_a_pad_token_keep_it(family):
    tok = load_tokenizer(ensure_tiny_arch(family))
    assert tok.pad_token_id is not None and tok.pad_token_id != tok.eos_token_id
    assert render_prompt(tok, [{"role": "user", "content": "sort 31:"}]) == "sort 31: "  # the built-in chat template


class _BosTokenizer:
    """One id per character; puts BOS (1) first when asked for special tokens, as Llama's does."""

    bos_token_id = 1

    def __init__(self, chat_template=None):
        self.chat_template = chat_template

    def __call__(self, texts, add_special_tokens=True):
        one = isinstance(texts, str)
        ids = [([1] if add_special_tokens else []) + [ord(c) for c in t] for t in ([texts] if one else texts)]
        return {"input_ids": ids[0] if one else ids}

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        return "<s>" + "".join(m["content"] for m in messages)  # the template writes its own BOS


def test_prompts_without_a_chat_template_start_with_the_bos_token_the_tokenizer_puts_first():
    from pipeline.models import prompt_token_ids

    chat = [{"role": "user", "content": "hi"}]
    assert prompt_token_ids(_BosTokenizer(), [chat, "hi"]) == [[1, ord("h"), ord("i")]] * 2
    templated = prompt_token_ids(_BosTokenizer(chat_template="..."), [chat, "hi"])
    assert templated == [[ord(c) for c in "<s>hi"], [1, ord("h"), ord("i")]]  # a plain string is not templated


def test_a_tokenizer_without_bos_encodes_prompts_as_before(digit_example):
    from pipeline.models import prompt_token_ids

    tok = load_tokenizer(os.path.join(digit_example, "model"))
    chat = [{"role": "user", "content": "digits 3 1 4 :"}]
    assert prompt_token_ids(tok, [chat, "digits 3"]) == [
        tok(render_prompt(tok, chat), add_special_tokens=False)["input_ids"], tok("digits 3", add_special_tokens=False)["input_ids"]]
