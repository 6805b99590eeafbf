"""What trained versions carry besides their weights: policy v0's files, byte for byte (the user's
config.json in whatever transformers layout it was written, tokenizer files, chat template, shipped
code), in in-phase versions, in the trainer's checkpoints and in phase-end versions; and phase-end
versions in the serving dtype (`model.dtype`), as in-phase versions are."""

import json
import os
import uuid

import pytest
import torch

from pipeline.config import parse_config
from pipeline.models import load_model, load_tokenizer
from pipeline.policy import PolicyStore
from pipeline.reshard.layout import is_weight_file
from pipeline.rundir import RunDir

TEXTS = [f"sort {i} {i * 7 % 10} {i * 3 % 10} -> digits" for i in range(100)]
TEMPLATE = "{% for m in messages %}{{ '<|im_start|>' + m['content'] + '<|endoftext|>' }}{% endfor %}"


@pytest.fixture(scope="module")
def user_model(tmp_path_factory):
    """A tiny Llama folder as users bring them: a transformers-4 config.json (rope_theta,
    rope_scaling, torch_dtype), bf16 weights in two shards, vocab.json/merges.txt beside
    tokenizer.json, special_tokens_map.json, the chat template in tokenizer_config.json, no pad
    token, a README and a Python file."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from pipeline.tiny_model import build_tokenizer

    folder = tmp_path_factory.mktemp("user") / "llama"
    tok = build_tokenizer(TEXTS)
    tok.eos_token, tok.pad_token = "<|endoftext|>", None
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                      tie_word_embeddings=False, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).save_pretrained(folder, max_shard_size="40KB")
    tok.save_pretrained(folder)
    tok.backend_tokenizer.model.save(str(folder))  # vocab.json, merges.txt
    c = json.loads((folder / "config.json").read_text())
    for key in ("rope_parameters", "dtype"):
        c.pop(key, None)
    c.update(rope_theta=500000.0, torch_dtype="bfloat16", transformers_version="4.45.0",
             rope_scaling={"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                           "original_max_position_embeddings": 32, "rope_type": "llama3"})
    (folder / "config.json").write_text(json.dumps(c, indent=2))
    t = json.loads((folder / "tokenizer_config.json").read_text())
    t.pop("pad_token", None)
    (folder / "tokenizer_config.json").write_text(json.dumps({**t, "chat_template": TEMPLATE}, indent=2))
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    (folder / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    (folder / "README.md").write_text("license: apache-2.0\n")
    (folder / "helper.py").write_text("VALUE = 1\n")
    assert len([n for n in os.listdir(folder) if n.endswith(".safetensors")]) > 1
    return str(folder)


def _meta_files(folder: str) -> dict[str, bytes]:
    """The files of a folder that are not weights, nor the store's manifest, nor a local copy's marker."""
    return {n: open(os.path.join(folder, n), "rb").read() for n in sorted(os.listdir(folder))
            if not is_weight_file(n) and not n.startswith(".") and os.path.isfile(os.path.join(folder, n))}


def _run(url: str, user_model: str, dtype: str) -> tuple[RunDir, PolicyStore]:
    run = RunDir(url)
    run.create(parse_config({"model": {"path": user_model, "dtype": dtype}}))
    store = PolicyStore(run)
    assert store.publish_folder(0, user_model)
    return run, store


def test_trained_versions_and_checkpoints_carry_v0s_files_byte_for_byte_and_phase_ends_the_serving_dtype(
        user_model, tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from pipeline.trainer.checkpoint import TrainerState, save_checkpoint
    from pipeline.trainer.critic import ActorCritic
    from pipeline.trainer.distributed import World
    from pipeline.trainer.publish import publish_policy

    run, store = _run(str(tmp_path / "run"), user_model, "bfloat16")
    v0 = _meta_files(store.local_dir(0))
    assert v0 == _meta_files(user_model) and "pad_token" not in v0["tokenizer_config.json"].decode()
    tokenizer = load_tokenizer(store.local_dir(0))  # the trainer's: pads with EOS, in memory only
    assert tokenizer.pad_token == tokenizer.eos_token
    actor = ActorCritic(load_model(store.local_dir(0), "float32"))  # float32 master weights
    opt = torch.optim.AdamW(actor.policy.parameters(), lr=1e-3)
    assert publish_policy(run, 1, actor, tokenizer, World(), dtype=torch.bfloat16)  # in-phase
    with torch.no_grad():
        actor.policy.model.norm.weight.add_(0.25)
    ck = save_checkpoint(run, actor, opt, None, TrainerState(step=2), tokenizer, World(), kind="phase")
    assert _meta_files(f"{ck.path}/hf") == v0
    done = store.publish_checkpoint(2, ck.url)  # phase end
    assert done.published_now and store.verify(2).ok

    for version in (1, 2):
        folder = store.local_dir(version)
        assert _meta_files(folder) == v0, version
        assert {t["dtype"] for t in store.manifest(version)["tensors"].values()} == {"BF16"}
        with safe_open(f"{folder}/model.safetensors", "pt") as f:
            assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    loaded = AutoModelForCausalLM.from_pretrained(store.local_dir(2), local_files_only=True, dtype=torch.bfloat16)
    assert torch.equal(loaded.model.norm.weight, actor.policy.model.norm.weight.to(torch.bfloat16))
    rope = getattr(loaded.config, "rope_parameters", None) or {"rope_theta": loaded.config.rope_theta,
                                                                **loaded.config.rope_scaling}
    assert (rope["rope_theta"], rope["rope_type"]) == (500000.0, "llama3")  # transformers read the classic keys


def test_a_float32_run_publishes_its_phase_end_in_float32_and_in_phase_versions_on_object_stores_keep_v0s_files(
        user_model, tmp_path):
    """model.dtype float32 over a bf16 folder: the phase end stays float32 (the serving dtype);
    on an object store, in-phase versions take v0's files from the run directory."""
    from pipeline.reshard import save_dcp

    run, store = _run(str(tmp_path / "run"), user_model, "float32")
    model = load_model(store.local_dir(0), "float32")
    ckpt = str(tmp_path / "run" / "checkpoints" / "step_3")
    save_dcp({"model": model.state_dict()}, ckpt, store.base_meta(), step=3, world_size=1, policy_version=3)
    assert store.publish_checkpoint(3, ckpt).published_now
    assert {t["dtype"] for t in store.manifest(3)["tensors"].values()} == {"F32"}
    assert _meta_files(store.local_dir(3)) == _meta_files(user_model)

    remote = PolicyStore(RunDir(f"memory://policy-meta-{uuid.uuid4().hex}/run"))
    remote.publish_folder(0, user_model)
    assert remote.publish_model(1, model, load_tokenizer(user_model), {"step": 1})
    assert _meta_files(remote.local_dir(1)) == _meta_files(user_model)


