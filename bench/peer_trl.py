"""The TRL arm of bench/peer.py: TRL's GRPOTrainer on CPU, run in the peer's environment.

    .venv-peer/bin/python bench/peer_trl.py --model DIR --train PARQUET --reward NAME --out DIR \
        --steps N --save-every K --max-new-tokens M [--lr 5e-4] [--threads 2]

Trains on the verl-format Parquet prompts (`prompt` chat messages, rendered by TRL with the
tokenizer's chat template, as this project renders them), 16 prompts x 8 completions per step,
scored by the project's built-in reward function (`pipeline.builtin_tasks`, plain Python). Every K
steps (and at step 0 and the last) it saves the policy to OUT/v<step>/; the time spent saving is
recorded and excluded from the clock; held-out evaluation happens afterwards, in bench/peer.py,
with the same code for both arms. Writes OUT/steps.jsonl: one line per step with the wall-clock
time its step began and ended, the seconds excluded so far, generated completion tokens so far and
the batch's mean reward.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def parse_args(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--train", required=True)
    p.add_argument("--reward", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--save-every", type=int, required=True)
    p.add_argument("--max-new-tokens", type=int, required=True)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--prompts-per-step", type=int, default=16)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    # the run config's settings (bench/peer.py trl_settings passes them)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--clip-eps", type=float, default=0.2)
    p.add_argument("--beta", type=float, default=0.0, help="KL coefficient (k3 estimator, as TRL computes it)")
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bf16", action="store_true", help="bf16 mixed precision (autocast), eager attention")
    return p.parse_args(argv)


def load_dataset(path: str):
    import datasets
    import pyarrow.parquet as pq

    t = pq.read_table(path, columns=["data_source", "prompt", "reward_model"]).to_pylist()
    return datasets.Dataset.from_list([{"prompt": [{"role": m["role"], "content": m["content"]} for m in r["prompt"]],
                                        "data_source": r["data_source"],
                                        "ground_truth": str(r["reward_model"]["ground_truth"])} for r in t])


def main(argv=None) -> int:
    a = parse_args(argv)
    import torch

    torch.set_num_threads(a.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from pipeline.builtin_tasks import SCORERS

    score = SCORERS[a.reward]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(a.model, local_files_only=True)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(a.model, local_files_only=True, dtype=torch.float32,
                                                 attn_implementation="eager" if a.bf16 else None)
    counters = {"tokens": 0, "reward_sum": 0.0, "n": 0}

    def reward(prompts, completions, completion_ids, data_source, ground_truth, **_):
        counters["tokens"] += sum(len(ids) for ids in completion_ids)
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        vals = []
        for ds, text, gt in zip(data_source, texts, ground_truth):
            r = score(ds, text, gt)
            vals.append(float(r["score"] if isinstance(r, dict) else r))
        counters["reward_sum"] += sum(vals)
        counters["n"] += len(vals)
        return vals

    log = open(out / "steps.jsonl", "w")
    state = {"excluded_s": 0.0, "begin": None}

    def save(step: int) -> None:
        t = time.time()
        model.save_pretrained(out / f"v{step}", safe_serialization=True)
        tok.save_pretrained(out / f"v{step}")
        state["excluded_s"] += time.time() - t

    class Clock(TrainerCallback):
        def on_step_begin(self, args, st, control, **kw):
            state["begin"] = time.time()

        def on_step_end(self, args, st, control, **kw):
            t = time.time()
            log.write(json.dumps({"step": st.global_step, "time/start": state["begin"], "time/end": t,
                                  "excluded_s": state["excluded_s"], "gen_tokens": counters["tokens"],
                                  "reward/mean": counters["reward_sum"] / max(counters["n"], 1)}) + "\n")
            log.flush()
            counters["reward_sum"], counters["n"] = 0.0, 0
            if st.global_step % a.save_every == 0 or st.global_step == a.steps:
                save(st.global_step)

    n = a.prompts_per_step * a.group_size
    cfg = GRPOConfig(
        output_dir=str(out / "trl"), per_device_train_batch_size=n, gradient_accumulation_steps=1,
        num_generations=a.group_size, max_completion_length=a.max_new_tokens, learning_rate=a.lr,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=a.max_grad_norm, beta=a.beta,
        epsilon=a.clip_eps, loss_type="dapo", scale_rewards="group", num_iterations=1, temperature=a.temperature, top_k=0,
        top_p=a.top_p, use_vllm=False, use_cpu=True, bf16=a.bf16, gradient_checkpointing=False, report_to="none",
        save_strategy="no", logging_steps=10_000, disable_tqdm=True, max_steps=a.steps, seed=a.seed,
        dataloader_num_workers=0,
    )
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=cfg, train_dataset=load_dataset(a.train),
                          processing_class=tok, callbacks=[Clock()])
    save(0)
    trainer.train()
    log.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
