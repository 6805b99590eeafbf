"""The hf backend's decoding loop: its sampler draws from p, its preallocated cache layer holds what
a growing one holds, and greedy decoding with it matches `generate`."""

import torch
from transformers.cache_utils import DynamicLayer

from pipeline.sampler.decode import _pick, _Preallocated, decode


def test_pick_draws_from_the_distribution_and_never_outside_the_nucleus():
    p = torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03, 0.0])
    logits = torch.log(p.clamp_min(1e-30)).repeat(20000, 1)
    gen = torch.Generator().manual_seed(0)
    tok, lp = _pick(logits, 1.0, 1.0, False, gen)
    freq = torch.bincount(tok, minlength=6).double() / tok.numel()
    # 20000 draws: a standard error of at most 0.0036 per share; 5 of them is 0.018
    assert (freq - p.double()).abs().max() < 0.018, freq
    assert freq[5] == 0
    assert torch.allclose(lp, torch.log_softmax(logits, -1).gather(-1, tok[:, None]).squeeze(-1))
    tok, _ = _pick(logits, 1.0, 0.8, False, gen)  # nucleus {0, 1, 2}: 0.5 + 0.25 < 0.8
    freq = torch.bincount(tok, minlength=6).double() / tok.numel()
    assert freq[3:].sum() == 0
    assert (freq[:3] - p[:3].double() / 0.9).abs().max() < 0.018, freq


def _kv(b, t, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, 2, t, 4, generator=g), torch.randn(b, 2, t, 4, generator=g)


def test_preallocated_layer_holds_what_a_growing_layer_holds():
    plain, fast = DynamicLayer(), DynamicLayer()
    k, v = _kv(3, 5, 0)
    plain.update(k, v)
    fast.update(k, v)
    _Preallocated.adopt(fast, capacity=7)  # room for 2 more; the 3rd and 4th update grow it
    for step in range(4):
        k, v = _kv(plain.keys.shape[0], 1, step + 1)
        out_plain, out_fast = plain.update(k, v), fast.update(k, v)
        assert all(torch.equal(a, b) for a, b in zip(out_plain, out_fast))
        if step == 1:
            keep = torch.tensor([0, 2])
            plain.batch_select_indices(keep)
            fast.batch_select_indices(keep)
    assert fast.get_seq_length() == plain.get_seq_length() == 9
    assert torch.equal(fast.keys, plain.keys) and torch.equal(fast.values, plain.values)


def test_greedy_decoding_matches_generate(digit_example):
    import os

    from pipeline.models import load_model, load_tokenizer

    folder = os.path.join(digit_example, "model")
    tok, model = load_tokenizer(folder), load_model(folder, "float32").eval()
    texts = ["digits 1 7 1 :", "digits 5 3 2 0 :"]
    rows = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    width = max(map(len, rows))
    ids = torch.tensor([[tok.pad_token_id] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    out = decode(model, ids, mask, n=1, max_new_tokens=12, eos_ids=[tok.eos_token_id], greedy=True,
                 generator=torch.Generator().manual_seed(0))
    for i, r in enumerate(rows):
        x = torch.tensor([r])
        ref = model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=12, do_sample=False,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)[0, len(r):].tolist()
        assert out.tokens[i] == ref


def test_rows_that_stop_keep_their_answer_while_the_others_run_on(digit_example):
    """Stopped rows leave the batch in bunches: until then they run on, and nothing they make is
    kept. Every row's log-probs are those of a fresh forward pass over its prompt and answer."""
    import os

    from pipeline.models import load_model, load_tokenizer

    folder = os.path.join(digit_example, "model")
    tok, model = load_tokenizer(folder), load_model(folder, "float32").eval()
    prompt = tok("digits 4 1 9 :", add_special_tokens=False)["input_ids"]
    ids, mask = torch.tensor([prompt]), torch.ones(1, len(prompt), dtype=torch.long)
    eos = set(range(0, model.config.vocab_size, 20))  # a twentieth of the vocabulary ends a row
    out = decode(model, ids, mask, n=64, max_new_tokens=16, eos_ids=sorted(eos), temperature=3.0,
                 generator=torch.Generator().manual_seed(0))
    ends = sorted(len(t) for t, s in zip(out.tokens, out.stopped) if s)
    assert len(set(ends)) > 4 and ends[0] < 4 and not all(out.stopped), ends  # rows stopped at many steps
    for tokens, lps, stopped in zip(out.tokens, out.logprobs, out.stopped):
        assert len(lps) == len(tokens) and (tokens[-1] in eos) == stopped
        assert not eos & set(tokens[:-1])
        assert stopped or len(tokens) == 16
        x = torch.tensor([prompt + tokens])
        with torch.no_grad():
            ref = torch.log_softmax(model(input_ids=x).logits[0, len(prompt) - 1:-1] / 3.0, -1)
        assert torch.allclose(torch.tensor(lps), ref.gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1), atol=1e-4)
