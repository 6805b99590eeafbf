"""Round trips between layouts are bit-exact and every output computes the original logits."""

import os

import torch
from reshard_loaders import load_hf, logits, model_with, state_from_dcp, state_from_tp

from pipeline.reshard import reshard, verify
from pipeline.weights import load_state_dict


def _same(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def test_dcp2_hf_tp2_hf_dcp1_round_trip_is_bit_exact_and_keeps_logits(tiny, trainer_ckpt, tmp_path):
    model, _, _ = tiny
    ref = {k: v.clone() for k, v in model.state_dict().items()}
    want = logits(model)
    out = {name: str(tmp_path / name) for name in ("dcp2", "hf_a", "tp2", "hf_b", "dcp1")}

    reshard(trainer_ckpt, out["dcp2"], to="dcp:2")
    reshard(out["dcp2"], out["hf_a"], to="hf")
    reshard(out["hf_a"], out["tp2"], to="tp:2")
    reshard(out["tp2"], out["hf_b"], to="hf", max_shard_bytes=400_000)  # several shards + index
    reshard(out["hf_b"], out["dcp1"], to="dcp:1")

    states = {
        "dcp2": state_from_dcp(out["dcp2"], ref), "hf_a": load_state_dict(out["hf_a"]),
        "tp2": state_from_tp(out["tp2"]), "hf_b": load_state_dict(out["hf_b"]), "dcp1": state_from_dcp(out["dcp1"], ref),
    }
    for name, state in states.items():
        _same(ref, state)
        torch.testing.assert_close(logits(model_with(model, state)), want, rtol=0, atol=1e-6)
    for name in ("hf_a", "hf_b"):
        torch.testing.assert_close(logits(load_hf(out[name])), want, rtol=0, atol=1e-6)
        assert verify(out[name]).ok
    assert os.path.exists(os.path.join(out["hf_b"], "model.safetensors.index.json"))
    assert sorted(os.listdir(os.path.join(out["dcp2"], "dcp"))) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    # each tensor is saved alone, not with the read buffer it lay in (torch.save writes a view's storage)
    weights = sum(os.path.getsize(os.path.join(out["hf_b"], f)) for f in os.listdir(out["hf_b"]) if f.endswith(".safetensors"))
    assert os.path.getsize(os.path.join(out["dcp1"], "dcp", "__0_0.distcp")) < 1.2 * weights


def test_outputs_of_the_same_weights_are_byte_identical_whatever_the_source(tiny, trainer_ckpt, tmp_path):
    _, _, full = tiny
    a, b, c = (str(tmp_path / n) for n in ("from_ckpt", "from_tp", "from_hf"))
    reshard(trainer_ckpt, str(tmp_path / "tp4"), to="tp:4")
    reshard(trainer_ckpt, a, to="hf")
    reshard(str(tmp_path / "tp4"), b, to="hf")
    reshard(full, c, to="hf")
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        with open(os.path.join(a, name), "rb") as fa, open(os.path.join(b, name), "rb") as fb:
            assert fa.read() == fb.read(), name
    with open(os.path.join(a, "model.safetensors"), "rb") as fa, open(os.path.join(c, "model.safetensors"), "rb") as fc:
        assert fa.read() == fc.read()


def test_trainer_checkpoint_carries_its_step_and_policy_version_into_the_manifest(trainer_ckpt, tmp_path):
    m = reshard(trainer_ckpt, str(tmp_path / "hf"), to="hf")
    assert (m["step"], m["version"], m["source_format"], m["format"]) == (4, 4, "dcp:1", "hf")
    assert m["architecture"] == "Qwen2ForCausalLM"
    on_disk = set(os.listdir(tmp_path / "hf")) - {"manifest.json"}
    assert set(m["files"]) == on_disk
    m2 = reshard(str(tmp_path / "hf"), str(tmp_path / "dcp3"), to="dcp:3", policy_version=9)
    assert (m2["step"], m2["version"], m2["world_size"]) == (4, 9, 3)
    import json

    with open(tmp_path / "dcp3" / "meta.json") as f:
        assert json.load(f) == {"step": 4, "world_size": 3, "policy_version": 9, "format": "dcp"}


def test_a_dcp_copy_of_a_trainer_checkpoint_keeps_its_retention_class_and_buffer_version(tiny, tmp_path):
    """A resume from `rlhf reshard --to dcp:N`'s copy takes the later replays back as from the original
    (trainer.checkpoint.restore_replays reads buffer_version); other sources have none to give."""
    import json

    from pipeline.reshard import save_dcp

    model, meta, _ = tiny
    ckpt = str(tmp_path / "checkpoints" / "step_6")
    save_dcp({"model": model.state_dict()}, ckpt, meta, step=6, world_size=1, policy_version=6, kind="phase",
             extra={"buffer_version": 41})
    reshard(ckpt, str(tmp_path / "dcp2"), to="dcp:2")
    with open(tmp_path / "dcp2" / "meta.json") as f:
        assert json.load(f) == {"step": 6, "world_size": 2, "policy_version": 6, "format": "dcp", "kind": "phase",
                                "buffer_version": 41}
    reshard(ckpt, str(tmp_path / "hf"), to="hf")
    reshard(str(tmp_path / "hf"), str(tmp_path / "dcp1"), to="dcp:1")
    with open(tmp_path / "dcp1" / "meta.json") as f:
        assert json.load(f) == {"step": 6, "world_size": 1, "policy_version": 6, "format": "dcp"}
