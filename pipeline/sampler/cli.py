"""`rlhf parity`: measure the behaviour log-prob gap of a sampler backend against the trainer's math.

    rlhf parity --policy runs/<id>/policy/v000003 --backend vllm --prompts 32

Prints one JSON object (mean and max gap per token, tokens compared) and exits 1 when the mean gap
is above the alarm threshold, so it can gate a deployment or a CI job.
"""

from __future__ import annotations

import argparse
import json
import os


def _prompt_ids(data: str, policy_dir: str, limit: int, seed: int) -> list[list[int]]:
    from ..config import ConfigError
    from ..data import load_prompts
    from ..models import load_tokenizer, prompt_token_ids

    if data.startswith("builtin:"):
        from ..example import ensure_example
        from ..builtin_tasks import TASKS

        task = data.split(":", 1)[1]
        if task not in TASKS:
            raise ConfigError(f"--data: unknown built-in {data!r}; use one of "
                              + ", ".join(f"builtin:{t}" for t in TASKS))
        data = os.path.join(ensure_example(task, seed), "data", "test.parquet")
    rows = load_prompts(data, "--data", limit=limit)
    tok = load_tokenizer(policy_dir)
    return prompt_token_ids(tok, [r.messages for r in rows])


def cmd_parity(args) -> int:
    from .parity import gap_report

    options = json.loads(args.vllm_options) if args.vllm_options else {}
    prompts = _prompt_ids(args.data, args.policy, args.prompts, args.seed)
    report = gap_report(args.policy, args.backend, prompts, n=args.n, max_new_tokens=args.max_new_tokens,
                        temperature=args.temperature, dtype=args.dtype, threads=args.threads, seed=args.seed,
                        options=options)
    ok = report["mean_abs_gap"] <= args.threshold
    print(json.dumps({"policy": args.policy, "backend": args.backend, **report, "threshold": args.threshold,
                      "ok": ok}))
    return 0 if ok else 1


def add_parser(subparsers) -> None:
    from .parity import GAP_ALARM

    s = subparsers.add_parser("parity", help="log-prob gap of a sampler backend against the trainer's recomputation",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    s.add_argument("--policy", required=True, help="policy folder in sampler layout (HF), e.g. runs/<id>/policy/v000002")
    s.add_argument("--backend", default="vllm", choices=["hf", "vllm"])
    s.add_argument("--data", default="builtin:sort", help="prompts: verl Parquet file/URL or builtin:<task>")
    s.add_argument("--prompts", type=int, default=32, help="number of prompts (the first N)")
    s.add_argument("--n", type=int, default=4, help="completions per prompt")
    s.add_argument("--max-new-tokens", type=int, default=16)
    s.add_argument("--temperature", type=float, default=1.0)
    s.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    s.add_argument("--threads", type=int, default=1)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--vllm-options", default="", help='engine arguments as JSON, e.g. \'{"max_model_len": 512}\'')
    s.add_argument("--threshold", type=float, default=GAP_ALARM, help="exit 1 when the mean gap is above this")
    s.set_defaults(fn=cmd_parity)
