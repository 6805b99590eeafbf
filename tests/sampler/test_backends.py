"""The hf backend's contract, dynamic batching and out-of-memory back-off (main environment)."""

import os

import pytest
import torch

from pipeline.sampler.backend import GenParams, make_backend
from pipeline.sampler.batching import TokenBudget, is_out_of_memory, prompt_cost
from pipeline.sampler.hf import HFBackend
from pipeline.sampler.parity import GAP_ALARM, measure_gap


@pytest.fixture(scope="module")
def model_dir(digit_example):
    return os.path.join(digit_example, "model")


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from pipeline.models import load_tokenizer

    return load_tokenizer(model_dir)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [tokenizer(f"digits {i} {i * 7 % 10} {i % 3} :", add_special_tokens=False)["input_ids"] for i in range(12)]


class RecordingHF(HFBackend):
    """Records each engine call's prompts; raises OOM above `oom_above` sequences per call."""

    def __init__(self, *args, oom_above: int | None = None, oom_error=torch.OutOfMemoryError, **kw):
        super().__init__(*args, **kw)
        self.calls: list[list[list[int]]] = []
        self.oom_above = oom_above
        self.oom_error = oom_error

    def _generate_batch(self, prompts, n, params, seeds):
        n_eff = 1 if params.greedy else n
        if self.oom_above is not None and len(prompts) * n_eff > self.oom_above:
            raise self.oom_error("CUDA out of memory. Tried to allocate 2.00 GiB")
        self.calls.append(prompts)
        return super()._generate_batch(prompts, n, params, seeds)


def test_completions_carry_eos_and_logprobs_of_sampled_tokens(model_dir, tokenizer, prompts):
    be = HFBackend(model_dir, threads=1, seed=0)
    groups = be.generate(prompts[:4], 3, GenParams(max_new_tokens=12, temperature=0.7))
    assert [len(g) for g in groups] == [3, 3, 3, 3]
    for c in (c for g in groups for c in g):
        assert len(c.logprobs) == len(c.token_ids) > 0
        assert all(lp <= 0.0 for lp in c.logprobs)
        if c.finish_reason == "stop":
            assert c.token_ids[-1] == tokenizer.eos_token_id
            assert tokenizer.eos_token_id not in c.token_ids[:-1]
        else:
            assert len(c.token_ids) == 12 and tokenizer.eos_token_id not in c.token_ids
        assert c.text == tokenizer.decode(c.token_ids, skip_special_tokens=True)


def test_hf_behaviour_logprobs_match_teacher_forced_recompute(model_dir, tokenizer, prompts):
    from pipeline.models import load_model

    be = HFBackend(model_dir, threads=1, seed=1)
    model = load_model(model_dir).eval()
    gap = measure_gap(be, model, tokenizer.pad_token_id, prompts[:6], 4, GenParams(max_new_tokens=10, temperature=0.7))
    assert gap["tokens"] > 0
    assert gap["mean_abs_gap"] < GAP_ALARM


def test_generate_splits_into_engine_calls_within_token_budget(model_dir, prompts):
    n, new = 4, 8
    costs = [prompt_cost(len(p), new, n) for p in prompts]
    budget = 3 * max(costs)
    be = RecordingHF(model_dir, threads=1, seed=0, max_batch_tokens=budget)
    groups = be.generate(prompts, n, GenParams(max_new_tokens=new))
    assert len(groups) == len(prompts) and all(len(g) == n for g in groups)
    assert len(be.calls) > 1
    assert [p for call in be.calls for p in call] == prompts  # every prompt once, in order
    for call in be.calls:
        assert sum(prompt_cost(len(p), new, n) for p in call) <= budget
    stats = be.stats()
    assert stats["sampler/engine_calls"] == len(be.calls)
    assert stats["sampler/max_batch_size"] <= 3 * n
    assert stats["sampler/tokens_per_s"] > 0


def test_out_of_memory_halves_the_chunk_and_keeps_results_in_order(model_dir, prompts):
    greedy = GenParams(max_new_tokens=8, greedy=True)
    reference = HFBackend(model_dir, threads=1, seed=0).generate(prompts, 1, greedy)
    be = RecordingHF(model_dir, threads=1, seed=0, oom_above=3)
    got = be.generate(prompts, 1, greedy)
    assert [g[0].token_ids for g in got] == [g[0].token_ids for g in reference]
    assert max(len(c) for c in be.calls) <= 3
    stats = be.stats()
    assert stats["sampler/oom_retries"] >= 2
    assert stats["sampler/token_budget"] < be.budget.limit  # later calls start smaller


@pytest.mark.parametrize("error", [MemoryError, RuntimeError])
def test_cpu_allocator_errors_count_as_out_of_memory(model_dir, prompts, error):
    be = RecordingHF(model_dir, threads=1, seed=0, oom_above=6, oom_error=error)
    got = be.generate(prompts, 1, GenParams(max_new_tokens=4, greedy=True))
    assert len(got) == len(prompts) and be.budget.oom_retries >= 1


def test_out_of_memory_on_a_single_prompt_is_raised(model_dir, prompts):
    be = RecordingHF(model_dir, threads=1, seed=0, oom_above=0)
    with pytest.raises(torch.OutOfMemoryError):
        be.generate(prompts[:4], 1, GenParams(max_new_tokens=4, greedy=True))


def test_errors_other_than_out_of_memory_are_not_retried(model_dir, prompts):
    be = RecordingHF(model_dir, threads=1, seed=0, oom_above=2, oom_error=ValueError)
    with pytest.raises(ValueError):
        be.generate(prompts[:4], 1, GenParams(max_new_tokens=4, greedy=True))
    assert be.budget.oom_retries == 0


def test_budget_regrows_to_its_limit_after_successful_calls():
    b = TokenBudget(1000, regrow_after=2)
    b.shrink(800)
    assert b.current == 400
    b.succeeded()
    assert b.current == 400
    b.succeeded()
    assert b.current == 800
    b.succeeded(), b.succeeded()
    assert b.current == 1000


def test_is_out_of_memory_recognises_allocator_messages_only():
    assert is_out_of_memory(torch.OutOfMemoryError("x"))
    assert is_out_of_memory(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes"))
    assert not is_out_of_memory(RuntimeError("shape mismatch"))
    assert not is_out_of_memory(ValueError("out of memory"))


def test_reload_changes_generations_and_reports_its_time(model_dir, prompts, tmp_path):
    from pipeline.models import load_model, load_tokenizer

    model = load_model(model_dir)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(tmp_path / "v1")
    load_tokenizer(model_dir).save_pretrained(tmp_path / "v1")
    be = HFBackend(model_dir, threads=1, seed=0)
    params = GenParams(max_new_tokens=6, temperature=1.0, seed=3)
    before = be.generate(prompts[:4], 2, params)
    seconds = be.load_weights(str(tmp_path / "v1"))
    after = be.generate(prompts[:4], 2, params)
    assert seconds > 0
    assert [c.logprobs for g in before for c in g] != [c.logprobs for g in after for c in g]
    assert torch.equal(be.model.lm_head.weight, model.lm_head.weight)


def test_token_budget_comes_from_make_backend(model_dir):
    be = make_backend("hf", model_dir, dtype="float32", threads=1, seed=0, max_batch_tokens=123)
    assert be.budget.limit == 123 and be.stats()["sampler/token_budget"] == 123


def test_vllm_backend_without_vllm_names_the_fix(model_dir, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    with pytest.raises(RuntimeError, match="sampler.backend=hf"):
        make_backend("vllm", model_dir, dtype="float32", threads=1, seed=0)
