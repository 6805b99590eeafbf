"""Tied input/output embeddings stay tied: through a training step, the trainer's checkpoint, both
publication paths (in-phase from memory, phase-end from the checkpoint) and the HF backend's reload."""

import pytest
import torch

from pipeline.example import ensure_tiny_arch
from pipeline.models import load_model, load_tokenizer
from pipeline.policy import PolicyStore
from pipeline.reshard import save_dcp
from pipeline.rundir import RunDir
from pipeline.sampler.hf import HFBackend
from pipeline.weights import load_state_dict, write_hf_folder

EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"


def _trained(path: str):
    """The model after one optimizer step whose gradient reaches the shared matrix from both ends."""
    model = load_model(path).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    return model.eval()


@pytest.mark.parametrize("family", ["qwen2-tied", "llama3", "gemma2", "gemma3"])
def test_a_trained_tied_model_is_published_once_and_reloads_tied(family, tmp_path):
    base = ensure_tiny_arch(family)
    before = load_state_dict(base)[EMBED]
    model = _trained(base)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    trained = model.model.embed_tokens.weight.detach().clone()
    assert not torch.equal(trained, before)

    store = PolicyStore(RunDir(str(tmp_path / "run")))
    store.publish_folder(0, base)
    tokenizer = load_tokenizer(base)
    # in-phase: the trainer's full state dict names the matrix twice
    weights = model.state_dict()
    assert weights[HEAD].data_ptr() == weights[EMBED].data_ptr()
    assert store.publish_model(1, model, tokenizer, weights=weights)
    # phase end: the trainer's checkpoint, resharded to the sampler's layout
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(0.5)
    meta = tmp_path / "meta"
    write_hf_folder(str(meta), config=model.config, tokenizer=tokenizer, generation_config=model.generation_config)
    ckpt = str(tmp_path / "run" / "checkpoints" / "step_2")
    save_dcp({"model": model.state_dict()}, ckpt, str(meta), step=2, world_size=1, policy_version=2)
    assert store.publish_checkpoint(2, ckpt).published_now

    backend = HFBackend(store.local_dir(0), threads=1)
    for version, want in ((1, trained), (2, trained * 0.5)):
        published = load_state_dict(store.local_dir(version))
        assert HEAD not in published and torch.equal(published[EMBED], want)  # held once, as save_pretrained does
        again = load_model(store.local_dir(version))
        assert again.lm_head.weight is again.model.embed_tokens.weight and torch.equal(again.lm_head.weight, want)
        backend.load_weights(store.local_dir(version))
        head = backend.model.get_output_embeddings().weight
        assert head is backend.model.get_input_embeddings().weight and torch.equal(head, want)