def test_resharding_casts_floating_tensors_only_when_asked_and_the_manifest_says_so(user_model, tmp_path):
    from pipeline.reshard import reshard, verify
    from pipeline.weights import load_state_dict

    plain = reshard(user_model, str(tmp_path / "plain"), to="hf")
    cast = reshard(user_model, str(tmp_path / "cast"), to="tp:2", dtype=torch.float32)
    assert {t["dtype"] for t in plain["tensors"].values()} == {"BF16"}
    assert {t["dtype"] for t in cast["tensors"].values()} == {"F32"} and verify(str(tmp_path / "cast")).ok
    back = reshard(str(tmp_path / "cast"), str(tmp_path / "back"), to="hf", dtype=torch.bfloat16)
    assert {t["dtype"] for t in back["tensors"].values()} == {"BF16"}
    assert all(torch.equal(v, load_state_dict(user_model)[k]) for k, v in load_state_dict(str(tmp_path / "back")).items())
    from pipeline.reshard import ReshardError

    with pytest.raises(ReshardError, match="already holds"):  # the same output in another dtype is another request
        reshard(user_model, str(tmp_path / "plain"), to="hf", dtype=torch.float32)
    with pytest.raises(ReshardError, match="not a floating-point dtype"):
        reshard(user_model, str(tmp_path / "int"), to="hf", dtype=torch.int8)
