"""Hugging Face backend: the fallback engine and the reference for behaviour log-probs. It runs the
model's own forward in its own decoding loop (see `decode`), not `generate`."""

from __future__ import annotations

import torch

from ..devices import set_threads

from ..models import eos_token_ids, load_model, load_tokenizer
from ..weights import load_state_dict
from .backend import Completion, GenParams, SamplerBackend
from .decode import decode


class HFBackend(SamplerBackend):
    name = "hf"

    def __init__(self, model_dir: str, *, dtype: str = "float32", threads: int = 1, seed: int = 0,
                 max_batch_tokens: int | None = None, trust_remote_code: bool = False):
        super().__init__(seed=seed, max_batch_tokens=max_batch_tokens)
        set_threads(threads)
        self.tokenizer = load_tokenizer(model_dir, trust_remote_code=trust_remote_code)
        # the process's accelerator, if any (its task gave it its own via CUDA_VISIBLE_DEVICES)
        self.device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        self.model = load_model(model_dir, dtype, trust_remote_code=trust_remote_code).to(self.device).eval()
        self.eos_ids = eos_token_ids(model_dir, self.tokenizer)
        self.pad_id = self.tokenizer.pad_token_id

    def _load_weights(self, policy_dir: str) -> None:
        sd = load_state_dict(policy_dir)
        missing, unexpected = self.model.load_state_dict(sd, strict=False)
        # A tied output layer is the embedding's own parameter: published once (as save_pretrained
        # writes it), it is refreshed in place with the embedding and stays tied.
        params = dict(self.model.named_parameters(remove_duplicate=False))
        loaded = {id(params[n]) for n in sd if n in params}
        missing = [m for m in missing if "rotary" not in m and not (m in params and id(params[m]) in loaded)]
        if unexpected or missing:
            raise RuntimeError(f"policy {policy_dir}: missing={missing[:5]} unexpected={unexpected[:5]}")

    @torch.no_grad()
    def _generate_batch(self, prompts: list[list[int]], n: int, params: GenParams,
                        seeds: list[int]) -> list[list[Completion]]:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):  # left padding: generation continues every row at the end
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        n_eff = 1 if params.greedy else n
        # One generator for the whole engine call, seeded by its first prompt.
        gen = torch.Generator(self.device).manual_seed(seeds[0])
        out = decode(self.model, ids, mask, n=n_eff, max_new_tokens=params.max_new_tokens, eos_ids=self.eos_ids,
                     temperature=params.temperature, top_p=params.top_p, greedy=params.greedy, generator=gen)
        results: list[list[Completion]] = []
        for i in range(len(prompts)):
            group = []
            for j in range(n_eff):
                row = i * n_eff + j
                toks = out.tokens[row]
                group.append(Completion(
                    token_ids=toks, logprobs=out.logprobs[row],
                    text=self.tokenizer.decode(toks, skip_special_tokens=True),
                    finish_reason="stop" if out.stopped[row] else "length",
                ))
            results.append(group)
        return results
