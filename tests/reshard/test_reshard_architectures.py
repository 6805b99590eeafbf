"""Every architecture family reshards: hf <-> dcp:N for any tensor names, tp:N by the role of each
module (checked slice by slice against rules written out here with torch.chunk), tied embeddings
held once in the sampler layouts and under both names in the trainer's."""

import json
import os
import shutil

import pytest
import torch
from reshard_loaders import load_hf, logits, state_from_dcp, state_from_tp
from safetensors import safe_open
from safetensors.torch import load_file

from pipeline.example import ARCH_FAMILIES, ensure_tiny_arch
from pipeline.reshard import ReshardError, reshard, verify
from pipeline.reshard.checkpoint import load_model_weights

FAMILIES = list(ARCH_FAMILIES)
EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"


def _names(folder: str) -> set[str]:
    names = set()
    for f in os.listdir(folder):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(folder, f), "pt") as sf:
                names |= set(sf.keys())
    return names


def _kv_rule(full: torch.Tensor, n: int, kv: int, r: int) -> torch.Tensor:
    """Rank r's rows of a k or v projection: its share of the heads, or one replicated head."""
    if kv >= n:
        return full.chunk(n, 0)[r]
    return full.chunk(kv, 0)[r // (n // kv)]


def expected_slice(name: str, full: torch.Tensor, n: int, r: int, cfg: dict) -> torch.Tensor:
    """The Megatron/vLLM split of tensor `name` for rank r of n, written independently of `arch`."""
    kv = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    module = name.rsplit(".", 2)[-2]
    if name in (EMBED, HEAD):
        step = -(-full.shape[0] // n)
        return full[r * step:(r + 1) * step]
    if module.endswith("norm"):
        return full
    if module in ("q_proj", "gate_proj", "up_proj"):
        return full.chunk(n, 0)[r]
    if module in ("k_proj", "v_proj"):
        return _kv_rule(full, n, kv, r)
    if module in ("o_proj", "down_proj"):
        return full.chunk(n, 1)[r]
    if module == "qkv_proj":
        q_rows = cfg["num_attention_heads"] * head_dim
        q, k, v = full.split([q_rows, kv * head_dim, kv * head_dim])
        return torch.cat([q.chunk(n, 0)[r], _kv_rule(k, n, kv, r), _kv_rule(v, n, kv, r)])
    if module == "gate_up_proj":
        gate, up = full.chunk(2, 0)
        return torch.cat([gate.chunk(n, 0)[r], up.chunk(n, 0)[r]])
    raise AssertionError(f"{name}: no expectation for this tensor")


@pytest.mark.parametrize("family", FAMILIES)
def test_family_round_trips_bit_exact_through_dcp_tp_and_hf(family, tmp_path):
    src = ensure_tiny_arch(family)
    model = load_hf(src)
    want = logits(model)
    ref = model.state_dict()
    tied = model.config.tie_word_embeddings
    reshard(src, str(tmp_path / "dcp2"), to="dcp:2")
    reshard(str(tmp_path / "dcp2"), str(tmp_path / "tp2"), to="tp:2")
    reshard(str(tmp_path / "tp2"), str(tmp_path / "tp4"), to="tp:4")
    m = reshard(str(tmp_path / "tp4"), str(tmp_path / "hf"), to="hf")
    assert m["architecture"] == model.config.architectures[0]

    # the trainer layout holds the tied matrix under both names (the trainer's state dict); the
    # sampler layouts hold it once, as save_pretrained does
    from_dcp = state_from_dcp(str(tmp_path / "dcp2"), ref)
    assert from_dcp.keys() == ref.keys() and all(torch.equal(from_dcp[k], v) for k, v in ref.items())
    for tp in ("tp2", "tp4"):
        from_tp = state_from_tp(str(tmp_path / tp))
        assert (HEAD in from_tp) is not tied
        assert all(torch.equal(from_tp[k], ref[k]) for k in from_tp) and set(ref) - set(from_tp) <= {HEAD}
    assert _names(str(tmp_path / "hf")) == _names(src) == set(ref) - ({HEAD} if tied else set())
    assert verify(str(tmp_path / "hf")).ok
    torch.testing.assert_close(logits(load_hf(str(tmp_path / "hf"))), want, rtol=0, atol=0)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("n", [2, 4])
def test_tp_slices_follow_the_role_of_each_module(family, n, tmp_path):
    src = ensure_tiny_arch(family)
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    full = load_file(os.path.join(src, "model.safetensors"))
    reshard(src, str(tmp_path / "tp"), to=f"tp:{n}")
    with open(tmp_path / "tp" / "manifest.json") as f:
        manifest = json.load(f)
    ranks = [load_file(str(tmp_path / "tp" / name)) for name in manifest["rank_files"]]
    assert all(r.keys() == full.keys() for r in ranks)
    for name, t in full.items():
        for r in range(n):
            assert torch.equal(ranks[r][name], expected_slice(name, t, n, r, cfg)), (family, name, r)


def test_phi3_fused_tensors_are_split_per_block_not_evenly(tmp_path):
    src = ensure_tiny_arch("phi3")
    reshard(src, str(tmp_path / "tp2"), to="tp:2")
    with open(tmp_path / "tp2" / "manifest.json") as f:
        tensors = json.load(f)["tensors"]
    q, kv = 4 * 32, 2 * 32  # 4 query heads, 2 KV heads of 32
    qkv = tensors["model.layers.0.self_attn.qkv_proj.weight"]
    assert qkv["dim"] == 0 and "ranges" not in qkv
    assert qkv["segments"] == [[[0, q // 2], [q, q + kv // 2], [q + kv, q + kv + kv // 2]],
                               [[q // 2, q], [q + kv // 2, q + kv], [q + kv + kv // 2, q + 2 * kv]]]
    assert tensors["model.layers.0.mlp.gate_up_proj.weight"]["segments"] == [[[0, 128], [256, 384]],
                                                                             [[128, 256], [384, 512]]]


def test_gemma_extra_norms_are_replicated(tmp_path):
    reshard(ensure_tiny_arch("gemma3"), str(tmp_path / "tp2"), to="tp:2")
    with open(tmp_path / "tp2" / "manifest.json") as f:
        tensors = json.load(f)["tensors"]
    for norm in ("pre_feedforward_layernorm", "post_feedforward_layernorm", "self_attn.q_norm", "self_attn.k_norm"):
        assert tensors[f"model.layers.1.{norm}.weight"]["dim"] is None, norm


def test_tied_output_layer_becomes_a_second_name_of_the_embedding_in_a_trainer_checkpoint(tmp_path):
    src = ensure_tiny_arch("llama3")
    assert HEAD not in _names(src)
    reshard(src, str(tmp_path / "step_0"), to="dcp:2")
    weights = load_model_weights(str(tmp_path / "step_0"))
    assert torch.equal(weights[HEAD], weights[EMBED])
    reshard(str(tmp_path / "step_0"), str(tmp_path / "hf"), to="hf")
    assert _names(str(tmp_path / "hf")) == _names(src)


@pytest.mark.parametrize("to", ["hf", "dcp:2"])
def test_tied_weights_that_drifted_apart_are_refused_before_any_output(tmp_path, to):
    from pipeline.weights import write_hf_folder

    model = load_hf(ensure_tiny_arch("qwen2-tied"))
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    weights[HEAD][3, 5] += 0.25
    write_hf_folder(str(tmp_path / "src"), config=model.config, weights=weights)
    with pytest.raises(ReshardError, match=r"tie_word_embeddings is true but 'lm_head.weight' differs from "
                                           r"'model.embed_tokens.weight' \(max difference 0.25\)"):
        reshard(str(tmp_path / "src"), str(tmp_path / "out"), to=to)
    assert not (tmp_path / "out").exists()


def test_any_architecture_reshards_between_hf_and_dcp_under_its_own_names(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=2, n_positions=32)).eval()
    model.save_pretrained(tmp_path / "src")
    reshard(str(tmp_path / "src"), str(tmp_path / "dcp3"), to="dcp:3")
    m = reshard(str(tmp_path / "dcp3"), str(tmp_path / "hf"), to="hf")
    assert m["architecture"] == "GPT2LMHeadModel"
    assert _names(str(tmp_path / "hf")) == _names(str(tmp_path / "src"))
    torch.testing.assert_close(logits(load_hf(str(tmp_path / "hf"))), logits(model), rtol=0, atol=0)


def test_a_tensor_missing_from_one_layer_is_named_before_any_output(tmp_path):
    from safetensors.torch import save_file

    src = str(tmp_path / "src")
    shutil.copytree(ensure_tiny_arch("gemma2"), src)
    weights = load_file(os.path.join(src, "model.safetensors"))
    del weights["model.layers.1.pre_feedforward_layernorm.weight"]
    save_file(weights, os.path.join(src, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ReshardError, match=r"1 parameter\(s\) of the Gemma2ForCausalLM config are missing, first "
                                           r"'model.layers.1.pre_feedforward_layernorm.weight'"):
        reshard(src, str(tmp_path / "out"), to="dcp:2")
    assert not (tmp_path / "out").exists()


def test_a_config_without_tie_word_embeddings_ties_as_transformers_reads_it(tmp_path):
    """Gemma's Hub configs leave the key out and transformers then ties (its config class's default)."""
    from transformers import CONFIG_MAPPING

    from pipeline.reshard.arch import FAMILIES as CHECKED, TIED_BY_DEFAULT, ties_embeddings

    for model_type in CHECKED:
        assert (model_type in TIED_BY_DEFAULT) == CONFIG_MAPPING[model_type]().tie_word_embeddings, model_type
    src = str(tmp_path / "gemma2")
    shutil.copytree(ensure_tiny_arch("gemma2"), src)
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    assert cfg.pop("tie_word_embeddings") and HEAD not in _names(src)
    with open(os.path.join(src, "config.json"), "w") as f:
        json.dump(cfg, f)
    assert ties_embeddings(cfg) and not ties_embeddings({**cfg, "model_type": "llama"})
    reshard(src, str(tmp_path / "hf"), to="hf")
    assert torch.equal(logits(load_hf(str(tmp_path / "hf"))), logits(load_hf(ensure_tiny_arch("gemma2"))))
