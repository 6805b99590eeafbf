"""Fixtures for the vLLM backend tests: they run under .venv-vllm (`make test-vllm`).

In an environment without vLLM (the main .venv) the whole folder is skipped, and only then: an
installed vLLM that fails to import (e.g. a broken torchvision) is an error, not a skip.
"""

import os
import sys
from pathlib import Path

import pytest
import torch

from pipeline.sampler.backend import GenParams

HERE = Path(__file__).resolve().parent
try:  # `from vllm import LLM`, not `import vllm`: this folder itself would import as a namespace package
    from vllm import LLM  # noqa: F401

    VLLM_MISSING = None
except ImportError as e:
    sys.modules.pop("vllm", None)  # drop the namespace stand-in so other code sees no vLLM either
    VLLM_MISSING = f"vLLM is not installed in this environment ({e}); `make test-vllm` runs these tests"


def pytest_collection_modifyitems(config, items):
    if VLLM_MISSING is None:
        return
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.skip(reason=VLLM_MISSING))


ENGINE_OPTIONS = {"max_model_len": 256}


def perturbed_copy(src: str, dst: str, scale: float, seed: int) -> str:
    """A new policy version: `src`'s weights plus Gaussian noise, saved in HF layout at `dst`."""
    from pipeline.models import load_model, load_tokenizer

    model = load_model(src)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)
    model.save_pretrained(dst)
    load_tokenizer(src).save_pretrained(dst)
    return dst


@pytest.fixture(scope="session")
def model_dir():
    """The warm-started sort model: it emits EOS, so both finish reasons occur."""
    from pipeline.example import ensure_example

    return os.path.join(ensure_example("sort", 0), "model")


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    from pipeline.models import load_tokenizer

    return load_tokenizer(model_dir)


@pytest.fixture(scope="session")
def prompts(tokenizer):
    from pipeline.models import render_prompt

    texts = [[{"role": "user", "content": f"sort {d}:"}] for d in ("3141", "592", "65358", "979", "3238", "46264",
                                                                  "338", "3279", "502", "88419")]
    return [tokenizer(render_prompt(tokenizer, t), add_special_tokens=False)["input_ids"] for t in texts]


@pytest.fixture(scope="session")
def versions(model_dir, tmp_path_factory):
    """Three successive policy versions, each a perturbation of the previous one."""
    root = tmp_path_factory.mktemp("policy")
    out, prev = [], model_dir
    for k in (1, 2, 3):
        prev = perturbed_copy(prev, str(root / f"v{k}"), scale=0.02, seed=k)
        out.append(prev)
    return out


@pytest.fixture(scope="session")
def engine(model_dir):
    """One persistent engine shared by the tests, as in a sampler process."""
    from pipeline.sampler.vllm import VLLMBackend

    be = VLLMBackend(model_dir, dtype="float32", threads=1, seed=0, options=ENGINE_OPTIONS)
    yield be
    be.close()


@pytest.fixture
def sampling():
    return GenParams(max_new_tokens=8, temperature=0.8)
