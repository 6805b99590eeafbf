"""Log-prob parity: do the sampler's behaviour log-probs match the trainer's for the same weights?

The off-policy corrections divide the trainer's probability of a token by the behaviour probability
the sampler stored with it. If the two engines disagree for identical weights (a stale engine that
missed a reload, a prefix cache computed with old weights, a different temperature convention, an
output layer not refreshed after a reload), every importance ratio is wrong and training quietly
degrades. The check: generate with the backend, recompute log_softmax(logits / temperature) of the
same tokens with a Hugging Face model holding the same weights (the trainer's computation), and
report the mean absolute difference per token. On one machine in float32 it is ~1e-6; 1e-3 is the
alarm threshold.
"""

from __future__ import annotations

from .backend import Completion, GenParams, SamplerBackend

GAP_ALARM = 1e-3


def recompute_logprobs(model, prompts: list[list[int]], groups: list[list[Completion]], temperature: float,
                       pad_id: int, batch_size: int = 64) -> list[list[float]]:
    """Teacher-forced log_softmax(logits / temperature) of each completion's tokens, in order."""
    import torch  # here, not at the top: `rlhf --help` builds this command's parser

    rows = [(p, c.token_ids) for p, group in zip(prompts, groups) for c in group]
    out: list[list[float]] = []
    for start in range(0, len(rows), batch_size):
        chunk = rows[start:start + batch_size]
        width = max(len(p) + len(r) for p, r in chunk)
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, (p, r) in enumerate(chunk):  # right padding: positions start at 0 for every row
            seq = p + r
            ids[i, :len(seq)] = torch.tensor(seq)
            mask[i, :len(seq)] = 1
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=mask).logits.float() / temperature
        logp = torch.log_softmax(logits, dim=-1)
        for i, (p, r) in enumerate(chunk):
            if not r:
                out.append([])
                continue
            # Token j of the response sits at len(p)+j and is predicted by the logits one position earlier.
            pos = torch.arange(len(p) - 1, len(p) - 1 + len(r))
            out.append(logp[i, pos, torch.tensor(r)].tolist())
    return out


def measure_gap(backend: SamplerBackend, model, pad_id: int, prompts: list[list[int]], n: int,
                params: GenParams) -> dict[str, float]:
    """Generate with `backend`, recompute with `model`; mean and max |difference| per token."""
    if params.greedy:
        raise ValueError("parity needs sampled tokens with their log-probs; greedy decoding stores none")
    groups = backend.generate(prompts, n, params)
    reference = recompute_logprobs(model, prompts, groups, params.temperature, pad_id)
    behaviour = [c.logprobs for group in groups for c in group]
    diffs = [abs(b - r) for bs, rs in zip(behaviour, reference) for b, r in zip(bs, rs)]
    if not diffs:
        raise ValueError("parity: the backend generated no tokens; raise max_new_tokens")
    return {"mean_abs_gap": sum(diffs) / len(diffs), "max_abs_gap": max(diffs), "tokens": float(len(diffs))}


def logprob_gap(policy_dir: str, backend_name: str, prompts: list[list[int]], *, n: int = 4,
                max_new_tokens: int = 16, temperature: float = 1.0, dtype: str = "float32", threads: int = 1,
                seed: int = 0, options: dict | None = None) -> float:
    """Mean |behaviour log-prob from `backend_name` - log-prob recomputed by the HF model| for the
    tokens the backend samples from `prompts` (token ids), both engines loading `policy_dir`."""
    return gap_report(policy_dir, backend_name, prompts, n=n, max_new_tokens=max_new_tokens,
                      temperature=temperature, dtype=dtype, threads=threads, seed=seed,
                      options=options)["mean_abs_gap"]


def gap_report(policy_dir: str, backend_name: str, prompts: list[list[int]], *, n: int = 4,
               max_new_tokens: int = 16, temperature: float = 1.0, dtype: str = "float32", threads: int = 1,
               seed: int = 0, options: dict | None = None) -> dict[str, float]:
    """`logprob_gap` with the max gap and token count as well."""
    from ..models import load_model, load_tokenizer
    from .backend import make_backend

    backend = make_backend(backend_name, policy_dir, dtype=dtype, threads=threads, seed=seed, options=options)
    try:
        model = load_model(policy_dir, dtype).eval()
        pad_id = load_tokenizer(policy_dir).pad_token_id
        params = GenParams(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
        return measure_gap(backend, model, pad_id, prompts, n, params)
    finally:
        backend.close()
