"""The tp:N split rules, checked slice by slice against the original tensors."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from pipeline.reshard import ReshardError, reshard


def _ranks(folder):
    with open(os.path.join(folder, "manifest.json")) as f:
        manifest = json.load(f)
    return manifest, [load_file(os.path.join(folder, n)) for n in manifest["rank_files"]]


def test_tp2_splits_column_row_vocab_and_replicates_norms(tiny, tmp_path):
    model, _, full = tiny
    ref = model.state_dict()
    reshard(full, str(tmp_path / "tp2"), to="tp:2")
    manifest, ranks = _ranks(str(tmp_path / "tp2"))
    assert manifest["tp_size"] == 2
    p = "model.layers.1."
    for r in range(2):
        for name in ("self_attn.q_proj.weight", "self_attn.q_proj.bias", "self_attn.k_proj.weight", "mlp.gate_proj.weight",
                     "mlp.up_proj.weight"):
            assert torch.equal(ranks[r][p + name], ref[p + name].chunk(2, dim=0)[r]), name
        for name in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
            assert torch.equal(ranks[r][p + name], ref[p + name].chunk(2, dim=1)[r]), name
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            assert torch.equal(ranks[r][name], ref[name].chunk(2, dim=0)[r]), name
        assert torch.equal(ranks[r]["model.norm.weight"], ref["model.norm.weight"])
        assert torch.equal(ranks[r][p + "input_layernorm.weight"], ref[p + "input_layernorm.weight"])


def test_tp4_with_two_kv_heads_replicates_each_kv_head_on_two_ranks(tiny, tmp_path):
    model, _, full = tiny
    ref = model.state_dict()
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    assert cfg.num_key_value_heads == 2
    reshard(full, str(tmp_path / "tp4"), to="tp:4")
    manifest, ranks = _ranks(str(tmp_path / "tp4"))
    for name in ("model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.v_proj.bias"):
        for r in range(4):
            head = r // 2
            assert torch.equal(ranks[r][name], ref[name][head * head_dim:(head + 1) * head_dim]), (name, r)
        assert manifest["tensors"][name]["ranges"] == [[0, head_dim], [0, head_dim], [head_dim, 2 * head_dim],
                                                       [head_dim, 2 * head_dim]]
    q = "model.layers.0.self_attn.q_proj.weight"
    assert [ranks[r][q].shape[0] for r in range(4)] == [head_dim] * 4


def test_tp_degree_that_does_not_divide_the_heads_is_refused_before_any_output(tiny, tmp_path):
    _, _, full = tiny
    with pytest.raises(ReshardError, match="does not divide num_attention_heads=4"):
        reshard(full, str(tmp_path / "tp3"), to="tp:3")
    assert not (tmp_path / "tp3").exists()


def test_unknown_format_names_the_accepted_ones(tiny, tmp_path):
    with pytest.raises(ReshardError, match="'hf', 'tp:N' or 'dcp:N'"):
        reshard(tiny[2], str(tmp_path / "x"), to="tp:two")


def test_row_parallel_slices_read_across_checkpoint_chunks_match_the_original(tiny, trainer_ckpt, tmp_path):
    model, _, _ = tiny
    ref = model.state_dict()
    reshard(trainer_ckpt, str(tmp_path / "dcp3"), to="dcp:3")  # each tensor in three files, rows split unevenly
    reshard(str(tmp_path / "dcp3"), str(tmp_path / "tp4"), to="tp:4")
    _, ranks = _ranks(str(tmp_path / "tp4"))
    for i in range(2):
        for name in (f"model.layers.{i}.self_attn.o_proj.weight", f"model.layers.{i}.mlp.down_proj.weight"):
            for r in range(4):
                assert torch.equal(ranks[r][name], ref[name].chunk(4, dim=1)[r]), (name, r)


def test_written_safetensors_put_page_multiple_tensors_on_page_boundaries_and_load_with_safetensors(tiny, tmp_path):
    import struct

    from pipeline.reshard.safetensors_io import PAGE, read_header

    model, _, full = tiny
    ref = model.state_dict()
    reshard(full, str(tmp_path / "hf"), to="hf")
    reshard(str(tmp_path / "hf"), str(tmp_path / "tp2"), to="tp:2")
    paths = [str(tmp_path / "hf" / "model.safetensors")] + [str(tmp_path / "tp2" / n) for n in _ranks(str(tmp_path / "tp2"))[0]["rank_files"]]
    for path in paths:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            assert (8 + n) % PAGE == 0, path
            f.seek(0)
            entries = read_header(f, path)
        by_offset = sorted(entries.values(), key=lambda e: e.begin)
        sizes = [e.end - e.begin for e in by_offset]
        whole = [s % PAGE == 0 for s in sizes]
        assert any(whole) and any(not w for w in whole), "the tiny model has both kinds"
        assert whole == sorted(whole, reverse=True), "whole-page tensors come first"
        assert all(e.begin % PAGE == 0 for e, w in zip(by_offset, whole) if w)
    loaded = load_file(paths[0])  # the safetensors library's own checks (no holes, valid header)
    assert set(loaded) == set(ref) and all(torch.equal(loaded[k], ref[k]) for k in ref)
