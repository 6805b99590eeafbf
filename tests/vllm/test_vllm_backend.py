"""vLLM backend on the CPU build: the rollout contract, in-place reloads, log-prob parity."""

import pytest
import torch

from pipeline.models import load_model
from pipeline.sampler.backend import GenParams
from pipeline.sampler.batching import TokenBudget
from pipeline.sampler.hf import HFBackend
from pipeline.sampler.parity import GAP_ALARM, measure_gap

pytestmark = pytest.mark.vllm


def test_completions_follow_the_hf_contract(engine, model_dir, tokenizer, prompts, sampling):
    engine.load_weights(model_dir)
    groups = engine.generate(prompts, 3, sampling)
    assert [len(g) for g in groups] == [3] * len(prompts)
    eos = tokenizer.eos_token_id
    reasons = set()
    for c in (c for g in groups for c in g):
        assert len(c.logprobs) == len(c.token_ids) > 0
        assert all(lp <= 0.0 for lp in c.logprobs)
        reasons.add(c.finish_reason)
        if c.finish_reason == "stop":
            assert c.token_ids[-1] == eos and eos not in c.token_ids[:-1]
        else:
            assert c.finish_reason == "length" and len(c.token_ids) == sampling.max_new_tokens
            assert eos not in c.token_ids
        assert c.text == tokenizer.decode(c.token_ids, skip_special_tokens=True)
    assert "stop" in reasons  # the EOS path is exercised, not only truncation


def test_greedy_decoding_agrees_with_hf(engine, model_dir, prompts):
    engine.load_weights(model_dir)
    greedy = GenParams(max_new_tokens=8, greedy=True)
    got = engine.generate(prompts, 4, greedy)
    ref = HFBackend(model_dir, threads=1).generate(prompts, 4, greedy)
    assert [len(g) for g in got] == [1] * len(prompts)
    assert [g[0].token_ids for g in got] == [g[0].token_ids for g in ref]
    assert all(lp == 0.0 for g in got for lp in g[0].logprobs)


def test_behaviour_logprobs_match_the_trainers_recompute(engine, model_dir, tokenizer, prompts):
    engine.load_weights(model_dir)
    model = load_model(model_dir).eval()
    for temperature in (1.0, 0.7):
        gap = measure_gap(engine, model, tokenizer.pad_token_id, prompts, 4,
                          GenParams(max_new_tokens=8, temperature=temperature))
        assert gap["tokens"] > 0
        assert gap["mean_abs_gap"] < GAP_ALARM, temperature


def test_reloads_in_place_keep_the_gap_small_for_every_version(engine, model_dir, versions, tokenizer, prompts,
                                                               sampling):
    engine.load_weights(model_dir)
    llm = engine.llm
    for path in versions:
        seconds = engine.load_weights(path)
        assert engine.llm is llm  # same engine: reloaded, not restarted
        assert seconds > 0
        model = load_model(path).eval()
        # The same prompts every time: a prefix cache computed with the previous weights would show here.
        gap = measure_gap(engine, model, tokenizer.pad_token_id, prompts, 4, sampling)
        assert gap["mean_abs_gap"] < GAP_ALARM, path


def test_a_stale_engine_shows_a_large_gap(engine, model_dir, versions, tokenizer, prompts, sampling):
    engine.load_weights(model_dir)  # the engine keeps v0 while the trainer is at v3
    newer = load_model(versions[-1]).eval()
    gap = measure_gap(engine, newer, tokenizer.pad_token_id, prompts, 4, sampling)
    assert gap["mean_abs_gap"] > 100 * GAP_ALARM


def test_samples_do_not_depend_on_how_a_call_is_split(engine, model_dir, prompts):
    engine.load_weights(model_dir)
    params = GenParams(max_new_tokens=8, temperature=1.0, seed=11)
    whole = engine.generate(prompts, 4, params)
    saved = engine.budget
    try:
        engine.budget = TokenBudget(2 * (max(map(len, prompts)) + 8) * 4)
        split = engine.generate(prompts, 4, params)
        assert engine.stats()["sampler/engine_calls"] > 1
    finally:
        engine.budget = saved
    assert [[c.token_ids for c in g] for g in split] == [[c.token_ids for c in g] for g in whole]


def test_samples_of_different_prompts_are_not_correlated(engine, model_dir, tokenizer):
    # Identical prompts in one call must not share their random draws (per-request seeds differ).
    engine.load_weights(model_dir)
    ids = tokenizer("sort 5213: ", add_special_tokens=False)["input_ids"]
    groups = engine.generate([ids] * 6, 4, GenParams(max_new_tokens=8, temperature=1.0))
    samples = [tuple(tuple(c.token_ids) for c in g) for g in groups]
    assert len(set(samples)) > 1


def test_out_of_memory_in_the_engine_backs_off(engine, model_dir, prompts, sampling, monkeypatch):
    engine.load_weights(model_dir)
    real = engine.llm.generate

    def tight_memory(requests, params, **kw):
        if len(requests) > 3:
            raise torch.OutOfMemoryError("CPU out of memory")
        return real(requests, params, **kw)

    monkeypatch.setattr(engine.llm, "generate", tight_memory)
    saved = engine.budget
    engine.budget = TokenBudget(saved.limit)
    try:
        groups = engine.generate(prompts, 2, sampling)
        assert len(groups) == len(prompts) and all(len(g) == 2 for g in groups)
        assert engine.stats()["sampler/oom_retries"] >= 2
        assert engine.stats()["sampler/max_batch_size"] <= 3 * 2
    finally:
        engine.budget = saved


def test_nucleus_sampling_is_refused_with_the_fix(engine, prompts):
    with pytest.raises(ValueError, match="top_p=0.9"):
        engine.generate(prompts[:1], 2, GenParams(max_new_tokens=4, top_p=0.9))


def test_options_the_pipeline_sets_are_refused(model_dir):
    from pipeline.sampler.vllm import VLLMBackend

    with pytest.raises(ValueError, match="sampler.vllm.dtype"):
        VLLMBackend(model_dir, options={"dtype": "float16"})


def test_reload_invalidates_prompt_blocks_cached_with_old_weights(engine, model_dir, versions, tokenizer, sampling):
    # Prompts longer than a KV block (128 tokens on CPU, 16 on GPU) leave full blocks in the prefix cache.
    digits = "31415926535897932384626433832795028841971693993751"
    long_prompts = [tokenizer(f"sort {(digits * 3)[i:i + 140]}:", add_special_tokens=False)["input_ids"]
                    for i in (0, 7)]
    assert min(map(len, long_prompts)) > 128
    engine.load_weights(model_dir)
    engine.generate(long_prompts, 2, sampling)  # caches their blocks under v0
    engine.load_weights(versions[0])
    gap = measure_gap(engine, load_model(versions[0]).eval(), tokenizer.pad_token_id, long_prompts, 2, sampling)
    assert gap["mean_abs_gap"] < GAP_ALARM


def test_unknown_engine_options_name_the_config_field(model_dir):
    from pipeline.sampler.vllm import VLLMBackend

    with pytest.raises(ValueError, match="sampler.vllm: an option is not a vllm.LLM argument"):
        VLLMBackend(model_dir, options={"max_modle_len": 256})
